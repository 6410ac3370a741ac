//! What turnlock knows of each store's protocol, in one place and as data: where the version
//! lives and how the precondition is sent, which answers to a write-back mean "the document
//! moved: re-read and re-merge", which fields the store manages, which of the client's
//! headers the write-back keeps, and in which form the client is answered.
//!
//! Chosen in the routes file (`[store] dialect = "http" | "s3" | "couchdb"`); the canonical
//! API is always `http`.

use serde::Deserialize;

/// The dialects a routes file can name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DialectName {
    /// ETag and `If-Match`, 412 (or 409) on conflict; answered in turnlock's JSON.
    #[default]
    Http,
    /// S3-compatible object stores: conditional writes, answered as S3 answers.
    S3,
    /// CouchDB-style document stores: `_rev` in the body, 409 on conflict.
    Couchdb,
}

/// Where a store keeps a document's version, and how a write-back states the one it read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VersionAt {
    /// The `ETag` of a read; the write-back sends `If-Match` (or `If-None-Match: *` to create).
    EtagHeader,
    /// A body field (`_rev`), sent back in the written document.
    BodyField(&'static str),
}

/// In which form a client is answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnswerForm {
    /// turnlock's JSON: `{"session", "turn", "version", …}`, errors `{"error", "message"}`.
    Turnlock,
    /// As S3 answers a `PutObject`: an empty 200 with the object's `ETag`; refusals as S3
    /// XML errors (`PreconditionFailed`, `SlowDown`, …) that SDKs raise as such.
    S3,
    /// As CouchDB answers a document `PUT`: `{"ok":true,"id":…,"rev":…}`; refusals as
    /// `{"error":…,"reason":…}`.
    Couchdb,
}

/// A request on a write route that is not a write of the document in the store's protocol:
/// it passes through to the store untouched, as any request no route names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotAWrite {
    /// A request of this method with one of these groups of query parameters: a
    /// subresource (S3's `PUT ?uploadId=…&partNumber=…`, `?tagging`, `?acl`, …). A group is
    /// there when each of its parameters is; one written `name=` only with a value (the
    /// store takes `PUT ?uploadId=u` without a part number, or `?uploadId=`, for a plain
    /// `PutObject`). Any other parameter, or a group in part, leaves the request a write
    /// (S3 stores `PUT …?cb=1` as it stores `PUT …`): a subresource missing here is then
    /// locked as a write, never let past the lock.
    Query(&'static str, &'static [&'static [&'static str]]),
    /// This request header (S3's `x-amz-copy-source`: a copy made by the store itself).
    Header(&'static str),
    /// A session placeholder starting with this (CouchDB's `_security`, `_design`, `_local`,
    /// `_bulk_docs`: the database's own resources, not documents).
    SessionPrefix(&'static str),
    /// A path whose first name starts with this, percent-decoded (CouchDB's system
    /// databases, `_users`, `_replicator`, `_global_changes`: no session's document).
    FirstSegmentPrefix(&'static str),
}

/// How a store reads the names in a path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Names {
    /// As most HTTP stores and routers do: normalized, read every way one of them could
    /// (see `normalize::readings`).
    Normalized,
    /// Literal (another case, an empty, dot or `;params` segment is another name): a bucket,
    /// then a key that is one string (`%2F` a `/` in it), as S3 reads them; slashes before
    /// the bucket are one.
    S3Keys,
    /// Literal: a database, then a document id (`%2F` a character of it: `a%2Fb` is the
    /// document `a/b`, where `a/b` is an attachment of `a`), as CouchDB reads them; an empty
    /// segment starts an id with `/` (`/db//d` is the document `/d`).
    CouchIds,
}

/// One store protocol.
#[derive(Debug, PartialEq, Eq)]
pub struct Dialect {
    pub name: &'static str,
    pub version: VersionAt,
    /// Write-back statuses that mean the document moved since it was read: re-read, re-merge.
    pub conflict_statuses: &'static [u16],
    /// Fields the store sets itself: never merged as the application's, never a conflict.
    pub managed_fields: &'static [&'static str],
    /// The client's headers the write-back carries (names, or prefixes ending in `*`),
    /// besides the content type and `Authorization`.
    pub kept_headers: &'static [&'static str],
    /// Request headers never carried: they describe the client's body, not the merged one.
    pub dropped_headers: &'static [&'static str],
    pub answer: AnswerForm,
    /// How the store reads a path's names (see [`Names`]).
    pub names: Names,
    /// Requests matching a write route that are not writes of the document.
    pub not_writes: &'static [NotAWrite],
    /// A body field by which a `POST` to a document's collection (a write route's path
    /// without its last name) names the document it writes: CouchDB's `POST /{db}` with an
    /// `_id` creates or updates that document (nano's `db.insert(doc)`), as its `PUT` does.
    pub named_in_body: Option<&'static str>,
    /// The last name of a collection's path to which a `POST` writes several documents, each
    /// named by [`Dialect::named_in_body`] (CouchDB's `_bulk_docs`).
    pub bulk_endpoint: Option<&'static str>,
    /// A body field that makes a write the document's deletion (CouchDB's `_deleted`):
    /// refused on a merged write, as a session's document is deleted by its `DELETE`.
    pub deleting_field: Option<&'static str>,
    /// The first names of paths whose writes start a replication (CouchDB's `_replicate` and
    /// `_replicator`): refused, as a replication writes documents as given.
    pub replication: &'static [&'static str],
    /// The query parameters of a session delete sent on to the store (`None`: all of them).
    /// CouchDB's `?rev=` only: pouchdb-server reads any other as a write option, and an
    /// empty `new_edits` makes the delete a no-op answered 200.
    pub delete_query: Option<&'static [&'static str]>,
}

