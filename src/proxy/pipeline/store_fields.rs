//! A store's own fields and version around the merge, as its dialect describes them
//! ([`crate::routes::Dialect`]): fields the store manages (`_id`, `_rev`) are taken out of the
//! document before the merge, so they are never merged nor a conflict, and the version the
//! store needs to accept the write-back is put back (the `_rev` read, in the body), or sent as
//! `If-Match` with the ETag read.

use http::HeaderValue;
use std::borrow::Cow;
use std::collections::HashSet;

use serde_json::Value;

use crate::merge::{self, Document, Op};
use crate::routes::{Dialect, VersionAt};
use crate::upstream::Precondition;

/// The fields of a stored document that its store manages, as read.
#[derive(Debug, Default)]
pub(super) struct Managed {
    fields: Vec<(String, Value)>,
}

/// Takes the store-managed fields out of a document read from the store.
pub(super) fn split(dialect: &Dialect, doc: Option<Document>) -> (Option<Document>, Managed) {
    let mut managed = Managed::default();
    let doc = doc.map(|mut d| {
        for f in dialect.managed_fields {
            if let Some(v) = d.remove(*f) {
                managed.fields.push(((*f).to_owned(), v));
            }
        }
        d
    });
    (doc, managed)
}

/// Takes the store-managed fields out of a merged document (a client's copy may have set them).
pub(super) fn strip(dialect: &Dialect, doc: &mut Document) {
    for f in dialect.managed_fields {
        doc.remove(*f);
    }
}

/// A whole copy without the store-managed fields it carries (a CouchDB copy's `_id` and `_rev`):
/// merged, they would be taken as the application's fields, and two copies with different
/// `_rev`s in one batch as a conflict.
pub(super) fn without_managed<'a>(dialect: &Dialect, op: Cow<'a, Op>) -> Cow<'a, Op> {
    let carries = |doc: &Document| dialect.managed_fields.iter().any(|f| doc.contains_key(*f));
    match op.as_ref() {
        Op::Put { doc, .. } | Op::Replace { doc, .. } if carries(doc) => {
            let mut op = op.into_owned();
            if let Op::Put { doc, .. } | Op::Replace { doc, .. } = &mut op {
                strip(dialect, doc);
            }
            Cow::Owned(op)
        }
        _ => op,
    }
}

/// The version of the stored document in the store's own terms: the ETag read, or the value
/// of the body field that holds it (quoted, as an entity tag).
pub(super) fn version_tag(dialect: &Dialect, etag: Option<&HeaderValue>, managed: &Managed) -> Option<HeaderValue> {
    match dialect.version {
        VersionAt::EtagHeader => etag.cloned(),
        VersionAt::BodyField(f) => managed
            .fields
            .iter()
            .find(|(k, _)| k == f)
            .and_then(|(_, v)| v.as_str())
            .and_then(|v| HeaderValue::from_str(&format!("\"{v}\"")).ok()),
    }
}

/// The document as written back: the merged one, with the version the store needs in it.
pub(super) fn for_store(dialect: &Dialect, next: &Document, managed: &Managed) -> Option<Document> {
    let VersionAt::BodyField(f) = dialect.version else {
        return None;
    };
    let mut doc = next.clone();
    if let Some((_, v)) = managed.fields.iter().find(|(k, _)| k == f) {
        doc.insert(f.to_owned(), v.clone());
    }
    Some(doc)
}

/// How the write-back states the version it was based on.
pub(super) fn precondition(dialect: &Dialect, exists: bool, etag: Option<HeaderValue>) -> Precondition {
    match (dialect.version, exists, etag) {
        // The version is in the body; a store of this kind refuses a create over a document.
        (VersionAt::BodyField(_), _, _) => Precondition::None,
        (VersionAt::EtagHeader, false, _) => Precondition::Absent,
        (VersionAt::EtagHeader, true, Some(tag)) => Precondition::IfMatch(tag),
        (VersionAt::EtagHeader, true, None) => Precondition::None,
    }
}

