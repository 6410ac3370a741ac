//! A writer's hold on a document's commit slot (see `slot_take.lua`): taken by the grant
//! itself when it is free (`acquire.lua`), settled and given back with the lock
//! (`release.lua`), so an uncontended commit costs no Redis round trip of its own.

use std::time::Duration;

use tokio::time::Instant;

use super::Shared;
use crate::lock::{Lease, Settled, Slot, SlotRelease};
use crate::proxy::answer::Answer;
use crate::proxy::error::WriteError;
use crate::session::Scope;
use crate::upstream::Reserved;

/// A writer's hold on a document's commit slot, for the length of one grant.
pub(super) struct SlotHold {
    pub(super) scope: Scope,
    /// When the slot was last taken or extended by this writer.
    pub(super) since: Option<Instant>,
    /// The document's turn mark, as read when the slot was last taken.
    pub(super) turn_mark: u64,
    /// Whether this writer took the slot under this grant (it then settles it at the release).
    taken: bool,
    /// What the store did with the writes made under the slot so far.
    settled: Settled,
    /// A write's outcome is unknown: the slot is left to expire by itself at the release.
    abandoned: bool,
    /// A take Redis did not answer: it may still run (a stalled Redis carries out what it
    /// had not answered once it resumes) and give this writer the slot, so the release gives
    /// it back if it holds it.
    maybe_taken: bool,
}

impl SlotHold {
    /// The hold as the grant left it: taken when the slot was free then.
    pub(super) fn from_grant(scope: Scope, lease: &Lease) -> Self {
        let (since, turn_mark) = match lease.slot_at_grant() {
            Some((Slot::Taken { turn_mark }, sent)) => (Some(sent), *turn_mark),
            _ => (None, 0),
        };
        Self {
            scope,
            since,
            turn_mark,
            taken: since.is_some(),
            settled: Settled::Unchanged,
            abandoned: false,
            maybe_taken: false,
        }
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
                    self.taken = true;
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
                Err(_) if s.locks.waits_out_failovers() => {
                    self.maybe_taken = true;
                    return Err(Answer::from(WriteError::CommitInFlight));
                }
                Err(e) => {
                    self.maybe_taken = true;
                    return Err(Answer::from(WriteError::LockUnavailable(e.to_string())));
                }
            }
        }
    }

    /// A store connection for a write made under the slot, then the slot held (extended when
    /// it was taken more than half a lease ago): the wait for a connection at the cap is not
    /// taken from the slot's life, which so outlives the store's answer to a write sent now.
    /// A write that gets no connection in time was never sent (502, nothing written).
    /// With `fresh`, the connection is a new one (see [`crate::upstream::Upstream::reserve_fresh`]).
    pub(super) async fn reserve(&mut self, s: &Shared, lease: &Lease, fresh: bool) -> Result<Reserved, Answer> {
        let conn = if fresh {
            s.upstream.reserve_fresh().await
        } else {
            s.upstream.reserve().await
        };
        let conn = conn.map_err(|e| Answer::from(WriteError::Upstream(e)))?;
        self.hold(s, lease).await?;
        Ok(conn)
    }

    /// Records what the store did with a write made under the slot (stored at the release).
    pub(super) fn settle(&mut self, settled: Settled) {
        self.settled = self.settled.then(settled);
    }

    /// A write's outcome is unknown (it may still land): the slot is not given back but left
    /// to expire by itself, after the write can have landed, and no commit of the document is
    /// ordered after it until then. A later write of the batch takes the slot anew.
    pub(super) fn abandon(&mut self) {
        self.abandoned = true;
        self.since = None;
    }

    /// What the lock's release does with the slot: `None` when it was never taken.
    pub(super) fn into_release(self) -> Option<SlotRelease> {
        (self.taken || self.maybe_taken).then_some(SlotRelease {
            scope: self.scope,
            settled: self.settled,
            give_back: !self.abandoned,
            surely_held: self.taken,
        })
    }
}
