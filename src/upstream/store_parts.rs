//! What the write-back of a merge keeps of the client's request, in the store's dialect.

use http::header;

use crate::routes::Dialect;

/// What the write-back of a merge keeps of the client's request, in the store's dialect.
#[derive(Clone, Debug)]
pub struct StoreParts {
    pub dialect: &'static Dialect,
    /// The client's end-to-end headers the dialect keeps (metadata, encryption, content type,
    /// credentials).
    pub headers: http::HeaderMap,
    /// `If-Match` with the store's own entity tag: the write applies only to that version.
    pub if_match: Option<http::HeaderValue>,
    /// `If-None-Match: *`: the write applies only if the document does not exist.
    pub if_none_match: bool,
}

impl Default for StoreParts {
    fn default() -> Self {
        Self {
            dialect: &crate::routes::dialect::HTTP,
            headers: http::HeaderMap::new(),
            if_match: None,
            if_none_match: false,
        }
    }
}

impl StoreParts {
    pub fn of(dialect: &'static Dialect, headers: &http::HeaderMap) -> Self {
        let if_none_match = headers
            .get(header::IF_NONE_MATCH)
            .is_some_and(|v| v.as_bytes().trim_ascii() == b"*");
        if dialect.answers_natively() {
            return Self {
                if_none_match,
                ..Self::default()
            };
        }
        let mut kept = http::HeaderMap::new();
        for (name, value) in headers {
            if dialect.keeps(name.as_str()) {
                kept.append(name.clone(), value.clone());
            }
        }
        Self {
            dialect,
            headers: kept,
            if_match: headers.get(header::IF_MATCH).cloned(),
            if_none_match,
        }
    }
}