/// A whole copy whose base is unknown, as a merged `PUT` based on the stored document
/// `stored`: a copy that carries no turnlock `version` (read as absent, or read from a document
/// turnlock never wrote) may lack what others wrote since the client's read, and nothing says
/// it saw it. So nothing it lacks is a deletion: the stored messages and fields it does not
/// carry are kept (the union of messages), and its values are taken for what it does carry.
/// Its messages equal to a stored one without an id are that message, not new ones.
pub(super) fn without_deletions(copy: &Document, stored: &Document) -> Op {
    let mut doc = copy.clone();
    for (k, v) in stored {
        if k != "messages" && k != "turn" && !doc.contains_key(k) {
            doc.insert(k.clone(), v.clone());
        }
    }
    let theirs = merge::messages_of(copy);
    let ids: HashSet<String> = theirs.iter().filter_map(merge::message_id).collect();
    // The copy's messages without an id, each matched to at most one stored message it equals:
    // one equal to a stored message with an id is that message (the merge gives it that id);
    // one equal to a stored message without an id is dropped (that one stays as stored).
    let mut idless: Vec<(Value, bool)> = theirs
        .iter()
        .filter(|m| merge::message_id(m).is_none())
        .map(|m| (m.clone(), true))
        .collect();
    let mut matched = vec![false; idless.len()];
    let mut kept: Vec<Value> = Vec::new();
    for m in merge::messages_of(stored) {
        let id = merge::message_id(m);
        if id.as_ref().is_some_and(|id| ids.contains(id)) {
            continue;
        }
        let bare = without_id_field(m);
        let found = idless
            .iter()
            .enumerate()
            .position(|(i, (c, _))| !matched[i] && same_message(&bare, c));
        match (found, id) {
            (Some(i), Some(_)) => matched[i] = true,
            (Some(i), None) => {
                matched[i] = true;
                idless[i].1 = false;
            }
            // Not in the copy: kept (a stored message without an id is never removed anyway).
            (None, Some(_)) => kept.push(m.clone()),
            (None, None) => {}
        }
    }
    if doc.contains_key("messages") || !kept.is_empty() {
        let mut messages: Vec<Value> = Vec::with_capacity(theirs.len() + kept.len());
        let mut idless = idless.into_iter();
        for m in theirs {
            if merge::message_id(m).is_some() {
                messages.push(m.clone());
            } else if let Some((m, true)) = idless.next() {
                messages.push(m);
            }
        }
        messages.extend(kept);
        doc.insert("messages".into(), Value::Array(messages));
    }
    Op::Put {
        doc,
        base_version: Some(merge::version_of(stored)),
    }
}

/// A stored message (without its id) and a client's copy of it: equal, or equal but for the
/// `turn` turnlock added to a message sent without one.
fn same_message(stored: &Value, copy: &Value) -> bool {
    if stored == copy {
        return true;
    }
    match (stored.as_object(), copy.as_object()) {
        (Some(s), Some(c)) if !c.contains_key("turn") => {
            s.len() == c.len() + 1 && s.contains_key("turn") && c.iter().all(|(k, v)| s.get(k) == Some(v))
        }
        _ => false,
    }
}

fn without_id_field(m: &Value) -> Value {
    match m.as_object() {
        Some(o) => {
            let mut o = o.clone();
            o.remove("id");
            Value::Object(o)
        }
        None => m.clone(),
    }
}

/// An entity tag without its quotes (and weak marker): stores and clients quote them differently.
pub(super) fn bare(tag: &[u8]) -> &[u8] {
    let tag = tag.strip_prefix(b"W/").unwrap_or(tag);
    let tag = tag.strip_prefix(b"\"").unwrap_or(tag);
    tag.strip_suffix(b"\"").unwrap_or(tag)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routes::dialect::{COUCHDB, S3};
    use serde_json::json;

    #[test]
    fn a_copy_of_unknown_base_keeps_what_it_lacks() {
        let stored = json!({"version": 4, "title": "t", "plan": "p", "messages": [
            {"id": "old", "content": "o", "turn": 1}, {"id": "direct", "content": "d"}, {"content": "legacy"}
        ]});
        let copy = json!({"title": "mine", "messages": [
            {"content": "o"}, {"content": "legacy"}, {"id": "mine", "content": "m"}
        ]});
        let Op::Put { doc, base_version } = without_deletions(copy.as_object().unwrap(), stored.as_object().unwrap())
        else {
            panic!("a put");
        };
        assert_eq!(base_version, Some(4));
        assert_eq!(doc["title"], "mine");
        assert_eq!(doc["plan"], "p");
        // The copy's id-less `o` is the stored `old` (left for the merge to name); its
        // `legacy` is the stored one (dropped); `direct` is kept.
        assert_eq!(
            doc["messages"],
            json!([{"content": "o"}, {"id": "mine", "content": "m"}, {"id": "direct", "content": "d"}])
        );
    }

    #[test]
    fn couchdb_fields_are_taken_out_and_the_rev_read_is_written_back() {
        let doc = json!({"_id": "s1", "_rev": "3-abc", "messages": [], "version": 3});
        let (doc, managed) = split(&COUCHDB, doc.as_object().cloned());
        let doc = doc.unwrap();
        assert!(!doc.contains_key("_rev") && !doc.contains_key("_id"));
        assert_eq!(version_tag(&COUCHDB, None, &managed).unwrap(), "\"3-abc\"");
        let out = for_store(&COUCHDB, &doc, &managed).unwrap();
        assert_eq!(out["_rev"], "3-abc");
        assert!(matches!(precondition(&COUCHDB, true, None), Precondition::None));
        // S3 manages no body field; its version is the ETag.
        let (_, m) = split(&S3, json!({"_rev": "x"}).as_object().cloned());
        assert!(version_tag(&S3, None, &m).is_none());
        assert_eq!(bare(b"W/\"3-abc\""), b"3-abc");
    }
}
