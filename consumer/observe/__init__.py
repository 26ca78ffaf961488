"""What the service tells: metrics, log lines per delivery, readiness, traces."""
