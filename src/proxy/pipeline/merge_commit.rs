//! The merge commit: read the document once, apply the batch's writes in order, write it back
//! once under the store's `If-Match` (or the commit slot, for a store without ETags).

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::StatusCode;
use serde_json::json;
use tokio::time::Instant;

use super::errors::refused;
use super::queue::{lock, Pending, Queue};
use super::slot::SlotHold;
use super::{Shared, MAX_ATTEMPTS};
use crate::http::etag_for;
use crate::lock::{Lease, Settled};
use crate::merge::{self, BatchDoc, DigestCache, Document, Finished, MergeError, Op, RandomIds, RawBatch, Snapshot};
use crate::proxy::answer::Answer;
use crate::proxy::error::WriteError;
use crate::redis_conn::Entry;
use crate::session::{Scope, SessionId};
use crate::upstream::{Precondition, UpstreamError};

pub(super) async fn merge_batch(
    s: &Shared,
    queue: &Queue<Op>,
    lease: &Lease,
    batch: &[Pending<Op>],
    records: &mut Vec<Entry>,
) -> Vec<Answer> {
    let mut slot = SlotHold::new(queue.scope.clone());
    let (answers, outcome_unknown) = merge_attempts(s, queue, lease, batch, records, &mut slot).await;
    // When the outcome is unknown the slot is left to expire: the write may still land, and
    // no commit of this document is ordered after it until then.
    if !outcome_unknown {
        slot.release(s, lease, Settled::Unchanged).await;
    }
    answers
}

/// How a write-back is fenced against another writer's commit of the same document.
#[derive(Debug)]
enum Fence {
    /// The store's entity tag as read: a commit in between makes the store answer 412.
    IfMatch(HeaderValue),
    /// No document was read: the write may only create it.
    CreateOnly,
    /// The store gives no entity tags: the document's commit slot in Redis, held from
    /// before the read until the store answered, orders the commits.
    CommitSlot,
}

impl Fence {
    /// The fence for a write-back of what was read; `None` when the read does not allow one
    /// (a document without an entity tag read outside the commit slot: read it again under
    /// the slot).
    fn after_read(found: bool, etag: Option<HeaderValue>, slot_held: bool) -> Option<Self> {
        match (found, etag) {
            (false, _) => Some(Self::CreateOnly),
            (true, Some(tag)) => Some(Self::IfMatch(tag)),
            (true, None) => slot_held.then_some(Self::CommitSlot),
        }
    }

    fn precondition(self) -> Precondition {
        match self {
            Self::IfMatch(tag) => Precondition::IfMatch(tag),
            Self::CreateOnly => Precondition::Absent,
            Self::CommitSlot => Precondition::None,
        }
    }
}

