//! The merge rules: how each kind of write changes a session document.
//!
//! Pure and synchronous. Given the stored document (if any), one write, and — for a merged
//! full-document `PUT` — the snapshot of the version that client read, it computes the next
//! document or says why the write is refused. The proxy applies a whole batch of coalesced
//! writes by calling [`apply`] once per write on the evolving document.

use serde_json::{Map, Value};
use std::collections::HashSet;

use crate::session::{is_stale, SessionId};

/// A session document: a JSON object with `session`, `turn`, `version`, `messages`, and any
/// other fields, which belong to the application and survive every write.
pub type Document = Map<String, Value>;

/// Fields no write may set directly: turnlock maintains them.
const MANAGED: [&str; 3] = ["session", "version", "messages"];

/// One write, already parsed and validated at the edge.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// Append a batch of messages, skipping ids that are already stored.
    Append { messages: Vec<Value> },
    /// RFC 7396 merge patch of the document's own fields.
    Patch { patch: Map<String, Value> },
    /// A client's full document, merged three ways against the version it read.
    Put { doc: Document, base_version: u64 },
    /// Drop the messages up to and including `through`, and set `summary`.
    Compact { through: String, summary: Value },
    /// Replace the whole document, if it is still at `if_match`.
    Replace { doc: Document, if_match: u64 },
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

/// What a three-way merge needs to know of the version a client read.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Snapshot {
    pub version: u64,
    /// Every field but `messages`.
    pub fields: Map<String, Value>,
    /// The ids of the messages, in order.
    pub message_ids: Vec<String>,
}

impl Snapshot {
    pub fn of(doc: &Document) -> Self {
        let fields = doc
            .iter()
            .filter(|(k, _)| k.as_str() != "messages")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Self {
            version: version_of(doc),
            fields,
            message_ids: messages_of(doc).iter().filter_map(message_id).collect(),
        }
    }
}

/// Why a write is refused. Each maps to one status and error code at the edge.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum MergeError {
    #[error("turn {turn} is older than the stored turn {current}")]
    StaleTurn { turn: u64, current: u64 },
    #[error("fields changed both by this write and concurrently: {}", fields.join(", "))]
    Conflict { fields: Vec<String> },
    #[error("the version this write was based on ({base}) is no longer known; read the session again and retry")]
    BaseUnknown { base: u64 },
    #[error("the document is at version {current}, not {expected}")]
    VersionMismatch { expected: u64, current: u64 },
    #[error("message {through:?} is not stored in this session")]
    UnknownThrough { through: String },
    #[error("session not found")]
    NotFound,
}

