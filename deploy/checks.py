"""Checks of deploy/ and k8s/ that need no Docker engine and no cluster (run by ci-checks.sh).

  python3 deploy/checks.py --turnlock target/release/turnlock

1. docker-compose.yml parses and references only files, services and turnlock subcommands and
   settings that exist; the Dockerfile copies only what exists and runs turnlock without a shell.
2. Every manifest in k8s/ validates against the Kubernetes OpenAPI schemas (kubernetes-validate,
   strict: unknown fields fail); cert-manager objects and cross-references are checked by hand.
3. Each example Deployment that opts in is sent, as the pod the API server would create, to a
   real `turnlock inject` over HTTPS; the returned patch is applied and the injected pod
   validated against the schemas too.
4. The compose scenario runs natively (the same programs, on loopback): two agent replicas with
   their own sidecars and a load generator; no acknowledged write may be lost.

Exits non-zero on the first failed group, after printing every failure of that group.
"""

import argparse
import base64
import copy
import json
import os
import re
import shlex
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request

import jsonpatch
import kubernetes_validate
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "deploy")
K8S = os.path.join(ROOT, "k8s")
KUBERNETES_VERSION = os.environ.get("KUBERNETES_VERSION", "1.33.0")

failures = []


def fail(msg):
    failures.append(msg)
    print(f"FAIL {msg}", flush=True)


def ok(msg):
    print(f"ok   {msg}", flush=True)


def end_group(name):
    if failures:
        sys.exit(f"{name}: {len(failures)} failure(s)")


# === turnlock's own command line ===


def help_text(turnlock, *sub):
    out = subprocess.run([turnlock, *sub, "--help"], capture_output=True, text=True, timeout=30)
    return out.returncode, out.stdout + out.stderr


def known_envs(turnlock, sub):
    code, text = help_text(turnlock, sub)
    if code != 0:
        return None
    # clap lists each setting's variable as `[env: NAME=...]`; RUST_LOG is read by the logger.
    return set(re.findall(r"\[env: ([A-Z0-9_]+)=", text)) | {"RUST_LOG", "TURNLOCK_LOG_FORMAT"}


def check_turnlock_invocation(turnlock, where, args, env):
    if not args:
        args = ["proxy"]  # the image's CMD
    sub = args[0]
    envs = known_envs(turnlock, sub)
    if envs is None:
        fail(f"{where}: `turnlock {sub}` is not a subcommand")
        return
    for name in env:
        if name.startswith("TURNLOCK_") and name not in envs:
            fail(f"{where}: `turnlock {sub}` reads no {name}")
    flags = [a.split("=")[0] for a in args[1:] if a.startswith("--")]
    _, text = help_text(turnlock, sub)
    for flag in flags:
        if not re.search(rf"(^|\s){re.escape(flag)}[\s,=<]", text, re.M):
            fail(f"{where}: `turnlock {sub}` has no flag {flag}")
    ok(f"{where}: turnlock {' '.join(args)} ({len(env)} env vars)")


# === 1. Docker ===


def dockerfile_build_command():
    """The cargo command of the Dockerfile's build stage."""
    lines = open(os.path.join(DEPLOY, "Dockerfile")).read().splitlines()
    text = "\n".join(l for l in lines if not l.lstrip().startswith("#")).replace("\\\n", " ")
    m = re.search(r"(cargo build[^&\n]*)", text)
    return m.group(1).strip() if m else None


def check_dockerfile(turnlock):
    path = os.path.join(DEPLOY, "Dockerfile")
    lines = [l.strip() for l in open(path).read().replace("\\\n", " ").splitlines()]
    stages = [l for l in lines if l.upper().startswith("FROM ")]
    if len(stages) < 2:
        fail("Dockerfile: not a multi-stage build")
    for l in lines:
        if l.upper().startswith("COPY ") and "--from=" not in l:
            for src in shlex.split(l)[1:-1]:
                if not src.startswith("--") and not os.path.exists(os.path.join(ROOT, src)):
                    fail(f"Dockerfile: COPY source {src} does not exist")
    entry = [l for l in lines if l.upper().startswith("ENTRYPOINT ")]
    if not entry or json.loads(entry[-1].split(None, 1)[1]) != ["turnlock"]:
        fail('Dockerfile: ENTRYPOINT must be ["turnlock"] (exec form, no shell)')
    users = [l.split()[1] for l in lines if l.upper().startswith("USER ")]
    if not users or users[-1].split(":")[0] in ("0", "root"):
        fail("Dockerfile: the final stage must run as a non-root USER")
    health = [l for l in lines if l.upper().startswith("HEALTHCHECK ")]
    if not health or "CMD [" not in health[-1]:
        fail("Dockerfile: HEALTHCHECK must run a turnlock subcommand in exec form")
    else:
        cmd = json.loads(health[-1].split("CMD", 1)[1].strip())
        if cmd[0] != "turnlock" or help_text(turnlock, *cmd[1:2])[0] != 0:
            fail(f"Dockerfile: HEALTHCHECK {cmd} is not a turnlock subcommand")
    if not dockerfile_build_command():
        fail("Dockerfile: no `cargo build` step")
    ignore = open(os.path.join(ROOT, ".dockerignore")).read().split()
    for needed in ("src/", "Cargo.toml", "Cargo.lock"):
        if needed in ignore or needed.rstrip("/") in ignore:
            fail(f".dockerignore excludes {needed}, which the build needs")
    ok(f"Dockerfile: {len(stages)} stages, non-root, exec-form entrypoint and health check")


