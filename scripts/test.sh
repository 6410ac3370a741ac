#!/usr/bin/env bash
# Runs turnlock's whole test suite. The integration tests start real redis-server processes,
# so Redis is installed first when it is missing (Debian/Ubuntu: apt-get, as root or via sudo).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
  echo "redis-server not found: installing it with apt-get" >&2
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
# The tests start their own servers; a system service is not needed.
cargo test --all-targets "$@"
