//! The Redis lock backend: `SET NX PX` with a random owner token and a fencing counter in one
//! script, compare-and-delete release that announces itself on a channel, and waiters woken by
//! that announcement through one shared pub/sub connection.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use futures_util::StreamExt;
use redis::aio::PubSubSink;
use redis::Script;
use tokio::sync::{mpsc, Notify};

use super::{Attempt, LockError, LockSettings, Released, Settled, Slot, SlotRelease, Wake};
use crate::metrics::Metrics;
use crate::redis_conn::Entry;
use crate::redis_conn::RedisConn;
use crate::session::{Keys, Scope};

struct Scripts {
    acquire: Script,
    release: Script,
    renew: Script,
    slot_take: Script,
}

pub struct RedisLocks {
    pub(super) settings: LockSettings,
    replica_wait: Option<ReplicaWait>,
    pub(super) metrics: Metrics,
    pub(super) held: DashMap<String, String>,
    /// Releases that failed (the lock then expires with its lease): a shutdown reports them.
    pub(super) release_failures: std::sync::atomic::AtomicUsize,
    conn: RedisConn,
    keys: Keys,
    scripts: Scripts,
    watchers: Arc<DashMap<String, Arc<Watcher>>>,
    subscriptions: mpsc::UnboundedSender<Subscription>,
}

/// Grants go through a connection of their own, followed by `WAIT`: a blocking `WAIT` on the
/// shared multiplexed connection would hold up every other command behind it.
struct ReplicaWait {
    conn: RedisConn,
    replicas: u32,
    timeout: Duration,
}

struct Watcher {
    notify: Arc<Notify>,
    waiters: AtomicUsize,
}

enum Subscription {
    Subscribe(String),
    Unsubscribe(String),
}

impl RedisLocks {
    pub fn new(conn: RedisConn, keys: Keys, settings: LockSettings, metrics: Metrics) -> Self {
        let watchers: Arc<DashMap<String, Arc<Watcher>>> = Arc::new(DashMap::new());
        let (tx, rx) = mpsc::unbounded_channel();
        if conn.is_cluster() {
            tokio::spawn(sharded_pubsub_loop(conn.clone(), watchers.clone(), rx));
        } else {
            tokio::spawn(pubsub_loop(conn.clone(), watchers.clone(), rx));
        }
        Self {
            settings,
            replica_wait: None,
            metrics,
            held: DashMap::new(),
            release_failures: std::sync::atomic::AtomicUsize::new(0),
            conn,
            keys,
            scripts: Scripts {
                acquire: Script::new(include_str!("scripts/acquire.lua")),
                release: Script::new(include_str!("scripts/release.lua")),
                renew: Script::new(include_str!("scripts/renew.lua")),
                slot_take: Script::new(include_str!("scripts/slot_take.lua")),
            },
            watchers,
            subscriptions: tx,
        }
    }

    /// Makes every grant wait until `replicas` replicas acknowledged it (Redis `WAIT`), on
    /// `conn`, a connection used for nothing else.
    pub fn with_replica_wait(mut self, conn: RedisConn, replicas: u32, timeout: Duration) -> Self {
        self.replica_wait = Some(ReplicaWait {
            conn,
            replicas,
            timeout,
        });
        self
    }

    pub fn conn(&self) -> &RedisConn {
        &self.conn
    }

