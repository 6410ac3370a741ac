//! What can go wrong with a request to the store, and whether its outcome is known.

use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("the context store did not answer within {0:?}")]
    Timeout(Duration),
    /// The connection to the store failed after the request may have been sent.
    #[error("the context store is unreachable: {0}")]
    Unreachable(String),
    /// The store's answer is not HTTP hyper can read (garbage, a head framed two ways). The
    /// request was sent: a write may have been applied.
    #[error("the context store's answer is not valid HTTP: {0}")]
    InvalidAnswer(String),
    /// The request never left: no connection to the store could be made, or no request could
    /// be built. Nothing was written.
    #[error("the context store could not be reached: {0}")]
    NotSent(String),
    #[error("the context store refused the conditional write (412)")]
    PreconditionFailed,
    #[error("the context store refused the write: a newer lock grant already wrote this session")]
    FencedOut,
    #[error("the context store answered {status}")]
    Status { status: StatusCode, body: Bytes },
    #[error("the context store returned a document turnlock cannot read: {0}")]
    InvalidDocument(String),
}

impl UpstreamError {
    /// Whether the write may have landed even though no confirmation came back.
    pub fn outcome_unknown(&self) -> bool {
        matches!(self, Self::Timeout(_) | Self::Unreachable(_) | Self::InvalidAnswer(_))
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Self::FencedOut => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::BAD_GATEWAY,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            Self::Timeout(_) => "upstream_timeout",
            Self::Unreachable(_) | Self::NotSent(_) => "upstream_unavailable",
            Self::PreconditionFailed => "upstream_conflict",
            Self::FencedOut => "fenced_out",
            Self::Status { .. } | Self::InvalidAnswer(_) => "upstream_error",
            Self::InvalidDocument(_) => "upstream_invalid_document",
        }
    }
}

/// An error with its causes, one after another.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}
