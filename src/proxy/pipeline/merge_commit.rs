//! The merge commit: read the document once under its commit slot, apply the batch's writes in
//! order, write it back once (under the store's `If-Match` too, when it gives ETags).

use std::collections::HashMap;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::StatusCode;
use serde_json::json;
use tokio::time::Instant;

use super::errors::refused;
use super::queue::{lock, Pending, Queue};
use super::slot::SlotHold;
use super::store_fields;
use super::{MergeWrite, Shared, MAX_ATTEMPTS};
use crate::http::etag_for;
use crate::lock::Lease;
use crate::merge::{
    self, history, BatchDoc, DigestCache, Digested, Document, Finished, MergeError, Op, RandomIds, RawBatch, Snapshot,
};
use crate::proxy::answer::Answer;
use crate::proxy::error::WriteError;
use crate::redis_conn::Entry;
use crate::routes::{Dialect, VersionAt};
use crate::session::{Scope, SessionId};
use crate::upstream::{Precondition, StoreParts, UpstreamError};

pub(super) async fn merge_batch(
    s: &Shared,
    queue: &Queue<MergeWrite>,
    lease: &Lease,
    batch: &[Pending<MergeWrite>],
    records: &mut Vec<Entry>,
    slot: &mut SlotHold,
) -> Vec<Answer> {
    let (answers, outcome_unknown) = merge_attempts(s, queue, lease, batch, records, slot).await;
    // When the outcome is unknown the slot is left to expire: the write may still land, and
    // no commit of this document is ordered after it until then. Otherwise it goes back with
    // the lock, the turn mark unchanged (a merged document carries its own turn).
    if outcome_unknown {
        slot.abandon();
    }
    answers
}

/// How a write-back is fenced against another writer's commit of the same document, on top
/// of the document's commit slot in Redis (held from before the read until the store
/// answered, for every merge commit: a store's `If-Match` may be weak or checked apart from
/// the write, and never orders commits alone).
#[derive(Debug)]
enum Fence {
    /// The store's entity tag as read: a commit in between makes the store answer 412.
    IfMatch(HeaderValue),
    /// No document was read: the write may only create it.
    CreateOnly,
    /// The commit slot alone: the store gives no entity tags, or keeps the version in the
    /// document (`_rev`, written back in the body).
    CommitSlot,
}

