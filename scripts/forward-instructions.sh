#!/usr/bin/env bash
# User-space instructions per forwarded GET, counted by callgrind: a figure that, unlike
# throughput, does not move with the machine's load. A one-thread `turnlock proxy` (and, for
# comparison, nginx with one worker and upstream keep-alive, and `examples/hyper_floor.rs`:
# the least a proxy built on hyper does) in front of `turnlock store`, driven by `wrk -c16`
# for 10 s after a 3 s warm-up; only the measured window is counted.
#
#   scripts/forward-instructions.sh [TURNLOCK_BINARY]    (default: target/release/turnlock)
#
# The floor is measured when target/release/examples/hyper_floor exists
# (`cargo build --release --example hyper_floor`).
#
# Needs valgrind, wrk, redis-server and curl (nginx optional). Uses loopback ports 22079-22103.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${1:-target/release/turnlock}"
for tool in valgrind callgrind_control callgrind_annotate wrk redis-server curl; do
  command -v "$tool" >/dev/null || { echo "missing: $tool (apt-get install -y valgrind wrk redis-server curl)" >&2; exit 1; }
done
dir=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  redis-cli -p 22079 shutdown nosave >/dev/null 2>&1 || true
  rm -rf "$dir"
}
trap cleanup EXIT
redis-server --port 22079 --bind 127.0.0.1 --save "" --appendonly no --daemonize yes >/dev/null
RUST_LOG=warn "$bin" store --listen 127.0.0.1:22080 >/dev/null 2>&1 & pids+=($!)
url=/v1/sessions/read-0
for _ in $(seq 50); do curl -s -o /dev/null "http://127.0.0.1:22080/" && break; sleep 0.1; done
python3 - <<'PY'
import json, urllib.request
messages = [{"id": f"m-{i}", "role": "user", "content": "x" * 120} for i in range(20)]
doc = {"session": "read-0", "turn": 1, "version": 0, "messages": messages, "state": {}}
urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:22080/v1/sessions/read-0",
                                              data=json.dumps(doc).encode(), method="PUT"))
PY

# Runs `$@` under callgrind (instrumentation off), serving on $port; prints instructions/request.
measure() {
  local name=$1 port=$2; shift 2
  valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$dir/$name.out" "$@" \
    >/dev/null 2>"$dir/$name.log" &
  local pid=$!; pids+=($pid)
  for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$port$url" && break; sleep 0.3; done
  wrk -t1 -c16 -d3s "http://127.0.0.1:$port$url" >/dev/null
  callgrind_control -i on "$pid" >/dev/null 2>&1
  wrk -t1 -c16 -d10s "http://127.0.0.1:$port$url" >"$dir/$name.wrk"
  callgrind_control -i off "$pid" >/dev/null 2>&1
  kill -TERM "$pid"; wait "$pid" 2>/dev/null || true
  local requests instructions
  requests=$(awk '/requests in/{print $1}' "$dir/$name.wrk")
  instructions=$(callgrind_annotate "$dir/$name.out" 2>/dev/null | awk '/PROGRAM TOTALS/{gsub(",","",$1); print $1}')
  printf '%-8s %8d requests  %9d instructions per request\n' "$name" "$requests" $((instructions / requests))
}

RUST_LOG=warn measure turnlock 22100 "$bin" proxy --worker-threads 1 --listen 127.0.0.1:22100 \
  --admin 127.0.0.1:22101 --upstream http://127.0.0.1:22080 --redis redis://127.0.0.1:22079
floor=target/release/examples/hyper_floor
if [ -x "$floor" ]; then
  measure floor 22103 "$floor" 127.0.0.1:22103 127.0.0.1:22080
else
  echo "no $floor (cargo build --release --example hyper_floor): no floor figure"
fi
nginx=$(command -v nginx || { [ -x /usr/sbin/nginx ] && echo /usr/sbin/nginx; } || true)
if [ -n "$nginx" ]; then
  mkdir -p "$dir/nginx"
  cat >"$dir/nginx/nginx.conf" <<CONF
daemon off; master_process off; worker_processes 1; pid $dir/nginx/nginx.pid; error_log $dir/nginx/error.log warn;
events { worker_connections 4096; }
http { access_log off; client_body_temp_path $dir/nginx/b; proxy_temp_path $dir/nginx/p;
  fastcgi_temp_path $dir/nginx/f; uwsgi_temp_path $dir/nginx/u; scgi_temp_path $dir/nginx/s;
  upstream store { server 127.0.0.1:22080; keepalive 256; }
  server { listen 127.0.0.1:22102; location / { proxy_pass http://store; proxy_http_version 1.1; proxy_set_header Connection ""; } } }
CONF
  measure nginx 22102 "$nginx" -p "$dir/nginx" -c "$dir/nginx/nginx.conf"
else
  echo "nginx not installed: no nginx figure"
fi
