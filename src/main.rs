//! The `turnlock` binary: parse the command line, start the runtime, run one subcommand.

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use turnlock::config::{ConfigError, StartError, EXIT_USAGE};

/// How long `turnlock health` waits for the admin server (the image HEALTHCHECK allows 3 s).
const HEALTH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);
/// Exit code of a proxy whose shutdown ran out of grace: writes were abandoned unanswered or
/// locks were left to expire (EX_SOFTWARE).
const EXIT_UNCLEAN: u8 = 70;
/// Exit code after a second SIGTERM/SIGINT cut the shutdown short (128 + SIGINT).
const EXIT_FORCED: i32 = 130;

#[derive(Debug, Parser)]
#[command(
    name = "turnlock",
    version,
    about = "Serializes AI-agent session-context writes: a sidecar proxy with lock, fence and idempotency."
)]
struct Cli {
    /// Threads that serve requests. `proxy` runs at most two by default, and one where the
    /// container may use one CPU or less (its CPU limit): a sidecar shares the pod's CPUs with
    /// the agent. Other commands use one per CPU.
    #[arg(long, global = true, env = "TURNLOCK_WORKER_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    worker_threads: Option<u16>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the sidecar proxy between an agent and its context store.
    Proxy(turnlock::config::ProxyArgs),
    /// Run the reference context store (a plain JSON document store with ETags).
    Store(turnlock::store::StoreArgs),
    /// Show lost updates without the sidecar and none with it, in one process.
    Demo(turnlock::demo::DemoArgs),
    /// Check a running proxy's readiness (for container health checks); exits 0 when ready.
    Health(HealthArgs),
    /// The Kubernetes sidecar-injection webhook (and `inject certs` for local clusters).
    Inject(turnlock::inject::InjectArgs),
    /// Install the pod's nat rules that send the agent's store traffic into the sidecar.
    InitIptables(turnlock::transparent::InitIptablesArgs),
    /// Measure turnlock side by side with going straight to the store and with naive locks;
    /// starts Redis, a store and proxies on loopback by itself.
    Bench(turnlock::bench::BenchArgs),
    /// Move a Redis from turnlock's older key layout (before hash tags) to today's: carries
    /// each session's fencing counter over and deletes the old keys. Run it with every proxy
    /// of the older version stopped.
    MigrateKeys(turnlock::key_layout::MigrateArgs),
}

#[derive(Debug, Clone, Args)]
struct HealthArgs {
    /// The admin address to ask.
    #[arg(long, env = "TURNLOCK_ADMIN", default_value = "127.0.0.1:9901")]
    admin: SocketAddr,
}