    pub(super) async fn try_acquire(
        self: &Arc<Self>,
        key: &str,
        fence_key: &str,
        token: &str,
        waiter: &str,
        slot: Option<&Scope>,
    ) -> Result<Attempt, LockError> {
        let lease_ms = self.settings.lease.as_millis() as u64;
        let (queue, expiries) = (format!("{key}:waiters"), format!("{key}:waiting"));
        let waiter_ttl_ms = super::WAITER_TTL.as_millis() as u64;
        let counter_ttl_ms = self.settings.key_ttl.as_millis() as u64;
        let slot_ms = self.settings.slot_ttl.as_millis() as u64;
        let slot_keys = slot.map(|scope| (scope.slot(), scope.turn_mark()));
        let script = &self.scripts.acquire;
        let conn = match &self.replica_wait {
            Some(w) => &w.conn,
            None => &self.conn,
        };
        let (reply, restart_hold): (Vec<i64>, Option<Duration>) = conn
            .run(|mut c| {
                let slot_keys = &slot_keys;
                async move {
                    // Looked at once the connection is made: a new connection is where a
                    // restart is noticed. After a restart that may have lost the slot, the
                    // grant takes none until every write-back that could have been in flight
                    // has ended: it answers as if one were.
                    let restart_hold = slot_keys.as_ref().and(self.restart_hold());
                    let mut invocation = script.key(key);
                    invocation.key(fence_key).key(&queue).key(&expiries);
                    if let (Some((slot, mark)), None) = (slot_keys, restart_hold) {
                        invocation.key(slot).key(mark);
                    }
                    let reply = invocation
                        .arg(token)
                        .arg(lease_ms)
                        .arg(counter_ttl_ms)
                        .arg(waiter)
                        .arg(waiter_ttl_ms)
                        .arg(slot_ms)
                        .invoke_async(&mut c)
                        .await?;
                    Ok((reply, restart_hold))
                }
            })
            .await
            .map_err(|e| {
                // Unanswered in time, the acquire may still run (see `give_back_late`).
                if e.is_timeout() {
                    let (this, key, token, slot) = (self.clone(), key.to_owned(), token.to_owned(), slot.cloned());
                    tokio::spawn(async move { this.give_back_late(&key, &token, slot.as_ref()).await });
                }
                backend(e)
            })?;
        let granted = reply.first() == Some(&1);
        if let (Some(w), true) = (&self.replica_wait, granted) {
            self.wait_for_replicas(w, key, token, slot).await?;
        }
        let second = reply.get(1).copied().unwrap_or(0);
        if !granted {
            return Ok(Attempt::Held {
                remaining: Duration::from_millis(second.max(1) as u64),
            });
        }
        let slot = match (slot, restart_hold, reply.get(2), reply.get(3)) {
            (None, ..) => None,
            (Some(_), Some(remaining), ..) => Some(Slot::InFlight { remaining }),
            (Some(_), None, Some(1), Some(&mark)) => Some(Slot::Taken {
                turn_mark: mark.max(0) as u64,
            }),
            (Some(_), None, _, pttl) => Some(Slot::InFlight {
                remaining: Duration::from_millis(pttl.copied().unwrap_or(1).max(1) as u64),
            }),
        };
        Ok(Attempt::Granted {
            fence: second.max(0) as u64,
            slot,
        })
    }

    /// Gives up `waiter`'s ticket for `key` (it stopped waiting).
    pub(super) async fn leave(&self, key: &str, waiter: &str) -> Result<(), LockError> {
        let (queue, expiries) = (format!("{key}:waiters"), format!("{key}:waiting"));
        let mut pipe = redis::pipe();
        pipe.cmd("ZREM").arg(&queue).arg(waiter).ignore();
        pipe.cmd("ZREM").arg(&expiries).arg(waiter).ignore();
        self.conn
            .run(|mut c| async move { pipe.query_async::<()>(&mut c).await })
            .await
            .map_err(backend)
    }

    /// Waits until the grant just made on `w.conn` reached enough replicas; gives it back
    /// when it did not, so that no write is made under a grant a failover could forget.
    async fn wait_for_replicas(
        &self,
        w: &ReplicaWait,
        key: &str,
        token: &str,
        slot: Option<&Scope>,
    ) -> Result<(), LockError> {
        let (replicas, timeout_ms) = (w.replicas, w.timeout.as_millis() as u64);
        let acked: Result<i64, redis::RedisError> = w
            .conn
            .run(|mut c| async move { c.wait_for_replicas(key, replicas, timeout_ms).await })
            .await;
        let acked = match acked {
            Ok(n) if n >= i64::from(replicas) => return Ok(()),
            Ok(n) => n.to_string(),
            Err(e) => e.to_string(),
        };
        // The commit slot the grant may have taken goes back with it.
        let slot = slot.map(|scope| SlotRelease {
            scope: scope.clone(),
            settled: Settled::Unchanged,
            give_back: true,
            surely_held: false,
        });
        if let Err(e) = self.release(key, token, &[], slot.as_ref()).await {
            tracing::warn!(%key, error = %e, "unacknowledged grant not given back; it expires with its lease");
        }
        Err(LockError::Backend(format!(
            "lock grant not acknowledged by {replicas} replica(s) within {timeout_ms} ms (acknowledged: {acked})"
        )))
    }

