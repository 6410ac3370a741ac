//! Third-party servers and clients that users put behind turnlock, installed once per machine
//! by the test setup (or here, when missing) and started on free loopback ports.
//!
//! Python tools (moto's S3 server, boto3, Strands Agents) live in a virtualenv at `TURNLOCK_TEST_VENV`
//! (default `~/.cache/turnlock-test-venv`). A tool that cannot be installed fails the test
//! with a message saying what to install: it never skips.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use super::{free_port, wait_for_port};

/// The Python packages the tests drive.
const PY_PACKAGES: &[&str] = &["moto[server]", "boto3", "strands-agents"];

static INSTALL: Mutex<()> = Mutex::new(());

/// The virtualenv with moto and boto3, created and filled on first use.
pub fn venv() -> PathBuf {
    let dir = std::env::var_os("TURNLOCK_TEST_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
            Path::new(&home).join(".cache/turnlock-test-venv")
        });
    let _guard = INSTALL.lock().unwrap_or_else(|e| e.into_inner());
    let python = dir.join("bin/python");
    let ready = || {
        Command::new(&python)
            .args(["-c", "import moto, boto3, flask, strands"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !ready() {
        let made = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            made,
            "cannot create a virtualenv at {dir:?}: install python3-venv (apt-get install python3-venv)"
        );
        let installed = Command::new(dir.join("bin/pip"))
            .args(["install", "-q"])
            .args(PY_PACKAGES)
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            installed && ready(),
            "cannot install {PY_PACKAGES:?} into {dir:?}: run `{}/bin/pip install 'moto[server]' boto3 strands-agents`",
            dir.display()
        );
    }
    dir
}

/// A process killed on drop.
pub struct Server {
    child: Child,
    pub port: u16,
    /// The server's working directory, when it writes files there.
    _dir: Option<tempfile::TempDir>,
}

impl Server {
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// moto's standalone S3-compatible server (`moto_server`) on a free port.
pub fn moto_server() -> Server {
    moto_server_with(&[])
}

/// moto's server with `env` (e.g. `INITIAL_NO_AUTH_ACTION_COUNT`, after which it checks
/// every request's signature against its IAM users).
pub fn moto_server_with(env: &[(&str, &str)]) -> Server {
    let venv = venv();
    let port = free_port();
    let child = Command::new(venv.join("bin/moto_server"))
        .envs(env.iter().copied())
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start moto_server");
    wait_for_port(port, Duration::from_secs(30));
    Server {
        child,
        port,
        _dir: None,
    }
}

/// The npm packages the tests run, installed at `TURNLOCK_TEST_NODE` (default
/// `~/.cache/turnlock-test-node`) on first use.
const NPM_PACKAGES: &[&str] = &["pouchdb-server@4", "nano@10"];

/// The directory whose `node_modules` has `pouchdb-server` and nano.
pub fn node_dir() -> PathBuf {
    let dir = std::env::var_os("TURNLOCK_TEST_NODE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
            Path::new(&home).join(".cache/turnlock-test-node")
        });
    let _guard = INSTALL.lock().unwrap_or_else(|e| e.into_inner());
    let bin = dir.join("node_modules/.bin/pouchdb-server");
    let nano = dir.join("node_modules/nano/package.json");
    if !bin.exists() || !nano.exists() {
        let _ = std::fs::create_dir_all(&dir);
        let installed = Command::new("npm")
            .args(["install", "--silent", "--no-audit", "--no-fund", "--prefix"])
            .arg(&dir)
            .args(NPM_PACKAGES)
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            installed && bin.exists() && nano.exists(),
            "cannot install {NPM_PACKAGES:?} into {dir:?}: run `npm install --prefix {} pouchdb-server@4 nano@10`",
            dir.display()
        );
    }
    dir
}