pub const HTTP: Dialect = Dialect {
    name: "http",
    version: VersionAt::EtagHeader,
    // 412 for a stale If-Match; 409, as many stores answer a concurrent write: both re-read.
    conflict_statuses: &[412, 409],
    managed_fields: &[],
    kept_headers: &[],
    dropped_headers: &[],
    answer: AnswerForm::Turnlock,
    names: Names::Normalized,
    not_writes: &[],
    named_in_body: None,
    bulk_endpoint: None,
    deleting_field: None,
    replication: &[],
    delete_query: None,
};

pub const S3: Dialect = Dialect {
    name: "s3",
    version: VersionAt::EtagHeader,
    // 409 ConditionalRequestConflict: a concurrent conditional write won the race.
    conflict_statuses: &[412, 409],
    managed_fields: &[],
    kept_headers: &[
        "x-amz-meta-*",
        "x-amz-server-side-encryption*",
        "x-amz-storage-class",
        "x-amz-acl",
        "x-amz-tagging",
        "x-amz-security-token",
        "x-amz-date",
        "cache-control",
        "content-disposition",
        "content-language",
        "expires",
    ],
    dropped_headers: &[
        "content-md5",
        "x-amz-checksum-*",
        "x-amz-sdk-checksum-algorithm",
        "x-amz-trailer",
        "x-amz-decoded-content-length",
        "x-amz-content-sha256",
        "content-encoding",
        "if-match",
        "if-none-match",
    ],
    answer: AnswerForm::S3,
    names: Names::S3Keys,
    // The object's subresources are not writes of the document: a part of a multipart
    // upload, its tags, ACL, retention and legal hold; deleting those, aborting an upload,
    // or deleting one version of the object. Any other `PUT` (`?versionId`, `?uploads`, an
    // `?uploadId` without its part number) is a `PutObject` to S3 and its emulators.
    not_writes: &[
        NotAWrite::Query(
            "PUT",
            &[
                &["uploadId=", "partNumber="],
                &["tagging"],
                &["acl"],
                &["retention"],
                &["legal-hold"],
            ],
        ),
        NotAWrite::Query("DELETE", &[&["uploadId="], &["tagging"], &["versionId="]]),
        NotAWrite::Header("x-amz-copy-source"),
    ],
    named_in_body: None,
    bulk_endpoint: None,
    deleting_field: None,
    replication: &[],
    delete_query: None,
};

