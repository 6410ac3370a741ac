//! Transparent interception end to end, inside two network namespaces this test creates: a
//! "pod" (agent, sidecar, Redis) and a "store" host joined by a veth pair. `turnlock
//! init-iptables` installs the nat rules in the pod; the agent (curl, as root) writes to the
//! store's own address and never learns of the sidecar, yet its append is served by turnlock.
//! A second lab checks what else crosses an intercepted port: 200 destinations (more than the
//! sidecar keeps at once), the agent's own `Host`, Redis traffic passed through as raw TCP, and
//! a sidecar running as the wrong user refusing its own looped-back connections.
//!
//! Needs root, `ip` (iproute2), `iptables` / `iptables-restore`, `setpriv` (util-linux), `curl`,
//! `python3` (a store that echoes the headers it gets), `redis-server` and `redis-cli`. A missing one fails the test; it is never skipped.

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

/// The address family a lab's store is reached over.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

/// What an interception lab of either address family needs first: root, the tools, the
/// namespaces (with IPv6 addresses on the veth pair for [`Family::V6`]), the reference store
/// on the store host and Redis on the pod's loopback, both ready. Returns the lab, turnlock's
/// binary and the store's URL; the sidecar comes with [`Lab::transparent_sidecar`].
fn store_lab(tag: &str, family: Family) -> (Lab, String, String) {
    assert_eq!(
        nix_euid(),
        0,
        "this test creates network namespaces and nat rules: run it as root"
    );
    require("ip", &["-V"]);
    match family {
        Family::V4 => require("iptables-restore", &["--version"]),
        Family::V6 => require("ip6tables-restore", &["--version"]),
    }
    require("setpriv", &["--version"]);
    require("curl", &["--version"]);
    require("redis-cli", &["--version"]);
    let redis = crate::support::redis_server_bin();
    let bin = crate::support::turnlock_bin().to_str().expect("utf-8 path").to_owned();

    let mut lab = Lab::create(tag);
    let (pod, store) = (lab.pod.clone(), lab.store.clone());
    let listen = match family {
        Family::V4 => format!("{STORE_IP}:{STORE_PORT}"),
        Family::V6 => {
            for (ns, dev, ip) in [(&pod, lab.veth_pod(), POD_IP6), (&store, lab.veth_store(), STORE_IP6)] {
                run(
                    "ip",
                    &["-n", ns, "addr", "add", &format!("{ip}/64"), "dev", &dev, "nodad"],
                );
            }
            format!("[{STORE_IP6}]:{STORE_PORT}")
        }
    };
    let store_url = format!("http://{listen}");
    // The store, on its own host.
    lab.spawn(&store, &[], &bin, &["store", "--listen", &listen]);
    lab.pod_redis(&redis);
    lab.wait_for(&format!("{store_url}/v1/sessions/probe"));
    (lab, bin, store_url)
}

/// An agent's append of message `id` at `turn` to session `session` on `store_url`, sent by
/// curl in the pod: (status, body).
fn append(lab: &Lab, store_url: &str, session: &str, turn: u64, id: &str) -> (u16, String) {
    let body = json!({"turn": turn, "messages": [{"id": id, "role": "user", "content": format!("turn {turn}")}]});
    lab.curl(&[
        "-g",
        "-X",
        "POST",
        "-H",
        "content-type: application/json",
        "--data",
        &body.to_string(),
        &format!("{store_url}/v1/sessions/{session}/messages"),
    ])
}

/// The two namespaces and the processes started in them; all removed on drop.
struct Lab {
    pod: String,
    store: String,
    children: Vec<Child>,
}

