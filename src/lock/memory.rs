//! The in-memory lock backend: the same semantics as Redis, for one process.

use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{Attempt, LockSettings, Reservation, Wake};
use crate::metrics::Metrics;

pub struct MemoryLocks {
    pub(super) settings: LockSettings,
    pub(super) metrics: Metrics,
    pub(super) held: DashMap<String, String>,
    locks: DashMap<String, Holder>,
    wakers: DashMap<String, Arc<Notify>>,
    counters: DashMap<String, u64>,
    pending: DashMap<String, Holder>,
}

struct Holder {
    token: String,
    expires: Instant,
}

impl MemoryLocks {
    pub fn new(settings: LockSettings, metrics: Metrics) -> Self {
        Self {
            settings,
            metrics,
            held: DashMap::new(),
            locks: DashMap::new(),
            wakers: DashMap::new(),
            counters: DashMap::new(),
            pending: DashMap::new(),
        }
    }

    pub(super) fn try_acquire(&self, key: &str, fence_key: &str, token: &str) -> Attempt {
        let now = Instant::now();
        let lease = self.settings.lease;
        let mut entry = self.locks.entry(key.to_owned()).or_insert_with(|| Holder {
            token: String::new(),
            expires: now,
        });
        if !entry.token.is_empty() && entry.expires > now {
            return Attempt::Held {
                remaining: entry.expires - now,
            };
        }
        *entry = Holder {
            token: token.to_owned(),
            expires: now + lease,
        };
        drop(entry);
        let mut counter = self.counters.entry(fence_key.to_owned()).or_insert(0);
        *counter += 1;
        Attempt::Granted { fence: *counter }
    }

    pub(super) fn watch(&self, key: &str) -> Wake {
        let notify = self.wakers.entry(key.to_owned()).or_default().clone();
        Wake::new(notify, None)
    }

    pub(super) fn renew(&self, key: &str, token: &str) -> bool {
        let now = Instant::now();
        match self.locks.get_mut(key) {
            Some(mut h) if h.token == token && h.expires > now => {
                h.expires = now + self.settings.lease;
                true
            }
            _ => false,
        }
    }

    pub(super) fn release(&self, key: &str, token: &str) -> bool {
        let removed = self
            .locks
            .remove_if(key, |_, h| h.token == token && h.expires > Instant::now())
            .is_some();
        // Drop expired entries of this key too, so the map does not grow.
        self.locks.remove_if(key, |_, h| h.expires <= Instant::now());
        if let Some((_, notify)) = self.wakers.remove(key) {
            notify.notify_one();
        }
        removed
    }

    pub(super) fn reserve_version(
        &self,
        lock_key: &str,
        token: &str,
        version_key: &str,
        pending_key: &str,
        read_version: u64,
    ) -> Reservation {
        let now = Instant::now();
        let holds = self
            .locks
            .get(lock_key)
            .is_some_and(|h| h.token == token && h.expires > now);
        if !holds {
            return Reservation::LeaseLost;
        }
        let committed = self.counters.get(version_key).map(|v| *v).unwrap_or(0);
        if committed > read_version {
            return Reservation::NewerCommitted;
        }
        let mut pending = self.pending.entry(pending_key.to_owned()).or_insert_with(|| Holder {
            token: String::new(),
            expires: now,
        });
        if !pending.token.is_empty() && pending.token != token && pending.expires > now {
            return Reservation::InFlight;
        }
        *pending = Holder {
            token: token.to_owned(),
            expires: now + self.settings.lease,
        };
        Reservation::Reserved
    }

    pub(super) fn settle_version(&self, token: &str, version_key: &str, pending_key: &str, stored: Option<u64>) {
        if let Some(v) = stored {
            let mut committed = self.counters.entry(version_key.to_owned()).or_insert(0);
            *committed = (*committed).max(v);
        }
        self.pending.remove_if(pending_key, |_, h| h.token == token);
    }

    pub(super) fn turn_mark(&self, key: &str) -> u64 {
        self.counters.get(key).map(|v| *v).unwrap_or(0)
    }

    pub(super) fn raise_turn_mark(&self, key: &str, turn: u64) {
        let mut mark = self.counters.entry(key.to_owned()).or_insert(0);
        *mark = (*mark).max(turn);
    }

    /// Drops expired locks (called periodically so abandoned keys do not accumulate).
    pub fn sweep(&self) {
        let now = Instant::now();
        self.locks.retain(|_, h| h.expires > now);
        self.pending.retain(|_, h| h.expires > now);
        self.wakers.retain(|_, n| Arc::strong_count(n) > 1);
    }

    /// How many locks are held right now (for tests and the admin view).
    pub fn held_count(&self) -> usize {
        let now = Instant::now();
        self.locks.iter().filter(|h| h.expires > now).count()
    }
}

/// How often the in-memory backend drops expired entries.
pub const SWEEP_EVERY: Duration = Duration::from_secs(5);
