#!/usr/bin/env bash
# Make sure the command-line tools that tests/deploy runs are installed, from Debian's packages:
# prometheus and promtool (package prometheus), systemd-analyze (package systemd), libfaketime
# (package faketime: tests/integration/test_clock_skew.py runs the service on a skewed clock), nft
# (package nftables: tests/chaos/network.py cuts links between network namespaces).
# Used by `make pytest` (so `make test` and .ci/run); a no-op when they are already there.
set -euo pipefail

missing=()
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  missing+=(prometheus)
fi
if ! command -v systemd-analyze >/dev/null; then
  missing+=(systemd)
fi
if ! command -v faketime >/dev/null; then
  missing+=(faketime)
fi
if ! command -v nft >/dev/null; then
  missing+=(nftables)
fi
[ "${#missing[@]}" -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null; then
    echo "error: ${missing[*]} (Debian packages) are needed by the tests; install them as root" >&2
    exit 1
  fi
  exec sudo --preserve-env=PATH "$0" "$@"
fi

# Only the tools are wanted, not the daemons: the prometheus package would start one on :9090.
# Docker-built images carry a policy-rc.d that forbids starting services; lend one if absent.
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
  chmod 755 /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi

echo "installing ${missing[*]} (Debian) for tests/deploy"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
command -v promtool >/dev/null && command -v prometheus >/dev/null && command -v systemd-analyze >/dev/null \
  && command -v faketime >/dev/null && command -v nft >/dev/null
