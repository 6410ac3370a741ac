//! Transparent interception end to end, inside two network namespaces this test creates: a
//! "pod" (agent, sidecar, Redis) and a "store" host joined by a veth pair. `turnlock
//! init-iptables` installs the nat rules in the pod; the agent (curl, as root) writes to the
//! store's own address and never learns of the sidecar, yet its append is served by turnlock.
//!
//! Needs root, `ip` (iproute2), `iptables` / `iptables-restore`, `setpriv` (util-linux), `curl`,
//! `redis-server` and `redis-cli`. A missing one fails the test; it is never skipped.

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Addresses from the benchmarking range (RFC 2544), used only inside the test's namespaces.
const POD_IP: &str = "198.18.0.1";
const STORE_IP: &str = "198.18.0.2";
const STORE_PORT: u16 = 8080;
const PROXY_PORT: u16 = 7070;
const ADMIN_PORT: u16 = 9901;
const REDIS_PORT: u16 = 6379;
const PROXY_UID: &str = "1337";

fn require(program: &str, probe: &[&str]) {
    let found = Command::new(program)
        .args(probe)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    assert!(
        found,
        "{program} not found: this test needs iproute2, iptables, util-linux, curl and redis \
         (apt-get install -y iproute2 iptables util-linux curl redis-server)"
    );
}

