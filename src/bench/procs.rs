//! The processes a benchmark run starts (redis-server, the store, the proxies) and what the
//! kernel says about them: resident memory and CPU time, read from `/proc`.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use tokio::time::Instant;

use super::BenchError;

/// How long a started process may take to accept connections.
const READY_WITHIN: Duration = Duration::from_secs(10);

/// A child process, killed when dropped.
pub struct Child {
    pub name: String,
    pub addr: SocketAddr,
    /// The admin address, for a proxy.
    pub admin: Option<SocketAddr>,
    child: std::process::Child,
    /// A directory of the process's own (nginx's configuration), removed with it.
    scratch: Option<std::path::PathBuf>,
}

impl Child {
    /// Starts `program args` and waits until it accepts connections on `addr`.
    pub async fn spawn(name: &str, program: &Path, args: &[String], addr: SocketAddr) -> Result<Self, BenchError> {
        let child = Command::new(program)
            .args(args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| BenchError::Start(format!("{name} ({}): {e}", program.display())))?;
        let mut child = Self {
            name: name.to_owned(),
            addr,
            admin: None,
            child,
            scratch: None,
        };
        child.wait_ready().await?;
        Ok(child)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    async fn wait_ready(&mut self) -> Result<(), BenchError> {
        let until = Instant::now() + READY_WITHIN;
        while Instant::now() < until {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(BenchError::Start(format!("{} exited at start ({status})", self.name)));
            }
            if tokio::net::TcpStream::connect(self.addr).await.is_ok() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(BenchError::Start(format!(
            "{} did not accept connections on {} within {READY_WITHIN:?}",
            self.name, self.addr
        )))
    }

    /// Resident memory in bytes.
    pub fn rss_bytes(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }

    /// User plus system CPU time consumed so far.
    pub fn cpu_time(&self) -> Option<Duration> {
        cpu_time_of(self.pid())
    }

    /// Like [`Child::cpu_time`], with that of the process's children (nginx's worker does
    /// the work; its master only starts it).
    pub fn tree_cpu_time(&self) -> Option<Duration> {
        let pid = self.pid();
        let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        let children = children.split_whitespace().filter_map(|c| c.parse().ok());
        Some(
            children
                .filter_map(cpu_time_of)
                .fold(cpu_time_of(pid)?, |all, child| all + child),
        )
    }
}

/// User plus system CPU time of process `pid` (all its threads) so far.
fn cpu_time_of(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces; the fields after it are fixed.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name comes field 3 of stat(5) (state); utime is field 14, stime 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(Duration::from_secs_f64((utime + stime) as f64 / clock_ticks() as f64))
}

/// How long a process asked to stop (`SIGTERM`) may take before it is killed.
const STOP_WITHIN: Duration = Duration::from_secs(3);

impl Drop for Child {
    /// Asks the process to stop (nginx's master then stops its workers, which a `SIGKILL` of
    /// the master would leave running), and kills it if it has not within [`STOP_WITHIN`].
    fn drop(&mut self) {
        let pid = libc::pid_t::try_from(self.child.id()).unwrap_or(0);
        let asked = pid > 0
            && matches!(self.child.try_wait(), Ok(None))
            // SAFETY: `kill` takes no pointer; the pid is our own child's, not yet reaped.
            && unsafe { libc::kill(pid, libc::SIGTERM) } == 0;
        let until = std::time::Instant::now() + STOP_WITHIN;
        while asked && std::time::Instant::now() < until {
            if !matches!(self.child.try_wait(), Ok(None)) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(dir) = &self.scratch {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Clock ticks per second, the unit of `/proc/<pid>/stat` times.
fn clock_ticks() -> u64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .filter(|t| *t > 0)
        .unwrap_or(100)
}

/// A free loopback address.
pub fn free_addr() -> Result<SocketAddr, BenchError> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| BenchError::Start(format!("no free loopback port: {e}")))
}

/// Whether `program` can be run at all.
pub fn installed(program: &str, version_flag: &str) -> bool {
    Command::new(program)
        .arg(version_flag)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

/// Starts a Redis server without persistence on a free loopback port.
pub async fn redis(program: &str) -> Result<Child, BenchError> {
    if !installed(program, "--version") {
        return Err(BenchError::Missing(format!(
            "{program} not found: install Redis (e.g. `apt-get install -y redis-server`) or pass --redis-server"
        )));
    }
    let addr = free_addr()?;
    let args: Vec<String> = [
        "--port",
        &addr.port().to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        &std::env::temp_dir().to_string_lossy(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    Child::spawn("redis-server", Path::new(program), &args, addr).await
}

/// Starts `turnlock store` (documents in memory, with ETags) on a free loopback port.
pub async fn store(exe: &Path) -> Result<Child, BenchError> {
    let addr = free_addr()?;
    let args = vec!["store".into(), "--listen".into(), addr.to_string()];
    Child::spawn("store", exe, &args, addr).await
}

/// Starts `turnlock proxy` in front of `store`, with its locks in `redis`, on `threads`
/// worker threads (its default when `None`).
pub async fn proxy(
    exe: &Path,
    n: usize,
    store: SocketAddr,
    redis: SocketAddr,
    threads: Option<usize>,
) -> Result<Child, BenchError> {
    let addr = free_addr()?;
    let admin = free_addr()?;
    let mut args = vec![
        "proxy".into(),
        "--listen".into(),
        addr.to_string(),
        "--admin".into(),
        admin.to_string(),
        "--upstream".into(),
        format!("http://{store}"),
        "--redis".into(),
        format!("redis://{redis}"),
    ];
    if let Some(threads) = threads {
        args.extend(["--worker-threads".into(), threads.to_string()]);
    }
    let mut child = Child::spawn(&format!("proxy {n}"), exe, &args, addr).await?;
    child.admin = Some(admin);
    Ok(child)
}

/// Starts `examples/hyper_floor` (the least a proxy built on hyper does per request: see its
/// source) in front of `store`, when it was built beside `exe`
/// (`cargo build --release --example hyper_floor`); `None` when it was not, or when it did not
/// start (a reference, not a part of the run: warned about, and left out).
pub async fn hyper_floor(exe: &Path, store: SocketAddr) -> Option<Child> {
    let program = exe.parent()?.join("examples").join("hyper_floor");
    if !program.is_file() {
        return None;
    }
    let started = match free_addr() {
        Ok(addr) => Child::spawn("hyper floor", &program, &[addr.to_string(), store.to_string()], addr).await,
        Err(e) => Err(e),
    };
    started
        .map_err(|error| tracing::warn!(%error, program = %program.display(), "no hyper-floor figures"))
        .ok()
}

/// The nginx to run: `program` when it runs, else `/usr/sbin/nginx` (Debian's, often not on
/// a user's `PATH`); `None` when neither does.
pub fn nginx_program(program: &str) -> Option<String> {
    [program, "/usr/sbin/nginx"]
        .into_iter()
        .find(|p| installed(p, "-v"))
        .map(str::to_owned)
}

/// Starts nginx as a pass-through peer in front of `store`: one worker process, keep-alive
/// connections to the store (as turnlock keeps them), no access log.
pub async fn nginx(program: &str, store: SocketAddr) -> Result<Child, BenchError> {
    let addr = free_addr()?;
    let dir = std::env::temp_dir().join(format!("turnlock-bench-nginx-{}-{}", std::process::id(), addr.port()));
    let fail = |e: std::io::Error| BenchError::Start(format!("nginx: {e}"));
    std::fs::create_dir_all(&dir).map_err(fail)?;
    let d = dir.display();
    let conf = format!(
        "daemon off;\nmaster_process on;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
           fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
           upstream store {{ server {store}; keepalive 256; }}\n\
           server {{\n    listen {addr};\n    location / {{\n      proxy_pass http://store;\n\
               proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n    }}\n  }}\n}}\n"
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf).map_err(fail)?;
    let args = vec![
        "-p".into(),
        dir.to_string_lossy().into_owned(),
        "-c".into(),
        path.to_string_lossy().into_owned(),
    ];
    let started = Child::spawn("nginx", Path::new(program), &args, addr).await;
    match started {
        Ok(mut child) => {
            child.scratch = Some(dir);
            Ok(child)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            Err(e)
        }
    }
}

/// What the machine is, for the record.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Machine {
    pub cores: usize,
    pub cpu: String,
    pub memory_mib: u64,
    pub kernel: String,
}

pub fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_owned())
        .unwrap_or_else(|| "unknown".into());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory_mib = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|k| k.parse::<u64>().ok())
        .map(|k| k / 1024)
        .unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    Machine {
        cores: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        cpu,
        memory_mib,
        kernel,
    }
}
