#!/bin/sh
# Least-privilege RabbitMQ users for one rabbit-pg-consumer service; run where rabbitmqctl reaches
# the broker (a node, or a pod with `kubectl exec`). Safe to run again: it sets the same
# permissions, and a password only when its file is given.
#
#   CONSUMER_NAME=consumer CONSUMER_EXCHANGE=events \
#   CONSUMER_PASSWORD_FILE=/run/secrets/rabbitmq-consumer \
#   BOOTSTRAP_PASSWORD_FILE=/run/secrets/rabbitmq-bootstrap \
#   deploy/rabbitmq/users.sh
#
# The consumer user (`consumer run`) declares nothing, publishes only to the retry and
# dead-letter exchanges and reads only the work queue. The bootstrap user (`consumer topology
# apply`/`check`, the `dlq` tools, `publish`) configures, writes and reads the service's own names
# and the ingress exchange. See deploy/README.md, "Least privilege".
#
# Settings (environment): CONSUMER_NAME (consumer), CONSUMER_EXCHANGE (events),
# RABBITMQ_VHOST (/), CONSUMER_USER (the name), BOOTSTRAP_USER (the name + -bootstrap),
# CONSUMER_PASSWORD_FILE, BOOTSTRAP_PASSWORD_FILE (needed to create a user), RABBITMQCTL
# (rabbitmqctl). Passwords go to rabbitmqctl on stdin, never on a command line.
set -eu

name=${CONSUMER_NAME:-consumer}
exchange=${CONSUMER_EXCHANGE:-events}
vhost=${RABBITMQ_VHOST:-/}
consumer_user=${CONSUMER_USER:-$name}
bootstrap_user=${BOOTSTRAP_USER:-$name-bootstrap}
ctl=${RABBITMQCTL:-rabbitmqctl}

# Permissions are regular expressions over names; a name's dots must match only dots.
regex_literal() {
    printf '%s' "$1" | sed 's/[][\\.^$*+?(){}|]/\\&/g'
}
n=$(regex_literal "$name")
x=$(regex_literal "$exchange")

# ensure_user USER PASSWORD_FILE: create the user, or set its password when a file is given.
ensure_user() {
    if "$ctl" --quiet list_users --silent | cut -f1 | grep -qxF -- "$1"; then
        if [ -n "$2" ]; then
            "$ctl" --quiet change_password "$1" <"$2" >/dev/null
            echo "user $1: password changed"
        else
            echo "user $1: exists, password unchanged"
        fi
    else
        if [ -z "$2" ]; then
            echo "user $1 does not exist: give its password file to create it" >&2
            exit 2
        fi
        "$ctl" --quiet add_user "$1" <"$2" >/dev/null
        echo "user $1: created"
    fi
}

ensure_user "$consumer_user" "${CONSUMER_PASSWORD_FILE:-}"
ensure_user "$bootstrap_user" "${BOOTSTRAP_PASSWORD_FILE:-}"

# configure: nothing (it only declares passively, which needs no permission);
# write: the exchanges it republishes failed events to; read: the queue it consumes, of any
# generation (CONSUMER_WORK_QUEUE_VERSION: <name>.work, <name>.work.v2, ...). With a queue table,
# each queue's own (<name>.<queue>.retry, <name>.<queue>.work), and a sharded queue's shards
# (<name>.<queue>.work.s1, ...).
q='([A-Za-z0-9][A-Za-z0-9_-]*\.)?'
"$ctl" --quiet set_permissions -p "$vhost" "$consumer_user" \
    '^$' "^$n\\.$q(retry|dlx)\$" "^$n\\.${q}work(\\.v[0-9]+)?(\\.s[0-9]+)?\$"
echo "user $consumer_user: configure ^\$, write $name.[<queue>.]retry and .dlx," \
    "read $name.[<queue>.]work[.vN][.sK]"

# Everything the service owns, and the ingress exchange (declared, bound from, replayed to).
owned="^($n\\..*|$x)\$"
"$ctl" --quiet set_permissions -p "$vhost" "$bootstrap_user" "$owned" "$owned" "$owned"
echo "user $bootstrap_user: configure, write and read $name.* and $exchange"
