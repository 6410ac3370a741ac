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
for pair in ip:iproute2 iptables:iptables iptables-restore:iptables ip6tables-restore:iptables \
    setpriv:util-linux curl:curl redis-server:redis-server redis-cli:redis-tools promtool:prometheus; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
done
if ((${#missing[@]})); then
    echo "+ apt-get install ${missing[*]}"
    apt-get update -qq
    # Install tools only: no package may start a service here (prometheus would).
    made_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        $(printf '%s\n' "${missing[@]}" | sort -u) >/dev/null
    if [ "$made_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
fi

# The alert rules: valid and their unit tests pass (tests/it/deploy_metrics.rs checks that every
# metric they and the dashboard name is one /metrics exposes).
echo "+ promtool check rules / test rules (deploy/alerts)"
promtool check rules deploy/alerts/turnlock-rules.yml
promtool test rules deploy/alerts/turnlock-rules.test.yml

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

"$venv/bin/python" - <<'EOF'
import json, sys, yaml
plain = yaml.safe_load(open("deploy/alerts/turnlock-rules.yml"))
crd = yaml.safe_load(open("deploy/alerts/turnlock-prometheusrule.yaml"))
if crd.get("kind") != "PrometheusRule" or crd["spec"]["groups"] != plain["groups"]:
    sys.exit("deploy/alerts/turnlock-prometheusrule.yaml does not hold the groups of turnlock-rules.yml")
dash = json.load(open("deploy/grafana/turnlock-dashboard.json"))
if not all(t.get("expr") for p in dash["panels"] for t in p["targets"]):
    sys.exit("deploy/grafana/turnlock-dashboard.json: a panel target has no expression")
print(f"ok: the PrometheusRule holds the plain rules' {len(plain['groups'])} groups; dashboard: {len(dash['panels'])} panels")
EOF

"$venv/bin/python" deploy/checks.py --turnlock target/release/turnlock --out-dir target