/// `pouchdb-server` in memory (`-m`), a CouchDB-compatible store, on a free port.
pub fn pouchdb_server() -> Server {
    let dir = node_dir();
    let port = free_port();
    let work = tempfile::tempdir().expect("temp dir");
    let child = Command::new(dir.join("node_modules/.bin/pouchdb-server"))
        .args(["-m", "-n", "-p", &port.to_string(), "-o", "127.0.0.1"])
        .current_dir(work.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start pouchdb-server");
    wait_for_port(port, Duration::from_secs(30));
    Server {
        child,
        port,
        _dir: Some(work),
    }
}

/// Runs a Python script of `tests/it/scripts` with the virtualenv's interpreter; returns
/// its standard output's last line parsed as JSON.
pub fn run_python(script: &str, args: &[&str]) -> serde_json::Value {
    run_python_env(script, args, &[])
}

/// [`run_python`] with more environment variables.
pub fn run_python_env(script: &str, args: &[&str], env: &[(String, String)]) -> serde_json::Value {
    let venv = venv();
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/it/scripts")
        .join(script);
    let out = Command::new(venv.join("bin/python"))
        .arg(&path)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .expect("run python");
    last_json(script, &out)
}

/// A script's standard output's last line parsed as JSON; the script must have succeeded.
fn last_json(script: &str, out: &std::process::Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{script} failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().unwrap_or("");
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{script} printed no JSON ({e}): {stdout}"))
}

/// Runs a Node script of `tests/it/scripts` with the packages of [`node_dir`]; returns its
/// standard output's last line parsed as JSON.
pub fn run_node(script: &str, args: &[&str]) -> serde_json::Value {
    let modules = node_dir().join("node_modules");
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/it/scripts")
        .join(script);
    let out = Command::new("node")
        .arg(&path)
        .args(args)
        .env("NODE_PATH", &modules)
        .output()
        .expect("run node");
    last_json(script, &out)
}

// === sidecars in front of these stores ===

/// A ready routes file for S3 session objects: turnlock's own reads and write-backs carry the
/// client's credentials.
pub const S3_ROUTES: &str = r#"
[store]
dialect = "s3"

[[route]]
method = "PUT"
path = "/{bucket}/sessions/{session}.json"
mode = "merge"
kind = "put"
document = "/{bucket}/sessions/{session}.json"
turn = { body = "/turn", optional = true }
"#;

/// A ready routes file for CouchDB documents (`_rev` in the body).
pub const COUCHDB_ROUTES: &str = r#"
[store]
dialect = "couchdb"

[[route]]
method = "PUT"
path = "/{db}/{session}"
mode = "merge"
kind = "put"
turn = { body = "/turn", optional = true }
"#;

/// An S3 routes file, with turnlock signing its own requests (SigV4 in `us-east-1`).
pub fn signed(routes: &str) -> String {
    routes.replace(
        "dialect = \"s3\"",
        "dialect = \"s3\"\nsigv4 = { region = \"us-east-1\" }",
    )
}

/// `text` in a temporary routes file.
pub fn routes_file(text: &str) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(file.path(), text).expect("write routes");
    file
}

/// The credentials the agents and in-process sidecars use (moto accepts any while it does
/// not check signatures).
pub fn aws_env() {
    std::env::set_var("AWS_ACCESS_KEY_ID", "testing");
    std::env::set_var("AWS_SECRET_ACCESS_KEY", "testing");
}

/// `n` in-process sidecars in front of `store`, sharing `redis`, serving `routes`.
pub async fn sidecars(
    store: &Server,
    redis: &super::RedisServer,
    routes: &tempfile::NamedTempFile,
    n: usize,
) -> Vec<turnlock::sidecar::Running> {
    let mut out = Vec::new();
    for _ in 0..n {
        let mut args = super::proxy_args(format!("127.0.0.1:{}", store.port).parse().expect("addr"), Some(redis));
        args.routes = Some(routes.path().display().to_string());
        out.push(super::proxy(args).await);
    }
    out
}

/// A `turnlock proxy` process in front of `store` with `routes`, with no AWS credentials in
/// its environment but those of `env`; returns it and its address.
pub fn sidecar_process(
    store: &Server,
    redis: &super::RedisServer,
    routes: &tempfile::NamedTempFile,
    env: &[(String, String)],
) -> (super::Proc, String) {
    let (proc, [port, _admin]) = super::Proc::listening(|[port, admin]| {
        let mut command = Command::new(super::turnlock_bin());
        command
            .arg("proxy")
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--admin", &format!("127.0.0.1:{admin}")])
            .args(["--upstream", &store.url(), "--redis", &redis.url()])
            .arg("--routes")
            .arg(routes.path())
            .env_remove("AWS_ACCESS_KEY_ID")
            .env_remove("AWS_SECRET_ACCESS_KEY")
            .env_remove("AWS_SESSION_TOKEN")
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        command
    });
    (proc, format!("http://127.0.0.1:{port}"))
}

/// A Python script of `tests/it/scripts` serving on a free port (given as its `args`'
/// `{port}`), killed on drop.
pub fn python_server(script: &str, args: &[&str]) -> Server {
    let venv = venv();
    let port = free_port();
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/it/scripts")
        .join(script);
    let child = Command::new(venv.join("bin/python"))
        .arg(&path)
        .args(args.iter().map(|a| a.replace("{port}", &port.to_string())))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {script}: {e}"));
    wait_for_port(port, Duration::from_secs(30));
    Server {
        child,
        port,
        _dir: None,
    }
}
