//! AWS Signature Version 4 for turnlock's own requests to an S3-compatible store (its read and
//! its write-back), with the `aws-sigv4` crate. Credentials come from the usual sources, in
//! the AWS SDKs' order: the environment variables (`AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`), read at each request so that a rotated set is
//! used as soon as the environment has it; else a web identity token file, as on EKS
//! (`AWS_WEB_IDENTITY_TOKEN_FILE`, `AWS_ROLE_ARN`: see [`super::web_identity`]).

use std::sync::Arc;
use std::time::SystemTime;

use aws_credential_types::Credentials;
use aws_sigv4::http_request::{
    sign, PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest, SigningSettings,
    UriPathNormalizationMode,
};
use aws_sigv4::sign::v4;
use aws_smithy_runtime_api::client::identity::Identity;
use http::Request;

use super::web_identity::{WebIdentity, WebIdentityConfig};

/// Headers that carry a client's own signature: replaced by turnlock's.
const SIGNATURE_HEADERS: [&str; 4] = [
    "authorization",
    "x-amz-date",
    "x-amz-content-sha256",
    "x-amz-security-token",
];

/// Signs requests for one region and service (`s3`).
#[derive(Clone)]
pub struct Signer {
    region: String,
    service: String,
    /// Credentials for a role, from a web identity token, when the environment names one.
    web_identity: Option<Arc<WebIdentity>>,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer")
            .field("region", &self.region)
            .field("service", &self.service)
            .field("web_identity", &self.web_identity.is_some())
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SignError {
    #[error("no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary ones), or AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN")]
    NoCredentials,
    #[error("{0}")]
    WebIdentity(String),
    #[error("cannot sign the request: {0}")]
    Signing(String),
}

impl Signer {
    /// A signer with credentials from the environment variables only.
    pub fn new(region: &str, service: &str) -> Self {
        Self {
            region: region.to_owned(),
            service: service.to_owned(),
            web_identity: None,
        }
    }

    /// A signer with credentials from the usual sources: the environment variables, else a
    /// web identity token file when the environment names one (its credentials are then
    /// fetched at once, and refreshed before they expire).
    pub fn from_env(region: &str, service: &str) -> Result<Self, String> {
        let web_identity = match WebIdentityConfig::from_env(region) {
            Some(config) => {
                let provider = WebIdentity::shared(config)?;
                provider.start();
                Some(provider)
            }
            None => None,
        };
        Ok(Self {
            web_identity,
            ..Self::new(region, service)
        })
    }

    fn credentials(&self) -> Result<Credentials, SignError> {
        let var = |name| std::env::var(name).ok().filter(|v| !v.is_empty());
        match (
            var("AWS_ACCESS_KEY_ID"),
            var("AWS_SECRET_ACCESS_KEY"),
            &self.web_identity,
        ) {
            (Some(id), Some(secret), _) => Ok(Credentials::new(
                id,
                secret,
                var("AWS_SESSION_TOKEN"),
                None,
                "environment",
            )),
            (_, _, Some(web_identity)) => web_identity.credentials().map_err(SignError::WebIdentity),
            _ => Err(SignError::NoCredentials),
        }
    }

    /// Signs `req` (whose URI is absolute) with a body of `body`, replacing any signature a
    /// client put on it.
    pub fn sign<B>(&self, req: &mut Request<B>, body: &[u8]) -> Result<(), SignError> {
        self.sign_body(req, SignableBody::Bytes(body))
    }

    /// Signs a request forwarded as the client sent it (its body streamed, not signed): the
    /// client signed it for the sidecar's address, which the store does not answer at.
    pub fn sign_forwarded<B>(&self, req: &mut Request<B>) -> Result<(), SignError> {
        self.sign_body(req, SignableBody::UnsignedPayload)
    }

    fn sign_body<B>(&self, req: &mut Request<B>, body: SignableBody<'_>) -> Result<(), SignError> {
        for name in SIGNATURE_HEADERS {
            req.headers_mut().remove(name);
        }
        let identity: Identity = self.credentials()?.into();
        let mut settings = SigningSettings::default();
        // S3's rules: the payload hash is sent and signed, the path is neither normalized nor
        // encoded twice.
        settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
        settings.percent_encoding_mode = PercentEncodingMode::Single;
        settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
        let params = v4::SigningParams::builder()
            .identity(&identity)
            .region(&self.region)
            .name(&self.service)
            .time(SystemTime::now())
            .settings(settings)
            .build()
            .map_err(|e| SignError::Signing(e.to_string()))?
            .into();
        let uri = req.uri().to_string();
        let headers: Vec<(&str, &str)> = req
            .headers()
            .iter()
            .filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?)))
            .collect();
        let signable = SignableRequest::new(req.method().as_str(), uri.as_str(), headers.into_iter(), body)
            .map_err(|e| SignError::Signing(e.to_string()))?;
        let (instructions, _) = sign(signable, &params)
            .map_err(|e| SignError::Signing(e.to_string()))?
            .into_parts();
        instructions.apply_to_request_http1x(req);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signed_request_carries_turnlocks_signature_not_the_clients() {
        std::env::set_var("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "secret");
        let mut req = Request::builder()
            .method("PUT")
            .uri("http://127.0.0.1:9000/bucket/sessions/s1.json")
            .header("authorization", "AWS4-HMAC-SHA256 Credential=client/…")
            .header("x-amz-meta-owner", "a")
            .body(())
            .unwrap();
        Signer::new("us-east-1", "s3").sign(&mut req, b"{}").unwrap();
        let auth = req.headers()["authorization"].to_str().unwrap();
        assert!(auth.starts_with("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/"), "{auth}");
        assert!(auth.contains("/us-east-1/s3/aws4_request"), "{auth}");
        assert!(auth.contains("x-amz-meta-owner"), "metadata is signed: {auth}");
        assert!(req.headers().contains_key("x-amz-date"));
        assert!(req.headers().contains_key("x-amz-content-sha256"));
    }
}