    /// Gives back the grant a failed attempt may still make. Redis carries out a command it
    /// had not answered when the wait for it ended (a stalled server) once it resumes: the
    /// acquire then grants `token` the lock and the document's commit slot with nobody to
    /// release them, and the session's writes wait a lease and a slot's life for them. Sent
    /// as soon as Redis answers again (tried for as long as such a grant could still hold),
    /// and once more a moment later: the late acquire may sit on another connection than the
    /// release's, and run after it.
    pub(super) async fn give_back_late(&self, key: &str, token: &str, slot: Option<&Scope>) {
        const PAUSE: Duration = Duration::from_millis(300);
        let slot = slot.map(|scope| SlotRelease {
            scope: scope.clone(),
            settled: Settled::Unchanged,
            give_back: true,
            surely_held: false,
        });
        let until = tokio::time::Instant::now() + self.settings.lease.max(self.settings.slot_ttl);
        let mut answered = 0;
        while answered < 2 && tokio::time::Instant::now() < until {
            match self.release_again_or_lock(key, token, slot.as_ref()).await {
                Ok(true) => {
                    tracing::info!(%key, "a lock Redis granted after the attempt gave up on it was given back");
                    return;
                }
                Ok(false) => answered += 1,
                Err(e) => tracing::debug!(%key, error = %e, "a late grant not given back yet; trying again"),
            }
            tokio::time::sleep(PAUSE).await;
        }
    }

    async fn release_again_or_lock(
        &self,
        key: &str,
        token: &str,
        slot: Option<&SlotRelease>,
    ) -> Result<bool, LockError> {
        let released = match slot {
            Some(slot) => self.release_again(key, token, slot).await?,
            None => self.release(key, token, &[], None).await?,
        };
        Ok(released.lock)
    }

    pub(super) fn watch(&self, key: &str) -> Wake {
        let channel = self.keys.released(key);
        // The waiter is counted, and subscription changes are sent, under the map's entry lock:
        // a last waiter leaving (which unsubscribes) and a new one arriving (which subscribes)
        // are then ordered, and the channel is never left unsubscribed while someone waits.
        let watcher = {
            let entry = self.watchers.entry(channel.clone()).or_insert_with(|| {
                let _ = self.subscriptions.send(Subscription::Subscribe(channel.clone()));
                Arc::new(Watcher {
                    notify: Arc::new(Notify::new()),
                    waiters: AtomicUsize::new(0),
                })
            });
            entry.waiters.fetch_add(1, Ordering::SeqCst);
            entry.clone()
        };
        let guard = WatchGuard {
            channel,
            watcher: watcher.clone(),
            watchers: self.watchers.clone(),
            subscriptions: self.subscriptions.clone(),
        };
        Wake::new(watcher.notify.clone(), Some(Box::new(guard)))
    }

    pub(super) async fn renew(&self, key: &str, token: &str) -> Result<bool, LockError> {
        let lease_ms = self.settings.lease.as_millis() as u64;
        let script = &self.scripts.renew;
        let held: i64 = self
            .conn
            .run(|mut c| async move { script.key(key).arg(token).arg(lease_ms).invoke_async(&mut c).await })
            .await
            .map_err(backend)?;
        Ok(held == 1)
    }

    /// Stores `records` and settles `slot`, then releases, in one round trip (see
    /// `release.lua`). Sent once more when the connection is cut under it (the script is safe
    /// to run twice), so a cut connection does not leave the document's commit slot to expire.
    pub(super) async fn release(
        &self,
        key: &str,
        token: &str,
        records: &[Entry],
        slot: Option<&SlotRelease>,
    ) -> Result<Released, LockError> {
        self.release_sending(key, token, records, slot, false).await
    }

    /// [`Self::release`] sent again later, after its first sending failed (it may have run):
    /// the turn mark changes only while the slot is still this owner's. No records.
    pub(super) async fn release_again(
        &self,
        key: &str,
        token: &str,
        slot: &SlotRelease,
    ) -> Result<Released, LockError> {
        self.release_sending(key, token, &[], Some(slot), true).await
    }