impl Fence {
    /// The fence for a write-back of what was read, in the store's dialect (see
    /// [`store_fields::precondition`]).
    fn after_read(dialect: &Dialect, found: bool, etag: Option<HeaderValue>) -> Self {
        match store_fields::precondition(dialect, found, etag) {
            Precondition::IfMatch(tag) => Self::IfMatch(tag),
            Precondition::Absent => Self::CreateOnly,
            Precondition::None => Self::CommitSlot,
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
    queue: &Queue<MergeWrite>,
    lease: &Lease,
    batch: &[Pending<MergeWrite>],
    records: &mut Vec<Entry>,
    slot: &mut SlotHold,
) -> (Vec<Answer>, bool) {
    let started = Instant::now();
    let session = &queue.session;
    let path = queue.path.as_str();
    let mut attempt = 0;
    loop {
        attempt += 1;
        // The document is read under its commit slot, whether or not the store gives ETags:
        // writers of different turns hold different locks, and a store's `If-Match` may be
        // weak (an ETag of size and whole-second mtime) or checked apart from the write. What
        // is read is then the latest commit (or what the store holds after a change made
        // behind turnlock's back, such as a delete), and nothing is committed between this
        // read and this write; the store's precondition is checked on top.
        if let Err(answer) = slot.hold(s, lease).await {
            return (vec![answer; batch.len()], false);
        }
        let store = store_parts(batch);
        let dialect = store.dialect;
        // The read's connection is kept for the write-back: at the connection cap a write
        // queues once, not once for its read and again for its write-back (its lock held).
        let read = async {
            let mut conn = s.upstream.reserve().await?;
            let fetched = s.upstream.get_document_raw_on(&mut conn, path, store).await?;
            Ok((conn, fetched))
        };
        let (conn, fetched) = match read.await {
            Ok(read) => read,
            Err(e) => return (vec![Answer::from(WriteError::ReadFailed(e)); batch.len()], false),
        };
        let created = fetched.body.is_none();
        let fence = Fence::after_read(dialect, !created, fetched.etag.clone());
        // A batch of appends to a stored document is merged on the store's raw JSON; any
        // other batch (or a document the raw merge does not take) on parsed values. The raw
        // merge keeps every field as stored, so a dialect with fields of its own (`_id`,
        // `_rev`: set apart before the merge, the version put back in the body), a write
        // naming the store's own entity tag, and writes without a turn (merged at the stored
        // turn) take the parsed path. Reads and write-backs are signed either way.
        let digests = s.digest_cache(path);
        let raw_fits = queue.turn_given
            && dialect.managed_fields.is_empty()
            && matches!(dialect.version, VersionAt::EtagHeader)
            && batch
                .iter()
                .all(|p| matches!(p.write.op, Op::Append { .. }) && p.write.store.if_match.is_none());
        let raw = fetched
            .body
            .as_deref()
            .filter(|_| raw_fits)
            .and_then(|bytes| RawBatch::parse(session, bytes, &mut lock(&digests)));
        let (merged, results, current_version) = match raw {
            Some(mut doc) => {
                let version = doc.version();
                let results: Vec<_> = batch
                    .iter()
                    .map(|p| match &p.write.op {
                        Op::Append { messages } => doc.append(queue.turn, messages, &mut RandomIds),
                        _ => Err(MergeError::NotFound),
                    })
                    .collect();
                (Merged::Raw(Box::new(doc)), results, version)
            }
            None => {
                let current = match fetched.body.as_deref().map(crate::upstream::parse_document).transpose() {
                    Ok(current) => current,
                    Err(e) => return (vec![Answer::from(WriteError::Upstream(e)); batch.len()], false),
                };
                // The store's own fields are the store's: out of the merge, put back on the write.
                let (mut current, managed) = store_fields::split(dialect, current);
                let tag = store_fields::version_tag(dialect, fetched.etag.as_ref(), &managed);
                let mut bases = load_bases(s, &queue.scope, batch, current.as_ref()).await;
                changed_behind_our_back(s, &queue.scope, batch, &mut current, &mut bases).await;
                let current_version = current.as_ref().map(merge::version_of).unwrap_or(0);
                let turn = queue.turn_given.then_some(queue.turn);
                let (doc, results) = apply_batch(session, turn, current, tag.as_ref(), batch, &bases);
                (Merged::Values(doc, managed), results, current_version)
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
        // The slot must outlive the write-back: extended when the read took long (the
        // write-back's connection is in hand: no wait comes between this and its send).
        if let Err(answer) = slot.hold(s, lease).await {
            return (refusals(results, &answer), false);
        }
        if !lease.check() {
            return (refusals(results, &Answer::from(WriteError::LeaseLost)), false);
        }
        // One write-back: the whole batch is one new version, whatever it merged.
        let new_version = current_version + 1;
        // A document gets its life when turnlock first writes it (see `merge::LIFE`).
        let (written, body) = merged.finish(dialect, new_version, lease.fence());
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
        // The version's snapshot is made while the store takes the write-back (the PUT is
        // sent first): it is off the lock's critical path. Its cache only maps messages'
        // bytes to their ids and digests, so one made for a write-back that then fails is
        // still right.
        let precondition = fence.precondition();
        let put = s
            .upstream
            .put_document_with(conn, path, body.clone(), &precondition, lease.fence(), store);
        let snapshot = async {
            tokio::task::yield_now().await;
            if !s.settings.snapshots {
                return None;
            }
            // A link only follows a record that is there, and will still be there when the
            // release renews it (the records below it live exactly as long): the previous
            // version may have been written past turnlock (a store that numbers versions
            // itself), or its record lost or about to expire. Asked while the store takes the
            // write-back; a slow answer gives a whole snapshot.
            let chained = written.may_chain(new_version)
                && matches!(
                    tokio::time::timeout(
                        history::LOOKUP_WAIT,
                        s.records.remaining(&queue.scope.history(new_version - 1))
                    )
                    .await,
                    Ok(Ok(Some(left))) if left > history::renewal_margin(s.settings.history_ttl)
                );
            let (json, digested) = written.snapshot_json(new_version, &mut lock(&digests), chained);
            Some((json, chained, digested))
        };
        let (put, snapshot) = tokio::join!(put, snapshot);
        // The slot is left to expire after a write-back that may still land (see `merge_batch`).
        let mut may_land_late = false;
        let put = match put {
            Err(first) if first.outcome_unknown() => {
                let timed_out = matches!(first, UpstreamError::Timeout(_));
                let again = WriteBack {
                    path,
                    body: body.clone(),
                    precondition: &precondition,
                    store,
                    version: new_version,
                };
                let resolved = again.resolve(s, lease, slot, first).await;
                // Whether the first write-back, should it still arrive, would be refused by
                // the store: under `If-Match` (the tag has moved), or under `If-None-Match: *`
                // at a store that gives ETags (the document exists now). Otherwise only the
                // commit slot orders it: left to lapse.
                let refused_if_late = match &precondition {
                    Precondition::IfMatch(_) => true,
                    Precondition::Absent => matches!(&resolved, Ok(Some(_))),
                    Precondition::None => false,
                };
                may_land_late = timed_out || !refused_if_late;
                resolved
            }
            other => other,
        };
        match put {
            Ok(etag) => {
                // Only a merged PUT reads a snapshot back: without such a route none is kept.
                let mut digested = None;
                if let Some((snapshot, chained, made)) = snapshot {
                    digested = made;
                    records.push(Entry {
                        key: queue.scope.history(new_version),
                        value: Bytes::from(snapshot),
                        ttl: s.settings.history_ttl,
                        expect: None,
                        refresh: false,
                    });
                    // A link lives as long as the records below it in its chain: they live on.
                    if chained {
                        records.extend(history::chain_below(new_version).map(|v| Entry {
                            key: queue.scope.history(v),
                            value: Bytes::new(),
                            ttl: s.settings.history_ttl,
                            expect: None,
                            refresh: true,
                        }));
                    }
                }
                let status = if created { StatusCode::CREATED } else { StatusCode::OK };
                let etag = etag.unwrap_or_else(|| etag_for(new_version));
                let turn = written.turn();
                // The next batch of this proxy on the document parses only what others
                // appended after what this one wrote (see `merge::resume`).
                if let Written::Raw(done) = written {
                    done.remember(body, digested, &mut lock(&digests));
                }
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
                return (answers, may_land_late);
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

/// A write-back, to resolve when its outcome is unknown.
struct WriteBack<'a> {
    path: &'a str,
    body: Bytes,
    precondition: &'a Precondition,
    store: &'a StoreParts,
    /// The version it writes.
    version: u64,
}

impl WriteBack<'_> {
    /// Resolves a write-back whose outcome is unknown (its connection cut before the answer,
    /// or no answer in time): the same bytes sent once more, on a new connection, under the
    /// same precondition, still under the commit slot (nothing else commits meanwhile, so
    /// two copies landing store the same document). A success means the write is applied; a
    /// refusal of the precondition means the first one landed, which the document read
    /// back at the version written confirms. Anything else leaves the outcome unknown:
    /// `first` is the answer. Whether a first copy still arriving later is refused is the
    /// caller's to judge (the slot is left to lapse otherwise).
    async fn resolve(
        self,
        s: &Shared,
        lease: &Lease,
        slot: &mut SlotHold,
        first: UpstreamError,
    ) -> Result<Option<HeaderValue>, UpstreamError> {
        if !lease.check() {
            return Err(first);
        }
        let Ok(conn) = slot.reserve(s, lease, true).await else {
            return Err(first);
        };
        tracing::info!(error = %first, "write-back's outcome unknown; sent once more under its precondition");
        s.metrics.upstream_retry();
        let again = s
            .upstream
            .put_document_with(
                conn,
                self.path,
                self.body.clone(),
                self.precondition,
                lease.fence(),
                self.store,
            )
            .await;
        match again {
            Ok(etag) => Ok(etag),
            Err(UpstreamError::PreconditionFailed) => {
                match s.upstream.get_document_raw_with(self.path, self.store).await {
                    Ok(read) if read.body.as_deref().is_some_and(|b| self.is_this_write(b)) => Ok(read.etag),
                    _ => Err(first),
                }
            }
            Err(_) => Err(first),
        }
    }

    /// Whether a document read back is the one this write-back wrote: the same bytes, or
    /// (a store that rewrites what it stores) the version it wrote.
    fn is_this_write(&self, stored: &[u8]) -> bool {
        stored == self.body.as_ref()
            || crate::upstream::parse_document(stored).is_ok_and(|doc| merge::version_of(&doc) == self.version)
    }
}

/// A batch merged, to write back.
enum Merged<'a> {
    /// Merged on parsed values, with the store-managed fields set apart before the merge.
    Values(Document, store_fields::Managed),
    Raw(Box<RawBatch<'a>>),
}

/// A batch merged and written out at its new version.
enum Written<'a> {
    Values(Document),
    Raw(Box<Finished<'a>>),
}

impl<'a> Merged<'a> {
    /// Sets the version (and the life, when the document has none) and writes the document
    /// out in the store's dialect (its own fields kept out, its version put back).
    fn finish(self, dialect: &Dialect, version: u64, life: u64) -> (Written<'a>, Bytes) {
        match self {
            Merged::Values(mut doc, managed) => {
                doc.insert("version".into(), json!(version));
                doc.entry(merge::LIFE).or_insert_with(|| json!(life));
                store_fields::strip(dialect, &mut doc);
                let body = match store_fields::for_store(dialect, &doc, &managed) {
                    Some(out) => serde_json::to_vec(&out),
                    None => serde_json::to_vec(&doc),
                };
                let body = Bytes::from(body.unwrap_or_default());
                (Written::Values(doc), body)
            }
            Merged::Raw(doc) => {
                let mut finished = doc.finish(version, life);
                let body = Bytes::from(std::mem::take(&mut finished.body));
                (Written::Raw(Box::new(finished)), body)
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

    /// Whether the snapshot of `version` may be stored as a link to the previous version's
    /// (see [`history`]): a batch of appends to a stored document of many messages.
    fn may_chain(&self, version: u64) -> bool {
        match self {
            Written::Values(_) => false,
            Written::Raw(doc) => history::may_chain(version) && doc.stored_messages() >= history::MIN_MESSAGES,
        }
    }

    /// The snapshot of the version written, serialized: whole, or `chained` to the previous
    /// version's (only where [`may_chain`](Self::may_chain)).
    fn snapshot_json(&self, version: u64, cache: &mut DigestCache, chained: bool) -> (Vec<u8>, Option<Digested>) {
        match self {
            Written::Values(doc) => (serde_json::to_vec(&Snapshot::of(doc)).unwrap_or_default(), None),
            Written::Raw(doc) => {
                let (json, digested) = doc.snapshot_json(version, cache, chained);
                (json, Some(digested))
            }
        }
    }
}

/// What the write-back keeps of the batch's requests: the last write's (its headers, and its
/// store's dialect).
fn store_parts(batch: &[Pending<MergeWrite>]) -> &StoreParts {
    static NONE: std::sync::OnceLock<StoreParts> = std::sync::OnceLock::new();
    batch
        .last()
        .map(|p| &p.write.store)
        .unwrap_or_else(|| NONE.get_or_init(StoreParts::default))
}

/// A write that names the store's own entity tag (`If-Match` in the store's format): refused
/// as the store would refuse it unless the document is still at that tag. A whole copy sent
/// to a foreign store without a turnlock `version` of its own (read as absent, or from a
/// document turnlock never wrote): its base is unknown, so it is merged without deletions.
/// `If-None-Match: *` on a PUT: refused when the document exists. Any other write as it is.
/// The store's own fields a copy carries (`_id`, `_rev`) are taken out before the merge: they
/// are the store's, never the application's, and never a conflict.
fn with_store_precondition<'a>(
    write: &'a MergeWrite,
    on: Option<&Document>,
    etag: Option<&HeaderValue>,
    first: bool,
) -> Result<std::borrow::Cow<'a, Op>, MergeError> {
    let op = store_precondition(write, on, etag, first)?;
    Ok(store_fields::without_managed(write.store.dialect, op))
}

fn store_precondition<'a>(
    write: &'a MergeWrite,
    on: Option<&Document>,
    etag: Option<&HeaderValue>,
    first: bool,
) -> Result<std::borrow::Cow<'a, Op>, MergeError> {
    let (op, store) = (&write.op, &write.store);
    if store.if_none_match && matches!(op, Op::Put { .. } | Op::Replace { .. }) {
        if let Some(cur) = on {
            return Err(MergeError::Exists {
                current: merge::version_of(cur),
            });
        }
    }
    let Some(wanted) = &store.if_match else {
        // A copy with no version of its own but the store's revision it was read at (CouchDB's
        // `_rev`, kept by a client that drops turnlock's fields): its fields are taken as the
        // client's, so it is written only onto that revision, as the store itself would write
        // it; a later one is a conflict (else its stale fields would undo acknowledged writes).
        if let (
            Op::Put {
                doc,
                base_version: None,
            },
            VersionAt::BodyField(field),
        ) = (op, store.dialect.version)
        {
            if let Some(rev) = doc.get(field).and_then(serde_json::Value::as_str) {
                let Some(cur) = on else {
                    return Err(MergeError::NothingToMatch);
                };
                let same = etag.is_some_and(|tag| store_fields::bare(tag.as_bytes()) == rev.as_bytes());
                if !first || !same {
                    return Err(MergeError::VersionMismatch {
                        expected: None,
                        current: merge::version_of(cur),
                    });
                }
            }
        }
        // A copy that names no version of its own has an unknown base: merged without
        // deletions (see `store_fields::without_deletions`).
        return Ok(match (op, on) {
            (
                Op::Put {
                    doc,
                    base_version: None,
                },
                Some(cur),
            ) if !store.dialect.answers_natively() => {
                std::borrow::Cow::Owned(store_fields::without_deletions(doc, cur))
            }
            _ => std::borrow::Cow::Borrowed(op),
        });
    };
    let Some(stored) = on else {
        return Err(MergeError::NothingToMatch);
    };
    let current = merge::version_of(stored);
    // Only the first write of the batch can still see the document at the tag it names.
    let any = wanted.as_bytes() == b"*";
    let same = etag.is_some_and(|tag| store_fields::bare(tag.as_bytes()) == store_fields::bare(wanted.as_bytes()));
    if !any && (!first || !same) {
        return Err(MergeError::VersionMismatch {
            expected: None,
            current,
        });
    }
    // The store's tag says the document is still there, not that the client saw every
    // message of it: only the copy's own `version` makes what it lacks a deletion.
    Ok(match op {
        Op::Put {
            doc,
            base_version: None,
        } => std::borrow::Cow::Owned(store_fields::without_deletions(doc, stored)),
        other => std::borrow::Cow::Borrowed(other),
    })
}

/// Applies a batch's writes one after another, in place, to the document read (`None` when
/// absent): one document per batch, never copied for an append, each write getting its own
/// result. `turn` is the batch's turn; `None` for writes that named none (on a route whose
/// turn is optional): each is merged at the stored turn, so it is never stale and moves no
/// turn. `etag` is the one the store gave the current document (for writes naming the
/// store's own).
pub(super) fn apply_batch(
    session: &SessionId,
    turn: Option<u64>,
    current: Option<Document>,
    etag: Option<&HeaderValue>,
    batch: &[Pending<MergeWrite>],
    bases: &HashMap<u64, Snapshot>,
) -> (Document, Vec<Result<merge::Applied, MergeError>>) {
    let mut doc = BatchDoc::new(session, current, &mut RandomIds);
    let results = batch
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let turn = turn.unwrap_or_else(|| doc.current().map(merge::turn_of).unwrap_or(0));
            let op = with_store_precondition(&p.write, doc.current(), etag, i == 0)?;
            let base = match op.as_ref() {
                Op::Put {
                    base_version: Some(v), ..
                } => bases.get(v),
                _ => None,
            };
            doc.apply(turn, op.as_ref(), base, &mut RandomIds)
        })
        .collect();
    (doc.into_document(), results)
}

/// A stored document that differs from what turnlock committed as its version (a writer
/// reached the store without the sidecar and kept the `version` it read) is a newer version:
/// a merged PUT based on that version is merged against what turnlock committed, so the
/// other writer's change is kept rather than taken as deleted by the client. Checked only
/// when a write of the batch is based on the current version (one Redis read).
async fn changed_behind_our_back(
    s: &Shared,
    scope: &Scope,
    batch: &[Pending<MergeWrite>],
    current: &mut Option<Document>,
    bases: &mut HashMap<u64, Snapshot>,
) {
    let Some(doc) = current.as_mut() else { return };
    let v = merge::version_of(doc);
    let based_on_current = batch.iter().any(|p| {
        matches!(
            &p.write.op,
            Op::Put { base_version: Some(b), .. } if *b == v && v > 0
        )
    });
    if !based_on_current {
        return;
    }
    let Some(committed) = load_snapshot(s, scope, v).await else {
        return;
    };
    let stored = Snapshot::of(doc);
    // A record of another life (the session deleted and written again, straight to the store
    // too, up to the same version number) says nothing of this document.
    if committed.field_digests.get(merge::LIFE) != stored.field_digests.get(merge::LIFE) {
        return;
    }
    if committed != stored {
        doc.insert("version".into(), json!(v + 1));
        bases.insert(v, committed);
    }
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
    batch: &[Pending<MergeWrite>],
    current: Option<&Document>,
) -> HashMap<u64, Snapshot> {
    let current_version = current.map(merge::version_of).unwrap_or(0);
    let mut bases = HashMap::new();
    for p in batch {
        if let Op::Put {
            base_version: Some(v), ..
        } = &p.write.op
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
            // A record of another life is no base for this one (see `changed_behind_our_back`).
            let life = current.and_then(|doc| doc.get(merge::LIFE)).map(merge::digest_tree);
            if let Some(snap) = load_snapshot(s, scope, v).await {
                if snap.field_digests.get(merge::LIFE) == life.as_ref() {
                    bases.insert(v, snap);
                }
            }
        }
    }
    bases
}

/// The snapshot of `version` as stored: its record, and when that is a link, the records
/// below it down to the chain's whole snapshot (see [`history`]). `None` when a record is
/// missing, unreadable or does not fit the chain.
async fn load_snapshot(s: &Shared, scope: &Scope, version: u64) -> Option<Snapshot> {
    let bytes = s.records.get(&scope.history(version)).await.ok()??;
    let newest = serde_json::from_slice::<Snapshot>(&bytes).ok()?;
    let Some(link) = &newest.after else {
        return Some(newest);
    };
    if link.version + 1 != version {
        return None;
    }
    // A link: the records below it, down to its chain's whole snapshot at the most, in one
    // round trip; the walk stops at the first whole one.
    let below: Vec<u64> = history::chain_below(version).collect();
    let keys: Vec<String> = below.iter().map(|v| scope.history(*v)).collect();
    let found = s.records.get_many(&keys).await.ok()?;
    let mut chain = vec![newest];
    for (at, bytes) in below.into_iter().zip(found) {
        let record = serde_json::from_slice::<Snapshot>(&bytes?).ok()?;
        let next = record.after.as_ref().map(|link| link.version);
        chain.push(record);
        match next {
            None => break,
            Some(v) if v + 1 == at => {}
            Some(_) => return None,
        }
    }
    history::assemble(chain)
}
