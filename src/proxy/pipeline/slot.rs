//! A writer's hold on a document's commit slot (see `slot_take.lua`).

use std::time::Duration;

use tokio::time::Instant;

use super::Shared;
use crate::lock::{Lease, Settled, Slot};
use crate::proxy::answer::Answer;
use crate::proxy::error::WriteError;
use crate::session::Scope;

/// A writer's hold on a document's commit slot.
pub(super) struct SlotHold {
    pub(super) scope: Scope,
    /// When the slot was last taken or extended by this writer.
    pub(super) since: Option<Instant>,
    /// The document's turn mark, as read when the slot was last taken.
    pub(super) turn_mark: u64,
}

impl SlotHold {
    pub(super) fn new(scope: Scope) -> Self {
        Self {
            scope,
            since: None,
            turn_mark: 0,
        }
    }

    pub(super) fn held(&self) -> bool {
        self.since.is_some()
    }

    /// Takes the slot, or extends it when it was taken more than half a lease ago, so that
    /// it outlives a write-back started now (the slot lives the store timeout plus a lease).
    /// Waits for another writer's commit in flight for the lock budget (at most half a lease):
    /// the lock is held meanwhile. A write that gives up is queued again (`write_conflict`).
    pub(super) async fn hold(&mut self, s: &Shared, lease: &Lease) -> Result<(), Answer> {
        let half = s.locks.settings().lease / 2;
        if self.since.is_some_and(|t| t.elapsed() < half) {
            return Ok(());
        }
        let give_up = Instant::now() + half.min(s.settings.budget);
        let mut pause = Duration::from_millis(1);
        loop {
            let sent = Instant::now();
            match s.locks.take_slot(lease, &self.scope).await {
                Ok(Slot::Taken { turn_mark }) => {
                    self.since = Some(sent);
                    self.turn_mark = turn_mark;
                    return Ok(());
                }
                Ok(Slot::LeaseLost) => return Err(Answer::from(WriteError::LeaseLost)),
                Ok(Slot::InFlight { remaining }) => {
                    let now = Instant::now();
                    if now >= give_up {
                        return Err(Answer::from(WriteError::CommitInFlight));
                    }
                    tokio::time::sleep(pause.min(remaining).min(give_up - now)).await;
                    pause = (pause * 2).min(Duration::from_millis(20));
                }
                // Nothing was written: on a cluster failing over, the write is queued again
                // (as after another turn's commit) to wait for the new primary.
                Err(_) if s.locks.waits_out_failovers() => return Err(Answer::from(WriteError::CommitInFlight)),
                Err(e) => return Err(Answer::from(WriteError::LockUnavailable(e.to_string()))),
            }
        }
    }

    /// Gives the slot back (when held), recording what the store did. A failure is logged:
    /// the slot then expires by itself, and nothing is lost, but the document waits for it.
    pub(super) async fn release(&mut self, s: &Shared, lease: &Lease, settled: Settled) {
        if self.since.take().is_none() {
            return;
        }
        match s.locks.release_slot(lease, &self.scope, settled).await {
            Ok(true) => {}
            Ok(false) => tracing::error!(
                slot = %self.scope.slot(),
                "the write-back outlived its commit slot: a write of another turn may have been ordered before it landed"
            ),
            Err(error) => {
                tracing::warn!(
                    slot = %self.scope.slot(),
                    %error,
                    "commit slot not given back; the document's next write waits until it expires"
                );
                s.locks.release_slot_later(lease, &self.scope, settled);
            }
        }
    }
}
