//! The answer to one write: status, a few headers and a body, small enough to keep as an
//! idempotency record and replay byte for byte.

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{Response, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::http::{full, Body};

#[derive(Clone, Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub body: Bytes,
}

impl Answer {
    pub fn json(status: StatusCode, value: &Value) -> Self {
        Self {
            status,
            headers: vec![(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))],
            body: Bytes::from(serde_json::to_vec(value).unwrap_or_default()),
        }
    }

    /// `{"error": code, "message": ..., ...extra}`.
    pub fn error(status: StatusCode, code: &str, message: impl std::fmt::Display, extra: Option<Value>) -> Self {
        let mut body = serde_json::json!({"error": code, "message": message.to_string()});
        if let (Some(Value::Object(extra)), Value::Object(map)) = (extra, &mut body) {
            map.extend(extra);
        }
        Self::json(status, &body)
    }

    /// A retryable refusal: 503 with `Retry-After`.
    pub fn retryable(code: &str, message: impl std::fmt::Display) -> Self {
        let mut a = Self::error(
            StatusCode::SERVICE_UNAVAILABLE,
            code,
            message,
            Some(serde_json::json!({"retryable": true})),
        );
        a.headers.push((header::RETRY_AFTER, HeaderValue::from_static("1")));
        a
    }

    pub fn with_header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.push((name, value));
        self
    }

    /// Whether a retry of the same request would get the same answer, so it may be recorded
    /// under its idempotency key: successes and refusals of the request itself, not
    /// transient failures.
    pub fn is_final(&self) -> bool {
        self.status.is_success() || self.status.is_client_error()
    }

    /// The error code of a refusal (its body's `error` field, as a bounded metric label);
    /// empty for a success.
    pub fn code(&self) -> &'static str {
        if self.status.is_success() {
            return "";
        }
        serde_json::from_slice::<Value>(&self.body)
            .ok()
            .and_then(|v| v["error"].as_str().map(crate::metrics::error_label))
            .unwrap_or("other")
    }

    pub fn into_response(self) -> Response<Body> {
        let code = self.code();
        let mut res = Response::new(full(self.body));
        res.extensions_mut().insert(crate::metrics::ErrorCode(code));
        *res.status_mut() = self.status;
        for (k, v) in self.headers {
            res.headers_mut().append(k, v);
        }
        res
    }
}

/// An idempotency record: a claim while the request is in flight, then its answer.
#[derive(Serialize, Deserialize)]
pub struct Record {
    pub fingerprint: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub done: Option<Stored>,
}

#[derive(Serialize, Deserialize)]
pub struct Stored {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Record {
    pub fn pending(fingerprint: &str) -> Bytes {
        Bytes::from(
            serde_json::to_vec(&Record {
                fingerprint: fingerprint.to_owned(),
                done: None,
            })
            .unwrap_or_default(),
        )
    }

    /// The record of a final answer, when its body can be kept as text.
    pub fn done(fingerprint: &str, answer: &Answer) -> Option<Bytes> {
        let body = String::from_utf8(answer.body.to_vec()).ok()?;
        let headers = answer
            .headers
            .iter()
            .filter_map(|(k, v)| Some((k.as_str().to_owned(), v.to_str().ok()?.to_owned())))
            .collect();
        let record = Record {
            fingerprint: fingerprint.to_owned(),
            done: Some(Stored {
                status: answer.status.as_u16(),
                headers,
                body,
            }),
        };
        serde_json::to_vec(&record).ok().map(Bytes::from)
    }

    pub fn parse(bytes: &[u8]) -> Option<Self> {
        serde_json::from_slice(bytes).ok()
    }
}

impl Stored {
    pub fn answer(&self) -> Answer {
        Answer {
            status: StatusCode::from_u16(self.status).unwrap_or(StatusCode::OK),
            headers: self
                .headers
                .iter()
                .filter_map(|(k, v)| {
                    Some((
                        HeaderName::from_bytes(k.as_bytes()).ok()?,
                        HeaderValue::from_str(v).ok()?,
                    ))
                })
                .collect(),
            body: Bytes::from(self.body.clone()),
        }
    }
}
