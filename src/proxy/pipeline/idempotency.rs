//! The idempotency wrapper around the pipeline: a write with an `Idempotency-Key` claims the
//! key before it runs (or is answered from the key's record), and its final answer is stored
//! with the lock's release.

use std::time::Duration;

use bytes::Bytes;
use http::header::HeaderValue;
use http::StatusCode;

use super::{Pending, Pipeline, Shared, MAX_ATTEMPTS};
use crate::proxy::answer::{Answer, Record};
use crate::proxy::error::WriteError;
use crate::redis_conn::Entry;

impl Pipeline {
    /// How long a claim lives: as long as its write can still run (the wait for the lock,
    /// every store round trip of every attempt, the lease's slack), plus a margin.
    pub(super) fn claim_ttl(&self) -> Duration {
        let s = &self.shared;
        let round_trips = 2 * (MAX_ATTEMPTS + 1);
        s.locks.settings().lease * 2
            + s.settings.wait
            + s.settings.upstream_timeout * round_trips
            + Duration::from_secs(10)
    }

    /// Claims an idempotency key (returning the claim stored), or answers from its record.
    pub(super) async fn claim(&self, key: &str, fingerprint: &str) -> Claim {
        let s = &self.shared;
        let claim_ttl = self.claim_ttl();
        // One round trip: the claim is stored, or the key's record comes back.
        let claim = Record::pending(fingerprint);
        let bytes = match s.records.put_new_or_get(key, claim.clone(), claim_ttl).await {
            Err(e) => return Claim::Answered(Answer::from(WriteError::LockUnavailable(e.to_string()))),
            Ok(None) => return Claim::Held(claim),
            Ok(Some(bytes)) => bytes,
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
        })
    })
}