    async fn release_sending(
        &self,
        key: &str,
        token: &str,
        records: &[Entry],
        slot: Option<&SlotRelease>,
        sent_before: bool,
    ) -> Result<Released, LockError> {
        let channel = self.keys.released(key);
        // On a cluster the release is announced on the session's shard only.
        let publish = if self.conn.is_cluster() { "SPUBLISH" } else { "PUBLISH" };
        let key_ms = self.settings.key_ttl.as_millis() as u64;
        let slot_keys = slot.map(|s| (s.scope.slot(), s.scope.turn_mark()));
        let mode = slot.map_or("", |s| if s.give_back { "give" } else { "keep" });
        let settled = slot.map_or(Settled::Unchanged, |s| s.settled).as_arg();
        let sendings = AtomicUsize::new(usize::from(sent_before));
        let script = &self.scripts.release;
        let ((lock, given), resent): ((i64, i64), bool) = self
            .conn
            .run_resent(|mut c| {
                let (slot_keys, channel, sendings) = (&slot_keys, &channel, &sendings);
                async move {
                    let resent = sendings.fetch_add(1, Ordering::SeqCst) > 0;
                    let mut invocation = script.key(key);
                    if let Some((slot, mark)) = slot_keys {
                        invocation.key(slot).key(mark);
                    }
                    for r in records {
                        invocation.key(&r.key);
                    }
                    invocation
                        .arg(token)
                        .arg(channel)
                        .arg(publish)
                        .arg(mode)
                        .arg(settled)
                        .arg(key_ms)
                        .arg(if resent { "1" } else { "0" });
                    for r in records {
                        invocation
                            .arg(r.value.as_ref())
                            .arg(r.ttl.as_millis() as u64)
                            .arg(r.expect.as_deref().unwrap_or_default())
                            .arg(if r.refresh { "1" } else { "" });
                    }
                    invocation.invoke_async(&mut c).await
                }
            })
            .await
            .map_err(backend)?;
        // Sent again after a cut connection, "not held" most likely means the first sending
        // gave it back before the cut: not a write-back that outlived its slot.
        Ok(Released {
            lock: lock == 1,
            slot: given == 1 || resent,
            unsaved: Vec::new(),
        })
    }

    pub(super) async fn take_slot(&self, lock_key: &str, token: &str, scope: &Scope) -> Result<Slot, LockError> {
        if let Some(remaining) = self.restart_hold() {
            return Ok(Slot::InFlight { remaining });
        }
        let slot_ms = self.settings.slot_ttl.as_millis() as u64;
        let key_ms = self.settings.key_ttl.as_millis() as u64;
        let (slot, mark) = (scope.slot(), scope.turn_mark());
        let script = &self.scripts.slot_take;
        let reply: (i64, i64) = self
            .conn
            .run(|mut c| {
                let (slot, mark) = (&slot, &mark);
                async move {
                    // Once more on this connection: it may be the one that noticed a restart.
                    if let Some(remaining) = self.restart_hold() {
                        return Ok((-1, remaining.as_millis().max(1) as i64));
                    }
                    script
                        .key(lock_key)
                        .key(slot)
                        .key(mark)
                        .arg(token)
                        .arg(slot_ms)
                        .arg(key_ms)
                        .invoke_async(&mut c)
                        .await
                }
            })
            .await
            .map_err(backend)?;
        Ok(match reply {
            (1, mark) => Slot::Taken {
                turn_mark: mark.max(0) as u64,
            },
            (0, _) => Slot::LeaseLost,
            (_, pttl) => Slot::InFlight {
                remaining: Duration::from_millis(pttl.max(1) as u64),
            },
        })
    }

    /// How long a commit slot is still not taken after Redis was seen to restart: a write-back
    /// taken under a slot the restart lost may be in flight for up to the slot's life since
    /// the restarted server started. Nothing is sent to Redis.
    fn restart_hold(&self) -> Option<Duration> {
        let window = self.settings.slot_ttl;
        let grants = self.replica_wait.as_ref().and_then(|w| w.conn.restart_hold(window));
        self.conn.restart_hold(window).max(grants)
    }

    pub(super) async fn ping(&self) -> Result<(), LockError> {
        let _: String = self
            .conn
            .run(|mut c| async move { redis::cmd("PING").query_async(&mut c).await })
            .await
            .map_err(backend)?;
        Ok(())
    }
}

fn backend(e: redis::RedisError) -> LockError {
    LockError::Backend(e.to_string())
}

/// Keeps a channel subscribed while at least one waiter watches it.
struct WatchGuard {
    channel: String,
    watcher: Arc<Watcher>,
    watchers: Arc<DashMap<String, Arc<Watcher>>>,
    subscriptions: mpsc::UnboundedSender<Subscription>,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        if self.watcher.waiters.fetch_sub(1, Ordering::SeqCst) == 1 {
            let subscriptions = &self.subscriptions;
            self.watchers.remove_if(&self.channel, |channel, w| {
                let idle = w.waiters.load(Ordering::SeqCst) == 0;
                if idle {
                    let _ = subscriptions.send(Subscription::Unsubscribe(channel.clone()));
                }
                idle
            });
        }
    }
}

