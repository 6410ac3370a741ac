//! The merge rules: how each kind of write changes a session document.
//!
//! Pure and synchronous. Given the stored document (if any), one write, and — for a merged
//! full-document `PUT` — the snapshot of the version that client read, it computes the next
//! document or says why the write is refused. The proxy applies a whole batch of coalesced
//! writes by calling [`apply`] once per write on the evolving document.

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};

use crate::session::{is_stale, SessionId};

mod append;
mod batch;
mod compact;
pub mod history;
mod patch;
mod put;
mod raw;
mod replace;
mod resume;

use self::append::append_new;
pub use self::batch::BatchDoc;
#[cfg(test)]
use self::put::without_id;
pub use self::raw::{with_version, DigestCache, Digested, Finished, NotADocument, RawBatch, RawDocument};

/// A session document: a JSON object with `session`, `turn`, `version`, `messages`, and any
/// other fields, which belong to the application and survive every write.
pub type Document = Map<String, Value>;

/// The field where turnlock keeps the ids of the latest compacted messages, so that a late
/// retry of an append cannot bring them back.
pub const COMPACTED_IDS: &str = "compacted_ids";

/// How many compacted ids are remembered (the oldest are forgotten first).
pub const COMPACTED_WINDOW: usize = 1000;

/// The field that tells one life of a session from the next: set when turnlock first writes a
/// document (the fencing token of that write, which only grows per session), kept by every
/// later write. A copy read in a previous life (before a delete) is refused, even when the
/// store reused its version numbers.
pub const LIFE: &str = "life";

/// Fields no write may set directly: turnlock maintains them.
const MANAGED: [&str; 5] = ["session", "version", "messages", COMPACTED_IDS, LIFE];

/// One write, already parsed and validated at the edge.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// Append a batch of messages, skipping ids that are already stored.
    Append { messages: Vec<Value> },
    /// RFC 7396 merge patch of the document's own fields.
    Patch { patch: Map<String, Value> },
    /// A client's full document, merged three ways against the version it read (`None`: the
    /// client said none, which only a new session accepts).
    Put { doc: Document, base_version: Option<u64> },
    /// Drop the messages up to and including `through`, and set `summary` (when given; else
    /// the stored summary stays).
    Compact { through: String, summary: Option<Value> },
    /// Replace the whole document, if it is still at `if_match` (`None`: `If-Match: *`, any
    /// stored document).
    Replace { doc: Document, if_match: Option<u64> },
}

impl Op {
    pub fn kind(&self) -> &'static str {
        match self {
            Op::Append { .. } => "append",
            Op::Patch { .. } => "patch",
            Op::Put { .. } => "put",
            Op::Compact { .. } => "compact",
            Op::Replace { .. } => "replace",
        }
    }
}

/// What a three-way merge needs to know of the version a client read: digests, not values.
/// An object field is kept as a tree of its members' digests (so objects merge key by key);
/// any other value as one digest. Its size grows with the number of keys and messages, not
/// with the size of their values.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Snapshot {
    pub version: u64,
    /// Every field but `messages`, as digest trees (see [`digest_tree`]).
    pub field_digests: Map<String, Value>,
    /// The ids of the messages, in order.
    pub message_ids: Vec<String>,
    /// The digest of each message, in the order of `message_ids`.
    pub message_digests: Vec<String>,
    /// Set on a stored link of a chain (see [`history`]): the messages above are the ones
    /// appended to the previous version's, which this names. A whole snapshot has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<history::Link>,
}

impl Snapshot {
    pub fn of(doc: &Document) -> Self {
        let field_digests = doc
            .iter()
            .filter(|(k, _)| k.as_str() != "messages")
            .map(|(k, v)| (k.clone(), digest_tree(v)))
            .collect();
        let (message_ids, message_digests) = messages_of(doc)
            .iter()
            .filter_map(|m| Some((message_id(m)?, digest(m))))
            .unzip();
        Self {
            version: version_of(doc),
            field_digests,
            message_ids,
            message_digests,
            after: None,
        }
    }

    fn message_digest(&self, id: &str) -> Option<&str> {
        self.message_ids
            .iter()
            .position(|i| i == id)
            .and_then(|i| self.message_digests.get(i))
            .map(String::as_str)
    }
}

/// Writes `value` as canonical JSON: object keys sorted, no whitespace. Two values that are
/// equal as JSON (whatever their key order) have the same canonical form.
pub fn canonical(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push(b'{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                let _ = serde_json::to_writer(&mut *out, k);
                out.push(b':');
                canonical(&map[k], out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                canonical(v, out);
            }
            out.push(b']');
        }
        other => {
            let _ = serde_json::to_writer(&mut *out, other);
        }
    }
}

/// A short digest of a value's canonical form (16 bytes of SHA-256, hex).
pub fn digest(value: &Value) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut bytes = Vec::new();
    canonical(value, &mut bytes);
    let mut out = String::with_capacity(32);
    for b in &Sha256::digest(&bytes)[..16] {
        out.push(HEX[usize::from(b >> 4)] as char);
        out.push(HEX[usize::from(b & 0xf)] as char);
    }
    out
}