impl MergeError {
    pub fn code(&self) -> &'static str {
        match self {
            Self::StaleTurn { .. } => "stale_turn",
            Self::Conflict { .. } => "conflict",
            Self::BaseUnknown { .. } => "conflict",
            Self::VersionMismatch { .. } => "version_mismatch",
            Self::UnknownThrough { .. } => "unknown_message",
            Self::NotFound => "session_not_found",
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

/// Applies one write to `current` (the stored document, `None` when absent), producing the next
/// document, with its version bumped by one. `base` is the snapshot of the version a `Put`
/// was based on, when it differs from `current`'s version and turnlock still knows it.
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
    let mut applied = Applied::default();
    let mut next = match (op, current) {
        (Op::Append { messages }, cur) => {
            let mut doc = cur.cloned().unwrap_or_else(|| empty(session));
            append_new(&mut doc, messages, turn, &HashSet::new(), ids, &mut applied);
            doc
        }
        (Op::Patch { patch }, cur) => {
            let mut doc = cur.cloned().unwrap_or_else(|| empty(session));
            for (key, value) in patch {
                if MANAGED.contains(&key.as_str()) || key == "turn" {
                    continue;
                }
                merge_patch_field(&mut doc, key, value);
            }
            doc
        }
        (Op::Put { doc: incoming, .. }, None) => {
            let mut doc = empty(session);
            for (k, v) in incoming {
                if !MANAGED.contains(&k.as_str()) {
                    doc.insert(k.clone(), v.clone());
                }
            }
            append_new(
                &mut doc,
                messages_of(incoming),
                turn,
                &HashSet::new(),
                ids,
                &mut applied,
            );
            doc
        }
        (
            Op::Put {
                doc: incoming,
                base_version,
            },
            Some(cur),
        ) => {
            let own;
            let base = if *base_version == version_of(cur) {
                own = Snapshot::of(cur);
                &own
            } else {
                match base {
                    Some(b) if b.version == *base_version => b,
                    _ => return Err(MergeError::BaseUnknown { base: *base_version }),
                }
            };
            let mut doc = three_way_fields(cur, incoming, base)?;
            // Messages the client's copy had but the store no longer has were removed since
            // (by a compaction): they must not come back.
            let removed: HashSet<&str> = base.message_ids.iter().map(String::as_str).collect();
            append_new(&mut doc, messages_of(incoming), turn, &removed, ids, &mut applied);
            doc
        }
        (Op::Compact { .. }, None) => return Err(MergeError::NotFound),
        (Op::Compact { through, summary }, Some(cur)) => {
            let mut doc = cur.clone();
            let messages = messages_of(cur);
            let Some(pos) = messages
                .iter()
                .position(|m| message_id(m).as_deref() == Some(through.as_str()))
            else {
                return Err(MergeError::UnknownThrough {
                    through: through.clone(),
                });
            };
            doc.insert("messages".into(), Value::Array(messages[pos + 1..].to_vec()));
            doc.insert("summary".into(), summary.clone());
            doc
        }
        (
            Op::Replace {
                doc: incoming,
                if_match,
            },
            cur,
        ) => {
            let current_version = cur.map(version_of).unwrap_or(0);
            if *if_match != current_version {
                return Err(MergeError::VersionMismatch {
                    expected: *if_match,
                    current: current_version,
                });
            }
            let mut doc = empty(session);
            for (k, v) in incoming {
                if !MANAGED.contains(&k.as_str()) {
                    doc.insert(k.clone(), v.clone());
                }
            }
            append_new(
                &mut doc,
                messages_of(incoming),
                turn,
                &HashSet::new(),
                ids,
                &mut applied,
            );
            doc
        }
    };
    let version = current.map(version_of).unwrap_or(0) + 1;
    let new_turn = current.map(turn_of).unwrap_or(0).max(turn);
    next.insert("session".into(), Value::String(session.as_str().to_owned()));
    next.insert("turn".into(), Value::from(new_turn));
    next.insert("version".into(), Value::from(version));
    Ok((next, applied))
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

/// Appends the messages whose ids are neither stored nor in `skip`, in order, assigning ids and
/// the write's turn where absent; records each incoming message's stored id in `applied`.
fn append_new(
    doc: &mut Document,
    incoming: &[Value],
    turn: u64,
    skip: &HashSet<&str>,
    ids: &mut dyn IdSource,
    applied: &mut Applied,
) {
    let mut stored: HashSet<String> = messages_of(doc).iter().filter_map(message_id).collect();
    let mut added = Vec::new();
    for message in incoming {
        let mut message = message.clone();
        let id = match message_id(&message) {
            Some(id) => id,
            None => {
                let id = ids.next_id();
                if let Some(obj) = message.as_object_mut() {
                    obj.insert("id".into(), Value::String(id.clone()));
                }
                id
            }
        };
        applied.message_ids.push(id.clone());
        if stored.contains(&id) || skip.contains(id.as_str()) {
            continue;
        }
        if let Some(obj) = message.as_object_mut() {
            obj.entry("turn").or_insert_with(|| Value::from(turn));
        }
        stored.insert(id);
        added.push(message);
    }
    if added.is_empty() && doc.get("messages").is_some_and(Value::is_array) {
        return;
    }
    let messages = doc.entry("messages").or_insert_with(|| Value::Array(Vec::new()));
    if !messages.is_array() {
        *messages = Value::Array(Vec::new());
    }
    if let Value::Array(list) = messages {
        list.extend(added);
    }
}

/// The three-way merge of every field but the managed ones and `turn`: what the client did not
/// change keeps its current value, what only the client changed takes the client's value, what
/// both changed the same way is kept, and what both changed differently is a conflict.
fn three_way_fields(current: &Document, incoming: &Document, base: &Snapshot) -> Result<Document, MergeError> {
    let mut doc = current.clone();
    let mut conflicts = Vec::new();
    let keys: Vec<&String> = {
        let mut seen = HashSet::new();
        current
            .keys()
            .chain(incoming.keys())
            .chain(base.fields.keys())
            .filter(|k| seen.insert(k.as_str()))
            .collect()
    };
    for key in keys {
        if MANAGED.contains(&key.as_str()) || key == "turn" {
            continue;
        }
        let (c, n, b) = (current.get(key), incoming.get(key), base.fields.get(key));
        if n == b || c == n {
            continue;
        }
        if c == b {
            match n {
                Some(v) => doc.insert(key.clone(), v.clone()),
                None => doc.remove(key),
            };
        } else {
            conflicts.push(key.clone());
        }
    }
    if conflicts.is_empty() {
        Ok(doc)
    } else {
        Err(MergeError::Conflict { fields: conflicts })
    }
}

/// RFC 7396 for one top-level member: `null` removes, objects merge recursively, anything else
/// replaces.
fn merge_patch_field(target: &mut Map<String, Value>, key: &str, patch: &Value) {
    match patch {
        Value::Null => {
            target.remove(key);
        }
        Value::Object(members) => {
            let slot = target
                .entry(key.to_owned())
                .or_insert_with(|| Value::Object(Map::new()));
            if !slot.is_object() {
                *slot = Value::Object(Map::new());
            }
            if let Value::Object(inner) = slot {
                for (k, v) in members {
                    merge_patch_field(inner, k, v);
                }
            }
        }
        other => {
            target.insert(key.to_owned(), other.clone());
        }
    }
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

    fn run(cur: Option<&Document>, turn: u64, op: Op, base: Option<&Snapshot>) -> Result<Document, MergeError> {
        apply(&sid(), cur, turn, &op, base, &mut Counter(0)).map(|(d, _)| d)
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
                base_version: 1,
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
                base_version: 1,
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
                base_version: 1,
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
                summary: json!("a and b"),
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
                base_version: 1,
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
                summary: json!({"s": 1}),
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
                summary: json!(null),
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
                    summary: json!(null)
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
                if_match: 0,
            },
            None,
        )
        .unwrap_err();
        assert_eq!(
            err,
            MergeError::VersionMismatch {
                expected: 0,
                current: 1
            }
        );
        let out = run(Some(&v1), 1, Op::Replace { doc: new, if_match: 1 }, None).unwrap();
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
                summary: json!("s"),
            },
            None,
        )
        .unwrap();
        let v4 = run(
            Some(&v3),
            2,
            Op::Put {
                doc: v3.clone(),
                base_version: 3,
            },
            None,
        )
        .unwrap();
        for d in [&v2, &v3, &v4] {
            assert_eq!(d["app"], json!({"k": [1, 2]}));
        }
    }

    proptest! {
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
                    run(Some(&cur), 0, Op::Put { doc: mine, base_version: version_of(read) }, Some(&snap)).unwrap()
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