pub(super) async fn merge_attempts(
    s: &Shared,
    queue: &Queue<Op>,
    lease: &Lease,
    batch: &[Pending<Op>],
    records: &mut Vec<Entry>,
    slot: &mut SlotHold,
) -> (Vec<Answer>, bool) {
    let started = Instant::now();
    let session = &queue.session;
    let path = queue.path.as_str();
    let mut attempt = 0;
    loop {
        attempt += 1;
        // Without ETags the document is read under its commit slot: what is read is then the
        // latest commit (or what the store holds after a change made behind turnlock's back,
        // such as a delete), and nothing is committed between this read and this write.
        if !s.etags_seen.load(Ordering::Relaxed) {
            if let Err(answer) = slot.hold(s, lease).await {
                return (vec![answer; batch.len()], false);
            }
        }
        let fetched = match s.upstream.get_document_raw(path).await {
            Ok(f) => f,
            Err(e) => return (vec![Answer::from(WriteError::Upstream(e)); batch.len()], false),
        };
        if fetched.etag.is_some() {
            s.etags_seen.store(true, Ordering::Relaxed);
        }
        let Some(fence) = Fence::after_read(fetched.body.is_some(), fetched.etag, slot.held()) else {
            // A document without an ETag from a store that gave them: read again under the slot.
            if let Err(answer) = slot.hold(s, lease).await {
                return (vec![answer; batch.len()], false);
            }
            continue;
        };
        let created = fetched.body.is_none();
        // A batch of appends to a stored document is merged on the store's raw JSON; any
        // other batch (or a document the raw merge does not take) on parsed values.
        let digests = s.digest_cache(path);
        let raw = fetched
            .body
            .as_deref()
            .filter(|_| batch.iter().all(|p| matches!(p.write, Op::Append { .. })))
            .and_then(|bytes| RawBatch::parse(session, bytes, &lock(&digests)));
        let (merged, results, current_version) = match raw {
            Some(mut doc) => {
                let version = doc.version();
                let results: Vec<_> = batch
                    .iter()
                    .map(|p| match &p.write {
                        Op::Append { messages } => doc.append(queue.turn, messages, &mut RandomIds),
                        _ => Err(MergeError::NotFound),
                    })
                    .collect();
                (Merged::Raw(doc), results, version)
            }
            None => {
                let current = match fetched.body.as_deref().map(crate::upstream::parse_document).transpose() {
                    Ok(current) => current,
                    Err(e) => return (vec![Answer::from(WriteError::Upstream(e)); batch.len()], false),
                };
                let current_version = current.as_ref().map(merge::version_of).unwrap_or(0);
                let bases = load_bases(s, &queue.scope, batch, current.as_ref()).await;
                let (doc, results) = apply_batch(session, queue.turn, current, batch, &bases);
                (Merged::Values(doc), results, current_version)
            }
        };
        let refusals = |results: Vec<Result<merge::Applied, MergeError>>, on_ok: &Answer| -> Vec<Answer> {
            results
                .into_iter()
                .map(|r| match r {
                    Ok(_) => on_ok.clone(),
                    Err(e) => refused(s, e),
                })
                .collect()
        };
        if !results.iter().any(Result::is_ok) {
            let on_ok = Answer::from(WriteError::Internal("nothing to write"));
            return (refusals(results, &on_ok), false);
        }
        // The slot must outlive the write-back: extended when the read took long.
        if slot.held() {
            if let Err(answer) = slot.hold(s, lease).await {
                return (refusals(results, &answer), false);
            }
        }
        if !lease.check() {
            return (refusals(results, &Answer::from(WriteError::LeaseLost)), false);
        }
        // One write-back: the whole batch is one new version, whatever it merged.
        let new_version = current_version + 1;
        // A document gets its life when turnlock first writes it (see `merge::LIFE`).
        let (written, body) = merged.finish(new_version, lease.fence());
        if body.len() > s.settings.max_document_bytes {
            return (
                refusals(
                    results,
                    &Answer::from(WriteError::DocumentTooLarge {
                        size: body.len(),
                        limit: s.settings.max_document_bytes,
                    }),
                ),
                false,
            );
        }
        match s
            .upstream
            .put_document(path, body, &fence.precondition(), lease.fence())
            .await
        {
            Ok(etag) => {
                // Only a merged PUT reads a snapshot back: without such a route none is kept.
                if s.settings.snapshots {
                    let snapshot = written.snapshot(new_version, &mut lock(&digests));
                    records.push(Entry {
                        key: queue.scope.history(new_version),
                        value: Bytes::from(serde_json::to_vec(&snapshot).unwrap_or_default()),
                        ttl: s.settings.history_ttl,
                        expect: None,
                    });
                }
                let status = if created { StatusCode::CREATED } else { StatusCode::OK };
                let etag = etag.unwrap_or_else(|| etag_for(new_version));
                let turn = written.turn();
                let answers = results
                    .into_iter()
                    .map(|r| match r {
                        Ok(applied) => Answer::json(
                            status,
                            &json!({"session": session.as_str(), "turn": turn, "version": new_version, "message_ids": applied.message_ids}),
                        )
                        .with_header(header::ETAG, etag.clone()),
                        Err(e) => refused(s, e),
                    })
                    .collect();
                return (answers, false);
            }
            Err(UpstreamError::PreconditionFailed) => {
                // Decided now, not before the write-back: a re-read must start within the lease.
                if attempt < MAX_ATTEMPTS && started.elapsed() < s.locks.settings().lease / 2 {
                    continue;
                }
                return (refusals(results, &Answer::from(WriteError::KeptMoving)), false);
            }
            Err(e) => {
                if let Some(suppressed) = crate::telemetry::warn_allowed("write-back failed") {
                    tracing::warn!(error = %e, suppressed, "write-back to the context store failed");
                }
                let unknown = e.outcome_unknown();
                return (refusals(results, &Answer::from(WriteError::Upstream(e))), unknown);
            }
        }
    }
}

