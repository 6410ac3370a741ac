//! The in-memory lock backend: the same semantics as Redis, for one process.

use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{Attempt, LockSettings, Settled, Slot, SlotRelease, Wake};
use crate::metrics::Metrics;
use crate::session::Scope;

pub struct MemoryLocks {
    pub(super) settings: LockSettings,
    pub(super) metrics: Metrics,
    pub(super) held: DashMap<String, String>,
    locks: DashMap<String, Holder>,
    wakers: DashMap<String, Arc<Notify>>,
    /// Fencing counters and turn marks, each with its expiry (refreshed by writes).
    counters: DashMap<String, Counter>,
    pending: DashMap<String, Holder>,
}

struct Counter {
    value: u64,
    expires: Instant,
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

    pub(super) fn try_acquire(&self, key: &str, fence_key: &str, token: &str, slot: Option<&Scope>) -> Attempt {
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
        // Like Redis: the larger of the counter + 1 and the clock in microseconds, so tokens
        // keep growing across a restart of the process.
        let micros = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        let fence = (self.counter(fence_key) + 1).max(micros);
        self.set_counter(fence_key, fence);
        // Like Redis: the grant takes the document's commit slot when it is free.
        let slot = slot.map(|scope| self.take_slot(key, token, scope));
        Attempt::Granted { fence, slot }
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

    pub(super) fn take_slot(&self, lock_key: &str, token: &str, scope: &Scope) -> Slot {
        let now = Instant::now();
        let holds = self
            .locks
            .get(lock_key)
            .is_some_and(|h| h.token == token && h.expires > now);
        if !holds {
            return Slot::LeaseLost;
        }
        let mut slot = self.pending.entry(scope.slot()).or_insert_with(|| Holder {
            token: String::new(),
            expires: now,
        });
        if !slot.token.is_empty() && slot.token != token && slot.expires > now {
            return Slot::InFlight {
                remaining: slot.expires - now,
            };
        }
        *slot = Holder {
            token: token.to_owned(),
            expires: now + self.settings.slot_ttl,
        };
        drop(slot);
        Slot::Taken {
            turn_mark: self.counter(&scope.turn_mark()),
        }
    }

    /// Settles a commit slot at its lock's release (see `release.lua`): records what the store
    /// did, then gives the slot back unless it is kept. Returns whether it was still this
    /// owner's (`true` when kept).
    pub(super) fn release_slot(&self, token: &str, release: &SlotRelease) -> bool {
        let scope = &release.scope;
        match release.settled {
            Settled::Unchanged => {}
            Settled::Accepted(turn) => {
                let key = scope.turn_mark();
                let mark = self.counter(&key).max(turn);
                self.set_counter(&key, mark);
            }
            Settled::Deleted => {
                self.counters.remove(&scope.turn_mark());
            }
        }
        if !release.give_back {
            return true;
        }
        let now = Instant::now();
        self.pending
            .remove_if(&scope.slot(), |_, h| h.token == token && h.expires > now)
            .is_some()
    }

    /// A counter's value; 0 when absent or expired.
    fn counter(&self, key: &str) -> u64 {
        let now = Instant::now();
        self.counters
            .get(key)
            .filter(|c| c.expires > now)
            .map(|c| c.value)
            .unwrap_or(0)
    }

    fn set_counter(&self, key: &str, value: u64) {
        let expires = Instant::now() + self.settings.key_ttl;
        self.counters.insert(key.to_owned(), Counter { value, expires });
    }

    /// Drops expired locks (called periodically so abandoned keys do not accumulate).
    pub fn sweep(&self) {
        let now = Instant::now();
        self.counters.retain(|_, c| c.expires > now);
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