def check_compose(turnlock):
    path = os.path.join(DEPLOY, "docker-compose.yml")
    doc = yaml.safe_load(open(path))
    services = doc.get("services") or {}
    if not services:
        fail("compose: no services")
        return
    for name, svc in services.items():
        where = f"compose service {name}"
        build = svc.get("build")
        if build:
            ctx = os.path.normpath(os.path.join(DEPLOY, build.get("context", ".")))
            if not os.path.isdir(ctx):
                fail(f"{where}: build context {ctx} does not exist")
            dockerfile = os.path.join(ctx, build.get("dockerfile", "Dockerfile"))
            if not os.path.isfile(dockerfile):
                fail(f"{where}: {dockerfile} does not exist")
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0] if isinstance(vol, str) else vol.get("source", "")
            if src.startswith(".") or src.startswith("/"):
                full = os.path.normpath(os.path.join(DEPLOY, src))
                if not os.path.exists(full):
                    fail(f"{where}: bind mount source {src} does not exist")
                cmd = svc.get("command") or []
                for arg in cmd:
                    target = vol.split(":")[1]
                    if isinstance(arg, str) and arg.startswith(target + "/"):
                        rel = os.path.join(full, arg[len(target) + 1 :])
                        if not os.path.exists(rel):
                            fail(f"{where}: runs {arg}, which is not in {src}")
        mode = svc.get("network_mode", "")
        if mode.startswith("service:") and mode.split(":", 1)[1] not in services:
            fail(f"{where}: network_mode names a missing service")
        deps = svc.get("depends_on") or []
        for dep in deps if isinstance(deps, list) else deps.keys():
            if dep not in services:
                fail(f"{where}: depends on missing service {dep}")
        if str(svc.get("image", "")).startswith("turnlock"):
            env = svc.get("environment") or {}
            if isinstance(env, list):
                env = dict(e.split("=", 1) for e in env)
            check_turnlock_invocation(turnlock, where, svc.get("command") or [], env)
    sidecars = [n for n, s in services.items() if str(s.get("network_mode", "")).startswith("service:")]
    if len(sidecars) < 2:
        fail("compose: expected two sidecars sharing their agent's network namespace")
    if "loadgen" not in services:
        fail("compose: no load generator")
    ok(f"compose: {len(services)} services, sidecars {sidecars}")


# === 2. Kubernetes manifests ===


def load_manifests():
    docs = []
    for name in sorted(os.listdir(K8S)):
        if name.endswith((".yaml", ".yml")):
            for doc in yaml.safe_load_all(open(os.path.join(K8S, name))):
                if doc:
                    docs.append((name, doc))
    return docs


def find(docs, kind, name=None):
    return [d for _, d in docs if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]


