//! Shared test harness: real `redis-server` processes on free ports, in-process stores and
//! proxies on loopback, and `turnlock` processes for the tests that signal or kill them.
//! `relay` injects faults between two sockets; `ledger` runs concurrent writers and checks
//! what they were told against what the store holds; `stores` serves stand-in upstreams.

pub mod ledger;
pub mod relay;
mod stores;
pub mod third_party;
pub mod tls;

pub use stores::{front_store, serve, Forwarded, PutDelay};

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use turnlock::client::{JsonClient, Reply};
use turnlock::config::ProxyArgs;
use turnlock::store::StoreArgs;

/// A free TCP port on loopback.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free loopback port")
}

/// The `redis-server` binary: `$TURNLOCK_REDIS_SERVER`, else the one on PATH. The tests that
/// need it fail (never skip) when it is missing.
pub fn redis_server_bin() -> String {
    let bin = std::env::var("TURNLOCK_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
    let found = Command::new(&bin)
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok();
    assert!(
        found,
        "{bin} not found: install Redis (e.g. `apt-get install -y redis-server`) or set TURNLOCK_REDIS_SERVER"
    );
    bin
}

/// A real Redis server on a free loopback port, with no persistence, killed on drop.
pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
    extra: Vec<String>,
}

impl RedisServer {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> Self {
        let mut server = Self {
            port: free_port(),
            child: None,
            dir: tempfile::tempdir().expect("tempdir"),
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        // A free port can be taken by another test's server before redis-server binds it:
        // then it exits, and another port is tried (never a server that is not ours).
        for _ in 0..5 {
            if server.try_spawn() {
                return server;
            }
            server.kill();
            server.port = free_port();
        }
        panic!("redis-server did not start on any of 5 free ports");
    }

    fn spawn(&mut self) {
        assert!(
            self.try_spawn(),
            "redis-server did not start again on port {}",
            self.port
        );
    }

