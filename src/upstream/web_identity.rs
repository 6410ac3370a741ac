//! AWS credentials from a web identity token file, as on EKS (IAM roles for service
//! accounts): the pod's projected token (`AWS_WEB_IDENTITY_TOKEN_FILE`) is exchanged for the
//! role's temporary credentials (`AWS_ROLE_ARN`, `AWS_ROLE_SESSION_NAME`) with STS
//! `AssumeRoleWithWebIdentity`. The credentials are cached and refreshed in the background
//! before they expire, the token file read anew at each refresh (the kubelet rotates it).
//!
//! The call is a plain form POST that STS takes without a signature, made on the proxy's own
//! HTTP client stack (hyper, rustls): the AWS SDK's provider would bring the SDK's own HTTP
//! stack and its STS client along for this one request.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use aws_credential_types::Credentials;
use bytes::Bytes;
use http::{header, Method, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::connect::CappedConnector;

/// The longest an STS call may take.
const STS_TIMEOUT: Duration = Duration::from_secs(10);
/// Credentials are refreshed this long before they expire at the most (as the AWS SDKs do)...
const REFRESH_BEFORE: Duration = Duration::from_secs(300);
/// ...and, for short-lived ones, once this fraction of their life is left.
const REFRESH_AT_LIFE_LEFT: u32 = 4;
/// Pauses between attempts after a failed refresh.
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);
/// The longest pause between STS requests while no valid credentials are held.
const RETRY_WITHOUT_CREDENTIALS: Duration = Duration::from_secs(2);

/// Where the token and the role are named (the variables the AWS SDKs read).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WebIdentityConfig {
    pub token_file: std::path::PathBuf,
    pub role_arn: String,
    pub session_name: String,
    /// STS's URL: `AWS_ENDPOINT_URL_STS`, else `AWS_ENDPOINT_URL`, else the region's.
    pub endpoint: String,
}

