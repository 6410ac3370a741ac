#!/usr/bin/env bash
# Builds and runs the container setup for real, on a machine that can reach Debian's apt mirror
# and crates.io but no container registry:
#   - installs Debian's docker.io, docker-compose and debootstrap when missing;
#   - starts its own dockerd (private socket, data root and exec root; no host iptables rules)
#     and stops it, and every container it started, on exit, also on failure;
#   - seeds the base images the files name, when absent from its image store (cached between
#     runs): debian:bookworm-slim from debootstrap, rust:<version>-bookworm from this machine's
#     own Rust toolchain, and stand-ins for the compose file's Redis and Python images built from
#     Debian packages (the compose file takes them from TURNLOCK_DEMO_*_IMAGE);
#   - builds deploy/Dockerfile with BuildKit and checks the image: uid 1337, read-only root
#     filesystem, `turnlock --version`, `turnlock health`, the image's HEALTHCHECK, its size;
#   - runs the compose scenario: through the sidecars no acknowledged write is lost; the
#     `without-turnlock` profile loses writes. Prints the counts; fails if either claim fails.
#
#   sudo bash deploy/container-check.sh
#
# Environment: TURNLOCK_CONTAINER_CACHE (default /var/tmp/turnlock-container-check: the image
# store and BuildKit cache kept between runs); TURNLOCK_CONTAINER_RESEED=1 makes the seeded
# base images again.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
    echo "container-check: dockerd needs root; run as root" >&2
    exit 1
fi

started_at=$(date +%s)
step() { echo "== [$(($(date +%s) - started_at))s] $*"; }

# --- packages --------------------------------------------------------------------------------
missing=()
for pair in /usr/bin/docker:docker.io /usr/sbin/dockerd:docker.io /usr/bin/docker-compose:docker-compose \
    /usr/sbin/debootstrap:debootstrap; do
    [ -x "${pair%%:*}" ] || missing+=("${pair#*:}")
