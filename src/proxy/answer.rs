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
    /// The store's own answer to the client's request (a session delete, a serialized
    /// write): passed on as it came, in every store dialect, where turnlock's own answers
    /// are put in the dialect's form.
    pub passed_on: bool,
}

impl Answer {
    pub fn json(status: StatusCode, value: &Value) -> Self {
        Self {
            status,
            headers: vec![(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))],
            body: Bytes::from(serde_json::to_vec(value).unwrap_or_default()),
            passed_on: false,
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
    /// `408`, `425` and `429` say "try again later": they are not final.
    pub fn is_final(&self) -> bool {
        let transient = matches!(
            self.status,
            StatusCode::REQUEST_TIMEOUT | StatusCode::TOO_EARLY | StatusCode::TOO_MANY_REQUESTS
        );
        self.status.is_success() || (self.status.is_client_error() && !transient)
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
    /// The random token of the claim: only its owner turns it into an answer or drops it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub done: Option<Stored>,
}

#[derive(Serialize, Deserialize)]
pub struct Stored {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// The body as text, when it is UTF-8.
    #[serde(default)]
    pub body: String,
    /// The body in base64, when it is not UTF-8 (a compressed answer, say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_base64: Option<String>,
    /// See [`Answer::passed_on`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub passed_on: bool,
}

impl Record {
    /// A new claim, with its own random token.
    pub fn pending(fingerprint: &str) -> Bytes {
        Bytes::from(
            serde_json::to_vec(&Record {
                fingerprint: fingerprint.to_owned(),
                claim: Some(format!("{:016x}{:016x}", rand::random::<u64>(), rand::random::<u64>())),
                done: None,
            })
            .unwrap_or_default(),
        )
    }

    /// The record of a final answer.
    pub fn done(fingerprint: &str, answer: &Answer) -> Option<Bytes> {
        let (body, body_base64) = match std::str::from_utf8(&answer.body) {
            Ok(text) => (text.to_owned(), None),
            Err(_) => (String::new(), Some(base64::encode(&answer.body))),
        };
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
                body_base64,
                passed_on: answer.passed_on,
            }),
            claim: None,
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
            body: match &self.body_base64 {
                Some(b64) => Bytes::from(base64::decode(b64).unwrap_or_default()),
                None => Bytes::from(self.body.clone()),
            },
            passed_on: self.passed_on,
        }
    }
}

/// Standard base64 (RFC 4648, with padding), for bodies that are not text.
mod base64 {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

    pub fn encode(bytes: &[u8]) -> String {
        let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
        for chunk in bytes.chunks(3) {
            let n = (u32::from(chunk[0]) << 16)
                | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8)
                | u32::from(*chunk.get(2).unwrap_or(&0));
            for i in 0..4 {
                if i <= chunk.len() {
                    out.push(ALPHABET[(n >> (18 - 6 * i)) as usize & 63] as char);
                } else {
                    out.push('=');
                }
            }
        }
        out
    }

    pub fn decode(text: &str) -> Option<Vec<u8>> {
        let mut out = Vec::with_capacity(text.len() / 4 * 3);
        let (mut acc, mut bits) = (0u32, 0u32);
        for c in text.bytes().filter(|c| *c != b'=') {
            let v = ALPHABET.iter().position(|a| *a == c)? as u32;
            acc = (acc << 6) | v;
            bits += 6;
            if bits >= 8 {
                bits -= 8;
                out.push((acc >> bits) as u8);
                acc &= (1 << bits) - 1;
            }
        }
        Some(out)
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn base64_round_trips_every_length() {
            let data: Vec<u8> = (0..=255u8).chain([0x1f, 0x8b, 0, 0xff]).collect();
            for n in 0..data.len() {
                assert_eq!(super::decode(&super::encode(&data[..n])).as_deref(), Some(&data[..n]));
            }
            assert_eq!(super::encode(b"foobar"), "Zm9vYmFy");
            assert_eq!(super::encode(b"fo"), "Zm8=");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16) -> Answer {
        Answer::error(StatusCode::from_u16(code).unwrap(), "x", "x", None)
    }

    #[test]
    fn try_again_later_answers_are_not_final() {
        for code in [200, 201, 400, 404, 409, 412, 413, 422, 428] {
            assert!(status(code).is_final(), "{code}");
        }
        for code in [408, 425, 429, 500, 502, 503, 504] {
            assert!(!status(code).is_final(), "{code}");
        }
    }

    #[test]
    fn a_record_keeps_a_body_that_is_not_text() {
        let mut answer = status(201);
        answer.body = Bytes::from_static(&[0x1f, 0x8b, 0x08, 0x00, 0xff]);
        let bytes = Record::done("fp", &answer).unwrap();
        let replayed = Record::parse(&bytes).unwrap().done.unwrap().answer();
        assert_eq!(replayed.body, answer.body);
        assert_eq!(replayed.status, StatusCode::CREATED);
    }

    #[test]
    fn every_claim_is_its_own() {
        assert_ne!(Record::pending("fp"), Record::pending("fp"));
    }
}
