//! Commands sent again after their connection was cut (only those safe to apply twice).

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
