//! The session lock: grant with a fencing token, lease renewal, release, and the commit slot
//! that orders the commits of one document across turns and proxies.
//!
//! Two backends with the same semantics: Redis (shared by every proxy replica) and in-memory
//! (serializes only the writers inside one process). The waiting loop is shared: a waiter is
//! woken when the holder releases, falls back to jittered exponential backoff, and never waits
//! past its deadline.

mod lease;
mod memory;
mod redis;

pub use self::lease::Lease;
use self::lease::{renew_loop, safe_lease, LeaseState};
pub use self::memory::MemoryLocks;
pub use self::redis::RedisLocks;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use tokio::time::Instant;

use crate::metrics::Metrics;
use crate::redis_conn::Entry;
use crate::session::Scope;

/// Shortest and longest pause between two attempts when no release wakes the waiter.
const BACKOFF_MIN: Duration = Duration::from_micros(500);
const BACKOFF_MAX: Duration = Duration::from_millis(16);

/// How long a waiter keeps its place in a lock's fair order without asking again: well
/// above the longest pause between two of its attempts ([`BACKOFF_MAX`], a Redis round trip),
/// and the longest a waiter that gave up without saying so can hold the lock back.
pub(crate) const WAITER_TTL: Duration = Duration::from_millis(250);

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("lock not obtained within {0:?}")]
    Busy(Duration),
    #[error("lock backend unavailable: {0}")]
    Backend(String),
}

/// What one attempt to take a lock found.
#[derive(Debug)]
pub(crate) enum Attempt {
    /// Granted; with what the grant found of the document's commit slot, when it asked for it.
    Granted {
        fence: u64,
        slot: Option<Slot>,
    },
    Held {
        remaining: Duration,
    },
}

/// What an attempt to take a document's commit slot found (see `slot_take.lua`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Slot {
    /// Taken (or extended) by this writer; carries the document's turn mark (0 when none).
    Taken { turn_mark: u64 },
    /// The writer's own lock is no longer held: it must not write.
    LeaseLost,
    /// Another writer's commit is in flight; it ends within `remaining` at the latest.
    InFlight { remaining: Duration },
}

/// What the store did with the writes a slot protected (see `release.lua`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settled {
    /// Nothing that changes the turn mark (a refused write, or a merge write).
    Unchanged,
    /// The store accepted a serialized write of this turn.
    Accepted(u64),
    /// The store deleted the document: its turn mark goes with it.
    Deleted,
}

impl Settled {
    /// What a later write of the same batch did adds to what an earlier one did: the latest
    /// change of the turn mark counts.
    pub fn then(self, later: Settled) -> Settled {
        match later {
            Settled::Unchanged => self,
            changed => changed,
        }
    }

    fn as_arg(self) -> i64 {
        match self {
            Settled::Unchanged => -1,
            Settled::Accepted(turn) => turn.min(crate::session::MAX_TURN) as i64,
            Settled::Deleted => -2,
        }
    }
}

/// What a lock's release does with the commit slot its holder took (see `release.lua`): one
/// round trip gives both back.
#[derive(Clone, Debug)]
pub struct SlotRelease {
    pub scope: Scope,
    /// What the store did with the writes made under the slot.
    pub settled: Settled,
    /// Whether the slot is given back; `false` leaves it to expire by itself (a write whose
    /// outcome is unknown may still land, and no commit is ordered after it until then).
    pub give_back: bool,
    /// The slot was taken (`false`: a take that Redis did not answer, which may or may not
    /// have run; not finding it held then is no overrun).
    pub surely_held: bool,
}

/// What a release found.
#[derive(Debug)]
pub struct Released {
    /// The lock was still this writer's.
    pub lock: bool,
    /// The commit slot was still this writer's (or none was given back): `false` means a
    /// write-back outlived its slot.
    pub slot: bool,
    /// The records the release carried when its round trip failed: none of them is known to
    /// be stored, and each is safe to store again (a compare-and-set on its claim, or a
    /// snapshot keyed by its version).
    pub unsaved: Vec<Entry>,
}

#[derive(Clone)]
pub enum Locks {
    Memory(Arc<MemoryLocks>),
    Redis(Arc<RedisLocks>),
}

