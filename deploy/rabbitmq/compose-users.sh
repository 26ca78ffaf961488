#!/bin/sh
# compose.yaml's rabbitmq-users job: users.sh on the compose broker, with the two users' passwords
# from the environment (RABBITMQ_CONSUMER_PASSWORD, RABBITMQ_BOOTSTRAP_PASSWORD). users.sh reads
# passwords from files, so they go to private files first; rabbitmqctl targets RABBITMQ_NODE
# (rabbit@rabbitmq) unless RABBITMQCTL names another command. Safe to run on every `up`.
set -eu

: "${RABBITMQ_CONSUMER_PASSWORD:?is not set}" "${RABBITMQ_BOOTSTRAP_PASSWORD:?is not set}"
here=$(dirname "$0")
umask 077
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

printf '%s' "$RABBITMQ_CONSUMER_PASSWORD" >"$work/consumer"
printf '%s' "$RABBITMQ_BOOTSTRAP_PASSWORD" >"$work/bootstrap"
if [ -z "${RABBITMQCTL:-}" ]; then
    printf '#!/bin/sh\nexec rabbitmqctl --node "%s" "$@"\n' "${RABBITMQ_NODE:?is not set}" \
        >"$work/rabbitmqctl"
    chmod 0700 "$work/rabbitmqctl"
    RABBITMQCTL=$work/rabbitmqctl
fi

RABBITMQCTL=$RABBITMQCTL \
    CONSUMER_PASSWORD_FILE=$work/consumer \
    BOOTSTRAP_PASSWORD_FILE=$work/bootstrap \
    sh "$here/users.sh"