    /// Starts redis-server on `self.port`; true once this process answers there like Redis.
    fn try_spawn(&mut self) -> bool {
        self.start_process();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut() {
                if !matches!(child.try_wait(), Ok(None)) {
                    return false;
                }
            }
            if answers_like_redis(self.port) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    fn start_process(&mut self) {
        let child = Command::new(redis_server_bin())
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--dir", self.dir.path().to_str().expect("utf-8 path")])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        self.child = Some(child);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL: nothing is saved).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends a signal (`STOP`, `CONT`, …) to the server process.
    pub fn signal(&self, sig: &str) {
        let Some(child) = &self.child else { return };
        let status = Command::new("kill")
            .args([&format!("-{sig}"), &child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill -{sig} failed");
    }

    /// Starts it again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Runs a command with `redis-cli`-like semantics through a blocking connection.
    pub fn cmd(&self, args: &[&str]) -> redis::Value {
        let client = redis::Client::open(self.url()).expect("redis url");
        let mut conn = client.get_connection().expect("redis connection");
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(&mut conn).expect("redis command")
    }

    /// Keys matching a pattern.
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        let client = redis::Client::open(self.url()).expect("redis url");
        let mut conn = client.get_connection().expect("redis connection");
        redis::cmd("KEYS").arg(pattern).query(&mut conn).expect("KEYS")
    }

    /// The session-turn lock keys held in this server.
    pub fn lock_keys(&self) -> Vec<String> {
        self.keys("turnlock:session:{*}:[0-9]*")
    }

    /// One field of `INFO <section>` (empty when absent).
    pub fn info(&self, section: &str, field: &str) -> String {
        let info = match self.cmd(&["INFO", section]) {
            redis::Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
            redis::Value::VerbatimString { text, .. } => text,
            other => panic!("INFO {section}: {other:?}"),
        };
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")).map(|v| v.trim().to_owned()))
            .unwrap_or_default()
    }
}

/// `MONITOR` on a Redis server, through a `redis-cli` process: every command the server runs,
/// one line each, in the order it ran them. Commands a Lua script runs are tagged `[0 lua]`.
pub struct Monitor {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
    port: u16,
}

impl Monitor {
    /// Starts monitoring; returns once the server has confirmed it.
    pub fn start(redis: &RedisServer) -> Self {
        let mut child = Command::new("redis-cli")
            .args(["-p", &redis.port.to_string(), "monitor"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-cli monitor (install redis-tools)");
        let stdout = child.stdout.take().expect("redis-cli stdout");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                sink.lock().expect("monitor lines").push(line);
            }
        });
        let monitor = Self {
            child,
            lines,
            reader: Some(reader),
            port: redis.port,
        };
        monitor.wait_for(|l| l == "OK");
        monitor
    }

    fn wait_for(&self, found: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.lines.lock().expect("monitor lines").iter().any(|l| found(l)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("redis-cli monitor on port {} did not show the expected line", self.port);
    }

    /// Stops monitoring and returns the lines seen, up to a marker command sent last (so
    /// everything the server ran before is in).
    pub fn stop(mut self, redis: &RedisServer) -> Vec<String> {
        let marker = format!("end-of-monitor-{}", free_port());
        redis.cmd(&["ECHO", &marker]);
        self.wait_for(|l| l.contains(&marker));
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        std::mem::take(&mut *self.lines.lock().expect("monitor lines"))
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whether what listens on `port` answers `PING` as Redis does (`+PONG`, or an error such as
/// `-NOAUTH`), not as some other server that took the port.
fn answers_like_redis(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut conn) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
    let mut first = [0u8; 1];
    conn.write_all(b"PING\r\n").is_ok() && conn.read_exact(&mut first).is_ok() && matches!(first[0], b'+' | b'-')
}

pub fn wait_for_port(port: u16, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("nothing listened on port {port} within {timeout:?}");
}

/// An in-process reference store on a free port.
pub async fn store() -> turnlock::store::RunningStore {
    turnlock::store::start(StoreArgs::local()).await.expect("start store")
}

/// An in-process reference store without ETags (no conditional writes).
pub async fn store_without_etags() -> turnlock::store::RunningStore {
    let mut args = StoreArgs::local();
    args.no_etags = true;
    turnlock::store::start(args).await.expect("start store")
}

/// Proxy settings for an upstream and an optional Redis.
pub fn proxy_args(upstream: SocketAddr, redis: Option<&RedisServer>) -> ProxyArgs {
    let mut args = ProxyArgs::local(format!("http://{upstream}"));
    args.redis = redis.map(|r| r.url());
    args
}

pub async fn proxy(args: ProxyArgs) -> turnlock::sidecar::Running {
    turnlock::sidecar::start(args).await.expect("start proxy")
}

pub fn client(addr: SocketAddr) -> JsonClient {
    JsonClient::new(format!("http://{addr}"))
}

/// The `turnlock` binary built for these tests, or the one `TURNLOCK_IT_BIN` names (to run
/// the process tests against another build, for comparison).
pub fn turnlock_bin() -> PathBuf {
    std::env::var_os("TURNLOCK_IT_BIN")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_turnlock")))
}

/// A `turnlock` process, killed on drop.
pub struct Proc {
    pub child: Child,
}

impl Proc {
    pub fn spawn(args: &[&str]) -> Self {
        let child = Command::new(turnlock_bin())
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn turnlock");
        Self { child }
    }

    /// A `turnlock store` process on a free port; returns once it listens.
    pub fn store() -> (Self, u16) {
        let (proc, [port]) = Self::listening(|[port]| {
            let mut command = Command::new(turnlock_bin());
            command.args(["store", "--listen", &format!("127.0.0.1:{port}")]);
            command
        });
        (proc, port)
    }

    /// A `turnlock` process that `command` makes for `N` free loopback ports; returns once
    /// it listens on all of them. A free port can be taken by another test before the process
    /// binds it: then it exits, and other ports are tried. Panics with what the process wrote
    /// to stderr when it never starts.
    pub fn listening<const N: usize>(mut command: impl FnMut([u16; N]) -> Command) -> (Self, [u16; N]) {
        let mut why = String::new();
        for _ in 0..5 {
            let ports = [(); N].map(|()| free_port());
            let stderr = tempfile::NamedTempFile::new().expect("stderr file");
            let child = command(ports)
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(stderr.reopen().expect("stderr file"))
                .spawn()
                .expect("spawn turnlock");
            let mut proc = Self { child };
            if ports
                .iter()
                .all(|&port| proc.wait_for_port(port, Duration::from_secs(20)))
            {
                return (proc, ports);
            }
            let _ = proc.child.kill();
            let status = proc.child.wait().expect("wait for turnlock");
            why = format!(
                "{status} on ports {ports:?}: {}",
                std::fs::read_to_string(stderr.path()).unwrap_or_default()
            );
        }
        panic!("turnlock did not start on any of 5 sets of free ports; last: {why}");
    }

    /// A `turnlock proxy` in front of `upstream` (with `extra` arguments), logging at `info`
    /// to the file `log`; returns once it listens, with the address it serves.
    pub fn logged_proxy(upstream: SocketAddr, extra: &[&str], log: &std::path::Path) -> (Self, SocketAddr) {
        let file = std::fs::File::create(log).expect("log file");
        let (port, admin) = (free_port(), free_port());
        let child = Command::new(turnlock_bin())
            .args(["proxy", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--admin", &format!("127.0.0.1:{admin}")])
            .args(["--upstream", &format!("http://{upstream}")])
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("spawn proxy");
        let mut proc = Self { child };
        assert!(
            proc.wait_for_port(port, Duration::from_secs(10)),
            "the proxy did not start: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        (proc, SocketAddr::from(([127, 0, 0, 1], port)))
    }

    /// True once something listens on `port`; false when this process exits first or
    /// `timeout` passes.
    fn wait_for_port(&mut self, port: u16, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return false;
            }
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill -{sig} failed");
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Message ids stored in a session document, in order.
pub fn message_ids(doc: &Value) -> Vec<String> {
    doc["messages"]
        .as_array()
        .map(|m| m.iter().filter_map(|m| m["id"].as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

pub async fn get_doc(client: &JsonClient, session: &str) -> Reply {
    client
        .send(http::Method::GET, &format!("/v1/sessions/{session}"), None, &[])
        .await
        .expect("GET document")
}

/// A whole document `PUT` through `client` (a merged PUT through a proxy).
pub async fn put_doc(client: &JsonClient, session: &str, doc: &serde_json::Value) -> Reply {
    client
        .send(http::Method::PUT, &format!("/v1/sessions/{session}"), Some(doc), &[])
        .await
        .expect("PUT document")
}

/// A `turnlock proxy` process on free ports, with its addresses; killed on drop.
pub struct ProxyProc {
    pub proc: Proc,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
}

impl ProxyProc {
    /// Starts it in front of `upstream` (with Redis at `redis`, if any) and `extra` flags;
    /// returns once both its ports listen.
    pub fn spawn(upstream: &str, redis: Option<&str>, extra: &[&str]) -> Self {
        let (proc, [port, admin]) = Proc::listening(|[port, admin]| {
            let mut command = Command::new(turnlock_bin());
            command
                .arg("proxy")
                .args(["--listen", &format!("127.0.0.1:{port}")])
                .args(["--admin", &format!("127.0.0.1:{admin}")])
                .args(["--upstream", upstream])
                .args(redis.map(|r| ["--redis", r]).into_iter().flatten())
                .args(extra);
            command
        });
        let at = |port| SocketAddr::from(([127, 0, 0, 1], port));
        Self {
            proc,
            addr: at(port),
            admin: at(admin),
        }
    }

    pub fn client(&self) -> JsonClient {
        client(self.addr)
    }
}

/// Sends a JSON body; panics only when no answer comes at all.
pub async fn send(c: &JsonClient, method: http::Method, path: &str, body: Value, headers: &[(&str, String)]) -> Reply {
    c.send(method, path, Some(&body), headers).await.expect("request")
}

/// Appends one message (content = `token`, with `id` = `token` when `with_id`); an error is
/// a request that got no answer.
pub async fn try_append(
    client: &JsonClient,
    session: &str,
    turn: u64,
    token: &str,
    with_id: bool,
    headers: &[(&str, String)],
) -> Result<Reply, String> {
    let message = if with_id {
        json!({"id": token, "role": "user", "content": token})
    } else {
        json!({"role": "user", "content": token})
    };
    let body = json!({"turn": turn, "messages": [message]});
    client
        .send(
            http::Method::POST,
            &format!("/v1/sessions/{session}/messages"),
            Some(&body),
            headers,
        )
        .await
        .map_err(|e| e.to_string())
}

/// Appends one message whose id and content are `id`.
pub async fn append(c: &JsonClient, session: &str, turn: u64, id: &str) -> Reply {
    append_ids(c, session, turn, &[id]).await
}

/// Appends one message per id, each with that id as its content.
pub async fn append_ids(c: &JsonClient, session: &str, turn: u64, ids: &[&str]) -> Reply {
    let messages: Vec<Value> = ids
        .iter()
        .map(|id| json!({"id": id, "role": "user", "content": id}))
        .collect();
    let body = json!({"turn": turn, "messages": messages});
    send(
        c,
        http::Method::POST,
        &format!("/v1/sessions/{session}/messages"),
        body,
        &[],
    )
    .await
}

/// The text of `/metrics` on an admin address.
pub async fn metrics(admin: SocketAddr) -> String {
    let reply = client(admin)
        .send(http::Method::GET, "/metrics", None, &[])
        .await
        .expect("GET /metrics");
    String::from_utf8_lossy(&reply.body).into_owned()
}

/// The value of the sample `name` (with its labels, if any) in a `/metrics` text; 0 when absent.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0)
}

/// Sends raw bytes on a new connection and reads everything until the server closes (or 15 s
/// pass).
pub async fn send_raw(addr: SocketAddr, bytes: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(bytes).await.expect("send");
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(15), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}