pub const COUCHDB: Dialect = Dialect {
    name: "couchdb",
    version: VersionAt::BodyField("_rev"),
    // 409 only: a 412 from a CouchDB-style store is no conflict (pouchdb-server's `missing_id`;
    // turnlock sends it no `If-Match`).
    conflict_statuses: &[409],
    managed_fields: &["_id", "_rev"],
    kept_headers: &[],
    // The write-back is JSON, and sent as such: CouchDB servers read a document only from a
    // body typed `application/json` (pouchdb-server stores `{}` from any other type, and
    // answers an update of an existing document 409, a conflict no re-read resolves).
    dropped_headers: &["if-match", "content-type"],
    answer: AnswerForm::Couchdb,
    names: Names::CouchIds,
    not_writes: &[NotAWrite::SessionPrefix("_"), NotAWrite::FirstSegmentPrefix("_")],
    named_in_body: Some("_id"),
    bulk_endpoint: Some("_bulk_docs"),
    deleting_field: Some("_deleted"),
    replication: &["_replicate", "_replicator"],
    delete_query: Some(&["rev"]),
};

/// Whether `query` has each parameter of `group` (one written `name=` with a value), its
/// names read as the store reads them: decoded (`%74agging` is `tagging`).
fn has_all(query: &str, group: &[&str]) -> bool {
    group.iter().all(|wanted| {
        let (name, valued) = match wanted.strip_suffix('=') {
            Some(name) => (name, true),
            None => (*wanted, false),
        };
        query.split('&').any(|pair| {
            let (n, v) = pair.split_once('=').unwrap_or((pair, ""));
            percent_encoding::percent_decode_str(n).decode_utf8_lossy() == name && !(valued && v.is_empty())
        })
    })
}

impl DialectName {
    pub fn dialect(self) -> &'static Dialect {
        match self {
            Self::Http => &HTTP,
            Self::S3 => &S3,
            Self::Couchdb => &COUCHDB,
        }
    }
}

impl Dialect {
    /// Whether a write-back answered `status` met a newer version (re-read and re-merge).
    pub fn is_conflict(&self, status: u16) -> bool {
        self.conflict_statuses.contains(&status)
    }

    /// Whether the client's header `name` (lower case) goes on the write-back.
    pub fn keeps(&self, name: &str) -> bool {
        let listed = |list: &[&str]| {
            list.iter().any(|p| match p.strip_suffix('*') {
                Some(prefix) => name.starts_with(prefix),
                None => name == *p,
            })
        };
        if listed(self.dropped_headers) {
            return false;
        }
        name == "authorization" || name == "content-type" || listed(self.kept_headers)
    }

    /// Whether a request that matched a write route is not a write of the document in this
    /// dialect (see [`NotAWrite`]): it is then forwarded untouched.
    pub fn not_a_write(
        &self,
        method: &http::Method,
        uri: &http::Uri,
        headers: &http::HeaderMap,
        session: &str,
    ) -> bool {
        let query = uri.query();
        self.not_writes.iter().any(|n| match n {
            NotAWrite::Query(on, groups) => {
                method.as_str() == *on && query.is_some_and(|q| groups.iter().any(|group| has_all(q, group)))
            }
            NotAWrite::Header(name) => headers.contains_key(*name),
            NotAWrite::SessionPrefix(prefix) => session.starts_with(prefix),
            NotAWrite::FirstSegmentPrefix(prefix) => {
                let first = uri.path().trim_start_matches('/').split('/').next().unwrap_or("");
                percent_encoding::percent_decode_str(first)
                    .decode_utf8_lossy()
                    .starts_with(prefix)
            }
        })
    }

    /// Whether the store manages `field` itself.
    pub fn manages(&self, field: &str) -> bool {
        self.managed_fields.contains(&field)
    }

