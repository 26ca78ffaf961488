#!/usr/bin/env bash
# Make sure the local RabbitMQ and PostgreSQL answer, starting them (Debian's packages) if not.
# Used by `make run`, `make test` and .ci/run; a no-op when both are already up.
set -euo pipefail

AMQP_PORT=${LOCAL_AMQP_PORT:-5672}
PG_PORT=${LOCAL_PG_PORT:-5432}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for_port() {
  local port=$1 what=$2 tries=0
  until port_open "$port"; do
    tries=$((tries + 1))
    if [ "$tries" -gt 120 ]; then
      echo "error: $what did not start listening on 127.0.0.1:$port within 60s" >&2
      exit 1
    fi
    sleep 0.5
  done
}

if ! port_open "$AMQP_PORT"; then
  if ! command -v rabbitmq-server >/dev/null; then
    echo "error: RabbitMQ is not answering on 127.0.0.1:$AMQP_PORT and rabbitmq-server is not installed" >&2
    exit 1
  fi
  echo "starting RabbitMQ"
  rabbitmq-server -detached
  wait_for_port "$AMQP_PORT" RabbitMQ
  rabbitmqctl await_startup >/dev/null 2>&1 || true
fi

# RabbitMQ's Prometheus endpoint (:15692), as deploy/rabbitmq/enabled_plugins has it in the
# containers: the dashboard's queue panels and the queue alerts read it. Enabling a plugin works
# on a running node, without a restart, and is a no-op when it is already on.
if command -v rabbitmq-plugins >/dev/null && ! port_open "${LOCAL_RABBITMQ_PROMETHEUS_PORT:-15692}"; then
  rabbitmq-plugins enable rabbitmq_prometheus >/dev/null ||
    echo "warning: could not enable rabbitmq_prometheus (is the broker on :$AMQP_PORT this machine's?)" >&2
fi

# The consistent-hash exchange, as deploy/rabbitmq/enabled_plugins has it: a queue table's queue
# with shards > 1 routes through one (`consumer topology apply` stops, one line, without it).
if command -v rabbitmq-plugins >/dev/null &&
  ! rabbitmq-plugins -q is_enabled rabbitmq_consistent_hash_exchange >/dev/null 2>&1; then
  rabbitmq-plugins enable rabbitmq_consistent_hash_exchange >/dev/null ||
    echo "warning: could not enable rabbitmq_consistent_hash_exchange (is the broker on :$AMQP_PORT this machine's?)" >&2
fi

if ! port_open "$PG_PORT"; then
  if ! command -v pg_ctlcluster >/dev/null; then
    echo "error: PostgreSQL is not answering on 127.0.0.1:$PG_PORT and pg_ctlcluster is not installed" >&2
    exit 1
  fi
  echo "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -n 1)" main start
  wait_for_port "$PG_PORT" PostgreSQL
fi