/// A batch merged, to write back.
enum Merged<'a> {
    Values(Document),
    Raw(RawBatch<'a>),
}

/// A batch merged and written out at its new version.
enum Written<'a> {
    Values(Document),
    Raw(Finished<'a>),
}

impl<'a> Merged<'a> {
    /// Sets the version (and the life, when the document has none) and writes the document out.
    fn finish(self, version: u64, life: u64) -> (Written<'a>, Bytes) {
        match self {
            Merged::Values(mut doc) => {
                doc.insert("version".into(), json!(version));
                doc.entry(merge::LIFE).or_insert_with(|| json!(life));
                let body = Bytes::from(serde_json::to_vec(&doc).unwrap_or_default());
                (Written::Values(doc), body)
            }
            Merged::Raw(doc) => {
                let mut finished = doc.finish(version, life);
                let body = Bytes::from(std::mem::take(&mut finished.body));
                (Written::Raw(finished), body)
            }
        }
    }
}

impl Written<'_> {
    fn turn(&self) -> u64 {
        match self {
            Written::Values(doc) => merge::turn_of(doc),
            Written::Raw(doc) => doc.turn(),
        }
    }

    fn snapshot(&self, version: u64, cache: &mut DigestCache) -> Snapshot {
        match self {
            Written::Values(doc) => Snapshot::of(doc),
            Written::Raw(doc) => doc.snapshot(version, cache),
        }
    }
}

/// Applies a batch's writes one after another, in place, to the document read (`None` when
/// absent): one document per batch, never copied for an append, each write getting its own
/// result.
pub(super) fn apply_batch(
    session: &SessionId,
    turn: u64,
    current: Option<Document>,
    batch: &[Pending<Op>],
    bases: &HashMap<u64, Snapshot>,
) -> (Document, Vec<Result<merge::Applied, MergeError>>) {
    let mut doc = BatchDoc::new(session, current, &mut RandomIds);
    let results = batch
        .iter()
        .map(|p| {
            let base = match &p.write {
                Op::Put {
                    base_version: Some(v), ..
                } => bases.get(v),
                _ => None,
            };
            doc.apply(turn, &p.write, base, &mut RandomIds)
        })
        .collect();
    (doc.into_document(), results)
}

/// The snapshots of the versions that merged PUTs in the batch were based on. The current
/// version's is among them: a PUT that follows another write in the same batch no longer
/// finds its base as the document it is applied to. A base newer than the current document
/// cannot be of its present life (it was read before a delete, and stores may reuse version
/// numbers): its snapshot is never loaded, and the PUT is refused as based on an unknown
/// version.
pub(super) async fn load_bases(
    s: &Shared,
    scope: &Scope,
    batch: &[Pending<Op>],
    current: Option<&Document>,
) -> HashMap<u64, Snapshot> {
    let current_version = current.map(merge::version_of).unwrap_or(0);
    let mut bases = HashMap::new();
    for p in batch {
        if let Op::Put {
            base_version: Some(v), ..
        } = &p.write
        {
            let v = *v;
            if v == 0 || v > current_version || bases.contains_key(&v) {
                continue;
            }
            if v == current_version {
                if let Some(doc) = current {
                    bases.insert(v, Snapshot::of(doc));
                }
                continue;
            }
            if let Ok(Some(bytes)) = s.records.get(&scope.history(v)).await {
                if let Ok(snap) = serde_json::from_slice::<Snapshot>(&bytes) {
                    bases.insert(v, snap);
                }
            }
        }
    }
    bases
}
