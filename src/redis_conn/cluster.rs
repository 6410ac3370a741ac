//! Redis Cluster: the cluster client (retries fitted to a lock budget), `WAIT` on a
//! session's own primary, sharded pub/sub connections.

use super::*;

impl Conn {
    /// `WAIT replicas timeout_ms` on the primary that holds `key` (on one server, that
    /// server): the replicas a cluster primary counts are its own.
    pub async fn wait_for_replicas(&mut self, key: &str, replicas: u32, timeout_ms: u64) -> Result<i64, RedisError> {
        let mut wait = redis::cmd("WAIT");
        wait.arg(replicas).arg(timeout_ms);
        match self {
            Self::Single(c) => wait.query_async(c).await,
            Self::Cluster(c) => {
                use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
                let primary = Route::new(crate::session::cluster_slot(key.as_bytes()), SlotAddr::Master);
                let node = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(primary));
                let reply = c.route_command(wait, node).await?;
                redis::from_redis_value(reply).map_err(RedisError::from)
            }
        }
    }
}

/// How many times a cluster command is retried (after a `MOVED`, `TRYAGAIN`, a lost node…)
/// and how long the client waits between tries: a few short waits, so a command ends within
/// a lock budget instead of redis-rs' default of 16 tries over seconds.
pub(super) const CLUSTER_RETRIES: u32 = 3;
pub(super) const CLUSTER_MIN_RETRY_WAIT_MS: u64 = 5;
pub(super) const CLUSTER_MAX_RETRY_WAIT_MS: u64 = 100;

impl RedisConn {
    /// Whether the URL names a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.inner.source, Source::Cluster { .. })
    }
}

impl RedisConn {
    /// A cluster connection of its own for sharded pub/sub (`SSUBSCRIBE`, RESP3): the
    /// messages and the client's re-subscriptions after a topology change arrive on the
    /// returned receiver.
    pub async fn cluster_pubsub(
        &self,
    ) -> Result<(ClusterConnection, tokio::sync::mpsc::UnboundedReceiver<redis::PushInfo>), RedisError> {
        let Source::Cluster { spec, tls, .. } = &self.inner.source else {
            return Err(io_error("not a cluster URL"));
        };
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let client = build_cluster(
            spec,
            *tls,
            &self.inner.options,
            self.inner.tls.as_ref(),
            self.inner.config_response_timeout(),
            Some(tx),
        )
        .map_err(|e| io_error(&e.to_string()))?;
        let conn = tokio::time::timeout(self.inner.connect_timeout * 2, client.get_async_connection())
            .await
            .map_err(|_| io_error("no cluster node answered"))??;
        Ok((conn, rx))
    }
}

/// A cluster client for `spec`: the URL's credentials (the password file's over them, read
/// now), TLS with the same files, and retries fitted to a lock budget. With `push`, the
/// connection speaks RESP3 and delivers sharded pub/sub messages there.
pub(super) fn build_cluster(
    spec: &ClusterSpec,
    tls: bool,
    options: &ConnOptions,
    files: Option<&Tls>,
    response_timeout: Duration,
    push: Option<tokio::sync::mpsc::UnboundedSender<redis::PushInfo>>,
) -> Result<ClusterClient, ConnError> {
    let scheme = if tls { "rediss" } else { "redis" };
    let nodes: Vec<String> = spec
        .hosts
        .iter()
        .map(|(h, p)| format!("{scheme}://{}:{p}", crate::redis_url::bracket(h)))
        .collect();
    let mut builder = ClusterClientBuilder::new(nodes)
        .retries(CLUSTER_RETRIES)
        .min_retry_wait(CLUSTER_MIN_RETRY_WAIT_MS)
        .max_retry_wait(CLUSTER_MAX_RETRY_WAIT_MS)
        .retry_wait_formula(10, 2)
        .connection_timeout(response_timeout.max(Duration::from_millis(200)))
        .response_timeout(response_timeout);
    let password = match &options.password_file {
        Some(path) => Some(read_password(path).map_err(ConnError::Setting)?),
        None => spec.password.clone(),
    };
    if let Some(user) = options.username.clone().or_else(|| spec.username.clone()) {
        builder = builder.username(user);
    }
    if let Some(pass) = password {
        builder = builder.password(pass);
    }
    if tls {
        builder = builder.tls(TlsMode::Secure);
        if let Some(certs) = files
            .map(Tls::certificates)
            .transpose()
            .map_err(|e| ConnError::Setting(e.to_string()))?
            .flatten()
        {
            builder = builder.certs(certs);
        }
    }
    if let Some(tx) = push {
        builder = builder.use_protocol(redis::ProtocolVersion::RESP3).push_sender(tx);
    }
    builder
        .build()
        .map_err(|e| ConnError::Setting(format!("Redis Cluster: {e}")))
}