/// An object as a JSON object of its members' digest trees; any other value as its digest
/// (a string). Two values are equal exactly when their trees are (up to digest collisions).
pub fn digest_tree(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(map.iter().map(|(k, v)| (k.clone(), digest_tree(v))).collect()),
        other => Value::String(digest(other)),
    }
}

/// Why a write is refused. Each maps to one status and error code at the edge.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum MergeError {
    #[error("turn {turn} is older than the stored turn {current}")]
    StaleTurn { turn: u64, current: u64 },
    #[error("fields changed both by this write and concurrently: {}", fields.join(", "))]
    Conflict { fields: Vec<String> },
    #[error("messages changed both by this write and concurrently: {}", ids.join(", "))]
    MessageConflict { ids: Vec<String> },
    #[error("the version this write was based on ({base}) is no longer known; read the session again and retry")]
    BaseUnknown { base: u64 },
    #[error("the document is at version {current}, not {}", expected.map_or("any stored version".to_owned(), |v| v.to_string()))]
    VersionMismatch { expected: Option<u64>, current: u64 },
    #[error("message {through:?} is not stored in this session")]
    UnknownThrough { through: String },
    #[error("session not found")]
    NotFound,
    /// `If-None-Match: *` on a document that exists.
    #[error("the document exists (version {current}); If-None-Match: * writes only a new one")]
    Exists { current: u64 },
    /// The store's precondition (`If-Match`) names a version of a document the store does
    /// not hold: S3 answers that 404, CouchDB 409 (a `_rev` of no document is a conflict).
    #[error("If-Match names a version of a document the store does not hold")]
    NothingToMatch,
    #[error("a merged PUT of a stored session needs the version it was based on: `version` in the body or If-Match")]
    VersionRequired,
    #[error("this copy was read from a previous life of the session (it was deleted since, and maybe created again); read the session again and retry")]
    PreviousLife,
}

impl MergeError {
    pub fn code(&self) -> &'static str {
        match self {
            Self::StaleTurn { .. } => "stale_turn",
            Self::Conflict { .. } | Self::MessageConflict { .. } => "conflict",
            Self::BaseUnknown { .. } => "conflict",
            Self::VersionMismatch { .. } | Self::Exists { .. } => "version_mismatch",
            Self::UnknownThrough { .. } => "unknown_message",
            Self::NotFound => "session_not_found",
            Self::NothingToMatch => "nothing_to_match",
            Self::VersionRequired => "precondition_required",
            Self::PreviousLife => "conflict",
        }
    }
}

/// The result of one applied write: the ids its messages are stored under.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Applied {
    pub message_ids: Vec<String>,
}

/// Source of ids for messages that arrive without one.
pub trait IdSource {
    fn next_id(&mut self) -> String;
}

/// Random message ids (`m-` and 16 hex digits).
pub struct RandomIds;

impl IdSource for RandomIds {
    fn next_id(&mut self) -> String {
        format!("m-{:016x}", rand::random::<u64>())
    }
}

/// Ids derived from a seed (an idempotency key and its request's fingerprint): a retry of the
/// same request gets the same ids, so de-duplication by id absorbs it.
pub struct KeyedIds {
    seed: String,
    next: u64,
}

impl KeyedIds {
    pub fn new(seed: &str) -> Self {
        Self {
            seed: seed.to_owned(),
            next: 0,
        }
    }
}

impl IdSource for KeyedIds {
    fn next_id(&mut self) -> String {
        let mut h = Sha256::new();
        h.update(self.seed.as_bytes());
        h.update(self.next.to_be_bytes());
        self.next += 1;
        let d = h.finalize();
        format!("m-{}", d[..8].iter().map(|b| format!("{b:02x}")).collect::<String>())
    }
}

/// Gives an id to every message of `messages` that has none.
pub fn assign_ids(messages: &mut [Value], ids: &mut dyn IdSource) {
    for m in messages {
        if let Some(obj) = m.as_object_mut() {
            if !obj.get("id").is_some_and(Value::is_string) {
                obj.insert("id".into(), Value::String(ids.next_id()));
            }
        }
    }
}

