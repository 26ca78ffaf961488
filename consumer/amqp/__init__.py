"""RabbitMQ: connections, channels, deliveries and acks, publishing, and the wire."""
