#!/usr/bin/env bash
# Runs turnlock's whole test suite.
#
# The integration tests start real redis-server processes (and Sentinel) on free loopback ports,
# and the transparent-interception test builds network namespaces with iproute2 and iptables
# (it needs root). Missing Debian packages are installed first (apt-get, as root or via sudo).
# The real-store tests drive third-party servers and clients, installed once per machine when
# missing: moto's S3 server, boto3 and strands-agents (PyPI) in a virtualenv at $TURNLOCK_TEST_VENV, and
# pouchdb-server and nano (npm) under $TURNLOCK_TEST_NODE.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for pair in redis-server:redis-server redis-cli:redis-tools ip:iproute2 iptables:iptables \
    setpriv:util-linux curl:curl python3:python3 npm:npm; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
done
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}" >&2
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
venv="${TURNLOCK_TEST_VENV:-$HOME/.cache/turnlock-test-venv}"
if ! "$venv/bin/python" -c 'import moto, boto3, flask, strands' >/dev/null 2>&1; then
  echo "installing moto[server], boto3 and strands-agents into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q 'moto[server]' boto3 strands-agents
fi
node_dir="${TURNLOCK_TEST_NODE:-$HOME/.cache/turnlock-test-node}"
if [ ! -x "$node_dir/node_modules/.bin/pouchdb-server" ] || [ ! -f "$node_dir/node_modules/nano/package.json" ]; then
  echo "installing pouchdb-server and nano into $node_dir" >&2
  mkdir -p "$node_dir"
  npm install --silent --no-audit --no-fund --prefix "$node_dir" pouchdb-server@4 nano@10 >/dev/null
fi
cargo test --all-targets "$@"