/// Applies one write to `current` (the stored document, `None` when absent), producing the next
/// document, with its version bumped by one. `base` is the snapshot of the version a `Put`
/// was based on, when it differs from `current`'s version and turnlock still knows it.
///
/// Stored messages without an id are given one first, once: they are written back with it.
pub fn apply(
    session: &SessionId,
    current: Option<&Document>,
    turn: u64,
    op: &Op,
    base: Option<&Snapshot>,
    ids: &mut dyn IdSource,
) -> Result<(Document, Applied), MergeError> {
    if let Some(doc) = current {
        let stored = turn_of(doc);
        if is_stale(turn, stored) {
            return Err(MergeError::StaleTurn { turn, current: stored });
        }
    }
    let with_ids;
    let current = match current {
        Some(doc) if messages_of(doc).iter().any(|m| message_id(m).is_none()) => {
            let mut doc = doc.clone();
            if let Some(Value::Array(list)) = doc.get_mut("messages") {
                assign_ids(list, ids);
            }
            with_ids = doc;
            Some(&with_ids)
        }
        other => other,
    };
    let mut applied = Applied::default();
    let mut next = match op {
        Op::Append { messages } => append::apply(session, current, messages, turn, ids, &mut applied),
        Op::Patch { patch } => patch::apply(session, current, patch),
        Op::Put { doc, base_version } => {
            put::apply(session, current, doc, *base_version, base, turn, ids, &mut applied)?
        }
        Op::Compact { through, summary } => match compact::apply(current, through, summary.as_ref())? {
            Some(doc) => doc,
            // The same compaction again (a retry whose first attempt landed) is a no-op.
            None => {
                return Ok(finish(
                    session,
                    current,
                    turn,
                    current.cloned().unwrap_or_default(),
                    applied,
                ))
            }
        },
        Op::Replace { doc, if_match } => replace::apply(session, current, doc, *if_match, turn, ids, &mut applied)?,
    };
    next.insert("session".into(), Value::String(session.as_str().to_owned()));
    Ok(finish(session, current, turn, next, applied))
}

fn finish(
    session: &SessionId,
    current: Option<&Document>,
    turn: u64,
    mut next: Document,
    applied: Applied,
) -> (Document, Applied) {
    let version = current.map(version_of).unwrap_or(0) + 1;
    let new_turn = current.map(turn_of).unwrap_or(0).max(turn);
    next.insert("session".into(), Value::String(session.as_str().to_owned()));
    next.insert("turn".into(), Value::from(new_turn));
    next.insert("version".into(), Value::from(version));
    (next, applied)
}

/// Refuses a whole-document write whose copy carries another life than the stored document's.
/// A copy without the field (built by the client, or read before lives were recorded) is
/// judged by its version alone.
fn check_life(current: &Document, incoming: &Document) -> Result<(), MergeError> {
    match incoming.get(LIFE) {
        Some(theirs) if current.get(LIFE) != Some(theirs) => Err(MergeError::PreviousLife),
        _ => Ok(()),
    }
}

