//! Small expiring records: idempotency results and the version snapshots that three-way
//! merges need. In Redis when configured (shared by every replica), else in memory.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dashmap::DashMap;
use tokio::time::Instant;

pub use crate::redis_conn::Entry;
use crate::redis_conn::RedisConn;

#[derive(Debug, thiserror::Error)]
#[error("record store unavailable: {0}")]
pub struct RecordError(String, bool);

impl RecordError {
    /// Redis did not answer in time: the command may still be carried out (a stalled server
    /// runs what it had not answered once it resumes).
    pub fn timed_out(&self) -> bool {
        self.1
    }
}

/// Compare-and-set (or compare-and-delete, with an empty value) of one record.
const CAS: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[3] then return 0 end
if ARGV[1] == '' then redis.call('DEL', KEYS[1]) else redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) end
return 1";

#[derive(Clone)]
pub enum Records {
    Memory(Arc<DashMap<String, (Bytes, Instant)>>),
    Redis(RedisConn),
}

impl Records {
    pub fn memory() -> Self {
        Records::Memory(Arc::new(DashMap::new()))
    }

    pub async fn get(&self, key: &str) -> Result<Option<Bytes>, RecordError> {
        match self {
            Records::Memory(map) => Ok(map.get(key).filter(|e| e.1 > Instant::now()).map(|e| e.0.clone())),
            Records::Redis(conn) => {
                let v: Option<Vec<u8>> = conn
                    .run(|mut c| async move { redis::cmd("GET").arg(key).query_async(&mut c).await })
                    .await
                    .map_err(err)?;
                Ok(v.map(Bytes::from))
            }
        }
    }

    /// Several records in one round trip (a pipeline of `GET`s, so the narrow ACL needs no
    /// more than `GET`), in the order of `keys`.
    pub async fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Bytes>>, RecordError> {
        match self {
            Records::Memory(map) => {
                let now = Instant::now();
                Ok(keys
                    .iter()
                    .map(|k| map.get(k).filter(|e| e.1 > now).map(|e| e.0.clone()))
                    .collect())
            }
            Records::Redis(_) if keys.is_empty() => Ok(Vec::new()),
            Records::Redis(conn) => {
                let mut pipe = redis::pipe();
                for k in keys {
                    pipe.cmd("GET").arg(k);
                }
                let found: Vec<Option<Vec<u8>>> = conn
                    .run(|mut c| async move { pipe.query_async(&mut c).await })
                    .await
                    .map_err(err)?;
                Ok(found.into_iter().map(|v| v.map(Bytes::from)).collect())
            }
        }
    }

    /// Stores `value` only if `key` is absent, in one round trip: `None` when it was stored,
    /// else what `key` holds. With Redis, `SET NX GET` (Redis 7.0 and later); an older
    /// server refuses it, and the claim is then made as a `GET` and a `SET NX`.
    pub async fn put_new_or_get(&self, key: &str, value: Bytes, ttl: Duration) -> Result<Option<Bytes>, RecordError> {
        match self {
            Records::Memory(map) => {
                let now = Instant::now();
                let mut entry = map.entry(key.to_owned()).or_insert((Bytes::new(), now));
                if entry.1 > now {
                    return Ok(Some(entry.0.clone()));
                }
                *entry = (value, now + ttl);
                Ok(None)
            }
            Records::Redis(conn) => {
                let sent = value.clone();
                let found: Result<Option<Vec<u8>>, RecordError> = conn
                    .run(|mut c| async move {
                        redis::cmd("SET")
                            .arg(key)
                            .arg(sent.as_ref())
                            .arg("NX")
                            .arg("PX")
                            .arg(ttl.as_millis() as u64)
                            .arg("GET")
                            .query_async(&mut c)
                            .await
                    })
                    .await
                    .map_err(err);
                match found {
                    Ok(found) => Ok(found.map(Bytes::from)),
                    Err(e) if e.0.contains("syntax error") => {
                        for _ in 0..2 {
                            if let Some(found) = self.get(key).await? {
                                return Ok(Some(found));
                            }
                            if self.put_new(key, value.clone(), ttl).await? {
                                return Ok(None);
                            }
                        }
                        Ok(self.get(key).await?.or(Some(Bytes::new())))
                    }
                    Err(e) => Err(e),
                }
            }
        }
    }

    /// Stores `value` only if `key` is absent; returns whether it was stored.
    pub async fn put_new(&self, key: &str, value: Bytes, ttl: Duration) -> Result<bool, RecordError> {
        match self {
            Records::Memory(map) => {
                let now = Instant::now();
                let mut entry = map.entry(key.to_owned()).or_insert((Bytes::new(), now));
                if entry.1 > now {
                    return Ok(false);
                }
                *entry = (value, now + ttl);
                Ok(true)
            }
            Records::Redis(conn) => {
                let ok: Option<String> = conn
                    .run(|mut c| async move {
                        redis::cmd("SET")
                            .arg(key)
                            .arg(value.as_ref())
                            .arg("NX")
                            .arg("PX")
                            .arg(ttl.as_millis() as u64)
                            .query_async(&mut c)
                            .await
                    })
                    .await
                    .map_err(err)?;
                Ok(ok.is_some())
            }
        }
    }