def check_manifests(turnlock):
    docs = load_manifests()
    if not docs:
        fail("k8s/: no manifests")
        return docs
    for file, doc in docs:
        ident = f"{file}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        if doc.get("apiVersion", "").startswith("cert-manager.io/"):
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            ok(f"{ident} validates against Kubernetes {KUBERNETES_VERSION} (strict)")
        except Exception as e:  # kubernetes_validate raises several error types
            fail(f"{ident}: {e}")

    # cert-manager objects have no schema in Kubernetes; check what the rest relies on.
    certs = find(docs, "Certificate")
    issuers = {d["metadata"]["name"] for d in find(docs, "Issuer")}
    hook = find(docs, "MutatingWebhookConfiguration")
    deployments = {d["metadata"]["name"]: d for d in find(docs, "Deployment")}
    services = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in find(docs, "Service")}
    by_name = {c["metadata"]["name"]: c for c in certs}
    if not certs or not hook:
        fail("k8s/: expected cert-manager Certificates and the MutatingWebhookConfiguration")
        return docs
    # The caBundle comes from a CA Certificate; the serving certificate is issued by that CA
    # (through a CA Issuer), so renewing it leaves the caBundle unchanged.
    ca_from = hook[0]["metadata"].get("annotations", {}).get("cert-manager.io/inject-ca-from", "")
    ca = by_name.get(ca_from.split("/", 1)[-1])
    if ca is None or ca_from != f"{ca['metadata']['namespace']}/{ca['metadata']['name']}":
        fail(f"webhook: cert-manager.io/inject-ca-from {ca_from} names no Certificate in k8s/")
        return docs
    if not ca["spec"].get("isCA"):
        fail("webhook: cert-manager.io/inject-ca-from must name the CA Certificate (isCA: true)")
    ca_issuers = {d["metadata"]["name"] for d in find(docs, "Issuer") if d["spec"].get("ca", {}).get("secretName") == ca["spec"].get("secretName")}
    serving = [c for c in certs if c is not ca]
    if len(serving) != 1:
        fail("k8s/: expected one serving Certificate besides the CA")
        return docs
    cert = serving[0]
    spec = cert["spec"]
    for field in ("secretName", "dnsNames", "issuerRef"):
        if field not in spec:
            fail(f"Certificate: spec.{field} missing")
    for c in certs:
        if c["spec"].get("issuerRef", {}).get("name") not in issuers:
            fail(f"Certificate {c['metadata']['name']}: issuerRef names no Issuer in k8s/")
    if spec.get("issuerRef", {}).get("name") not in ca_issuers:
        fail("Certificate: the serving certificate is not issued by the CA the caBundle holds")
    injector = deployments.get("turnlock-injector")
    if not injector:
        fail("k8s/: no turnlock-injector Deployment")
        return docs
    secrets = [v["secret"]["secretName"] for v in injector["spec"]["template"]["spec"].get("volumes", []) if "secret" in v]
    if spec.get("secretName") not in secrets:
        fail("injector: does not mount the Certificate's Secret")
    for wh in hook[0]["webhooks"]:
        svc = wh["clientConfig"]["service"]
        target = services.get((svc["namespace"], svc["name"]))
        if not target:
            fail(f"webhook {wh['name']}: no Service {svc['namespace']}/{svc['name']}")
            continue
        if svc.get("port", 443) not in [p["port"] for p in target["spec"]["ports"]]:
            fail(f"webhook {wh['name']}: Service has no port {svc.get('port')}")
        dns = f"{svc['name']}.{svc['namespace']}.svc"
        if dns not in spec.get("dnsNames", []):
            fail(f"Certificate: dnsNames lack {dns}, the name the API server calls")
        if wh.get("failurePolicy") not in ("Fail", "Ignore"):
            fail(f"webhook {wh['name']}: failurePolicy must be chosen explicitly")
        if wh["clientConfig"]["service"].get("path") not in ("/inject", "/inject/namespace"):
            fail(f"webhook {wh['name']}: path is not one the injector serves")
    for name, dep in deployments.items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            if c.get("image", "").startswith("turnlock"):
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                check_turnlock_invocation(turnlock, f"Deployment {name}/{c['name']}", c.get("args", []), env)
    ok("cert-manager objects and cross-references")
    return docs


# === 3. Injection of the example Deployments ===


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, seconds=20):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


def pod_from_template(dep):
    template = copy.deepcopy(dep["spec"]["template"])
    meta = template.get("metadata", {})
    meta["namespace"] = dep["metadata"]["namespace"]
    meta["generateName"] = dep["metadata"]["name"] + "-"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


