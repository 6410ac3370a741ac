//! A store's own fields and version around the merge, as its dialect describes them
//! ([`crate::routes::Dialect`]): fields the store manages (`_id`, `_rev`) are taken out of the
//! document before the merge, so they are never merged nor a conflict, and the version the
//! store needs to accept the write-back is put back (the `_rev` read, in the body), or sent as
//! `If-Match` with the ETag read.

use http::HeaderValue;
use serde_json::Value;

use crate::merge::Document;
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