impl WebIdentityConfig {
    /// From the environment; `None` unless both `AWS_WEB_IDENTITY_TOKEN_FILE` and
    /// `AWS_ROLE_ARN` are set. STS is reached in `AWS_REGION` (else `AWS_DEFAULT_REGION`,
    /// else `region`, the store's).
    pub fn from_env(region: &str) -> Option<Self> {
        let var = |name| std::env::var(name).ok().filter(|v: &String| !v.is_empty());
        let (token_file, role_arn) = (var("AWS_WEB_IDENTITY_TOKEN_FILE")?, var("AWS_ROLE_ARN")?);
        let session_name = var("AWS_ROLE_SESSION_NAME").unwrap_or_else(|| {
            let millis = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis());
            format!("turnlock-{millis}")
        });
        let region = var("AWS_REGION")
            .or_else(|| var("AWS_DEFAULT_REGION"))
            .unwrap_or_else(|| region.to_owned());
        let endpoint = var("AWS_ENDPOINT_URL_STS")
            .or_else(|| var("AWS_ENDPOINT_URL"))
            .unwrap_or_else(|| format!("https://sts.{region}.amazonaws.com"));
        Some(Self {
            token_file: token_file.into(),
            role_arn,
            session_name,
            endpoint,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StsError {
    #[error("cannot read the web identity token file {path}: {source}")]
    Token { path: String, source: std::io::Error },
    #[error("STS endpoint {0:?} is not a URL")]
    Endpoint(String),
    #[error("STS unreachable: {0}")]
    Unreachable(String),
    #[error("STS refused AssumeRoleWithWebIdentity ({status}): {code}: {message}")]
    Refused { status: u16, code: String, message: String },
    #[error("STS answered what is not a credential: {0}")]
    Answer(String),
}

/// The role's credentials, kept fresh in the background.
pub struct WebIdentity {
    config: WebIdentityConfig,
    client: Client<CappedConnector, Full<Bytes>>,
    /// The credentials last obtained, or why there are none.
    current: Mutex<Result<Credentials, String>>,
    started: OnceLock<()>,
}

impl WebIdentity {
    /// The provider of this process for `config` (one refresh loop, whatever the number of
    /// stores signed for).
    pub fn shared(config: WebIdentityConfig) -> Result<Arc<Self>, String> {
        static SHARED: Mutex<Vec<Arc<WebIdentity>>> = Mutex::new(Vec::new());
        let mut all = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(found) = all.iter().find(|w| w.config == config) {
            return Ok(found.clone());
        }
        let made = Arc::new(Self::new(config)?);
        all.push(made.clone());
        Ok(made)
    }

    fn new(config: WebIdentityConfig) -> Result<Self, String> {
        let uri: Uri = config
            .endpoint
            .parse()
            .map_err(|_| StsError::Endpoint(config.endpoint.clone()).to_string())?;
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(STS_TIMEOUT));
        let mut connector = CappedConnector::new(http, 4);
        if uri.scheme() == Some(&http::uri::Scheme::HTTPS) {
            connector =
                connector.with_tls(super::tls::tls_config(None).map_err(|e| format!("STS {}: {e}", config.endpoint))?);
        }
        Ok(Self {
            config,
            client: Client::builder(TokioExecutor::new()).build(connector),
            current: Mutex::new(Err("not obtained yet".into())),
            started: OnceLock::new(),
        })
    }

    /// Starts the refresh loop (once), when a runtime is there to run it.
    pub fn start(self: &Arc<Self>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        self.started.get_or_init(|| {
            runtime.spawn(refresh_loop(Arc::downgrade(self)));
        });
    }

    /// The credentials to sign with now.
    pub fn credentials(self: &Arc<Self>) -> Result<Credentials, String> {
        self.start();
        let current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        match &*current {
            Ok(c) if c.expiry().map_or(true, |at| at > SystemTime::now()) => Ok(c.clone()),
            Ok(_) => Err(format!(
                "the credentials of {} expired and were not renewed",
                self.config.role_arn
            )),
            Err(why) => Err(format!(
                "no credentials for {} from web identity: {why}",
                self.config.role_arn
            )),
        }
    }

    /// One `AssumeRoleWithWebIdentity` call, with the token as the file holds it now.
    pub async fn fetch(&self) -> Result<Credentials, StsError> {
        let path = &self.config.token_file;
        // A small file on a projected volume: read in place.
        let token = std::fs::read_to_string(path).map_err(|source| StsError::Token {
            path: path.display().to_string(),
            source,
        })?;
        let body: String = form_urlencoded::Serializer::new(String::new())
            .append_pair("Action", "AssumeRoleWithWebIdentity")
            .append_pair("Version", "2011-06-15")
            .append_pair("RoleArn", &self.config.role_arn)
            .append_pair("RoleSessionName", &self.config.session_name)
            .append_pair("WebIdentityToken", token.trim())
            .finish();
        let req = Request::builder()
            .method(Method::POST)
            .uri(&self.config.endpoint)
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .header(header::ACCEPT, "text/xml")
            .body(Full::new(Bytes::from(body)))
            .map_err(|_| StsError::Endpoint(self.config.endpoint.clone()))?;
        let call = async {
            let res = self
                .client
                .request(req)
                .await
                .map_err(|e| StsError::Unreachable(super::error::error_chain(&e)))?;
            let status = res.status();
            let body = res
                .into_body()
                .collect()
                .await
                .map_err(|e| StsError::Unreachable(e.to_string()))?
                .to_bytes();
            Ok::<_, StsError>((status, body))
        };
        let (status, body) = tokio::time::timeout(STS_TIMEOUT, call)
            .await
            .map_err(|_| StsError::Unreachable(format!("no answer within {STS_TIMEOUT:?}")))??;
        let text = String::from_utf8_lossy(&body);
        if !status.is_success() {
            let (code, message) = sts_error(&text);
            return Err(StsError::Refused {
                status: status.as_u16(),
                code,
                message,
            });
        }
        parse_credentials(&text)
    }
}

/// Fetches credentials, then again before they expire, for as long as a signer uses them.
async fn refresh_loop(this: std::sync::Weak<WebIdentity>) {
    let mut retry = RETRY_MIN;
    loop {
        let Some(provider) = this.upgrade() else {
            return;
        };
        let pause = match provider.fetch().await {
            Ok(credentials) => {
                retry = RETRY_MIN;
                let pause = credentials
                    .expiry()
                    .and_then(|at| at.duration_since(SystemTime::now()).ok())
                    .map_or(REFRESH_BEFORE, refresh_after);
                tracing::debug!(role = %provider.config.role_arn, next_in = ?pause, "web identity credentials obtained");
                *provider.current.lock().unwrap_or_else(|e| e.into_inner()) = Ok(credentials);
                pause
            }
            Err(error) => {
                if let Some(suppressed) = crate::telemetry::warn_allowed("web identity credentials") {
                    tracing::warn!(role = %provider.config.role_arn, %error, suppressed, "web identity credentials not obtained; retrying");
                }
                let mut current = provider.current.lock().unwrap_or_else(|e| e.into_inner());
                // Credentials still valid are kept: a failed refresh is retried before they expire.
                let keep = matches!(&*current, Ok(c) if c.expiry().map_or(true, |at| at > SystemTime::now()));
                if !keep {
                    *current = Err(error.to_string());
                }
                let pause = retry;
                // Without valid credentials every signed request fails: STS is asked again
                // soon, so writes resume within seconds of it answering.
                retry = (retry * 2).min(if keep { RETRY_MAX } else { RETRY_WITHOUT_CREDENTIALS });
                pause.min(if keep { RETRY_MAX } else { RETRY_WITHOUT_CREDENTIALS })
            }
        };
        drop(provider);
        tokio::time::sleep(pause).await;
    }
}

/// How long to use credentials with `left` to live before refreshing them: until
/// [`REFRESH_BEFORE`] is left, or a [`REFRESH_AT_LIFE_LEFT`]th of their life for short ones.
fn refresh_after(left: Duration) -> Duration {
    let margin = (left / REFRESH_AT_LIFE_LEFT).min(REFRESH_BEFORE);
    left.saturating_sub(margin).max(Duration::from_millis(100))
}

/// The credentials in an `AssumeRoleWithWebIdentity` answer.
fn parse_credentials(xml: &str) -> Result<Credentials, StsError> {
    let doc = roxmltree::Document::parse(xml).map_err(|e| StsError::Answer(e.to_string()))?;
    let Some(creds) = doc.descendants().find(|n| n.has_tag_name("Credentials")) else {
        return Err(StsError::Answer("no Credentials element".into()));
    };
    let field = |name: &str| {
        creds
            .children()
            .find(|n| n.has_tag_name(name))
            .and_then(|n| n.text())
            .map(|t| t.trim().to_owned())
            .filter(|t| !t.is_empty())
    };
    let missing = |name: &str| StsError::Answer(format!("no {name}"));
    let id = field("AccessKeyId").ok_or_else(|| missing("AccessKeyId"))?;
    let secret = field("SecretAccessKey").ok_or_else(|| missing("SecretAccessKey"))?;
    let token = field("SessionToken").ok_or_else(|| missing("SessionToken"))?;
    let expiration = field("Expiration").ok_or_else(|| missing("Expiration"))?;
    let expiry = aws_smithy_types::DateTime::from_str(&expiration, aws_smithy_types::date_time::Format::DateTime)
        .ok()
        .and_then(|t| SystemTime::try_from(t).ok())
        .ok_or_else(|| StsError::Answer(format!("Expiration {expiration:?} is not a date")))?;
    Ok(Credentials::new(id, secret, Some(token), Some(expiry), "web-identity"))
}

/// The code and message of an STS error answer (or the start of the answer as it came).
fn sts_error(xml: &str) -> (String, String) {
    let text = |name: &str| {
        roxmltree::Document::parse(xml).ok().and_then(|doc| {
            doc.descendants()
                .find(|n| n.has_tag_name(name))
                .and_then(|n| n.text())
                .map(str::to_owned)
        })
    };
    match (text("Code"), text("Message")) {
        (Some(code), message) => (code, message.unwrap_or_default()),
        _ => ("unknown".into(), xml.chars().take(200).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_sts_answer_gives_the_roles_temporary_credentials() {
        let xml = r#"<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">
  <AssumeRoleWithWebIdentityResult>
    <Credentials>
      <SessionToken>FQoGZXIvYXdzEE0a</SessionToken>
      <SecretAccessKey>wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKEY</SecretAccessKey>
      <Expiration>2014-10-24T23:00:23Z</Expiration>
      <AccessKeyId>ASgeIAIOSFODNN7EXAMPLE</AccessKeyId>
    </Credentials>
  </AssumeRoleWithWebIdentityResult>
</AssumeRoleWithWebIdentityResponse>"#;
        let c = parse_credentials(xml).expect("credentials");
        assert_eq!(c.access_key_id(), "ASgeIAIOSFODNN7EXAMPLE");
        assert_eq!(c.session_token(), Some("FQoGZXIvYXdzEE0a"));
        let at = c.expiry().expect("expiry");
        assert_eq!(
            at.duration_since(SystemTime::UNIX_EPOCH).expect("after 1970").as_secs(),
            1_414_191_623
        );
    }

    #[test]
    fn an_sts_error_names_its_code() {
        let xml = r#"<ErrorResponse><Error><Type>Sender</Type><Code>InvalidIdentityToken</Code><Message>bad token</Message></Error></ErrorResponse>"#;
        assert_eq!(sts_error(xml), ("InvalidIdentityToken".into(), "bad token".into()));
        assert!(parse_credentials(xml).is_err());
    }

    #[test]
    fn credentials_are_refreshed_before_they_expire() {
        let hour = Duration::from_secs(3600);
        assert_eq!(refresh_after(hour), hour - REFRESH_BEFORE);
        assert_eq!(refresh_after(Duration::from_secs(8)), Duration::from_secs(6));
        assert_eq!(refresh_after(Duration::ZERO), Duration::from_millis(100));
    }
}
