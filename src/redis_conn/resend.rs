//! Commands sent again: after their connection was cut (only those safe to apply twice), and
//! in the background after they failed (until what they settle would expire anyway).

use super::*;

impl RedisConn {
    /// Like [`RedisConn::run`], but a command lost with its connection (the connection was cut:
    /// reset, broken pipe) is sent once more on a new connection. Only for commands that are
    /// safe to apply twice, such as a release compared against its token. Returns the result
    /// and whether it was sent again (then a "not held" answer may mean the first attempt ran).
    pub async fn run_resent<T, F, Fut>(&self, f: F) -> Result<(T, bool), RedisError>
    where
        F: Fn(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, RedisError>>,
    {
        match self.run(&f).await {
            Err(e) if needs_reconnect(&e) => {
                tracing::debug!(error = %e, "Redis connection lost under a command: sending it again on a new one");
                self.run(&f).await.map(|t| (t, true))
            }
            other => other.map(|t| (t, false)),
        }
    }
}

/// First and longest pause between the attempts of [`again_until`].
const AGAIN_PAUSE: Duration = Duration::from_millis(100);
const AGAIN_PAUSE_MAX: Duration = Duration::from_millis(400);

/// Runs `attempt` again after a pause (100 ms, doubled up to 400 ms) until it succeeds, or
/// until the next try would start after `until` (when what it settles expires by itself);
/// returns whether it succeeded. For commands whose failure is already answered for and whose
/// success only tidies up (a commit slot given back, idempotency records stored), run on a
/// task of their own.
pub async fn again_until<F, Fut>(until: tokio::time::Instant, mut attempt: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let mut pause = AGAIN_PAUSE;
    while tokio::time::Instant::now() + pause < until {
        tokio::time::sleep(pause).await;
        if attempt().await {
            return true;
        }
        pause = (pause * 2).min(AGAIN_PAUSE_MAX);
    }
    false
}
