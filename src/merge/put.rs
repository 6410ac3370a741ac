//! Merged `PUT`: a client's whole document, merged three ways against the version it read.

use std::collections::HashSet;

use serde_json::Value;

use super::*;

/// A client's whole document: on no stored document, a new one (unless the copy was read
/// before a delete); else merged three ways against `base_version`'s snapshot.
#[allow(clippy::too_many_arguments)]
pub(super) fn apply(
    session: &SessionId,
    current: Option<&Document>,
    incoming: &Document,
    base_version: Option<u64>,
    base: Option<&Snapshot>,
    turn: u64,
    ids: &mut dyn IdSource,
    applied: &mut Applied,
) -> Result<Document, MergeError> {
    let Some(cur) = current else {
        // A copy of a stored document (it carries a life or a version) whose document is
        // gone was read before a delete: writing it would undo the delete.
        if incoming.contains_key(LIFE) || base_version.is_some_and(|v| v > 0) {
            return Err(MergeError::PreviousLife);
        }
        let mut doc = empty(session);
        for (k, v) in incoming {
            if !MANAGED.contains(&k.as_str()) {
                doc.insert(k.clone(), v.clone());
            }
        }
        append_new(&mut doc, messages_of(incoming), turn, &HashSet::new(), ids, applied);
        return Ok(doc);
    };
    check_life(cur, incoming)?;
    let Some(base_version) = base_version else {
        return Err(MergeError::VersionRequired);
    };
    let own;
    let base = if base_version == version_of(cur) {
        own = Snapshot::of(cur);
        &own
    } else {
        match base {
            Some(b) if b.version == base_version => b,
            _ => return Err(MergeError::BaseUnknown { base: base_version }),
        }
    };
    let mut doc = three_way_fields(cur, incoming, base)?;
    if incoming.contains_key("messages") {
        three_way_messages(&mut doc, messages_of(incoming), turn, base, ids, applied)?;
    }
    Ok(doc)
}

/// Whether a client's copy of a message says the same as the stored one: equal, or equal but
/// for the `turn` turnlock added to a message sent without one.
fn same_message(stored: &Value, incoming: &Value) -> bool {
    if stored == incoming {
        return true;
    }
    match (stored.as_object(), incoming.as_object()) {
        (Some(s), Some(n)) if !n.contains_key("turn") => {
            s.len() == n.len() + 1 && s.contains_key("turn") && n.iter().all(|(k, v)| s.get(k) == Some(v))
        }
        _ => false,
    }
}

/// The messages of a merged `PUT`, three ways per message against the client's base:
///
/// - a message without an id is the stored message it equals (ignoring the id), else new;
/// - a message the client did not change keeps its stored value; one only the client changed
///   takes the client's value, in place; one both changed differently is a conflict;
/// - a message of the base the client left out was deleted by it: removed when nobody else
///   changed it, else a conflict;
/// - a message the store no longer has but the base had (compacted or deleted meanwhile), or
///   one compacted recently, is not brought back; any other new message is appended.
fn three_way_messages(
    doc: &mut Document,
    incoming: &[Value],
    turn: u64,
    base: &Snapshot,
    ids: &mut dyn IdSource,
    applied: &mut Applied,
) -> Result<(), MergeError> {
    let stored: Vec<Value> = messages_of(doc).to_vec();
    let position: HashMap<String, usize> = stored
        .iter()
        .enumerate()
        .filter_map(|(i, m)| Some((message_id(m)?, i)))
        .collect();
    // Give id-less incoming messages the id of the stored message they equal.
    let explicit: HashSet<String> = incoming.iter().filter_map(message_id).collect();
    let mut taken: HashSet<usize> = HashSet::new();
    let mut resolved = Vec::with_capacity(incoming.len());
    for m in incoming {
        if message_id(m).is_some() {
            resolved.push(m.clone());
            continue;
        }
        let found = stored.iter().enumerate().find(|(i, s)| {
            !taken.contains(i)
                && message_id(s).is_some_and(|id| !explicit.contains(&id))
                && without_id(s).is_some_and(|s| same_message(&s, m))
        });
        let mut m = m.clone();
        if let (Some((i, s)), Some(obj)) = (found, m.as_object_mut()) {
            taken.insert(i);
            if let Some(id) = message_id(s) {
                obj.insert("id".into(), Value::String(id));
            }
        }
        resolved.push(m);
    }
    let mut next = stored.clone();
    let mut remove: HashSet<usize> = HashSet::new();
    let mut conflicts = Vec::new();
    for m in &resolved {
        let Some(id) = message_id(m) else { continue };
        let Some(&i) = position.get(&id) else {
            // Removed since the client's read (compacted or deleted): an edit of it cannot be
            // made. (A copy without `turn` cannot be told from the base: it is taken as unedited.)
            let edited = m.get("turn").is_some() && base.message_digest(&id).is_some_and(|b| digest(m) != b);
            if edited {
                conflicts.push(id);
            }
            continue;
        };
        let current = &stored[i];
        if same_message(current, m) {
            continue;
        }
        match base.message_digest(&id) {
            Some(b) if digest(m) == b => {}
            Some(b) if digest(current) == b => next[i] = m.clone(),
            _ => conflicts.push(id),
        }
    }
    let sent: HashSet<String> = resolved.iter().filter_map(message_id).collect();
    for (id, b) in base.message_ids.iter().zip(&base.message_digests) {
        if sent.contains(id) {
            continue;
        }
        if let Some(&i) = position.get(id) {
            if digest(&stored[i]) == *b {
                remove.insert(i);
            } else {
                conflicts.push(id.clone());
            }
        }
    }
    if !conflicts.is_empty() {
        return Err(MergeError::MessageConflict { ids: conflicts });
    }
    let kept: Vec<Value> = next
        .into_iter()
        .enumerate()
        .filter(|(i, _)| !remove.contains(i))
        .map(|(_, m)| m)
        .collect();
    doc.insert("messages".into(), Value::Array(kept));
    let mut skip: HashSet<&str> = base.message_ids.iter().map(String::as_str).collect();
    let compacted: Vec<String> = compacted_ids(doc).into_iter().map(str::to_owned).collect();
    skip.extend(compacted.iter().map(String::as_str));
    // Ids of messages the client sent that are stored (kept or edited) are answered too.
    let mut answered = Applied::default();
    append_new(doc, &resolved, turn, &skip, ids, &mut answered);
    applied.message_ids.extend(answered.message_ids);
    Ok(())
}

