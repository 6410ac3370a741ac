//! Logging: human-readable by default, JSON with `TURNLOCK_LOG_FORMAT=json`, level from
//! `RUST_LOG` (default `info`).

use tracing_subscriber::EnvFilter;

pub const LOG_FORMAT: &str = "TURNLOCK_LOG_FORMAT";

/// Installs the global subscriber; `default` is the level used when `RUST_LOG` is unset.
pub fn init(default: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let json = std::env::var(LOG_FORMAT).is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if json {
        builder.json().with_current_span(true).try_init()
    } else {
        builder.try_init()
    };
}
