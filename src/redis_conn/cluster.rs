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

/// One primary as the health check found it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct NodeHealth {
    /// `host:port`, as the cluster announces it.
    pub node: String,
    /// The slots it serves, as `first-last` ranges.
    pub slots: Vec<String>,
    /// It answered `CLUSTER INFO` and says `cluster_state:ok`.
    pub up: bool,
    /// Its `cluster_state`, when it answered.
    pub state: Option<String>,
    pub error: Option<String>,
}

/// The cluster's primaries, each checked on its own: a primary that does not answer, or one
/// that says the cluster is down (`cluster_state:fail`), is down.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ClusterHealth {
    pub nodes: Vec<NodeHealth>,
}

impl ClusterHealth {
    /// Whether every primary answered and says the cluster is ok.
    pub fn all_up(&self) -> bool {
        !self.nodes.is_empty() && self.nodes.iter().all(|n| n.up)
    }

    /// What is wrong, for `/status` and the log: the nodes down and why.
    pub fn summary(&self) -> String {
        let down: Vec<String> = self
            .nodes
            .iter()
            .filter(|n| !n.up)
            .map(|n| {
                let why = n
                    .error
                    .clone()
                    .or_else(|| n.state.as_ref().map(|s| format!("cluster_state:{s}")))
                    .unwrap_or_default();
                format!("{} ({why})", n.node)
            })
            .collect();
        if down.is_empty() {
            "every primary answers".into()
        } else {
            format!(
                "{} of {} primaries down: {}",
                down.len(),
                self.nodes.len(),
                down.join(", ")
            )
        }
    }
}

impl RedisConn {
    /// Checks each primary of the cluster on its own, within `timeout`: the slot layout from
    /// any node (`CLUSTER SLOTS`), then `CLUSTER INFO` on every primary it names. A `PING`
    /// routed by the cluster client goes to whichever node it picks, and says nothing of the
    /// others.
    pub async fn cluster_health(&self, timeout: Duration) -> Result<ClusterHealth, RedisError> {
        use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
        let Conn::Cluster(conn) = self.get().await? else {
            return Err(io_error("not a cluster URL"));
        };
        let mut slots_cmd = redis::cmd("CLUSTER");
        slots_cmd.arg("SLOTS");
        let mut c = conn.clone();
        let layout = tokio::time::timeout(
            timeout,
            c.route_command(slots_cmd, RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random)),
        )
        .await
        .map_err(|_| io_error("no node answered CLUSTER SLOTS"))??;
        let primaries = primaries_of(&layout);
        if primaries.is_empty() {
            return Err(io_error("CLUSTER SLOTS named no primary"));
        }
        let checks = primaries.into_iter().map(|((host, port), slots)| {
            let mut c = conn.clone();
            async move {
                let mut info = redis::cmd("CLUSTER");
                info.arg("INFO");
                let node = format!("{}:{port}", crate::redis_url::bracket(&host));
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host, port });
                let answer = tokio::time::timeout(timeout, c.route_command(info, route)).await;
                let (state, error) = match answer {
                    Ok(Ok(v)) => match redis::from_redis_value::<String>(v) {
                        Ok(text) => (cluster_state(&text), None),
                        Err(e) => (None, Some(e.to_string())),
                    },
                    Ok(Err(e)) => (None, Some(e.to_string())),
                    Err(_) => (None, Some(format!("no answer within {timeout:?}"))),
                };
                NodeHealth {
                    node,
                    slots,
                    up: state.as_deref() == Some("ok"),
                    state,
                    error,
                }
            }
        });
        let mut nodes = futures_util::future::join_all(checks).await;
        nodes.sort_by(|a, b| a.node.cmp(&b.node));
        Ok(ClusterHealth { nodes })
    }
}

/// The `cluster_state` line of a `CLUSTER INFO` answer.
fn cluster_state(info: &str) -> Option<String> {
    info.lines()
        .find_map(|l| l.trim().strip_prefix("cluster_state:"))
        .map(|s| s.trim().to_owned())
}

/// The primary of every slot range of a `CLUSTER SLOTS` answer, with its ranges.
pub(super) fn primaries_of(layout: &redis::Value) -> Vec<((String, u16), Vec<String>)> {
    use redis::Value;
    let mut out: Vec<((String, u16), Vec<String>)> = Vec::new();
    let Value::Array(ranges) = layout else { return out };
    for range in ranges {
        let Value::Array(fields) = range else { continue };
        let (Some(Value::Int(first)), Some(Value::Int(last)), Some(Value::Array(primary))) =
            (fields.first(), fields.get(1), fields.get(2))
        else {
            continue;
        };
        let host = match primary.first() {
            Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            Some(Value::SimpleString(s)) => s.clone(),
            _ => continue,
        };
        let Some(Value::Int(port)) = primary.get(1) else {
            continue;
        };
        let Ok(port) = u16::try_from(*port) else { continue };
        let span = if first == last {
            first.to_string()
        } else {
            format!("{first}-{last}")
        };
        match out.iter_mut().find(|(addr, _)| addr.0 == host && addr.1 == port) {
            Some((_, spans)) => spans.push(span),
            None => out.push(((host, port), vec![span])),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_primaries_and_their_slots_are_read_from_cluster_slots() {
        use redis::Value;
        let node = |host: &str, port: i64| {
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let layout = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node("10.0.0.1", 6379),
                node("10.0.0.4", 6379),
            ]),
            Value::Array(vec![Value::Int(5461), Value::Int(10922), node("10.0.0.2", 6379)]),
            Value::Array(vec![Value::Int(10923), Value::Int(10923), node("10.0.0.1", 6379)]),
        ]);
        let got = primaries_of(&layout);
        assert_eq!(
            got,
            vec![
                (("10.0.0.1".into(), 6379), vec!["0-5460".into(), "10923".into()]),
                (("10.0.0.2".into(), 6379), vec!["5461-10922".into()]),
            ]
        );
        assert_eq!(
            cluster_state("cluster_enabled:1\r\ncluster_state:fail\r\n").as_deref(),
            Some("fail")
        );
    }
}
