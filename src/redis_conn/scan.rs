//! `SCAN` over every primary: one server's keyspace, or each cluster primary's in turn (a
//! cluster's `SCAN` covers only the node it is sent to).

use super::*;

impl RedisConn {
    /// Calls `visit` with each key matching `pattern`, until `visit` returns `false` or
    /// `max_rounds` `SCAN` calls (of up to 1,000 keys each) were made on a node. Returns
    /// whether every node's keyspace was walked to its end; the first node that failed ends
    /// the walk with its error (see [`Self::scan_reachable`] to go on past it).
    pub async fn scan(
        &self,
        pattern: &str,
        max_rounds: usize,
        visit: impl FnMut(String) -> bool,
    ) -> Result<bool, RedisError> {
        let (complete, mut failed) = self.scan_reachable(pattern, max_rounds, visit).await?;
        match failed.pop() {
            Some((_, error)) => Err(error),
            None => Ok(complete),
        }
    }

    /// [`Self::scan`] that goes on past a cluster primary that does not answer: returns
    /// whether the walk was complete, and each primary that failed with its error.
    pub async fn scan_reachable(
        &self,
        pattern: &str,
        max_rounds: usize,
        mut visit: impl FnMut(String) -> bool,
    ) -> Result<(bool, Vec<(String, RedisError)>), RedisError> {
        use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
        let conn = self.get().await?;
        let nodes: Vec<Option<(String, u16)>> = match &conn {
            Conn::Single(_) => vec![None],
            Conn::Cluster(c) => {
                let mut slots = redis::cmd("CLUSTER");
                slots.arg("SLOTS");
                let layout = c
                    .clone()
                    .route_command(slots, RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random))
                    .await?;
                cluster::primaries_of(&layout)
                    .into_iter()
                    .map(|(addr, _)| Some(addr))
                    .collect()
            }
        };
        let mut complete = true;
        let mut failed = Vec::new();
        'nodes: for node in nodes {
            let mut cursor = 0u64;
            let mut walked = false;
            for _ in 0..max_rounds {
                let mut cmd = redis::cmd("SCAN");
                cmd.arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(1000);
                let reply = match (&conn, &node) {
                    (Conn::Cluster(c), Some((host, port))) => {
                        let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                            host: host.clone(),
                            port: *port,
                        });
                        match c.clone().route_command(cmd, route).await {
                            Ok(reply) => reply,
                            Err(error) => {
                                failed.push((format!("{host}:{port}"), error));
                                complete = false;
                                continue 'nodes;
                            }
                        }
                    }
                    (c, _) => cmd.query_async(&mut c.clone()).await?,
                };
                let (next, keys): (u64, Vec<String>) = redis::from_redis_value(reply)?;
                for key in keys {
                    if !visit(key) {
                        return Ok((false, failed));
                    }
                }
                cursor = next;
                if cursor == 0 {
                    walked = true;
                    break;
                }
            }
            complete &= walked;
        }
        Ok((complete, failed))
    }
}