/// The ids of the latest compacted messages (see [`COMPACTED_WINDOW`]).
pub fn compacted_ids(doc: &Document) -> HashSet<&str> {
    doc.get(COMPACTED_IDS)
        .and_then(Value::as_array)
        .map(|ids| ids.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn remember_compacted(doc: &mut Document, dropped: Vec<String>) {
    let mut list: Vec<Value> = doc
        .get(COMPACTED_IDS)
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    list.extend(dropped.into_iter().map(Value::String));
    if list.len() > COMPACTED_WINDOW {
        list.drain(..list.len() - COMPACTED_WINDOW);
    }
    doc.insert(COMPACTED_IDS.into(), Value::Array(list));
}

/// A new, empty session document.
pub fn empty(session: &SessionId) -> Document {
    let mut doc = Map::new();
    doc.insert("session".into(), Value::String(session.as_str().to_owned()));
    doc.insert("turn".into(), Value::from(0u64));
    doc.insert("version".into(), Value::from(0u64));
    doc.insert("messages".into(), Value::Array(Vec::new()));
    doc.insert("state".into(), Value::Object(Map::new()));
    doc.insert("summary".into(), Value::Null);
    doc
}

pub fn turn_of(doc: &Document) -> u64 {
    doc.get("turn").and_then(Value::as_u64).unwrap_or(0)
}

pub fn version_of(doc: &Document) -> u64 {
    doc.get("version").and_then(Value::as_u64).unwrap_or(0)
}

pub fn messages_of(doc: &Document) -> &[Value] {
    doc.get("messages")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

pub fn message_id(message: &Value) -> Option<String> {
    message.get("id").and_then(Value::as_str).map(str::to_owned)
}

/// Checks what a write body says about messages: an array of objects whose `id`, when
/// present, is a non-empty string. Returns a description of the first problem.
pub fn validate_messages(value: &Value) -> Result<Vec<Value>, String> {
    let Some(items) = value.as_array() else {
        return Err("`messages` must be an array".into());
    };
    for (i, m) in items.iter().enumerate() {
        let Some(obj) = m.as_object() else {
            return Err(format!("messages[{i}] must be an object"));
        };
        match obj.get("id") {
            None => {}
            Some(Value::String(s)) if !s.is_empty() => {}
            Some(_) => return Err(format!("messages[{i}].id must be a non-empty string")),
        }
    }
    Ok(items.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    struct Counter(u64);
    impl IdSource for Counter {
        fn next_id(&mut self) -> String {
            self.0 += 1;
            format!("gen-{}", self.0)
        }
    }

    fn sid() -> SessionId {
        SessionId::parse("s-1").unwrap()
    }

    fn obj(v: Value) -> Document {
        v.as_object().unwrap().clone()
    }

    fn msg(id: &str) -> Value {
        json!({"id": id, "role": "user", "content": id})
    }

    fn ids(doc: &Document) -> Vec<String> {
        messages_of(doc).iter().filter_map(message_id).collect()
    }

    /// Ids unique across every call of a test process, as random ones are.
    struct Unique;
    impl IdSource for Unique {
        fn next_id(&mut self) -> String {
            static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
            format!("gen-{}", NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
        }
    }

    fn run(cur: Option<&Document>, turn: u64, op: Op, base: Option<&Snapshot>) -> Result<Document, MergeError> {
        apply(&sid(), cur, turn, &op, base, &mut Unique).map(|(d, _)| d)
    }

    #[test]
    fn append_creates_the_session_and_skips_stored_ids() {
        let doc = run(
            None,
            1,
            Op::Append {
                messages: vec![msg("a"), msg("b")],
            },
            None,
        )
        .unwrap();
        assert_eq!(ids(&doc), ["a", "b"]);
        assert_eq!(version_of(&doc), 1);
        assert_eq!(turn_of(&doc), 1);
        let doc = run(
            Some(&doc),
            2,
            Op::Append {
                messages: vec![msg("b"), msg("c"), msg("c")],
            },
            None,
        )
        .unwrap();
        assert_eq!(ids(&doc), ["a", "b", "c"]);
        assert_eq!(version_of(&doc), 2);
        assert_eq!(turn_of(&doc), 2);
    }

    #[test]
    fn append_assigns_ids_and_turns_where_absent() {
        let (doc, applied) = apply(
            &sid(),
            None,
            4,
            &Op::Append {
                messages: vec![json!({"role": "user"})],
            },
            None,
            &mut Counter(0),
        )
        .unwrap();
        assert_eq!(applied.message_ids, ["gen-1"]);
        assert_eq!(messages_of(&doc)[0]["turn"], json!(4));
    }

    #[test]
    fn stale_turn_is_rejected_with_current_turn() {
        let doc = run(None, 7, Op::Append { messages: vec![] }, None).unwrap();
        let err = run(
            Some(&doc),
            5,
            Op::Append {
                messages: vec![msg("x")],
            },
            None,
        )
        .unwrap_err();
        assert_eq!(err, MergeError::StaleTurn { turn: 5, current: 7 });
        assert_eq!(err.code(), "stale_turn");
    }

    #[test]
    fn patch_cannot_touch_managed_fields_and_removes_on_null() {
        let doc = run(
            None,
            1,
            Op::Append {
                messages: vec![msg("a")],
            },
            None,
        )
        .unwrap();
        let patch = obj(json!({"state": {"x": 1, "y": {"z": 2}}, "extra": true, "messages": [], "version": 99}));
        let doc = run(Some(&doc), 1, Op::Patch { patch }, None).unwrap();
        assert_eq!(doc["state"], json!({"x": 1, "y": {"z": 2}}));
        assert_eq!(ids(&doc), ["a"]);
        assert_eq!(version_of(&doc), 2);
        let doc = run(
            Some(&doc),
            1,
            Op::Patch {
                patch: obj(json!({"state": {"x": null, "y": {"w": 3}}, "extra": null})),
            },
            None,
        )
        .unwrap();
        assert_eq!(doc["state"], json!({"y": {"z": 2, "w": 3}}));
        assert!(!doc.contains_key("extra"));
    }

    #[test]
    fn put_from_a_stale_copy_keeps_the_other_writers_messages_and_state() {
        let v1 = run(
            None,
            1,
            Op::Append {
                messages: vec![msg("a")],
            },
            None,
        )
        .unwrap();
        // Replica B appends and changes `state.b` concurrently.
        let mut v2 = run(
            Some(&v1),
            1,
            Op::Append {
                messages: vec![msg("b")],
            },
            None,
        )
        .unwrap();
        v2 = run(
            Some(&v2),
            1,
            Op::Patch {
                patch: obj(json!({"state": {"b": 1}})),
            },
            None,
        )
        .unwrap();
        // Replica A read v1, appended "c" and set `plan`, and PUTs the whole document.
        let mut mine = v1.clone();
        mine.insert("messages".into(), json!([msg("a"), msg("c")]));
        mine.insert("plan".into(), json!("go"));
        let snap = Snapshot::of(&v1);
        let out = run(
            Some(&v2),
            2,
            Op::Put {
                doc: mine,
                base_version: Some(1),
            },
            Some(&snap),
        )
        .unwrap();
        assert_eq!(ids(&out), ["a", "b", "c"]);
        assert_eq!(out["state"], json!({"b": 1}));
        assert_eq!(out["plan"], json!("go"));
        assert_eq!(version_of(&out), version_of(&v2) + 1);
    }

    #[test]
    fn put_changing_a_field_changed_concurrently_is_a_conflict() {
        let v1 = run(
            None,
            1,
            Op::Patch {
                patch: obj(json!({"plan": "a"})),
            },
            None,
        )
        .unwrap();
        let v2 = run(
            Some(&v1),
            1,
            Op::Patch {
                patch: obj(json!({"plan": "b"})),
            },
            None,
        )
        .unwrap();
        let mut mine = v1.clone();
        mine.insert("plan".into(), json!("c"));
        let err = run(
            Some(&v2),
            1,
            Op::Put {
                doc: mine,
                base_version: Some(1),
            },
            Some(&Snapshot::of(&v1)),
        )
        .unwrap_err();
        assert_eq!(
            err,
            MergeError::Conflict {
                fields: vec!["plan".into()]
            }
        );
    }

    #[test]
    fn put_with_an_unknown_base_is_refused_not_guessed() {
        let v1 = run(
            None,
            1,
            Op::Append {
                messages: vec![msg("a")],
            },
            None,
        )
        .unwrap();
        let v2 = run(
            Some(&v1),
            1,
            Op::Append {
                messages: vec![msg("b")],
            },
            None,
        )
        .unwrap();
        let err = run(
            Some(&v2),
            1,
            Op::Put {
                doc: v1.clone(),
                base_version: Some(1),
            },
            None,
        )
        .unwrap_err();
        assert_eq!(err, MergeError::BaseUnknown { base: 1 });
    }

    #[test]
    fn put_from_a_copy_older_than_a_compaction_does_not_bring_messages_back() {
        let v1 = run(
            None,
            1,
            Op::Append {
                messages: vec![msg("a"), msg("b"), msg("c")],
            },
            None,
        )
        .unwrap();
        let v2 = run(
            Some(&v1),
            2,
            Op::Compact {
                through: "b".into(),
                summary: Some(json!("a and b")),
            },
            None,
        )
        .unwrap();
        assert_eq!(ids(&v2), ["c"]);
        let mut mine = v1.clone();
        mine.insert("messages".into(), json!([msg("a"), msg("b"), msg("c"), msg("d")]));
        let out = run(
            Some(&v2),
            2,
            Op::Put {
                doc: mine,
                base_version: Some(1),
            },
            Some(&Snapshot::of(&v1)),
        )
        .unwrap();
        assert_eq!(ids(&out), ["c", "d"]);
        assert_eq!(out["summary"], json!("a and b"));
    }

    #[test]
    fn compaction_keeps_messages_appended_meanwhile() {
        let v1 = run(
            None,
            1,
            Op::Append {
                messages: vec![msg("a"), msg("b")],
            },
            None,
        )
        .unwrap();
        let v2 = run(
            Some(&v1),
            1,
            Op::Append {
                messages: vec![msg("c")],
            },
            None,
        )
        .unwrap();
        let v3 = run(
            Some(&v2),
            1,
            Op::Compact {
                through: "a".into(),
                summary: Some(json!({"s": 1})),
            },
            None,
        )
        .unwrap();
        assert_eq!(ids(&v3), ["b", "c"]);
        let err = run(
            Some(&v3),
            1,
            Op::Compact {
                through: "a".into(),
                summary: Some(json!(null)),
            },
            None,
        )
        .unwrap_err();
        assert_eq!(err.code(), "unknown_message");
        assert_eq!(
            run(
                None,
                1,
                Op::Compact {
                    through: "a".into(),
                    summary: Some(json!(null))
                },
                None
            )
            .unwrap_err(),
            MergeError::NotFound
        );
    }

    #[test]
    fn replace_requires_the_current_version() {
        let v1 = run(
            None,
            1,
            Op::Append {
                messages: vec![msg("a")],
            },
            None,
        )
        .unwrap();
        let new = obj(json!({"messages": [msg("z")], "state": {"fresh": true}, "version": 77}));
        let err = run(
            Some(&v1),
            1,
            Op::Replace {
                doc: new.clone(),
                if_match: Some(0),
            },
            None,
        )
        .unwrap_err();
        assert_eq!(
            err,
            MergeError::VersionMismatch {
                expected: Some(0),
                current: 1
            }
        );
        let out = run(
            Some(&v1),
            1,
            Op::Replace {
                doc: new,
                if_match: Some(1),
            },
            None,
        )
        .unwrap();
        assert_eq!(ids(&out), ["z"]);
        assert_eq!(out["state"], json!({"fresh": true}));
        assert_eq!(version_of(&out), 2);
    }

    #[test]
    fn application_fields_survive_every_kind_of_write() {
        let v1 = run(
            None,
            1,
            Op::Patch {
                patch: obj(json!({"app": {"k": [1, 2]}})),
            },
            None,
        )
        .unwrap();
        let v2 = run(
            Some(&v1),
            1,
            Op::Append {
                messages: vec![msg("a")],
            },
            None,
        )
        .unwrap();
        let v3 = run(
            Some(&v2),
            2,
            Op::Compact {
                through: "a".into(),
                summary: Some(json!("s")),
            },
            None,
        )
        .unwrap();
        let v4 = run(
            Some(&v3),
            2,
            Op::Put {
                doc: v3.clone(),
                base_version: Some(3),
            },
            None,
        )
        .unwrap();
        for d in [&v2, &v3, &v4] {
            assert_eq!(d["app"], json!({"k": [1, 2]}));
        }
    }

    fn put(cur: &Document, mine: Document, base: &Document) -> Result<Document, MergeError> {
        let snap = Snapshot::of(base);
        run(
            Some(cur),
            turn_of(cur),
            Op::Put {
                doc: mine,
                base_version: Some(version_of(base)),
            },
            Some(&snap),
        )
    }

    fn with_messages(doc: &Document, messages: Vec<Value>) -> Document {
        let mut d = doc.clone();
        d.insert("messages".into(), Value::Array(messages));
        d
    }

    #[test]
    fn put_edit_of_a_message_nobody_else_changed_is_applied_in_place() {
        let v1 = run(
            None,
            1,
            Op::Append {
                messages: vec![msg("a"), msg("b")],
            },
            None,
        )
        .unwrap();
        let mut edited = messages_of(&v1).to_vec();
        edited[0]["content"] = json!("final text");
        let out = put(&v1, with_messages(&v1, edited), &v1).unwrap();
        assert_eq!(ids(&out), ["a", "b"]);
        assert_eq!(messages_of(&out)[0]["content"], json!("final text"));
    }

    #[test]
    fn put_edit_of_a_message_changed_concurrently_is_a_conflict_naming_it() {
        let v1 = run(
            None,
            1,
            Op::Append {
                messages: vec![msg("a"), msg("b")],
            },
            None,
        )
        .unwrap();
        // Another writer edits `a` (through a PUT of its own) first.
        let mut theirs = messages_of(&v1).to_vec();
        theirs[0]["content"] = json!("theirs");
        let v2 = put(&v1, with_messages(&v1, theirs), &v1).unwrap();
        let mut mine = messages_of(&v1).to_vec();
        mine[0]["content"] = json!("mine");
        mine[1]["content"] = json!("b edited");
        let err = put(&v2, with_messages(&v1, mine), &v1).unwrap_err();
        assert_eq!(err, MergeError::MessageConflict { ids: vec!["a".into()] });
        // The same edit on both sides is no conflict.
        let mut same = messages_of(&v1).to_vec();
        same[0]["content"] = json!("theirs");
        let out = put(&v2, with_messages(&v1, same), &v1).unwrap();
        assert_eq!(messages_of(&out)[0]["content"], json!("theirs"));
    }

    #[test]
    fn put_editing_a_message_compacted_meanwhile_is_a_conflict() {
        let v1 = run(
            None,
            1,
            Op::Append {
                messages: vec![msg("a"), msg("b")],
            },
            None,
        )
        .unwrap();
        let v2 = run(
            Some(&v1),
            1,
            Op::Compact {
                through: "a".into(),
                summary: None,
            },
            None,
        )
        .unwrap();
        let mut mine = messages_of(&v1).to_vec();
        mine[0]["content"] = json!("edited");
        let err = put(&v2, with_messages(&v1, mine), &v1).unwrap_err();
        assert_eq!(err, MergeError::MessageConflict { ids: vec!["a".into()] });
        // Unedited, it is simply not brought back.
        let out = put(&v2, v1.clone(), &v1).unwrap();
        assert_eq!(ids(&out), ["b"]);
    }

    #[test]
    fn put_without_a_message_deletes_it_unless_changed_meanwhile() {
        let v1 = run(
            None,
            1,
            Op::Append {
                messages: vec![msg("a"), msg("b")],
            },
            None,
        )
        .unwrap();
        let out = put(&v1, with_messages(&v1, vec![messages_of(&v1)[1].clone()]), &v1).unwrap();
        assert_eq!(ids(&out), ["b"]);
        let mut theirs = messages_of(&v1).to_vec();
        theirs[0]["content"] = json!("edited");
        let v2 = put(&v1, with_messages(&v1, theirs), &v1).unwrap();
        let err = put(&v2, with_messages(&v1, vec![messages_of(&v1)[1].clone()]), &v1).unwrap_err();
        assert_eq!(err, MergeError::MessageConflict { ids: vec!["a".into()] });
        // A PUT without `messages` at all leaves them alone.
        let mut no_messages = v1.clone();
        no_messages.remove("messages");
        assert_eq!(ids(&put(&v1, no_messages, &v1).unwrap()), ["a", "b"]);
    }

    #[test]
    fn stored_messages_without_ids_get_ids_once_and_copies_do_not_multiply() {
        let mut stored = run(None, 1, Op::Append { messages: vec![] }, None).unwrap();
        let plain = vec![
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": "hello"}),
            json!({"role": "user", "content": "hi"}),
        ];
        stored.insert("messages".into(), Value::Array(plain.clone()));
        // A client that keeps the messages as read, without ids, PUTs three times.
        let mut doc = stored.clone();
        for round in 0..3 {
            let mut mine = with_messages(&doc, plain.clone());
            mine.insert("round".into(), json!(round));
            doc = put(&doc, mine, &doc).unwrap();
            assert_eq!(messages_of(&doc).len(), 3, "round {round}: {:?}", messages_of(&doc));
            assert!(messages_of(&doc).iter().all(|m| message_id(m).is_some()));
        }
        // A client that drops ids of what it read (which now have ids) and adds one message.
        let mut dropped: Vec<Value> = messages_of(&doc).iter().map(|m| without_id(m).unwrap()).collect();
        dropped.push(json!({"role": "user", "content": "new"}));
        let out = put(&doc, with_messages(&doc, dropped), &doc).unwrap();
        assert_eq!(messages_of(&out).len(), 4);
        // Ids given once can be compacted through.
        let through = ids(&out)[1].clone();
        let out = run(Some(&out), 1, Op::Compact { through, summary: None }, None).unwrap();
        assert_eq!(messages_of(&out).len(), 2);
    }

    #[test]
    fn objects_merge_key_by_key_recursively_and_conflicts_name_the_path() {
        let v1 = run(
            None,
            1,
            Op::Patch {
                patch: obj(json!({"state": {"a": 1, "b": 1, "deep": {"x": 1, "y": 1}}})),
            },
            None,
        )
        .unwrap();
        let mut one = v1.clone();
        one["state"]["a"] = json!(2);
        one["state"]["deep"]["x"] = json!(2);
        let v2 = put(&v1, one, &v1).unwrap();
        let mut two = v1.clone();
        two["state"]["b"] = json!(3);
        two["state"]["deep"]["y"] = json!(3);
        two["state"]["new"] = json!(true);
        let v3 = put(&v2, two, &v1).unwrap();
        assert_eq!(
            v3["state"],
            json!({"a": 2, "b": 3, "deep": {"x": 2, "y": 3}, "new": true})
        );
        let mut three = v1.clone();
        three["state"]["deep"]["x"] = json!(9);
        let err = put(&v3, three, &v1).unwrap_err();
        assert_eq!(
            err,
            MergeError::Conflict {
                fields: vec!["state.deep.x".into()]
            }
        );
    }

    #[test]
    fn snapshots_hold_digests_whose_size_does_not_grow_with_the_values() {
        let big = "x".repeat(500_000);
        let doc = run(
            None,
            1,
            Op::Patch {
                patch: obj(json!({"state": {"blob": big, "k": 1}, "notes": "y".repeat(100_000)})),
            },
            None,
        )
        .unwrap();
        let size = serde_json::to_vec(&Snapshot::of(&doc)).unwrap().len();
        assert!(size < 1_000, "snapshot of a 600 KB document is {size} bytes");
    }

    #[test]
    fn compaction_without_summary_keeps_the_summary_and_repeats_are_no_ops() {
        let v1 = run(
            None,
            1,
            Op::Append {
                messages: vec![msg("a"), msg("b"), msg("c")],
            },
            None,
        )
        .unwrap();
        let v2 = run(
            Some(&v1),
            1,
            Op::Compact {
                through: "a".into(),
                summary: Some(json!("s1")),
            },
            None,
        )
        .unwrap();
        let v3 = run(
            Some(&v2),
            1,
            Op::Compact {
                through: "b".into(),
                summary: None,
            },
            None,
        )
        .unwrap();
        assert_eq!(v3["summary"], json!("s1"));
        assert_eq!(ids(&v3), ["c"]);
        // The same compaction again (a retry) changes nothing.
        let again = run(
            Some(&v3),
            1,
            Op::Compact {
                through: "b".into(),
                summary: None,
            },
            None,
        )
        .unwrap();
        assert_eq!(ids(&again), ["c"]);
        assert_eq!(again["summary"], json!("s1"));
        // A compacted id appended again is not brought back.
        let v4 = run(
            Some(&v3),
            1,
            Op::Append {
                messages: vec![msg("a"), msg("d")],
            },
            None,
        )
        .unwrap();
        assert_eq!(ids(&v4), ["c", "d"]);
    }

    #[test]
    fn the_compacted_id_window_is_bounded() {
        let mut doc = run(None, 1, Op::Append { messages: vec![] }, None).unwrap();
        for i in 0..(COMPACTED_WINDOW + 10) {
            let id = format!("c{i}");
            doc = run(
                Some(&doc),
                1,
                Op::Append {
                    messages: vec![msg(&id)],
                },
                None,
            )
            .unwrap();
            doc = run(
                Some(&doc),
                1,
                Op::Compact {
                    through: id,
                    summary: None,
                },
                None,
            )
            .unwrap();
        }
        assert_eq!(compacted_ids(&doc).len(), COMPACTED_WINDOW);
        assert!(!compacted_ids(&doc).contains("c0"));
    }

    #[test]
    fn keyed_ids_repeat_for_the_same_seed_only() {
        let a: Vec<String> = (0..3)
            .map({
                let mut k = KeyedIds::new("k1");
                move |_| k.next_id()
            })
            .collect();
        let b: Vec<String> = (0..3)
            .map({
                let mut k = KeyedIds::new("k1");
                move |_| k.next_id()
            })
            .collect();
        let c: Vec<String> = (0..3)
            .map({
                let mut k = KeyedIds::new("k2");
                move |_| k.next_id()
            })
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.iter().collect::<HashSet<_>>().len(), 3);
    }

    #[test]
    fn canonical_json_ignores_key_order() {
        let a: Value = serde_json::from_str(r#"{"b": 1, "a": {"y": [1, {"q": 2, "p": 1}], "x": null}}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"a": {"x": null, "y": [1, {"p": 1, "q": 2}]}, "b": 1}"#).unwrap();
        assert_eq!(digest(&a), digest(&b));
        let mut out = Vec::new();
        canonical(&a, &mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#"{"a":{"x":null,"y":[1,{"p":1,"q":2}]},"b":1}"#
        );
    }

    proptest! {
        /// Writers that each change their own keys of `state` from any stale copy never
        /// conflict, and every change is kept.
        #[test]
        fn disjoint_keys_of_state_never_conflict(plan in proptest::collection::vec((0usize..4, 0usize..3, 0u32..100), 1..30)) {
            let mut history: Vec<Document> = vec![run(None, 0, Op::Patch { patch: obj(json!({"state": {}})) }, None).unwrap()];
            let mut expected = Map::new();
            for (step, (writer, lag, value)) in plan.into_iter().enumerate() {
                let cur = history.last().unwrap().clone();
                let read = history[history.len().saturating_sub(1 + lag)].clone();
                let mut mine = read.clone();
                let key = format!("w{writer}-{step}");
                mine["state"][&key] = json!({"v": value});
                expected.insert(key, json!({"v": value}));
                let next = put(&cur, mine, &read);
                prop_assert!(next.is_ok(), "{:?}", next);
                history.push(next.unwrap());
            }
            prop_assert_eq!(&history.last().unwrap()["state"], &Value::Object(expected));
        }

        /// Edits of distinct messages from stale copies are all applied.
        #[test]
        fn edits_of_distinct_messages_are_all_applied(plan in proptest::collection::vec((0usize..5, 0usize..3, 0u32..100), 1..20)) {
            let start = run(None, 0, Op::Append { messages: (0..5).map(|i| msg(&format!("m{i}"))).collect() }, None).unwrap();
            let mut history = vec![start];
            let mut last_writer_of: HashMap<usize, usize> = HashMap::new();
            let mut expected: HashMap<usize, Value> = HashMap::new();
            for (step, (target, lag, value)) in plan.into_iter().enumerate() {
                let cur = history.last().unwrap().clone();
                let idx = history.len().saturating_sub(1 + lag);
                let read = history[idx].clone();
                // Each edit writes a text never written before: a value that comes back to one a
                // copy holds (A → B → A) is, by value, no change, and three-way merges by value.
                let text = json!(format!("v{value}-{step}"));
                let mut messages = messages_of(&read).to_vec();
                messages[target]["content"] = text.clone();
                let result = put(&cur, with_messages(&read, messages), &read);
                // Changed since the client's copy by another write: a conflict (unless it is
                // the same text), else applied.
                let changed_since = last_writer_of.get(&target).is_some_and(|w| *w > idx);
                let same = messages_of(&cur)[target]["content"] == text;
                if messages_of(&read)[target]["content"] == text {
                    // Not a change from the client's copy: nothing to apply.
                    prop_assert!(result.is_ok());
                    continue;
                }
                match result {
                    Ok(next) => {
                        prop_assert!(!changed_since || same);
                        expected.insert(target, text);
                        history.push(next);
                        if !same {
                            last_writer_of.insert(target, history.len() - 1);
                        }
                    }
                    Err(MergeError::MessageConflict { ids }) => {
                        prop_assert!(changed_since && !same);
                        prop_assert_eq!(ids, vec![format!("m{target}")]);
                    }
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                }
            }
            let fin = history.last().unwrap();
            prop_assert_eq!(messages_of(fin).len(), 5);
            for (i, text) in expected {
                prop_assert_eq!(&messages_of(fin)[i]["content"], &text);
            }
        }

        /// Any interleaving of appends and merged PUTs from stale copies keeps every message
        /// exactly once.
        #[test]
        fn concurrent_appends_and_puts_lose_nothing(plan in proptest::collection::vec((0u8..2, 0usize..4), 1..30)) {
            let mut history: Vec<Document> = vec![run(None, 0, Op::Append { messages: vec![] }, None).unwrap()];
            let mut expected = Vec::new();
            for (i, (kind, lag)) in plan.into_iter().enumerate() {
                let cur = history.last().unwrap().clone();
                let id = format!("m{i}");
                expected.push(id.clone());
                let next = if kind == 0 {
                    run(Some(&cur), 0, Op::Append { messages: vec![msg(&id)] }, None).unwrap()
                } else {
                    let read = &history[history.len().saturating_sub(1 + lag)];
                    let mut mine = read.clone();
                    if let Some(Value::Array(list)) = mine.get_mut("messages") { list.push(msg(&id)); }
                    let snap = Snapshot::of(read);
                    run(Some(&cur), 0, Op::Put { doc: mine, base_version: Some(version_of(read)) }, Some(&snap)).unwrap()
                };
                history.push(next);
            }
            let fin = history.last().unwrap();
            prop_assert_eq!(ids(fin), expected);
        }

        #[test]
        fn turn_never_moves_backwards(turns in proptest::collection::vec(0u64..20, 1..30)) {
            let mut doc: Option<Document> = None;
            for t in turns {
                let before = doc.as_ref().map(turn_of).unwrap_or(0);
                match run(doc.as_ref(), t, Op::Append { messages: vec![] }, None) {
                    Ok(d) => { prop_assert!(turn_of(&d) >= before); prop_assert!(t >= before); doc = Some(d); }
                    Err(MergeError::StaleTurn { current, .. }) => prop_assert!(t < current),
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                }
            }
        }
    }
}
