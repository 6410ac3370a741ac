//! HTTP plumbing shared by every server here: the body type, JSON answers and errors, the
//! hop-by-hop header rules.

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::Value;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Every body turnlock sends or forwards.
pub type Body = http_body_util::combinators::BoxBody<Bytes, BoxError>;

pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).map_err(|never| match never {}).boxed()
}

/// Any body as a [`Body`] (hyper's, or one built in memory).
pub fn boxed<B>(body: B) -> Body
where
    B: http_body::Body<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(|e| -> BoxError { e.into() }).boxed()
}

pub fn empty() -> Body {
    full(Bytes::new())
}

pub fn json(status: StatusCode, value: &Value) -> Response<Body> {
    let bytes = serde_json::to_vec(value).unwrap_or_default();
    let mut res = Response::new(full(bytes));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    res
}

/// A JSON error: `{"error": code, "message": ..., ...extra}`.
pub fn error(status: StatusCode, code: &str, message: impl std::fmt::Display, extra: Option<Value>) -> Response<Body> {
    let mut body = serde_json::json!({"error": code, "message": message.to_string()});
    if let (Some(Value::Object(extra)), Value::Object(map)) = (extra, &mut body) {
        map.extend(extra);
    }
    json(status, &body)
}

/// Headers that describe one connection, not the message: never forwarded (RFC 9110 §7.6.1).
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Removes hop-by-hop headers, including any the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names present (usually a handful), not one lookup per listed name.
    let present = headers
        .keys()
        .any(|name| HOP_BY_HOP.contains(name) || name.as_str() == "proxy-connection");
    if !present {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
    headers.remove("proxy-connection");
}

/// Parses an entity tag holding a version number: `"12"`, `W/"12"` or `12`.
pub fn version_from_etag(raw: &str) -> Option<u64> {
    let raw = raw.trim();
    let raw = raw.strip_prefix("W/").unwrap_or(raw);
    raw.trim_matches('"').parse().ok()
}

pub fn etag_for(version: u64) -> HeaderValue {
    HeaderValue::from_str(&format!("\"{version}\"")).unwrap_or_else(|_| HeaderValue::from_static("\"0\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_and_those_named_by_connection_are_removed() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, x-private"));
        h.insert("x-private", HeaderValue::from_static("1"));
        h.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn etags_parse_to_versions() {
        assert_eq!(version_from_etag("\"12\""), Some(12));
        assert_eq!(version_from_etag("W/\"3\""), Some(3));
        assert_eq!(version_from_etag("7"), Some(7));
        assert_eq!(version_from_etag("\"abc\""), None);
    }
}