impl Lab {
    /// `tag` tells apart the labs of tests running at once in one process.
    fn create(tag: &str) -> Self {
        let id = std::process::id();
        let lab = Self {
            pod: format!("tl-pod-{id}{tag}"),
            store: format!("tl-store-{id}{tag}"),
            children: Vec::new(),
        };
        let (veth_pod, veth_store) = (lab.veth_pod(), lab.veth_store());
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

    fn veth_pod(&self) -> String {
        self.pod.replace("tl-pod-", "tlp")
    }

    fn veth_store(&self) -> String {
        self.store.replace("tl-store-", "tls")
    }

    /// Starts a process in a namespace; returns its pid (`ip netns exec` and `setpriv` exec).
    fn spawn(&mut self, ns: &str, prefix: &[&str], program: &str, args: &[&str]) -> u32 {
        let child = Command::new("ip")
            .args(["netns", "exec", ns])
            .args(prefix)
            .arg(program)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("{program}: {e}"));
        let pid = child.id();
        self.children.push(child);
        pid
    }

    /// Kills the process started with `pid`.
    /// Redis on the pod's loopback (the lock path is the usual one).
    fn pod_redis(&mut self, redis: &str) {
        let pod = self.pod.clone();
        self.spawn(
            &pod,
            &[],
            redis,
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
    }

    /// The sidecar in the pod, as its own user, in transparent mode (listening on 127.0.0.1,
    /// and so on [::1]), with Redis on the pod's loopback; returns once it is ready.
    fn transparent_sidecar(&mut self, bin: &str) {
        let pod = self.pod.clone();
        self.spawn(
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
        self.wait_for(&format!("http://127.0.0.1:{ADMIN_PORT}/readyz"));
    }

    fn kill(&mut self, pid: u32) {
        if let Some(i) = self.children.iter().position(|c| c.id() == pid) {
            let mut c = self.children.remove(i);
            let _ = c.kill();
            let _ = c.wait();
        }
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
    let (mut lab, bin, store_url) = store_lab("a", Family::V4);
    let bin = bin.as_str();
    let pod = lab.pod.clone();
    // Before the rules, the agent reaches the store itself, which has no append endpoint.
    let append = |lab: &Lab, turn: u64, id: &str| append(lab, &store_url, "s-1", turn, id);
    let (direct, body) = append(&lab, 1, "m-1");
    assert!(
        !(200..300).contains(&direct),
        "the bare store must not accept an append: {direct} {body}"
    );

    // The sidecar, as its own user, in transparent mode; then the pod's nat rules.
    lab.transparent_sidecar(bin);
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

/// An HTTP server for the store host that answers every GET, POST and PUT with the `Host`
/// and `Via` headers it received (and the `Host` of the last PUT), on every address of its host.
const ECHO_SERVER: &str = r#"
import http.server, json
LAST = {}
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        self.reply()
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.reply()
    def do_PUT(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        LAST["put_host"] = self.headers.get("host")
        self.reply()
    def reply(self):
        body = json.dumps({"host": self.headers.get("host"), "via": self.headers.get("via"),
                           "put_host": LAST.get("put_host")}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8080), H).serve_forever()
"#;
const RAW_PORT: u16 = 6380;
/// Distinct destinations the agent reaches through one sidecar, past its cache size.
const DESTINATIONS: u32 = 200;

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn many_destinations_the_host_header_and_non_http_traffic_are_served_and_a_loop_is_refused() {
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
    require("python3", &["--version"]);
    let redis = crate::support::redis_server_bin();
    let bin = crate::support::turnlock_bin();
    let bin = bin.to_str().expect("utf-8 path");

    let mut lab = Lab::create("b");
    let (pod, store) = (lab.pod.clone(), lab.store.clone());
    // The store host answers on 200 more addresses, routed from the pod.
    let batch = (1..=DESTINATIONS)
        .map(|i| format!("addr add 198.18.1.{i}/32 dev {}\n", lab.veth_store()))
        .collect::<String>();
    let batch_file = std::env::temp_dir().join(format!("{store}.batch"));
    std::fs::write(&batch_file, batch).expect("batch file");
    run("ip", &["-n", &store, "-batch", batch_file.to_str().expect("path")]);
    let _ = std::fs::remove_file(&batch_file);
    run("ip", &["-n", &pod, "route", "add", "198.18.1.0/24", "via", STORE_IP]);

    lab.spawn(&store, &[], "python3", &["-c", ECHO_SERVER]);
    lab.spawn(
        &store,
        &[],
        &redis,
        &[
            "--port",
            &RAW_PORT.to_string(),
            "--protected-mode",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
    );
    lab.pod_redis(&redis);
    lab.wait_for(&format!("http://{STORE_IP}:{STORE_PORT}/"));
    let routes = std::env::temp_dir().join(format!("{pod}.routes.toml"));
    std::fs::write(
        &routes,
        "[[route]]\nmethod = \"POST\"\npath = \"/threads/{session}/events\"\nturn = { header = \"X-Turn\" }\nmode = \"serialize\"\n",
    )
    .expect("routes file");
    let routes = routes.to_str().expect("path").to_owned();
    let sidecar = |lab: &mut Lab, uid: &str| {
        lab.spawn(
            &pod,
            &["setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", "--"],
            bin,
            &[
                "proxy",
                "--transparent",
                "--listen",
                &format!("0.0.0.0:{PROXY_PORT}"),
                "--admin",
                &format!("127.0.0.1:{ADMIN_PORT}"),
                "--redis",
                &format!("redis://127.0.0.1:{REDIS_PORT}"),
                "--routes",
                &routes,
            ],
        )
    };
    let good = sidecar(&mut lab, PROXY_UID);
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
            &format!("{STORE_PORT},{RAW_PORT}"),
            "--proxy-port",
            &PROXY_PORT.to_string(),
            "--proxy-uid",
            PROXY_UID,
        ],
    );

    // The Host the agent sent reaches the store (name-based virtual hosting keeps working),
    // and the Via entry shows the request went through the sidecar.
    let (status, body) = lab.curl(&[
        "-H",
        "Host: store.example.com:8080",
        &format!("http://{STORE_IP}:{STORE_PORT}/anything"),
    ]);
    assert_eq!(status, 200, "{body}");
    let seen: Value = serde_json::from_str(&body).expect("echo");
    assert_eq!(seen["host"], "store.example.com:8080", "{seen}");
    assert!(seen["via"].as_str().is_some_and(|v| v.contains("turnlock")), "{seen}");

    // A serialize write keeps it too: the store gets the agent's request, under the lock.
    let (status, body) = lab.curl(&[
        "-X",
        "POST",
        "-H",
        "Host: store.example.com:8080",
        "-H",
        "X-Turn: 3",
        "--data",
        "{}",
        &format!("http://{STORE_IP}:{STORE_PORT}/threads/t1/events"),
    ]);
    assert_eq!(status, 200, "{body}");
    let seen: Value = serde_json::from_str(&body).expect("echo");
    assert_eq!(seen["host"], "store.example.com:8080", "{seen}");
    let (status, body) = lab.curl(&[
        "-X",
        "POST",
        "-H",
        "Host: store.example.com:8080",
        "-H",
        "X-Turn: 2",
        "--data",
        "{}",
        &format!("http://{STORE_IP}:{STORE_PORT}/threads/t1/events"),
    ]);
    assert_eq!(status, 409, "a stale serialize write is refused by the sidecar: {body}");
    // Another virtual host at the same address is another store: its turns are its own.
    let (status, body) = lab.curl(&[
        "-X",
        "POST",
        "-H",
        "Host: other.example.com:8080",
        "-H",
        "X-Turn: 2",
        "--data",
        "{}",
        &format!("http://{STORE_IP}:{STORE_PORT}/threads/t1/events"),
    ]);
    assert_eq!(status, 200, "another store's turn refused a write: {body}");

    // So does a merge write: turnlock's own read and write-back name the store as the agent did.
    let (status, body) = lab.curl(&[
        "-X",
        "POST",
        "-H",
        "Host: store.example.com:8080",
        "-H",
        "content-type: application/json",
        "--data",
        r#"{"turn": 1, "messages": [{"id": "m-1", "role": "user", "content": "hi"}]}"#,
        &format!("http://{STORE_IP}:{STORE_PORT}/v1/sessions/s-9/messages"),
    ]);
    assert!((200..300).contains(&status), "{status} {body}");
    let (_, body) = lab.curl(&[&format!("http://{STORE_IP}:{STORE_PORT}/anything")]);
    let seen: Value = serde_json::from_str(&body).expect("echo");
    assert_eq!(seen["put_host"], "store.example.com:8080", "{seen}");

    // 200 distinct destinations, one after another, twice: none is refused for good.
    let started = Instant::now();
    for round in 0..2 {
        for i in 1..=DESTINATIONS {
            let (status, body) = lab.curl(&[&format!("http://198.18.1.{i}:{STORE_PORT}/r{round}")]);
            assert_eq!(status, 200, "destination {i}, round {round}: {body}");
            let seen: Value = serde_json::from_str(&body).expect("echo");
            assert!(seen["via"].as_str().is_some_and(|v| v.contains("turnlock")), "{seen}");
        }
    }
    eprintln!(
        "TRANSPARENT {} requests to {DESTINATIONS} destinations in {:?}; sidecar descriptors {}",
        2 * DESTINATIONS,
        started.elapsed(),
        fd_count(good)
    );
    assert!(fd_count(good) < 400, "descriptors grew to {}", fd_count(good));

    // Redis on an intercepted port: not HTTP, so passed through as raw TCP.
    let redis_cli = |args: &[&str]| {
        let out = Command::new("ip")
            .args(["netns", "exec", &pod, "timeout", "5", "redis-cli", "-h", STORE_IP, "-p"])
            .arg(RAW_PORT.to_string())
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    assert_eq!(redis_cli(&["PING"]), "PONG");
    assert_eq!(redis_cli(&["SET", "k", "v"]), "OK");
    assert_eq!(redis_cli(&["GET", "k"]), "v");

    // The sidecar restarted as a user the rules do not exclude: its own connections come
    // back to it. It refuses the loop at once instead of forwarding until descriptors run out.
    lab.kill(good);
    let wrong = sidecar(&mut lab, "1338");
    lab.wait_for(&format!("http://127.0.0.1:{ADMIN_PORT}/readyz"));
    let started = Instant::now();
    let (status, body) = lab.curl(&[&format!("http://{STORE_IP}:{STORE_PORT}/anything")]);
    assert_eq!(status, 508, "{body}");
    assert!(body.contains("forwarding_loop"), "{body}");
    let refused_in = started.elapsed();
    assert!(refused_in < Duration::from_secs(3), "{refused_in:?}");
    assert_ne!(
        redis_cli(&["PING"]),
        "PONG",
        "a looped raw connection cannot reach the store"
    );
    std::thread::sleep(Duration::from_millis(300));
    let fds = fd_count(wrong);
    assert!(fds < 100, "the loop used {fds} descriptors");
    eprintln!("TRANSPARENT loop refused in {refused_in:?}; descriptors {fds}");
    let _ = std::fs::remove_file(&routes);
}

fn nix_euid() -> u32 {
    let out = Command::new("id").arg("-u").output().expect("id -u");
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(u32::MAX)
}

/// IPv6 addresses from the documentation range (RFC 3849), used only inside the namespaces.
const POD_IP6: &str = "2001:db8::1";
const STORE_IP6: &str = "2001:db8::2";

/// Dual stack: `init-iptables` writes the same rules with `ip6tables`, and the sidecar forwards
/// an IPv6 connection to its original destination (`IP6T_SO_ORIGINAL_DST`), with the usual lock
/// path. A namespace without IPv6 gets the IPv4 rules only (`--ipv6 auto`), and `--ipv6 on`
/// refuses to run there.
#[test]
fn ipv6_store_traffic_is_intercepted_and_forwarded_to_its_original_destination() {
    let (mut lab, bin, store_url) = store_lab("c", Family::V6);
    let bin = bin.as_str();
    let pod = lab.pod.clone();
    let append = |lab: &Lab, turn: u64, id: &str| append(lab, &store_url, "s-6", turn, id);

    // The sidecar listens on 127.0.0.1 as usual (and so, in transparent mode, on [::1]).
    lab.transparent_sidecar(bin);
    for _ in 0..2 {
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
    }
    let rules6 = String::from_utf8_lossy(&run("ip", &["netns", "exec", &pod, "ip6tables", "-t", "nat", "-S"]).stdout)
        .into_owned();
    assert_eq!(
        rules6.matches("-A OUTPUT -p tcp -j TURNLOCK_OUTPUT").count(),
        1,
        "{rules6}"
    );
    assert!(rules6.contains("--uid-owner 1337 -j RETURN"), "{rules6}");
    assert!(rules6.contains("-j REDIRECT --to-ports 7070"), "{rules6}");

    // The agent writes to the store's IPv6 address: served by turnlock (created, merged, a
    // stale turn refused), and the writes land in the store behind that address.
    let (status, body) = append(&lab, 1, "m-1");
    assert_eq!(status, 201, "the IPv6 append was not served by the sidecar: {body}");
    let (status, body) = append(&lab, 2, "m-2");
    assert_eq!(status, 200, "{body}");
    let (status, body) = append(&lab, 1, "m-old");
    assert_eq!(status, 409, "a stale turn is refused by the sidecar: {body}");
    let (status, body) = lab.curl(&["-g", &format!("{store_url}/v1/sessions/s-6")]);
    assert_eq!(status, 200, "{body}");
    let stored: Value = serde_json::from_str(&body).expect("document");
    assert_eq!(crate::support::message_ids(&stored), ["m-1", "m-2"]);
    let (_, metrics) = lab.curl(&[&format!("http://127.0.0.1:{ADMIN_PORT}/metrics")]);
    assert!(
        metrics
            .lines()
            .any(|l| l.contains("route=\"append\"") && l.contains("status=\"201\"") && l.ends_with(" 1")),
        "no append counted:\n{metrics}"
    );

    // A pod without IPv6: `auto` installs the IPv4 rules only and says so; `on` refuses.
    let bare = Lab::create("d");
    let bare_pod = bare.pod.clone();
    run(
        "ip",
        &[
            "netns",
            "exec",
            &bare_pod,
            "sysctl",
            "-q",
            "-w",
            "net.ipv6.conf.all.disable_ipv6=1",
        ],
    );
    let init = |extra: &[&str]| {
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &bare_pod,
                bin,
                "init-iptables",
                "--store-ports",
                "8080",
            ])
            .args(extra)
            .output()
            .expect("init-iptables")
    };
    let on = init(&["--ipv6", "on"]);
    assert!(!on.status.success(), "--ipv6 on succeeded without IPv6");
    assert!(
        String::from_utf8_lossy(&on.stderr).contains("no IPv6"),
        "{}",
        String::from_utf8_lossy(&on.stderr)
    );
    let auto = init(&[]);
    assert!(auto.status.success(), "{}", String::from_utf8_lossy(&auto.stderr));
    let rules4 =
        String::from_utf8_lossy(&run("ip", &["netns", "exec", &bare_pod, "iptables", "-t", "nat", "-S"]).stdout)
            .into_owned();
    assert!(rules4.contains("-j TURNLOCK_OUTPUT"), "{rules4}");
    let rules6 = Command::new("ip")
        .args(["netns", "exec", &bare_pod, "ip6tables", "-t", "nat", "-S"])
        .output()
        .expect("ip6tables");
    assert!(
        !String::from_utf8_lossy(&rules6.stdout).contains("TURNLOCK"),
        "IPv6 rules installed in a namespace without IPv6"
    );

    // One interface turns IPv6 back on under `all.disable_ipv6=1`: the namespace has IPv6
    // again, and `auto` must cover it, or that interface's traffic passes by the sidecar.
    run(
        "ip",
        &[
            "netns",
            "exec",
            &bare_pod,
            "sysctl",
            "-q",
            "-w",
            "net.ipv6.conf.lo.disable_ipv6=0",
        ],
    );
    let again = init(&[]);
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    let rules6 = Command::new("ip")
        .args(["netns", "exec", &bare_pod, "ip6tables", "-t", "nat", "-S"])
        .output()
        .expect("ip6tables");
    assert!(
        String::from_utf8_lossy(&rules6.stdout).contains("-j TURNLOCK_OUTPUT"),
        "no IPv6 rules though an interface has IPv6: {}",
        String::from_utf8_lossy(&rules6.stdout)
    );
}
