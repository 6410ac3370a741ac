//! Where the reference store keeps documents: memory, or Redis.

use std::sync::Arc;

use bytes::Bytes;
use dashmap::DashMap;
use redis::Script;

use super::{Expect, PutOutcome};
use crate::merge::RawDocument;
use crate::redis_conn::{RedisConn, DEFAULT_RESPONSE_TIMEOUT};

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BackendError(String);

#[derive(Clone)]
pub enum Backend {
    Memory(Arc<DashMap<String, Stored>>),
    Redis {
        conn: RedisConn,
        prefix: String,
        put: Arc<Script>,
        delete: Arc<Script>,
    },
}

/// One document in memory: its version, its body, and the highest fencing token that wrote it.
#[derive(Clone)]
pub struct Stored {
    version: u64,
    body: Bytes,
    fence: u64,
}

/// The stored form: the document (a JSON object, checked by the caller) with its `version`
/// field set to the store's version, every other field as the client sent it.
fn encode(doc: &RawDocument<'_>, version: u64) -> Bytes {
    Bytes::from(doc.with_version(version))
}

fn allowed(expect: Expect, current: Option<u64>) -> bool {
    match (expect, current) {
        (Expect::Any, _) => true,
        (Expect::Absent, c) => c.is_none(),
        (Expect::Exists, c) => c.is_some(),
        (Expect::Version(v), Some(c)) => v == c,
        (Expect::Version(_), None) => false,
    }
}

impl Backend {
    pub fn memory() -> Self {
        Backend::Memory(Arc::new(DashMap::new()))
    }

    pub fn redis(url: &str, prefix: &str) -> Result<Self, BackendError> {
        let conn = RedisConn::open(url, DEFAULT_RESPONSE_TIMEOUT).map_err(|e| BackendError(e.to_string()))?;
        Ok(Backend::Redis {
            conn,
            prefix: prefix.to_owned(),
            put: Arc::new(Script::new(include_str!("put.lua"))),
            delete: Arc::new(Script::new(include_str!("delete.lua"))),
        })
    }

    pub async fn get(&self, id: &str) -> Result<Option<(u64, Bytes)>, BackendError> {
        match self {
            Backend::Memory(map) => Ok(map.get(id).map(|e| (e.version, e.body.clone()))),
            Backend::Redis { conn, prefix, .. } => {
                let key = format!("{prefix}doc:{id}");
                let (v, body): (Option<u64>, Option<Vec<u8>>) = conn
                    .run(|mut c| async move {
                        redis::cmd("HMGET")
                            .arg(&key)
                            .arg("v")
                            .arg("body")
                            .query_async(&mut c)
                            .await
                    })
                    .await
                    .map_err(|e| BackendError(e.to_string()))?;
                Ok(v.zip(body).map(|(v, b)| (v, Bytes::from(b))))
            }
        }
    }

    /// Stores `doc` if `expect` holds and, when `fence` is given, if no write with a higher
    /// fencing token has been stored for this id.
    pub async fn put(
        &self,
        id: &str,
        doc: &RawDocument<'_>,
        expect: Expect,
        fence: Option<u64>,
    ) -> Result<PutOutcome, BackendError> {
        match self {
            Backend::Memory(map) => {
                let mut entry = map.entry(id.to_owned());
                let (current, highest) = match &entry {
                    dashmap::Entry::Occupied(o) => (Some(o.get().version), o.get().fence),
                    dashmap::Entry::Vacant(_) => (None, 0),
                };
                if let Some(token) = fence.filter(|t| *t < highest) {
                    return Ok(PutOutcome::Fenced { token, highest });
                }
                if !allowed(expect, current) {
                    return Ok(PutOutcome::PreconditionFailed);
                }
                let version = current.unwrap_or(0) + 1;
                let body = encode(doc, version);
                let stored = Stored {
                    version,
                    body: body.clone(),
                    fence: highest.max(fence.unwrap_or(0)),
                };
                match &mut entry {
                    dashmap::Entry::Occupied(o) => *o.get_mut() = stored,
                    dashmap::Entry::Vacant(_) => {
                        entry.insert(stored);
                    }
                }
                Ok(PutOutcome::Stored {
                    version,
                    created: current.is_none(),
                    body,
                })
            }
            Backend::Redis { conn, prefix, put, .. } => {
                let key = format!("{prefix}doc:{id}");
                // Read the version, build the body for the next one, compare-and-set; an
                // unconditional write that raced another retries.
                for _ in 0..16 {
                    let current: Option<u64> = {
                        let key = key.clone();
                        conn.run(|mut c| async move { redis::cmd("HGET").arg(&key).arg("v").query_async(&mut c).await })
                            .await
                            .map_err(|e| BackendError(e.to_string()))?
                    };
                    if !allowed(expect, current) {
                        return Ok(PutOutcome::PreconditionFailed);
                    }
                    let base = current.unwrap_or(0);
                    let body = encode(doc, base + 1);
                    let script = put.clone();
                    let (k, b) = (key.clone(), body.clone());
                    let reply: i64 = conn
                        .run(|mut c| async move {
                            script
                                .key(&k)
                                .arg(base)
                                .arg(b.as_ref())
                                .arg(fence.unwrap_or(0))
                                .invoke_async(&mut c)
                                .await
                        })
                        .await
                        .map_err(|e| BackendError(e.to_string()))?;
                    if reply == -2 {
                        return Ok(PutOutcome::Fenced {
                            token: fence.unwrap_or(0),
                            highest: 0,
                        });
                    }
                    if reply > 0 {
                        return Ok(PutOutcome::Stored {
                            version: reply as u64,
                            created: current.is_none(),
                            body,
                        });
                    }
                    if expect != Expect::Any {
                        return Ok(PutOutcome::PreconditionFailed);
                    }
                }
                Err(BackendError("too much contention on one document".into()))
            }
        }
    }

    /// `Some(true)` deleted, `Some(false)` precondition failed, `None` absent.
    pub async fn delete(&self, id: &str, expect: Expect) -> Result<Option<bool>, BackendError> {
        match self {
            Backend::Memory(map) => {
                let Some(current) = map.get(id).map(|e| e.version) else {
                    return Ok(None);
                };
                if !allowed(expect, Some(current)) {
                    return Ok(Some(false));
                }
                Ok(Some(map.remove_if(id, |_, e| e.version == current).is_some()))
            }
            Backend::Redis {
                conn, prefix, delete, ..
            } => {
                let key = format!("{prefix}doc:{id}");
                let expected = match expect {
                    Expect::Version(v) => v.to_string(),
                    _ => String::new(),
                };
                let script = delete.clone();
                let reply: i64 = conn
                    .run(|mut c| async move { script.key(&key).arg(&expected).invoke_async(&mut c).await })
                    .await
                    .map_err(|e| BackendError(e.to_string()))?;
                Ok(match reply {
                    1 => Some(true),
                    0 => None,
                    _ => Some(false),
                })
            }
        }
    }
}
