//! The `turnlock` binary: parse the command line, start the runtime, run one subcommand.

use std::process::ExitCode;

use clap::Parser;
use tokio_util::sync::CancellationToken;
use turnlock::config::{Cli, Command, ConfigError};

/// Exit code for bad configuration (EX_USAGE).
const EXIT_USAGE: u8 = 64;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo prints a table; its in-process servers only log problems.
    let default_level = if matches!(cli.command, Command::Demo(_)) {
        "error"
    } else {
        "info"
    };
    turnlock::telemetry::init(default_level);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
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
            ExitCode::from(EXIT_USAGE)
        }
    }
}

async fn run(command: Command) -> Result<ExitCode, ConfigError> {
    match command {
        Command::Proxy(args) => {
            let running = turnlock::sidecar::start(args).await?;
            on_signal(running.shutdown_token());
            running.wait().await;
            Ok(ExitCode::SUCCESS)
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
            Err(e) => Err(ConfigError(e.to_string())),
        },
        Command::Inject(args) => {
            let shutdown = CancellationToken::new();
            on_signal(shutdown.clone());
            turnlock::inject::run(args, shutdown).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::InitIptables(args) => turnlock::transparent::run_init_iptables(args).await,
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
        Command::Health(args) => {
            let client = turnlock::client::JsonClient::new(format!("http://{}", args.admin));
            match client.send(http::Method::GET, "/readyz", None, &[]).await {
                Ok(r) if r.status.is_success() => Ok(ExitCode::SUCCESS),
                Ok(r) => {
                    eprintln!("not ready: {}", r.json);
                    Ok(ExitCode::FAILURE)
                }
                Err(e) => {
                    eprintln!("admin server unreachable at {}: {e}", args.admin);
                    Ok(ExitCode::FAILURE)
                }
            }
        }
    }
}

/// Cancels `token` on SIGTERM or SIGINT.
fn on_signal(token: CancellationToken) {
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    token.cancel();
                    return;
                }
            };
            tokio::select! {
                _ = ctrl_c => {},
                _ = term.recv() => {},
            }
        }
        #[cfg(not(unix))]
        let _ = ctrl_c.await;
        tracing::info!("shutting down: no new connections; finishing in-flight writes");
        token.cancel();
    });
}