    /// Whether the client is answered in turnlock's own form.
    pub fn answers_natively(&self) -> bool {
        self.answer == AnswerForm::Turnlock
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s3_keeps_metadata_and_credentials_but_not_the_body_checksums() {
        for kept in [
            "x-amz-meta-owner",
            "x-amz-server-side-encryption",
            "x-amz-server-side-encryption-aws-kms-key-id",
            "authorization",
            "content-type",
        ] {
            assert!(S3.keeps(kept), "{kept}");
        }
        for dropped in [
            "content-md5",
            "x-amz-checksum-crc32",
            "if-match",
            "host",
            "x-fencing-token",
        ] {
            assert!(!S3.keeps(dropped), "{dropped}");
        }
    }

    #[test]
    fn only_a_plain_write_of_the_document_is_a_write() {
        let none = http::HeaderMap::new();
        let put = |d: &Dialect, target: &str, headers: &http::HeaderMap| {
            d.not_a_write(&http::Method::PUT, &target.parse().expect("uri"), headers, "s1")
        };
        let delete = |d: &Dialect, target: &str| {
            d.not_a_write(&http::Method::DELETE, &target.parse().expect("uri"), &none, "s1")
        };
        // A parameter S3 ignores, or a subresource a PUT does not have, leaves a PutObject
        // a write.
        for q in [
            "",
            "?x-id=PutObject",
            "?X-Amz-Signature=ab&X-Amz-Date=1",
            "?X-ID=PutObject",
            "?cb=1",
            "?foo",
            "?&",
            "?versionId=v1",
            "?uploads",
            "?uploadId=u1",
            "?partNumber=1",
            "?uploadId=&partNumber=1",
            "?torrent",
            "?restore",
            "?select",
            "?attributes",
            "?renameObject",
        ] {
            assert!(!put(&S3, &format!("/b/k{q}"), &none), "{q}");
        }
        for q in [
            "?uploadId=u1&partNumber=2",
            "?partNumber=2&x-id=UploadPart&uploadId=u1",
            "?tagging",
            "?acl",
            "?x-id=PutObject&retention",
            "?legal-hold",
            "?%74agging",
        ] {
            assert!(put(&S3, &format!("/b/k{q}"), &none), "{q}");
        }
        // Deleting a subresource, an upload or one version is not deleting the document.
        for q in ["?uploadId=u1", "?tagging", "?versionId=v1"] {
            assert!(delete(&S3, &format!("/b/k{q}")), "{q}");
            assert!(!put(&S3, &format!("/b/k{q}"), &none) || q == "?tagging", "{q}");
        }
        for q in ["", "?uploadId=", "?versionId=", "?x-id=DeleteObject"] {
            assert!(!delete(&S3, &format!("/b/k{q}")), "{q}");
        }
        let mut copy = http::HeaderMap::new();
        copy.insert("x-amz-copy-source", http::HeaderValue::from_static("/b/k"));
        assert!(put(&S3, "/b/k", &copy));
        let doc = |target: &str, session: &str| {
            COUCHDB.not_a_write(&http::Method::PUT, &target.parse().expect("uri"), &none, session)
        };
        assert!(doc("/db/_security", "_security"));
        assert!(!doc("/db/s_1?rev=1-a", "s_1"));
        // A system database holds no session's document, however its name is spelled.
        for target in [
            "/_users/org.couchdb.user:jan",
            "/%5Freplicator/r1",
            "/_global_changes/x",
        ] {
            assert!(doc(target, "x"), "{target}");
        }
        assert!(!doc("/db_/x", "x"));
        assert!(!HTTP.not_a_write(&http::Method::PUT, &"/_x?tagging".parse().expect("uri"), &copy, "_x"));
    }

    #[test]
    fn each_dialect_names_its_conflicts_and_managed_fields() {
        assert!(HTTP.is_conflict(412) && HTTP.is_conflict(409));
        assert!(S3.is_conflict(412) && S3.is_conflict(409));
        assert!(COUCHDB.is_conflict(409));
        assert!(COUCHDB.manages("_rev") && COUCHDB.manages("_id") && !S3.manages("_rev"));
        assert_eq!(DialectName::default().dialect(), &HTTP);
    }
}
