//! Shared test harness: real `redis-server` processes on free ports, in-process stores and
//! proxies on loopback, and `turnlock` processes for the tests that signal or kill them.
#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
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
        server.spawn();
        server
    }

    fn spawn(&mut self) {
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
        wait_for_port(self.port, Duration::from_secs(10));
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
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
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

/// The `turnlock` binary built for these tests.
pub fn turnlock_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_turnlock"))
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

    /// A `turnlock proxy` process on `port` with its admin on `admin`, in front of the store at
    /// `store_port`, with `extra` flags; returns once it listens.
    pub fn proxy(port: u16, admin: u16, store_port: u16, extra: &[&str]) -> Self {
        let (listen, admin, upstream) = (
            format!("127.0.0.1:{port}"),
            format!("127.0.0.1:{admin}"),
            format!("http://127.0.0.1:{store_port}"),
        );
        let mut args = vec!["proxy", "--listen", &listen, "--admin", &admin, "--upstream", &upstream];
        args.extend_from_slice(extra);
        let proc = Self::spawn(&args);
        wait_for_port(port, Duration::from_secs(10));
        proc
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