/// Settings shared by both backends.
#[derive(Clone, Debug)]
pub struct LockSettings {
    pub lease: Duration,
    /// How long a commit slot lives: at least as long as a write-back can take (the store
    /// timeout) plus a lease.
    pub slot_ttl: Duration,
    /// How long a session's keys (fencing counter, turn marks) outlive its last write.
    pub key_ttl: Duration,
}

impl LockSettings {
    /// Settings for a store that answers within `store_timeout`.
    pub fn new(lease: Duration, store_timeout: Duration, key_ttl: Duration) -> Self {
        Self {
            lease,
            slot_ttl: store_timeout + lease,
            key_ttl,
        }
    }
}

// === impl Locks ===

impl Locks {
    pub fn settings(&self) -> &LockSettings {
        match self {
            Locks::Memory(m) => &m.settings,
            Locks::Redis(r) => &r.settings,
        }
    }

    /// Takes `key`, waiting until `deadline` at the most.
    pub async fn acquire(
        &self,
        key: &str,
        fence_key: &str,
        deadline: Instant,
        metrics: &Metrics,
    ) -> Result<Lease, LockError> {
        let waiter = format!("{:016x}", rand::random::<u64>());
        self.acquire_as(key, fence_key, deadline, metrics, &waiter, None).await
    }