done
if ((${#missing[@]})); then
    step "apt-get install ${missing[*]}"
    apt-get update -qq
    # Tools only: docker.io's postinst may try to start dockerd as a service; policy-rc.d
    # forbids it (this script starts its own).
    policy=/usr/sbin/policy-rc.d
    made_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made_policy=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        $(printf '%s\n' "${missing[@]}" | sort -u) >/dev/null
    if [ "$made_policy" = 1 ]; then rm -f "$policy"; fi
fi

# The first `docker` on PATH may be a newer CLI without the buildx and compose plugins;
# Debian's 20.10 CLI builds with BuildKit on its own.
DOCKER=/usr/bin/docker
COMPOSE=/usr/bin/docker-compose
export DOCKER_BUILDKIT=1

# --- dockerd ---------------------------------------------------------------------------------
cache="${TURNLOCK_CONTAINER_CACHE:-/var/tmp/turnlock-container-check}"
mkdir -p "$cache"
run="$(mktemp -d /tmp/tl-ctr.XXXXXX)"
export DOCKER_HOST="unix://$run/docker.sock"
dockerd_pid=""
project=turnlock-check
compose_file=deploy/docker-compose.yml

cleanup() {
    local status=$?
    set +e
    if [ -n "$dockerd_pid" ] && kill -0 "$dockerd_pid" 2>/dev/null; then
        step "stopping the containers and dockerd (pid $dockerd_pid)"
        if [ -f "$run/docker-compose.yml" ]; then
            for profile in "" "--profile without-turnlock"; do
                # shellcheck disable=SC2086
                timeout 60 "$COMPOSE" -p "$project" --project-directory deploy -f "$run/docker-compose.yml" \
                    $profile down -v --remove-orphans >/dev/null 2>&1
            done
        fi
        ids="$(timeout 20 "$DOCKER" ps -aq 2>/dev/null)"
        if [ -n "$ids" ]; then
            # shellcheck disable=SC2086
            timeout 60 "$DOCKER" rm -f $ids >/dev/null 2>&1
        fi
        kill -TERM "$dockerd_pid"
        for _ in $(seq 1 60); do
            kill -0 "$dockerd_pid" 2>/dev/null || break
            sleep 0.5
        done
        if kill -0 "$dockerd_pid" 2>/dev/null; then
            echo "dockerd did not stop within 30 s: killing it" >&2
            kill -KILL "$dockerd_pid"
        fi
        # dockerd's managed containerd is its child, started by it with its own pid file.
        if [ -f "$run/exec/containerd/containerd.pid" ]; then
            cpid="$(cat "$run/exec/containerd/containerd.pid")"
            kill -0 "$cpid" 2>/dev/null && kill -TERM "$cpid"
        fi
        wait "$dockerd_pid" 2>/dev/null
    fi
    umount "$run"/exec/netns/* 2>/dev/null
    rm -rf "$run"
    if [ "$status" -ne 0 ]; then
        echo "container-check: FAILED (exit $status); dockerd's log was $cache/dockerd.log" >&2
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

step "starting dockerd (data root $cache/docker)"
# No host iptables rules and no default bridge: builds use the host network, the compose
# scenario its own bridge network, and nothing is published on the host.
/usr/sbin/dockerd --host "$DOCKER_HOST" --data-root "$cache/docker" --exec-root "$run/exec" \
    --pidfile "$run/dockerd.pid" --iptables=false --ip-forward=false --ip-masq=false \
    --bridge=none >"$cache/dockerd.log" 2>&1 &
dockerd_pid=$!
for _ in $(seq 1 120); do
    "$DOCKER" version >/dev/null 2>&1 && break
    kill -0 "$dockerd_pid" 2>/dev/null || { tail -20 "$cache/dockerd.log" >&2; exit 1; }
    sleep 0.5
done
"$DOCKER" version --format 'dockerd {{.Server.Version}}'

have_image() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

rust_version="$(sed -n 's/^ARG RUST_VERSION=\(.*\)$/\1/p' deploy/Dockerfile)"
rust_image="rust:${rust_version}-bookworm"
python_image=turnlock-check/python:bookworm
redis_image=turnlock-check/redis:bookworm
if [ "${TURNLOCK_CONTAINER_RESEED:-}" = 1 ]; then
    step "TURNLOCK_CONTAINER_RESEED=1: removing the seeded images"
    for i in "$python_image" "$redis_image" "$rust_image" debian:bookworm-slim; do
        if have_image "$i"; then "$DOCKER" rmi -f "$i" >/dev/null; fi
    done
fi

# --- base images -----------------------------------------------------------------------------
# The apt mirror this machine is configured with (deb822 or one-line sources).
mirror="$(sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*\/debian\)\/*$/\1/p' /etc/apt/sources.list.d/*.sources \
    2>/dev/null | head -1)"
if [ -z "$mirror" ]; then
    mirror="$(sed -n 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]*\/debian\)\/*[[:space:]]\+bookworm[[:space:]].*/\2/p' \
        /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | head -1)"
fi
mirror="${mirror:-http://deb.debian.org/debian}"

if ! have_image debian:bookworm-slim; then
    step "seeding debian:bookworm-slim (debootstrap minbase from $mirror)"
    rootfs="$cache/rootfs"
    rm -rf "$rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$cache/debootstrap.log" 2>&1 \
        || { tail -20 "$cache/debootstrap.log" >&2; exit 1; }
    # What the official slim image leaves out, and its apt and dpkg settings: no package
    # caches or documentation in the layers built on it (image sizes then compare).
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin \
        "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* \
        "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/*
    cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
    printf 'Acquire::Languages "none";\n' >"$rootfs/etc/apt/apt.conf.d/docker-no-languages"
    printf 'Acquire::GzipIndexes "true";\n' >"$rootfs/etc/apt/apt.conf.d/docker-gzip-indexes"
    printf 'Apt::AutoRemove::SuggestsImportant "false";\n' \
        >"$rootfs/etc/apt/apt.conf.d/docker-autoremove-suggests"
    printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
        'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' \
        'path-exclude /usr/share/locale/*' 'path-include /usr/share/locale/locale.alias' \
        'path-exclude /usr/share/groff/*' 'path-exclude /usr/share/lintian/*' \
        'path-exclude /usr/share/linda/*' >"$rootfs/etc/dpkg/dpkg.cfg.d/docker"
    tar -C "$rootfs" -c . | "$DOCKER" import --change 'CMD ["bash"]' - debian:bookworm-slim >/dev/null
    rm -rf "$rootfs"
fi

if ! have_image "$rust_image"; then
    toolchain="$(rustc --print sysroot)"
    have="$(rustc --version | cut -d' ' -f2)"
    case "$have" in
    "$rust_version" | "$rust_version".*) ;;
    *)
        echo "this machine's Rust is $have; deploy/Dockerfile wants $rust_version" >&2
        exit 1
        ;;
    esac
    step "seeding $rust_image from this machine's toolchain ($toolchain, rustc $have)"
    ctx="$run/rust-image"
    mkdir -p "$ctx"
    cat >"$ctx/Dockerfile" <<'EOF'
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# This machine's trust store: its way to crates.io may pass a TLS-inspecting proxy.
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY toolchain /usr/local/rustup/toolchains/default
ENV RUSTUP_HOME=/usr/local/rustup CARGO_HOME=/usr/local/cargo \
    PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN mkdir -p /usr/local/cargo/bin \
    && for b in cargo rustc rustdoc; do ln -s /usr/local/rustup/toolchains/default/bin/$b /usr/local/cargo/bin/$b; done \
    && cargo --version && rustc --version
EOF
    cp /etc/ssl/certs/ca-certificates.crt "$ctx/"
    # The context streamed as one tar: the toolchain without its documentation, the trust
    # store and the Dockerfile.
    tar -c -C "$toolchain" --exclude=./share/doc --transform 's,^\.,toolchain,' . \
        -C "$ctx" Dockerfile ca-certificates.crt |
        "$DOCKER" build --network host -t "$rust_image" - >"$cache/rust-image.log" 2>&1 \
        || { tail -30 "$cache/rust-image.log" >&2; exit 1; }
fi

# Stand-ins for the compose file's third-party images, from Debian packages.
if ! have_image "$python_image"; then
    step "building $python_image (Debian's python3)"
    printf '%s\n' 'FROM debian:bookworm-slim' \
        'RUN apt-get update && apt-get install -y --no-install-recommends python3 python-is-python3 \' \
        '    && rm -rf /var/lib/apt/lists/*' |
        "$DOCKER" build --network host -t "$python_image" - >"$cache/python-image.log" 2>&1 \
        || { tail -30 "$cache/python-image.log" >&2; exit 1; }
fi
if ! have_image "$redis_image"; then
    step "building $redis_image (Debian's redis-server)"
    # Like the official image: without a config file, Redis answers other containers.
    printf '%s\n' 'FROM debian:bookworm-slim' \
        'RUN apt-get update && apt-get install -y --no-install-recommends redis-server \' \
        '    && rm -rf /var/lib/apt/lists/*' \
        'ENTRYPOINT ["/bin/sh", "-c", "if [ \"$1\" = redis-server ]; then shift; exec redis-server --protected-mode no \"$@\"; fi; exec \"$@\"", "--"]' \
        'CMD ["redis-server"]' |
        "$DOCKER" build --network host -t "$redis_image" - >"$cache/redis-image.log" 2>&1 \
        || { tail -30 "$cache/redis-image.log" >&2; exit 1; }
fi
export TURNLOCK_DEMO_PYTHON_IMAGE="$python_image" TURNLOCK_DEMO_REDIS_IMAGE="$redis_image"

# --- the image -------------------------------------------------------------------------------
image=turnlock:dev
step "building $image from deploy/Dockerfile (BuildKit; cargo's registry and target in cache mounts)"
build_started=$(date +%s)
# The build reaches crates.io and the apt mirror through the host's network.
"$DOCKER" build --network host --progress plain -f deploy/Dockerfile -t "$image" . \
    >"$cache/image-build.log" 2>&1 || { tail -40 "$cache/image-build.log" >&2; exit 1; }
echo "built in $(($(date +%s) - build_started)) s"

fail() {
    echo "FAIL: $*" >&2
    exit 1
}

step "checking the image"
user="$("$DOCKER" image inspect -f '{{.Config.User}}' "$image")"
[ "$user" = "1337:1337" ] || fail "the image's user is '$user', not 1337:1337"
uid="$("$DOCKER" run --rm --read-only --entrypoint id "$image" -u)"
[ "$uid" = 1337 ] || fail "the entrypoint runs as uid $uid, not 1337"
echo "runs as uid $uid"
version="$("$DOCKER" run --rm --read-only "$image" --version)"
echo "--version: $version"
case "$version" in turnlock\ *) ;; *) fail "turnlock --version printed '$version'" ;; esac

# The proxy with a read-only root filesystem, no capabilities and no Redis: it must come up,
# answer `turnlock health`, and the image's own HEALTHCHECK must report it healthy.
cid="$("$DOCKER" run -d --read-only --cap-drop ALL --security-opt no-new-privileges:true \
    --network none -e TURNLOCK_REDIS=redis://127.0.0.1:6379 "$image" proxy)"
healthy=""
for _ in $(seq 1 60); do
    state="$("$DOCKER" inspect -f '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}' "$cid")"
    case "$state" in
    "running healthy") healthy=1 && break ;;
    running*) sleep 0.5 ;;
    *)
        "$DOCKER" logs "$cid" >&2
        fail "the proxy container stopped: $state"
        ;;
    esac
done
if [ -z "$healthy" ]; then
    "$DOCKER" logs "$cid" >&2
    fail "the image's HEALTHCHECK never reported healthy ($state)"
fi
"$DOCKER" exec "$cid" turnlock health || fail "turnlock health failed in the running container"
echo "read-only root filesystem: the proxy is up and healthy (HEALTHCHECK and turnlock health)"
"$DOCKER" rm -f "$cid" >/dev/null

size="$("$DOCKER" image inspect -f '{{.Size}}' "$image")"
echo "image size: $size bytes ($((size / 1000000)) MB); its layers:"
"$DOCKER" history --format '{{.Size}}\t{{.CreatedBy}}' "$image" | grep -v '^0B' | cut -c1-100 | sed 's/^/  /'

# --- the compose scenario --------------------------------------------------------------------
# Debian's Compose is 1.29, which does not know the Compose Specification's top-level `name`
# (Compose v2 does): it reads a copy without it, with paths relative to deploy/ as before.
sed '/^name:/d' "$compose_file" >"$run/docker-compose.yml"
compose() { "$COMPOSE" -p "$project" --project-directory deploy -f "$run/docker-compose.yml" "$@"; }

# Prints the load generator's JSON summary from its output ($1) and the number of lost writes.
lost_of() {
    local line
    line="$(grep -o '{"agents".*"lost".*}' "$1" | tail -1)"
    [ -n "$line" ] || return 1
    echo "$line" >&2
    python3 -c 'import json,sys; print(json.loads(sys.argv[1])["lost"])' "$line"
}

step "compose: two agent replicas with turnlock sidecars"
compose down -v --remove-orphans >/dev/null 2>&1 || true
set +e
compose up --no-build --no-color --abort-on-container-exit --exit-code-from loadgen >"$cache/compose-sidecars.log" 2>&1
with_status=$?
set -e
compose down -v --remove-orphans >/dev/null 2>&1 || true
with_lost="$(lost_of "$cache/compose-sidecars.log")" || {
    tail -40 "$cache/compose-sidecars.log" >&2
    fail "the load generator printed no summary (exit $with_status)"
}

step "compose: the same agents without turnlock (profile without-turnlock)"
set +e
compose --profile without-turnlock up --no-build --no-color --abort-on-container-exit \
    --exit-code-from loadgen-direct loadgen-direct >"$cache/compose-direct.log" 2>&1
direct_status=$?
set -e
compose --profile without-turnlock down -v --remove-orphans >/dev/null 2>&1 || true
direct_lost="$(lost_of "$cache/compose-direct.log")" || {
    tail -40 "$cache/compose-direct.log" >&2
    fail "the load generator printed no summary (exit $direct_status)"
}

echo "compose scenario: with turnlock sidecars $with_lost lost (loadgen exit $with_status);" \
    "without turnlock $direct_lost lost (loadgen exit $direct_status)"
[ "$with_status" -eq 0 ] && [ "$with_lost" -eq 0 ] \
    || fail "through the sidecars the load generator lost $with_lost writes (exit $with_status)"
[ "$direct_lost" -gt 0 ] || fail "without turnlock no write was lost: the scenario shows nothing"

step "container checks passed"
