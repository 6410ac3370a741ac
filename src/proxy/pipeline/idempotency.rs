//! The idempotency wrapper around the pipeline: a write with an `Idempotency-Key` claims the
//! key before it runs (or is answered from the key's record), and its final answer is stored
//! with the lock's release.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use http::header::HeaderValue;
use http::StatusCode;

use super::{Pending, Pipeline, Shared, MAX_ATTEMPTS};
use crate::proxy::answer::{Answer, Record};
use crate::proxy::error::WriteError;
use crate::redis_conn::Entry;

impl Shared {
    /// How long a claim lives: as long as its write can still run (the wait for the lock,
    /// every store round trip of every attempt, the lease's slack), plus a margin.
    pub(super) fn claim_ttl(&self) -> Duration {
        let s = self;
        let round_trips = 2 * (MAX_ATTEMPTS + 1);
        s.locks.settings().lease * 2
            + s.settings.wait
            // Each round trip: a wait for a store connection, then the store's answer.
            + s.settings.upstream_timeout * 2 * round_trips
            + Duration::from_secs(10)
    }
}

/// Stores `entries` now; what fails (Redis failing over, a connection cut) is stored again in
/// the background until Redis takes it or the claims it settles have expired by themselves.
/// Without this a claim whose write was answered with "nothing applied" would keep the key
/// `request_in_progress` for the claim's whole lifetime, and a final answer would not be
/// replayed. Each entry is safe to store twice: a compare-and-set on its claim (a record
/// stored meanwhile stays), or a snapshot keyed by its version.
pub(super) async fn settle(s: &Arc<Shared>, entries: Vec<Entry>) {
    if entries.is_empty() {
        return;
    }
    let Err(error) = s.records.put_entries(entries.clone()).await else {
        return;
    };
    settle_later(s, entries, error.to_string());
}

/// Stores `entries` in the background, as [`settle`] does after its first try failed.
pub(super) fn settle_later(s: &Arc<Shared>, entries: Vec<Entry>, error: String) {
    let until = Instant::now() + s.claim_ttl();
    let shared = s.clone();
    tracing::warn!(%error, entries = entries.len(), "idempotency records not stored: trying again in the background");
    // Not tracked: a drain does not wait for it (the claims expire by themselves).
    tokio::spawn(async move {
        let again = || async {
            let stored = shared.records.put_entries(entries.clone()).await;
            if let Err(e) = &stored {
                tracing::debug!(error = %e, "idempotency records still not stored");
            }
            stored.is_ok()
        };
        if crate::redis_conn::again_until(until, again).await {
            tracing::info!(entries = entries.len(), "idempotency records stored after a retry");
        } else {
            tracing::warn!(
                entries = entries.len(),
                "idempotency records never stored; their claims expire by themselves"
            );
        }
    });
}

/// Drops the claim a request that was answered "nothing applied" may still have stored: a
/// stalled Redis carries out the claim it had not answered in time once it resumes, and the
/// key would answer `request_in_progress` to every retry for the claim's whole life. Dropped
/// (only while it holds this claim) as soon as Redis answers again, and once more a moment
/// later: the late claim may run after the first drop, on another connection.
fn drop_late_claim(s: &Arc<Shared>, key: &str, claim: Bytes) {
    let entry = Entry {
        key: key.to_owned(),
        value: Bytes::new(),
        ttl: s.settings.idempotency_ttl,
        expect: Some(claim),
        refresh: false,
    };
    let (shared, until) = (s.clone(), Instant::now() + s.claim_ttl());
    tokio::spawn(async move {
        let mut answered = 0;
        let mut pause = Duration::from_millis(100);
        while answered < 2 && Instant::now() + pause < until {
            tokio::time::sleep(pause).await;
            match shared.records.put_entries(vec![entry.clone()]).await {
                Ok(()) => answered += 1,
                Err(_) => pause = (pause * 2).min(Duration::from_millis(400)),
            }
        }
    });
}

impl Pipeline {
    /// Claims an idempotency key (returning the claim stored), or answers from its record.
    ///
    /// On a cluster whose shard fails over, the claim is tried again until `deadline`, as the
    /// lock is: the shard has a new primary within seconds.
    pub(super) async fn claim(&self, key: &str, fingerprint: &str, deadline: Instant) -> Claim {
        let s = &self.shared;
        let claim_ttl = s.claim_ttl();
        // One round trip: the claim is stored, or the key's record comes back.
        let claim = Record::pending(fingerprint);
        let bytes = loop {
            match s.records.put_new_or_get(key, claim.clone(), claim_ttl).await {
                Err(_) if s.locks.waits_out_failovers() && Instant::now() + super::FAILOVER_PAUSE < deadline => {
                    tokio::time::sleep(super::FAILOVER_PAUSE).await;
                }
                Err(e) => {
                    if e.timed_out() {
                        drop_late_claim(s, key, claim);
                    }
                    return Claim::Answered(Answer::from(WriteError::LockUnavailable(e.to_string())));
                }
                Ok(None) => return Claim::Held(claim),
                // A try whose answer was lost stored it: the claim is this request's own.
                Ok(Some(bytes)) if bytes == claim => return Claim::Held(claim),
                Ok(Some(bytes)) => break bytes,
            }
        };
        let Some(record) = Record::parse(&bytes) else {
            return Claim::Answered(Answer::from(WriteError::RecordUnreadable));
        };
        if record.fingerprint != fingerprint {
            return Claim::Answered(Answer::from(WriteError::KeyReused));
        }
        Claim::Answered(match record.done {
            Some(stored) => {
                s.metrics.idempotent_replay();
                stored.answer().with_header(
                    http::HeaderName::from_static("idempotent-replayed"),
                    HeaderValue::from_static("true"),
                )
            }
            None => Answer::from(WriteError::InProgress),
        })
    }
}

/// The outcome of claiming an idempotency key.
pub(super) enum Claim {
    /// This request holds the key: the claim's exact value, to replace or drop it later only
    /// while it still holds.
    Held(Bytes),
    /// Answered from the key's record (a replay, a reuse with another payload, in progress).
    Answered(Answer),
}

/// The idempotency record of each write of a batch that holds a claim, to store with the
/// lock's release: its answer when final, else nothing (a retry may apply it).
pub(super) fn results<'a, W: 'a>(
    s: &'a Shared,
    settled: impl Iterator<Item = (&'a Pending<W>, &'a Answer)> + 'a,
    unknown_is_final: bool,
) -> impl Iterator<Item = Entry> + 'a {
    settled.filter_map(move |(p, a)| {
        let idem = p.idempotency.as_ref()?;
        let (key, claim) = p.claim.clone()?;
        // A serialized write whose outcome is unknown cannot be made idempotent by turnlock
        // (the store's own write is forwarded as is): its 504 is the answer a retry gets.
        let unknown = unknown_is_final && a.status == StatusCode::GATEWAY_TIMEOUT;
        let value = if a.is_final() || unknown {
            Record::done(&idem.fingerprint, a)?
        } else {
            // Nothing recorded: a retry may apply it (even if this client is gone).
            Bytes::new()
        };
        Some(Entry {
            key,
            value,
            ttl: s.settings.idempotency_ttl,
            expect: Some(claim),
            refresh: false,
        })
    })
}