pub(super) fn without_id(message: &Value) -> Option<Value> {
    let mut obj = message.as_object()?.clone();
    obj.remove("id");
    Some(Value::Object(obj))
}

/// The three-way merge of every field but the managed ones and `turn`, objects key by key
/// (recursively): what the client did not change keeps its current value, what only the
/// client changed takes the client's value, what both changed the same way is kept, and what
/// both changed differently is a conflict (named by its path, e.g. `state.plan`).
fn three_way_fields(current: &Document, incoming: &Document, base: &Snapshot) -> Result<Document, MergeError> {
    let mut doc = current.clone();
    let mut conflicts = Vec::new();
    let keys: Vec<&String> = {
        let mut seen = HashSet::new();
        current
            .keys()
            .chain(incoming.keys())
            .chain(base.field_digests.keys())
            .filter(|k| seen.insert(k.as_str()))
            .collect()
    };
    for key in keys {
        if MANAGED.contains(&key.as_str()) || key == "turn" {
            continue;
        }
        let merged = merge3(
            key,
            current.get(key),
            incoming.get(key),
            base.field_digests.get(key),
            &mut conflicts,
        );
        match merged {
            Some(v) => {
                doc.insert(key.clone(), v);
            }
            None => {
                doc.remove(key);
            }
        }
    }
    if conflicts.is_empty() {
        Ok(doc)
    } else {
        Err(MergeError::Conflict { fields: conflicts })
    }
}

/// One value three ways: `c` current, `n` the client's, `b` the base's digest tree.
pub(super) fn merge3(
    path: &str,
    c: Option<&Value>,
    n: Option<&Value>,
    b: Option<&Value>,
    conflicts: &mut Vec<String>,
) -> Option<Value> {
    if c == n || n.map(digest_tree).as_ref() == b {
        return c.cloned();
    }
    if c.map(digest_tree).as_ref() == b {
        return n.cloned();
    }
    if let (Some(Value::Object(co)), Some(Value::Object(no))) = (c, n) {
        let none = Map::new();
        let bo = match b {
            Some(Value::Object(m)) => m,
            _ => &none,
        };
        let mut seen = HashSet::new();
        let mut out = Map::new();
        for key in co.keys().chain(no.keys()).filter(|k| seen.insert(k.as_str())) {
            let sub = format!("{path}.{key}");
            if let Some(v) = merge3(&sub, co.get(key), no.get(key), bo.get(key), conflicts) {
                out.insert(key.clone(), v);
            }
        }
        return Some(Value::Object(out));
    }
    conflicts.push(path.to_owned());
    c.cloned()
}
