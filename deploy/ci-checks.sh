#!/usr/bin/env bash
# Every check of deploy/ and k8s/ that needs neither a Docker engine nor a cluster:
#   - builds turnlock with the Dockerfile's own `cargo build` command;
#   - deploy/checks.py: the Dockerfile and compose file reference only what exists, every
#     manifest validates against the Kubernetes OpenAPI schemas (strict), the example agent
#     Deployment is injected by a real `turnlock inject` over HTTPS and the injected pod
#     validates too, and the compose scenario (two replicas + sidecars + load generator) runs
#     natively with zero lost writes.
# Installs what it needs when missing: Debian packages (also those the transparent-interception
# test needs) and, in a virtualenv, the Python packages of deploy/requirements-checks.txt.
#
#   bash deploy/ci-checks.sh
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for pair in ip:iproute2 iptables:iptables iptables-restore:iptables setpriv:util-linux curl:curl \
    redis-server:redis-server redis-cli:redis-tools; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
done
if ((${#missing[@]})); then
    echo "+ apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

venv="${TURNLOCK_CHECKS_VENV:-target/deploy-checks-venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import yaml, kubernetes_validate, jsonpatch' 2>/dev/null; then
    "$venv/bin/pip" install -q -r deploy/requirements-checks.txt
fi

build="$("$venv/bin/python" deploy/checks.py --print-build-command --turnlock /dev/null)"
if [ -z "$build" ]; then
    echo "deploy/Dockerfile has no cargo build step" >&2
    exit 1
fi
read -r -a build_cmd <<<"$build"
echo "+ $build   (the Dockerfile's build step)"
"${build_cmd[@]}"

"$venv/bin/python" deploy/checks.py --turnlock target/release/turnlock --out-dir target
