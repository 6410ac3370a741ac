//! A granted lock: its lease renewed in the background, checked before a write, and given
//! back with what was committed under it.

use super::*;

/// A granted lock. Renewed in the background while held; [`Lease::check`] says whether it can
/// still be trusted, and [`Lease::release`] gives it back. Dropping an unreleased lease
/// releases it in the background.
pub struct Lease {
    pub(super) locks: Locks,
    pub(super) key: String,
    pub(super) token: String,
    pub(super) fence: u64,
    pub(super) acquired: Instant,
    /// What the grant found of the commit slot it asked for, and when it was sent.
    pub(super) slot: Option<(Slot, Instant)>,
    pub(super) state: Arc<LeaseState>,
    pub(super) renewal: Option<tokio::task::JoinHandle<()>>,
    pub(super) released: bool,
}

pub(super) struct LeaseState {
    pub(super) lost: AtomicBool,
    /// Conservative local expiry: measured from before each grant or renewal was sent.
    pub(super) expires: std::sync::Mutex<Instant>,
}

/// The part of a lease trusted locally: a margin for clock drift and the renewal round trip.
pub(super) fn safe_lease(lease: Duration) -> Duration {
    lease.saturating_sub(lease / 10 + Duration::from_millis(2))
}

pub(super) async fn renew_loop(locks: Locks, key: String, token: String, lease: Duration, state: Arc<LeaseState>) {
    let period = (lease / 3).max(Duration::from_millis(1));
    loop {
        tokio::time::sleep(period).await;
        let sent = Instant::now();
        let result = locks.renew(&key, &token).await;
        if let Locks::Redis(r) = &locks {
            r.metrics.lock_renewed(matches!(result, Ok(true)));
        } else if let Locks::Memory(m) = &locks {
            m.metrics.lock_renewed(matches!(result, Ok(true)));
        }
        match result {
            Ok(true) => {
                if let Ok(mut expires) = state.expires.lock() {
                    *expires = sent + safe_lease(lease);
                }
            }
            Ok(false) => {
                tracing::warn!(%key, "lease lost: the lock is no longer held by this writer");
                state.lost.store(true, Ordering::SeqCst);
                return;
            }
            Err(error) => {
                tracing::warn!(%key, %error, "lease renewal failed; treating the lease as lost");
                state.lost.store(true, Ordering::SeqCst);
                return;
            }
        }
    }
}

// === impl Lease ===

impl Lease {
    pub fn fence(&self) -> u64 {
        self.fence
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// What the grant found of the commit slot it was asked to take, and when the grant was
    /// sent (the slot lives from then on); `None` when it was not asked to.
    pub fn slot_at_grant(&self) -> Option<(&Slot, Instant)> {
        self.slot.as_ref().map(|(slot, sent)| (slot, *sent))
    }

    /// Whether the lease can still be trusted: not reported lost, and not past its local
    /// expiry. A writer checks this right before it writes.
    pub fn check(&self) -> bool {
        if self.state.lost.load(Ordering::SeqCst) {
            return false;
        }
        match self.state.expires.lock() {
            Ok(expires) => Instant::now() < *expires,
            Err(_) => false,
        }
    }

    /// Gives the lock back; returns whether it was still held by this writer.
    pub async fn release(self, metrics: &Metrics) -> bool {
        self.release_with(metrics, Vec::new(), None).await.lock
    }

    /// Stores `records` (what was committed under the lock; only for a backend that
    /// [`Locks::carries_records`]), settles the commit slot taken under this lease (`slot`),
    /// and gives the lock back, in one round trip. A failure counts as neither given back:
    /// both expire by themselves.
    pub async fn release_with(mut self, metrics: &Metrics, records: Vec<Entry>, slot: Option<SlotRelease>) -> Released {
        self.released = true;
        if let Some(r) = self.renewal.take() {
            r.abort();
        }
        metrics.lock_held(self.acquired.elapsed());
        let result = self
            .locks
            .release_key_with(&self.key, &self.token, &records, slot.as_ref())
            .await;
        if result.is_err() && !records.is_empty() {
            tracing::warn!(
                key = %self.key,
                "idempotency records and version snapshot not stored with the release; stored again once Redis answers"
            );
        }
        self.locks.held().remove(&self.key);
        match result {
            Ok(released) => {
                if let (false, Some(slot)) = (released.slot, slot.as_ref().filter(|s| s.surely_held)) {
                    tracing::error!(
                        slot = %slot.scope.slot(),
                        "the write-back outlived its commit slot: a write of another turn may have been ordered before it landed"
                    );
                }
                released
            }
            Err(error) => {
                self.locks.release_failed();
                tracing::warn!(key = %self.key, %error, "lock release failed; it expires with its lease");
                if let Some(slot) = &slot {
                    tracing::warn!(
                        slot = %slot.scope.slot(),
                        "commit slot not given back; the document's next write waits until it expires"
                    );
                    self.locks.release_later(&self.key, &self.token, slot);
                }
                Released {
                    lock: false,
                    slot: false,
                    unsaved: records,
                }
            }
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(r) = self.renewal.take() {
            r.abort();
        }
        if !self.released {
            let locks = self.locks.clone();
            let key = std::mem::take(&mut self.key);
            let token = std::mem::take(&mut self.token);
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(async move {
                    let _ = locks.release_key(&key, &token).await;
                    locks.held().remove(&key);
                });
            }
        }
    }
}