def check_injection(turnlock, docs, out_dir):
    work = tempfile.mkdtemp(prefix="turnlock-inject-")
    subprocess.run(
        [turnlock, "inject", "certs", "--out-dir", work, "--san", "127.0.0.1"],
        check=True,
        capture_output=True,
        timeout=30,
    )
    port = free_port()
    injector = find(docs, "Deployment", "turnlock-injector")[0]
    env = dict(os.environ)
    for e in injector["spec"]["template"]["spec"]["containers"][0].get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
    env.update(
        TURNLOCK_INJECT_LISTEN=f"127.0.0.1:{port}",
        TURNLOCK_TLS_CERT=os.path.join(work, "tls.crt"),
        TURNLOCK_TLS_KEY=os.path.join(work, "tls.key"),
    )
    server = subprocess.Popen([turnlock, "inject"], env=env, stderr=subprocess.DEVNULL)
    try:
        if not wait_port(port):
            fail("turnlock inject did not start")
            return
        context = ssl.create_default_context(cafile=os.path.join(work, "ca.crt"))
        opted_in = [
            d
            for d in find(docs, "Deployment")
            if d["spec"]["template"]["metadata"].get("labels", {}).get("turnlock.dev/inject") == "true"
            or d["spec"]["template"]["metadata"].get("annotations", {}).get("turnlock.dev/inject") == "true"
        ]
        if not opted_in:
            fail("k8s/: no example Deployment opts in to injection")
        for dep in opted_in:
            pod = pod_from_template(dep)
            review = {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "request": {
                    "uid": "ci-" + dep["metadata"]["name"],
                    "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "resource": {"group": "", "version": "v1", "resource": "pods"},
                    "namespace": dep["metadata"]["namespace"],
                    "operation": "CREATE",
                    "object": pod,
                },
            }
            req = urllib.request.Request(
                f"https://127.0.0.1:{port}/inject",
                data=json.dumps(review).encode(),
                headers={"content-type": "application/json"},
                method="POST",
            )
            with urllib.request.urlopen(req, context=context, timeout=10) as res:
                answer = json.loads(res.read())["response"]
            if not answer.get("allowed") or answer.get("patchType") != "JSONPatch":
                fail(f"{dep['metadata']['name']}: not injected: {answer}")
                continue
            patch = jsonpatch.JsonPatch(json.loads(base64.b64decode(answer["patch"])))
            injected = patch.apply(pod)
            try:
                kubernetes_validate.validate(injected, KUBERNETES_VERSION, strict=True)
            except Exception as e:
                fail(f"{dep['metadata']['name']}: the injected pod does not validate: {e}")
                continue
            names = [c["name"] for c in injected["spec"].get("initContainers", []) + injected["spec"]["containers"]]
            if "turnlock" not in names:
                fail(f"{dep['metadata']['name']}: no turnlock container after the patch")
                continue
            with open(os.path.join(out_dir, f"injected-{dep['metadata']['name']}.yaml"), "w") as f:
                yaml.safe_dump(injected, f, sort_keys=False)
            ok(f"{dep['metadata']['name']}: injected over HTTPS ({len(patch.patch)} ops); the pod validates (strict)")
    finally:
        server.terminate()
        server.wait(timeout=10)


# === 4. The compose scenario, natively ===


def check_scenario(turnlock, redis_server):
    procs = []

    def spawn(args, env=None):
        e = dict(os.environ)
        e.update(env or {})
        p = subprocess.Popen(args, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(p)
        return p

    try:
        redis_port, store_port = free_port(), free_port()
        spawn([redis_server, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        spawn([turnlock, "store", "--listen", f"127.0.0.1:{store_port}"])
        agents = []
        for _ in range(2):
            proxy, admin, agent = free_port(), free_port(), free_port()
            spawn(
                [turnlock, "proxy"],
                {
                    "TURNLOCK_LISTEN": f"127.0.0.1:{proxy}",
                    "TURNLOCK_ADMIN": f"127.0.0.1:{admin}",
                    "TURNLOCK_UPSTREAM": f"http://127.0.0.1:{store_port}",
                    "TURNLOCK_REDIS": f"redis://127.0.0.1:{redis_port}",
                },
            )
            spawn(
                [sys.executable, os.path.join(DEPLOY, "agent", "agent.py")],
                {"CONTEXT_STORE_URL": f"http://127.0.0.1:{proxy}", "AGENT_PORT": str(agent)},
            )
            agents.append((agent, admin))
        for agent, admin in agents:
            if not (wait_port(agent) and wait_port(admin)):
                fail("the scenario's processes did not start")
                return
        for _, admin in agents:
            health = subprocess.run([turnlock, "health", "--admin", f"127.0.0.1:{admin}"], timeout=30)
            if health.returncode != 0:
                fail("`turnlock health` (the image's HEALTHCHECK) says a sidecar is not ready")
        env = dict(os.environ)
        env.update(
            AGENTS=",".join(f"http://127.0.0.1:{a}" for a, _ in agents),
            STORE_URL=f"http://127.0.0.1:{store_port}",
            SESSIONS="4",
            TURNS="25",
            RUN_ID="ci",
        )
        out = subprocess.run(
            [sys.executable, os.path.join(DEPLOY, "agent", "loadgen.py")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        print(out.stdout.strip(), flush=True)
        if out.returncode != 0:
            fail(f"the compose scenario lost or duplicated writes: {out.stdout} {out.stderr}")
        else:
            ok("compose scenario: two replicas with sidecars, zero lost writes")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--turnlock", required=True, help="the turnlock binary to check with")
    parser.add_argument("--redis-server", default="redis-server")
    parser.add_argument("--print-build-command", action="store_true")
    parser.add_argument("--out-dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    if args.print_build_command:
        print(dockerfile_build_command() or "")
        return
    turnlock = os.path.abspath(args.turnlock)

    check_dockerfile(turnlock)
    check_compose(turnlock)
    end_group("docker")
    docs = check_manifests(turnlock)
    end_group("manifests")
    check_injection(turnlock, docs, args.out_dir)
    end_group("injection")
    check_scenario(turnlock, args.redis_server)
    end_group("scenario")
    print("all deploy checks passed", flush=True)


if __name__ == "__main__":
    main()