fn run(program: &str, args: &[&str]) -> Output {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The two namespaces and the processes started in them; all removed on drop.
struct Lab {
    pod: String,
    store: String,
    children: Vec<Child>,
}

impl Lab {
    fn create() -> Self {
        let id = std::process::id();
        let lab = Self {
            pod: format!("tl-pod-{id}"),
            store: format!("tl-store-{id}"),
            children: Vec::new(),
        };
        let (veth_pod, veth_store) = (format!("tlp{id}"), format!("tls{id}"));
        run("ip", &["netns", "add", &lab.pod]);
        run("ip", &["netns", "add", &lab.store]);
        run(
            "ip",
            &["link", "add", &veth_pod, "type", "veth", "peer", "name", &veth_store],
        );
        run("ip", &["link", "set", &veth_pod, "netns", &lab.pod]);
        run("ip", &["link", "set", &veth_store, "netns", &lab.store]);
        for (ns, dev, ip) in [(&lab.pod, &veth_pod, POD_IP), (&lab.store, &veth_store, STORE_IP)] {
            run("ip", &["-n", ns, "link", "set", "lo", "up"]);
            run("ip", &["-n", ns, "addr", "add", &format!("{ip}/30"), "dev", dev]);
            run("ip", &["-n", ns, "link", "set", dev, "up"]);
        }
        lab
    }

    fn spawn(&mut self, ns: &str, prefix: &[&str], program: &str, args: &[&str]) {
        let child = Command::new("ip")
            .args(["netns", "exec", ns])
            .args(prefix)
            .arg(program)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("{program}: {e}"));
        self.children.push(child);
    }

    /// `curl` inside the pod, as root: the agent. Returns (status, body).
    fn curl(&self, args: &[&str]) -> (u16, String) {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.pod,
                "curl",
                "-sS",
                "--max-time",
                "5",
                "-w",
                "\n%{http_code}",
            ])
            .args(args)
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_owned())
    }

    /// Waits (bounded) until `url` answers anything from inside the pod.
    fn wait_for(&self, url: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if self.curl(&["-o", "/dev/null", url]).0 != 0 {
                return;
            }
            assert!(Instant::now() < deadline, "{url} did not come up");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in [&self.pod, &self.store] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

#[test]
fn agent_store_traffic_is_intercepted_without_the_agent_knowing() {
    assert_eq!(
        nix_euid(),
        0,
        "this test creates network namespaces and nat rules: run it as root"
    );
    require("ip", &["-V"]);
    require("iptables-restore", &["--version"]);
    require("setpriv", &["--version"]);
    require("curl", &["--version"]);
    require("redis-cli", &["--version"]);
    let redis = crate::support::redis_server_bin();
    let bin = crate::support::turnlock_bin();
    let bin = bin.to_str().expect("utf-8 path");

    let mut lab = Lab::create();
    let (pod, store) = (lab.pod.clone(), lab.store.clone());
    let store_url = format!("http://{STORE_IP}:{STORE_PORT}");

    // The store, on its own host.
    lab.spawn(
        &store,
        &[],
        bin,
        &["store", "--listen", &format!("{STORE_IP}:{STORE_PORT}")],
    );
    // Redis, in the pod (loopback): the lock path is the usual one.
    lab.spawn(
        &pod,
        &[],
        &redis,
        &[
            "--port",
            &REDIS_PORT.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
    );
    lab.wait_for(&format!("{store_url}/v1/sessions/probe"));

    // Before the rules, the agent reaches the store itself, which has no append endpoint.
    let append = |lab: &Lab, turn: u64, id: &str| {
        let body = json!({"turn": turn, "messages": [{"id": id, "role": "user", "content": format!("turn {turn}")}]});
        lab.curl(&[
            "-X",
            "POST",
            "-H",
            "content-type: application/json",
            "--data",
            &body.to_string(),
            &format!("{store_url}/v1/sessions/s-1/messages"),
        ])
    };
    let (direct, body) = append(&lab, 1, "m-1");
    assert!(
        !(200..300).contains(&direct),
        "the bare store must not accept an append: {direct} {body}"
    );

    // The sidecar, as its own user, in transparent mode; then the pod's nat rules.
    lab.spawn(
        &pod,
        &[
            "setpriv",
            "--reuid",
            PROXY_UID,
            "--regid",
            PROXY_UID,
            "--clear-groups",
            "--",
        ],
        bin,
        &[
            "proxy",
            "--transparent",
            "--listen",
            &format!("127.0.0.1:{PROXY_PORT}"),
            "--admin",
            &format!("127.0.0.1:{ADMIN_PORT}"),
            "--redis",
            &format!("redis://127.0.0.1:{REDIS_PORT}"),
        ],
    );
    lab.wait_for(&format!("http://127.0.0.1:{ADMIN_PORT}/readyz"));
    run(
        "ip",
        &[
            "netns",
            "exec",
            &pod,
            bin,
            "init-iptables",
            "--store-ports",
            &STORE_PORT.to_string(),
            "--proxy-port",
            &PROXY_PORT.to_string(),
            "--proxy-uid",
            PROXY_UID,
        ],
    );
    // Running it again (an init container restarted) leaves one copy of the rules.
    run(
        "ip",
        &[
            "netns",
            "exec",
            &pod,
            bin,
            "init-iptables",
            "--store-ports",
            "8080",
            "--proxy-uid",
            PROXY_UID,
        ],
    );
    let rules = String::from_utf8_lossy(&run("ip", &["netns", "exec", &pod, "iptables", "-t", "nat", "-S"]).stdout)
        .into_owned();
    assert_eq!(rules.matches("-j TURNLOCK_OUTPUT").count(), 1, "{rules}");

    // The same request to the same address is now served by turnlock: created, turn and
    // version in the answer, and a second writer's append merged rather than overwriting.
    let (status, body) = append(&lab, 1, "m-1");
    assert_eq!(status, 201, "{body}");
    let doc: Value = serde_json::from_str(&body).expect("json answer");
    assert_eq!(doc["turn"], 1, "{doc}");
    let (status, body) = append(&lab, 2, "m-2");
    assert_eq!(status, 200, "{body}");
    let (status, body) = append(&lab, 1, "m-old");
    assert_eq!(status, 409, "a stale turn is refused by the sidecar: {body}");

    // Reads pass through to the store, which holds both messages.
    let (status, body) = lab.curl(&[&format!("{store_url}/v1/sessions/s-1")]);
    assert_eq!(status, 200, "{body}");
    let stored: Value = serde_json::from_str(&body).expect("document");
    assert_eq!(crate::support::message_ids(&stored), ["m-1", "m-2"]);
    assert_eq!(stored["turn"], 2);

    // The sidecar counted the writes, and its lock state is in the pod's Redis.
    let (_, metrics) = lab.curl(&[&format!("http://127.0.0.1:{ADMIN_PORT}/metrics")]);
    let appends = metrics
        .lines()
        .find(|l| l.contains("route=\"append\"") && l.contains("status=\"201\""))
        .unwrap_or_else(|| panic!("no append metric in:\n{metrics}"));
    assert!(appends.ends_with(" 1"), "{appends}");
    let keys = run(
        "ip",
        &[
            "netns",
            "exec",
            &pod,
            "redis-cli",
            "-p",
            &REDIS_PORT.to_string(),
            "--scan",
        ],
    );
    assert!(
        String::from_utf8_lossy(&keys.stdout).contains("s-1"),
        "no turnlock key for the session in Redis"
    );
}

fn nix_euid() -> u32 {
    let out = Command::new("id").arg("-u").output().expect("id -u");
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(u32::MAX)
}
