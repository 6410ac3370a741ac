#!/usr/bin/env bash
# Runs turnlock's whole test suite.
#
# The integration tests start real redis-server processes (and Sentinel) on free loopback ports,
# and the transparent-interception test builds network namespaces with iproute2 and iptables
# (it needs root). Missing Debian packages are installed first (apt-get, as root or via sudo).
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for pair in redis-server:redis-server redis-cli:redis-tools ip:iproute2 iptables:iptables \
    setpriv:util-linux curl:curl python3:python3; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}" >&2
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
cargo test --all-targets "$@"