/// How long a pub/sub loop waits before connecting again after a failure.
const RECONNECT_PAUSE: Duration = Duration::from_millis(500);

/// The pause of a pub/sub loop whose connection failed: subscription requests are drained
/// meanwhile (the watchers map is the source of truth, subscribed in full on reconnect).
/// `Break` when the lock backend is gone (the request channel closed): the loop ends.
async fn pause_draining(rx: &mut mpsc::UnboundedReceiver<Subscription>) -> std::ops::ControlFlow<()> {
    let pause = tokio::time::sleep(RECONNECT_PAUSE);
    tokio::pin!(pause);
    loop {
        tokio::select! {
            _ = &mut pause => return std::ops::ControlFlow::Continue(()),
            msg = rx.recv() => if msg.is_none() { return std::ops::ControlFlow::Break(()) },
        }
    }
}

/// Owns the pub/sub connection: applies subscription changes and wakes watchers on each
/// release. When Redis is unreachable it retries with a pause; waiters meanwhile fall back to
/// polling, so a lost connection only costs latency, never correctness.
async fn pubsub_loop(
    conn: RedisConn,
    watchers: Arc<DashMap<String, Arc<Watcher>>>,
    mut rx: mpsc::UnboundedReceiver<Subscription>,
) {
    loop {
        let pubsub = conn.pubsub().await;
        let (mut sink, mut stream): (PubSubSink, _) = match pubsub {
            Ok(p) => p.split(),
            Err(error) => {
                tracing::debug!(%error, "lock release channel unavailable; waiters poll");
                if pause_draining(&mut rx).await.is_break() {
                    return;
                }
                continue;
            }
        };
        let channels: Vec<String> = watchers.iter().map(|e| e.key().clone()).collect();
        if !channels.is_empty() && sink.subscribe(&channels).await.is_err() {
            continue;
        }
        loop {
            tokio::select! {
                msg = stream.next() => match msg {
                    Some(msg) => {
                        if let Some(w) = watchers.get(msg.get_channel_name()) {
                            w.notify.notify_one();
                        }
                    }
                    None => break,
                },
                req = rx.recv() => {
                    let result = match req {
                        Some(Subscription::Subscribe(ch)) => sink.subscribe(&ch).await,
                        Some(Subscription::Unsubscribe(ch)) => sink.unsubscribe(&ch).await,
                        None => return,
                    };
                    if result.is_err() {
                        break;
                    }
                }
            }
        }
    }
}

/// [`pubsub_loop`] on a Redis Cluster: sharded pub/sub (`SSUBSCRIBE`), each channel on the
/// shard that owns its session. The cluster client re-subscribes by itself after a
/// reconnection or a slot moving; a lost connection costs latency only (waiters poll).
async fn sharded_pubsub_loop(
    conn: RedisConn,
    watchers: Arc<DashMap<String, Arc<Watcher>>>,
    mut rx: mpsc::UnboundedReceiver<Subscription>,
) {
    loop {
        let (mut sub, mut pushes) = match conn.cluster_pubsub().await {
            Ok(p) => p,
            Err(error) => {
                tracing::debug!(%error, "lock release channels unavailable; waiters poll");
                if pause_draining(&mut rx).await.is_break() {
                    return;
                }
                continue;
            }
        };
        let channels: Vec<String> = watchers.iter().map(|e| e.key().clone()).collect();
        let mut failed = false;
        for ch in &channels {
            if sub.ssubscribe(ch).await.is_err() {
                failed = true;
                break;
            }
        }
        if failed {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        loop {
            tokio::select! {
                push = pushes.recv() => match push {
                    Some(push) => {
                        if push.kind == redis::PushKind::SMessage {
                            if let Some(redis::Value::BulkString(name)) = push.data.first() {
                                if let Some(w) = std::str::from_utf8(name).ok().and_then(|n| watchers.get(n)) {
                                    w.notify.notify_one();
                                }
                            }
                        }
                    }
                    None => break,
                },
                req = rx.recv() => {
                    let result = match req {
                        Some(Subscription::Subscribe(ch)) => sub.ssubscribe(&ch).await,
                        Some(Subscription::Unsubscribe(ch)) => sub.sunsubscribe(&ch).await,
                        None => return,
                    };
                    if let Err(error) = result {
                        tracing::debug!(%error, "sharded subscription change failed; reconnecting");
                        break;
                    }
                }
            }
        }
    }
}