/// The environment variable a rejected value came from, when it was not given as a flag:
/// clap's message names only the flag.
fn env_source(e: &clap::Error) -> Option<String> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if !matches!(e.kind(), ErrorKind::InvalidValue | ErrorKind::ValueValidation) {
        return None;
    }
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else {
        return None;
    };
    let long = arg.strip_prefix("--")?.split([' ', '=']).next()?;
    let flag = format!("--{long}");
    if std::env::args().any(|a| a == flag || a.starts_with(&format!("{flag}="))) {
        return None;
    }
    fn find(cmd: &clap::Command, long: &str) -> Option<String> {
        cmd.get_arguments()
            .find(|a| a.get_long() == Some(long))
            .and_then(|a| a.get_env())
            .map(|v| v.to_string_lossy().into_owned())
            .or_else(|| cmd.get_subcommands().find_map(|c| find(c, long)))
    }
    let var = find(&<Cli as clap::CommandFactory>::command(), long)?;
    std::env::var_os(&var).is_some().then_some(var)
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version are not errors; a bad argument is a usage error (64), like
            // every other configuration problem.
            let _ = e.print();
            if let Some(var) = env_source(&e) {
                eprintln!("note: the value came from the environment variable {var}");
            }
            return if e.use_stderr() {
                ExitCode::from(EXIT_USAGE)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    // The demo prints a table; its in-process servers only log problems.
    let default_level = if matches!(cli.command, Command::Demo(_)) {
        "error"
    } else {
        "info"
    };
    // Held to the end of `main`: dropping it flushes the queued log lines.
    let _log = match turnlock::telemetry::init(default_level) {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("turnlock: configuration error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let threads = cli
        .worker_threads
        .map(usize::from)
        .or(matches!(cli.command, Command::Proxy(_)).then(|| {
            // The CPUs this process may use: its cgroup's CPU quota (a container's CPU limit)
            // is counted, rounded up.
            std::thread::available_parallelism().map_or(1, |n| n.get().min(2))
        }));
    let mut builder = match threads {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(n) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("turnlock: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("turnlock: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

async fn run(command: Command) -> Result<ExitCode, StartError> {
    match command {
        Command::Proxy(args) => {
            let running = turnlock::sidecar::start(args).await?;
            on_signal(running.shutdown_token());
            let outcome = running.wait().await;
            Ok(if outcome.clean() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(EXIT_UNCLEAN)
            })
        }
        Command::Store(args) => {
            let running = turnlock::store::start(args).await?;
            on_signal(running.shutdown_token());
            running.wait().await;
            Ok(ExitCode::SUCCESS)
        }
        Command::Demo(args) => match turnlock::demo::run(args).await {
            Ok(reports) => {
                println!("{}", turnlock::demo::table(&reports));
                let direct_lost = reports.first().map(|r| r.lost).unwrap_or(0);
                let proxied = reports.get(1);
                if let Some(p) = proxied {
                    println!(
                        "Without turnlock {direct_lost} acknowledged writes were lost; through turnlock {} were.",
                        p.lost
                    );
                }
                Ok(if proxied.is_some_and(|p| p.lost == 0 && p.duplicated == 0) {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::FAILURE
                })
            }
            Err(e) => Err(ConfigError(e.to_string()).into()),
        },
        Command::Inject(args) => {
            let shutdown = CancellationToken::new();
            on_signal(shutdown.clone());
            turnlock::inject::run(args, shutdown).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::InitIptables(args) => Ok(turnlock::transparent::run_init_iptables(args).await?),
        Command::Bench(args) => match turnlock::bench::run(args).await {
            Ok(report) => {
                println!("{}", turnlock::bench::table(&report));
                Ok(if report.lost_writes() == 0 {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::FAILURE
                })
            }
            Err(e) => {
                eprintln!("turnlock bench: {e}");
                Ok(ExitCode::FAILURE)
            }
        },
        Command::MigrateKeys(args) => {
            let conn = turnlock::redis_conn::RedisConn::open(&args.redis, std::time::Duration::from_secs(5))
                .map_err(|e| ConfigError(e.to_string()))?;
            match turnlock::key_layout::migrate(&conn, &args.key_prefix, args.dry_run).await {
                Ok(done) => {
                    println!(
                        "{} fencing counters carried over, {} keys of the older layout {}",
                        done.fences_carried,
                        done.deleted,
                        if args.dry_run { "to delete" } else { "deleted" }
                    );
                    Ok(ExitCode::SUCCESS)
                }
                Err(e) => Err(StartError::Backend(e)),
            }
        }
        Command::Health(args) => {
            let client = turnlock::client::JsonClient::new(format!("http://{}", args.admin));
            // Within the image HEALTHCHECK's own 3 s timeout, so the check reports why.
            let asked = client.send(http::Method::GET, "/readyz", None, &[]);
            match tokio::time::timeout(HEALTH_TIMEOUT, asked).await {
                Ok(Ok(r)) if r.status.is_success() => Ok(ExitCode::SUCCESS),
                Ok(Ok(r)) => {
                    eprintln!("not ready: {}", r.json);
                    Ok(ExitCode::FAILURE)
                }
                Ok(Err(e)) => {
                    eprintln!("admin server unreachable at {}: {e}", args.admin);
                    Ok(ExitCode::FAILURE)
                }
                Err(_) => {
                    eprintln!(
                        "admin server at {} did not answer within {HEALTH_TIMEOUT:?}",
                        args.admin
                    );
                    Ok(ExitCode::FAILURE)
                }
            }
        }
    }
}

/// Cancels `token` on SIGTERM or SIGINT; a second one exits at once ([`EXIT_FORCED`]).
fn on_signal(token: CancellationToken) {
    tokio::spawn(async move {
        let mut signals = match Signals::new() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch for SIGTERM; only SIGINT stops the process");
                Signals::Interrupt
            }
        };
        signals.next().await;
        tracing::info!("shutting down: not ready, no new connections; finishing in-flight requests and writes");
        token.cancel();
        signals.next().await;
        tracing::warn!("second signal: exiting now; locks still held expire after their lease");
        std::process::exit(EXIT_FORCED);
    });
}

/// SIGTERM and SIGINT (SIGINT only where SIGTERM cannot be watched).
enum Signals {
    #[cfg(unix)]
    Both(tokio::signal::unix::Signal, tokio::signal::unix::Signal),
    Interrupt,
}

impl Signals {
    #[cfg(unix)]
    fn new() -> std::io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self::Both(
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
        ))
    }

    #[cfg(not(unix))]
    fn new() -> std::io::Result<Self> {
        Ok(Self::Interrupt)
    }

    async fn next(&mut self) {
        match self {
            #[cfg(unix)]
            Self::Both(term, int) => {
                tokio::select! {
                    _ = term.recv() => {},
                    _ = int.recv() => {},
                }
            }
            Self::Interrupt => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
}