    /// Stores several records in one round trip.
    pub async fn put_many(&self, items: Vec<(String, Bytes)>, ttl: Duration) -> Result<(), RecordError> {
        if items.is_empty() {
            return Ok(());
        }
        match self {
            Records::Memory(map) => {
                let expires = Instant::now() + ttl;
                for (k, v) in items {
                    map.insert(k, (v, expires));
                }
                Ok(())
            }
            Records::Redis(conn) => {
                let mut pipe = redis::pipe();
                for (k, v) in &items {
                    pipe.cmd("SET")
                        .arg(k)
                        .arg(v.as_ref())
                        .arg("PX")
                        .arg(ttl.as_millis() as u64)
                        .ignore();
                }
                conn.run(|mut c| async move { pipe.query_async::<()>(&mut c).await })
                    .await
                    .map_err(err)
            }
        }
    }

    /// Changes `key` to `value` (deletes it when `value` is empty) only while it holds
    /// `expect`; returns whether it did.
    pub async fn compare_and_set(
        &self,
        key: &str,
        expect: &[u8],
        value: Bytes,
        ttl: Duration,
    ) -> Result<bool, RecordError> {
        match self {
            Records::Memory(map) => {
                let now = Instant::now();
                let Some(mut entry) = map.get_mut(key) else {
                    return Ok(false);
                };
                if entry.1 <= now || entry.0.as_ref() != expect {
                    return Ok(false);
                }
                if value.is_empty() {
                    drop(entry);
                    map.remove_if(key, |_, (v, _)| v.as_ref() == expect);
                } else {
                    *entry = (value, now + ttl);
                }
                Ok(true)
            }
            Records::Redis(conn) => {
                let script = redis::Script::new(CAS);
                let script = &script;
                let done: i64 = conn
                    .run(|mut c| async move {
                        let mut invocation = script.key(key);
                        invocation.arg(value.as_ref()).arg(ttl.as_millis() as u64).arg(expect);
                        invocation.invoke_async(&mut c).await
                    })
                    .await
                    .map_err(err)?;
                Ok(done == 1)
            }
        }
    }

    /// Stores entries with their own lifetimes (grouped into one round trip per lifetime);
    /// those with an expected value one by one, compared and set.
    pub async fn put_entries(&self, entries: Vec<Entry>) -> Result<(), RecordError> {
        let mut by_ttl: Vec<(Duration, Vec<(String, Bytes)>)> = Vec::new();
        for e in entries {
            if e.refresh {
                self.refresh(&e.key, e.ttl).await?;
                continue;
            }
            if let Some(expect) = &e.expect {
                self.compare_and_set(&e.key, expect, e.value, e.ttl).await?;
                continue;
            }
            match by_ttl.iter_mut().find(|(ttl, _)| *ttl == e.ttl) {
                Some((_, items)) => items.push((e.key, e.value)),
                None => by_ttl.push((e.ttl, vec![(e.key, e.value)])),
            }
        }
        for (ttl, items) in by_ttl {
            self.put_many(items, ttl).await?;
        }
        Ok(())
    }

    /// How long `key` has left to live; `None` when it does not exist.
    pub async fn remaining(&self, key: &str) -> Result<Option<Duration>, RecordError> {
        match self {
            Records::Memory(map) => {
                let now = Instant::now();
                Ok(map.get(key).filter(|e| e.1 > now).map(|e| e.1 - now))
            }
            Records::Redis(conn) => {
                let ms: i64 = conn
                    .run(|mut c| async move { redis::cmd("PTTL").arg(key).query_async(&mut c).await })
                    .await
                    .map_err(err)?;
                // -1: no expiry; -2: no such key.
                Ok(match ms {
                    -1 => Some(Duration::MAX),
                    ms if ms >= 0 => Some(Duration::from_millis(ms as u64)),
                    _ => None,
                })
            }
        }
    }

    /// Sets how long `key` lives from now on, when it exists.
    pub async fn refresh(&self, key: &str, ttl: Duration) -> Result<(), RecordError> {
        match self {
            Records::Memory(map) => {
                let now = Instant::now();
                if let Some(mut entry) = map.get_mut(key) {
                    if entry.1 > now {
                        entry.1 = now + ttl;
                    }
                }
                Ok(())
            }
            Records::Redis(conn) => conn
                .run(|mut c| async move {
                    redis::cmd("PEXPIRE")
                        .arg(key)
                        .arg(ttl.as_millis() as u64)
                        .query_async::<()>(&mut c)
                        .await
                })
                .await
                .map_err(err),
        }
    }

    pub async fn delete(&self, key: &str) -> Result<(), RecordError> {
        match self {
            Records::Memory(map) => {
                map.remove(key);
                Ok(())
            }
            Records::Redis(conn) => conn
                .run(|mut c| async move { redis::cmd("DEL").arg(key).query_async::<()>(&mut c).await })
                .await
                .map_err(err),
        }
    }

    /// Drops expired in-memory records (called periodically).
    pub fn sweep(&self) {
        if let Records::Memory(map) = self {
            let now = Instant::now();
            map.retain(|_, (_, exp)| *exp > now);
        }
    }
}

fn err(e: redis::RedisError) -> RecordError {
    RecordError(e.to_string(), e.is_timeout())
}
