//! `admission.k8s.io/v1` AdmissionReview: the request the API server sends, and the answer
//! (allowed, with a base64 JSONPatch when the pod gets the sidecar).

use serde::Deserialize;
use serde_json::{json, Value};

use super::pod::{self, Outcome, Scope};
use super::WebhookArgs;

pub const API_VERSION: &str = "admission.k8s.io/v1";
pub const KIND: &str = "AdmissionReview";

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Review {
    api_version: String,
    kind: String,
    request: Option<Request>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Request {
    uid: String,
    kind: GroupVersionKind,
    #[serde(default)]
    operation: String,
    #[serde(default)]
    object: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct GroupVersionKind {
    #[serde(default)]
    group: String,
    #[serde(default)]
    kind: String,
}

/// A request body that is not an AdmissionReview the webhook can answer (HTTP 400).
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    #[error("not an AdmissionReview: {0}")]
    Malformed(String),
    #[error("expected apiVersion {API_VERSION} and kind {KIND}, got {0} {1}")]
    WrongType(String, String),
    #[error("the AdmissionReview has no request")]
    NoRequest,
}

/// Answers one AdmissionReview body.
pub fn answer(body: &[u8], scope: Scope, defaults: &WebhookArgs) -> Result<Value, ReviewError> {
    let review: Review = serde_json::from_slice(body).map_err(|e| ReviewError::Malformed(e.to_string()))?;
    if review.api_version != API_VERSION || review.kind != KIND {
        return Err(ReviewError::WrongType(review.api_version, review.kind));
    }
    let request = review.request.ok_or(ReviewError::NoRequest)?;
    if request.uid.is_empty() {
        return Err(ReviewError::Malformed("request.uid is empty".into()));
    }
    let is_pod = request.kind.group.is_empty() && request.kind.kind == "Pod";
    let outcome = match (&request.object, is_pod, request.operation.as_str()) {
        (Some(object), true, "CREATE") => pod::inject(object, scope, defaults),
        (_, false, _) => Outcome::Unchanged("not a pod"),
        (None, true, _) => Outcome::Unchanged("the request carries no pod"),
        (Some(_), true, _) => Outcome::Unchanged("only pod creation is mutated"),
    };
    let response = match outcome {
        Outcome::Unchanged(reason) => {
            tracing::debug!(uid = %request.uid, reason, "admitted unchanged");
            json!({"uid": request.uid, "allowed": true})
        }
        Outcome::Patch { patch, warnings } => {
            let bytes = serde_json::to_vec(&patch).map_err(|e| ReviewError::Malformed(e.to_string()))?;
            tracing::info!(uid = %request.uid, ops = patch.0.len(), "sidecar injected");
            let mut r = json!({
                "uid": request.uid,
                "allowed": true,
                "patchType": "JSONPatch",
                "patch": k8s_openapi::ByteString(bytes),
            });
            if !warnings.is_empty() {
                r["warnings"] = json!(warnings);
            }
            r
        }
        Outcome::Refuse(message) => {
            tracing::info!(uid = %request.uid, %message, "pod refused");
            json!({
                "uid": request.uid,
                "allowed": false,
                "status": {"code": 400, "reason": "BadRequest", "message": message},
            })
        }
    };
    Ok(json!({"apiVersion": API_VERSION, "kind": KIND, "response": response}))
}