    /// Takes `key` as `waiter`, waiting until `deadline` at the most. With Redis, waiters of
    /// all proxies take the lock in the order they first asked for it (a waiter keeps its
    /// place across calls with the same id while it keeps asking, see [`WAITER_TTL`]): a
    /// proxy that just released it waits behind the others.
    ///
    /// With `slot`, the grant takes that document's commit slot in the same round trip (see
    /// [`Lease::slot_at_grant`]), to be given back with the lock ([`Lease::release_with`]).
    pub async fn acquire_as(
        &self,
        key: &str,
        fence_key: &str,
        deadline: Instant,
        metrics: &Metrics,
        waiter: &str,
        slot: Option<&Scope>,
    ) -> Result<Lease, LockError> {
        let started = Instant::now();
        let token = format!("{:032x}", rand::random::<u128>());
        let mut backoff = BACKOFF_MIN;
        // The fast path (lock free) sends one command: no release channel is watched until
        // an attempt finds the lock held. From then on a watch is always registered before
        // the next attempt, so a release between an attempt and the wait is not missed, and
        // the channel stays subscribed for as long as this writer waits.
        let mut wake: Option<Wake> = None;
        let result = loop {
            let sent = Instant::now();
            match self.try_acquire(key, fence_key, &token, waiter, slot).await {
                Ok(Attempt::Granted { fence, slot }) => {
                    break Ok(self.lease(key, token, fence, sent, slot));
                }
                Ok(Attempt::Held { remaining }) => {
                    let now = Instant::now();
                    if now >= deadline {
                        break Err(LockError::Busy(now - started));
                    }
                    let Some(current) = wake.take() else {
                        wake = Some(self.watch(key));
                        continue;
                    };
                    wake = Some(self.watch(key));
                    let pause = jitter(backoff).min(remaining).min(deadline - now);
                    current.wait(pause.max(Duration::from_micros(100))).await;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
                Err(e) => break Err(e),
            }
        };
        let outcome = match &result {
            Ok(_) => "acquired",
            Err(LockError::Busy(_)) => "busy",
            Err(LockError::Backend(_)) => "error",
        };
        metrics.lock_acquired(outcome, started.elapsed());
        result
    }

    async fn try_acquire(
        &self,
        key: &str,
        fence_key: &str,
        token: &str,
        waiter: &str,
        slot: Option<&Scope>,
    ) -> Result<Attempt, LockError> {
        match self {
            Locks::Memory(m) => Ok(m.try_acquire(key, fence_key, token, slot)),
            Locks::Redis(r) => r.try_acquire(key, fence_key, token, waiter, slot).await,
        }
    }

    /// Gives up `waiter`'s place in `key`'s order (it stops waiting for it).
    pub async fn leave(&self, key: &str, waiter: &str) {
        if let Locks::Redis(r) = self {
            if let Err(e) = r.leave(key, waiter).await {
                tracing::debug!(error = %e, "a waiter's place not given up; it lapses by itself");
            }
        }
    }

    fn watch(&self, key: &str) -> Wake {
        match self {
            Locks::Memory(m) => m.watch(key),
            Locks::Redis(r) => r.watch(key),
        }
    }

    async fn renew(&self, key: &str, token: &str) -> Result<bool, LockError> {
        match self {
            Locks::Memory(m) => Ok(m.renew(key, token)),
            Locks::Redis(r) => r.renew(key, token).await,
        }
    }

    async fn release_key(&self, key: &str, token: &str) -> Result<bool, LockError> {
        self.release_key_with(key, token, &[], None).await.map(|r| r.lock)
    }

    /// Releases after storing `records` and settling `slot`; only a backend that
    /// [`carries_records`] is given any records.
    ///
    /// [`carries_records`]: Locks::carries_records
    async fn release_key_with(
        &self,
        key: &str,
        token: &str,
        records: &[Entry],
        slot: Option<&SlotRelease>,
    ) -> Result<Released, LockError> {
        match self {
            Locks::Memory(m) => {
                // The slot before the lock, as in Redis's one script.
                let slot = slot.map_or(true, |s| m.release_slot(token, s));
                Ok(Released {
                    lock: m.release(key, token),
                    slot,
                    unsaved: Vec::new(),
                })
            }
            Locks::Redis(r) => r.release(key, token, records, slot).await,
        }
    }

    /// Whether [`Lease::release_with`] stores records in the same round trip as the release
    /// (Redis, where the records live too). Otherwise the caller stores them first.
    pub fn carries_records(&self) -> bool {
        matches!(self, Locks::Redis(_))
    }

    /// Takes the commit slot of a document (`scope`) for the holder of `lease`, or extends
    /// it when this holder has it already. Taken before the document is read (by the grant
    /// itself when the slot was free then); given back with the lock ([`Lease::release_with`])
    /// once the store answered the write.
    pub async fn take_slot(&self, lease: &Lease, scope: &Scope) -> Result<Slot, LockError> {
        match self {
            Locks::Memory(m) => Ok(m.take_slot(&lease.key, &lease.token, scope)),
            Locks::Redis(r) => r.take_slot(&lease.key, &lease.token, scope).await,
        }
    }

    /// Sends a failed release again in the background: on a Redis Cluster whose shard is
    /// failing over the commit slot reached the replica, and a Redis that stalled (`CLIENT
    /// PAUSE`, a paused process) drops the release of a connection given up on while it
    /// stalled; either way the document's next write would otherwise wait until the slot
    /// lapses (the store timeout + a lease). Tried until the slot lapses
    /// by itself; safe to run late: it is sent as a re-sending (the turn mark changes only while
    /// the slot still holds this grant's token, and the slot goes only then), and the lock goes
    /// only while it still holds the token. A deletion's release is not sent again (a late one
    /// could clear the mark of a document written again meanwhile). Records are not carried:
    /// they are settled on their own.
    fn release_later(&self, key: &str, token: &str, slot: &SlotRelease) {
        let Locks::Redis(r) = self else { return };
        if matches!(slot.settled, Settled::Deleted) || !slot.give_back {
            return;
        }
        let (r, key, token, slot) = (r.clone(), key.to_owned(), token.to_owned(), slot.clone());
        let until = Instant::now() + r.settings.slot_ttl;
        tokio::spawn(async move {
            let again = || async { r.release_again(&key, &token, &slot).await.is_ok() };
            if crate::redis_conn::again_until(until, again).await {
                tracing::info!(slot = %slot.scope.slot(), "commit slot given back after a retry");
            }
        });
    }

    /// Whether the lock backend has left commands unanswered for longer than `limit`: a
    /// write that runs out of time then is answered `lock_unavailable`, not `session_busy`.
    pub fn stalled(&self, limit: Duration) -> bool {
        match self {
            Locks::Memory(_) => false,
            Locks::Redis(r) => r.conn().stalled_for() >= limit,
        }
    }

    /// Whether a lock backend error is worth waiting out within a write's deadline: on a
    /// Redis Cluster, a shard failing over has a new primary within seconds, and the other
    /// shards keep working. (A single Redis that fails is answered at once.)
    pub fn waits_out_failovers(&self) -> bool {
        match self {
            Locks::Memory(_) => false,
            Locks::Redis(r) => r.conn().is_cluster(),
        }
    }

    /// On a Redis Cluster, each primary checked on its own (see
    /// [`crate::redis_conn::RedisConn::cluster_health`]); `None` on any other backend.
    pub async fn cluster_health(
        &self,
        timeout: std::time::Duration,
    ) -> Option<Result<crate::redis_conn::ClusterHealth, LockError>> {
        match self {
            Locks::Redis(r) if r.conn().is_cluster() => Some(
                r.conn()
                    .cluster_health(timeout)
                    .await
                    .map_err(|e| LockError::Backend(e.to_string())),
            ),
            _ => None,
        }
    }

    /// Answers whether the backend is reachable.
    pub async fn ping(&self) -> Result<(), LockError> {
        match self {
            Locks::Memory(_) => Ok(()),
            Locks::Redis(r) => r.ping().await,
        }
    }

    fn held(&self) -> &DashMap<String, String> {
        match self {
            Locks::Memory(m) => &m.held,
            Locks::Redis(r) => &r.held,
        }
    }

    /// Releases every lock this process still holds (at shutdown, after the grace period).
    /// How many locks this process holds (what a shutdown would leave to expire).
    pub fn held_count(&self) -> usize {
        self.held().len()
    }

    /// How many releases have failed so far (each lock left to expire with its lease).
    pub fn release_failures(&self) -> usize {
        match self {
            Locks::Memory(_) => 0,
            Locks::Redis(r) => r.release_failures.load(Ordering::SeqCst),
        }
    }

    fn release_failed(&self) {
        if let Locks::Redis(r) = self {
            r.release_failures.fetch_add(1, Ordering::SeqCst);
        }
    }

    pub async fn release_all(&self) -> usize {
        let held: Vec<(String, String)> = self
            .held()
            .iter()
            .map(|e| (e.key().clone(), e.value().clone()))
            .collect();
        let mut released = 0;
        for (key, token) in held {
            match self.release_key(&key, &token).await {
                Ok(true) => released += 1,
                Ok(false) => {}
                Err(_) => self.release_failed(),
            }
            self.held().remove(&key);
        }
        released
    }

    fn lease(&self, key: &str, token: String, fence: u64, sent: Instant, slot: Option<Slot>) -> Lease {
        let lease_len = self.settings().lease;
        let state = Arc::new(LeaseState {
            lost: AtomicBool::new(false),
            expires: std::sync::Mutex::new(sent + safe_lease(lease_len)),
        });
        self.held().insert(key.to_owned(), token.clone());
        let renewal = tokio::spawn(renew_loop(
            self.clone(),
            key.to_owned(),
            token.clone(),
            lease_len,
            state.clone(),
        ));
        Lease {
            locks: self.clone(),
            key: key.to_owned(),
            token,
            fence,
            acquired: Instant::now(),
            slot: slot.map(|slot| (slot, sent)),
            state,
            renewal: Some(renewal),
            released: false,
        }
    }
}

/// A waiter's subscription to one lock's release.
pub(crate) struct Wake {
    notify: Option<Arc<tokio::sync::Notify>>,
    _guard: Option<Box<dyn Send + Sync>>,
}

impl Wake {
    pub(crate) fn new(notify: Arc<tokio::sync::Notify>, guard: Option<Box<dyn Send + Sync>>) -> Self {
        Self {
            notify: Some(notify),
            _guard: guard,
        }
    }

    /// Waits for a release, or `pause` at the most.
    async fn wait(self, pause: Duration) {
        match &self.notify {
            Some(n) => {
                let _ = tokio::time::timeout(pause, n.notified()).await;
            }
            None => tokio::time::sleep(pause).await,
        }
    }
}

fn jitter(d: Duration) -> Duration {
    let nanos = d.as_nanos() as u64;
    Duration::from_nanos(nanos / 2 + rand::random::<u64>() % (nanos / 2 + 1))
}

/// How often the in-memory backend drops expired entries.
pub fn memory_sweep_every() -> Duration {
    memory::SWEEP_EVERY
}
