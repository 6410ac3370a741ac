//! Append: the messages not stored yet, in order, after the stored ones.

use std::collections::HashSet;

use serde_json::Value;

use super::*;

/// An append to the current document (a new one when none is stored); ids compacted recently
/// are skipped like stored ones.
pub(super) fn apply(
    session: &SessionId,
    current: Option<&Document>,
    messages: &[Value],
    turn: u64,
    ids: &mut dyn IdSource,
    applied: &mut Applied,
) -> Document {
    let mut doc = current.cloned().unwrap_or_else(|| empty(session));
    let compacted: Vec<String> = compacted_ids(&doc).into_iter().map(str::to_owned).collect();
    let skip = compacted.iter().map(String::as_str).collect();
    append_new(&mut doc, messages, turn, &skip, ids, applied);
    doc
}

/// Appends the messages whose ids are neither stored nor in `skip`, in order, assigning ids and
/// the write's turn where absent; records each incoming message's stored id in `applied`.
pub(super) fn append_new(
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
