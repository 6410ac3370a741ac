//! The pod annotations the injector reads, and the sidecar settings they resolve to (each falls
//! back to the webhook's cluster-wide default).

use std::collections::BTreeMap;

use super::WebhookArgs;

/// `"true"` opts a pod in, `"false"` opts it out (also read from a pod label of that name).
pub const INJECT: &str = "turnlock.dev/inject";
/// Set on every injected pod; a pod carrying it is never patched again.
pub const STATUS: &str = "turnlock.dev/status";
/// The store URL the sidecar forwards to.
pub const UPSTREAM: &str = "turnlock.dev/upstream";
/// The agent's environment variable that is set to the sidecar's address.
pub const STORE_URL_ENV: &str = "turnlock.dev/store-url-env";
/// Comma-separated agent containers to point at the sidecar (default: all of them).
pub const CONTAINERS: &str = "turnlock.dev/containers";
/// The sidecar's hold budget (`--lock-budget-ms`), in milliseconds.
pub const LOCK_BUDGET_MS: &str = "turnlock.dev/lock-budget-ms";
/// How long a write may wait for its turn (`--wait-deadline-ms`), in milliseconds.
pub const WAIT_DEADLINE_MS: &str = "turnlock.dev/wait-deadline-ms";
/// The Redis URL given to the sidecar.
pub const REDIS_URL: &str = "turnlock.dev/redis-url";
/// A Secret key holding the Redis URL, as `<secret-name>/<key>`.
pub const REDIS_SECRET: &str = "turnlock.dev/redis-secret";
pub const CPU_REQUEST: &str = "turnlock.dev/cpu-request";
pub const MEMORY_REQUEST: &str = "turnlock.dev/memory-request";
pub const CPU_LIMIT: &str = "turnlock.dev/cpu-limit";
pub const MEMORY_LIMIT: &str = "turnlock.dev/memory-limit";
/// The sidecar's `RUST_LOG`.
pub const LOG_LEVEL: &str = "turnlock.dev/log-level";
/// `"true"` / `"false"`: native sidecar or regular container, overriding the webhook default.
pub const NATIVE_SIDECAR: &str = "turnlock.dev/native-sidecar";
/// `"true"`: intercept the agent's store traffic with nat rules instead of changing its env.
pub const TRANSPARENT: &str = "turnlock.dev/transparent";
/// Comma-separated ports intercepted in transparent mode (default: the upstream URL's port).
pub const INTERCEPT_PORTS: &str = "turnlock.dev/intercept-ports";
/// A Secret holding the CA that signs Redis's certificate, as `<secret-name>` (key `ca.crt`)
/// or `<secret-name>/<key>`; mounted read-only, given as `--redis-ca`.
pub const REDIS_CA_SECRET: &str = "turnlock.dev/redis-ca-secret";
/// A `kubernetes.io/tls` Secret (`tls.crt`, `tls.key`): the client certificate for mutual TLS
/// with Redis; mounted read-only, given as `--redis-cert` / `--redis-key`.
pub const REDIS_CLIENT_CERT_SECRET: &str = "turnlock.dev/redis-client-cert-secret";
/// A Secret key holding the Redis password, as `<secret-name>/<key>`; mounted read-only,
/// given as `--redis-password-file`.
pub const REDIS_PASSWORD_SECRET: &str = "turnlock.dev/redis-password-secret";
/// The Redis ACL user (`--redis-username`).
pub const REDIS_USERNAME: &str = "turnlock.dev/redis-username";
/// The name Redis's certificate carries, when the URL's host is not it (`--redis-tls-server-name`).
pub const REDIS_TLS_SERVER_NAME: &str = "turnlock.dev/redis-tls-server-name";

/// Where the sidecar's Redis URL comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RedisSource {
    /// No Redis: the in-memory backend (one replica only).
    None,
    Url(String),
    Secret {
        name: String,
        key: String,
    },
}

/// Secrets mounted into the sidecar for its Redis connection, and the ACL user.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RedisAccess {
    /// The CA's Secret and key.
    pub ca: Option<(String, String)>,
    /// The client certificate's `kubernetes.io/tls` Secret.
    pub client_cert: Option<String>,
    /// The password's Secret and key.
    pub password: Option<(String, String)>,
    pub username: Option<String>,
    pub server_name: Option<String>,
}

/// Resource requests and limits of the sidecar.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resources {
    pub cpu_request: String,
    pub memory_request: String,
    pub cpu_limit: String,
    pub memory_limit: String,
}

/// Everything the injected containers are built from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub upstream: Option<String>,
    pub redis: RedisSource,
    pub redis_access: RedisAccess,
    pub lock_budget_ms: Option<u64>,
    pub wait_deadline_ms: Option<u64>,
    pub store_url_env: Option<String>,
    pub containers: Option<Vec<String>>,
    pub resources: Resources,
    pub log_level: String,
    pub native: bool,
    /// Intercepted ports, in transparent mode.
    pub transparent: Option<Vec<u16>>,
}

/// An annotation whose value cannot be used; the pod is refused with this message.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("annotation {key}: {reason}")]
pub struct InvalidAnnotation {
    pub key: &'static str,
    pub reason: String,
}

/// Whether a pod asks for the sidecar: its annotation (or label) decides, else the default
/// (`true` in a namespace that opted in).
pub fn wants_injection(
    annotations: &BTreeMap<String, String>,
    labels: &BTreeMap<String, String>,
    default: bool,
) -> Result<bool, InvalidAnnotation> {
    match annotations.get(INJECT).or_else(|| labels.get(INJECT)) {
        None => Ok(default),
        Some(v) => flag(INJECT, v),
    }
}

/// Resolves the settings of one pod.
pub fn resolve(annotations: &BTreeMap<String, String>, defaults: &WebhookArgs) -> Result<Settings, InvalidAnnotation> {
    let get = |key: &str| annotations.get(key).map(|v| v.trim().to_owned());

    let upstream = get(UPSTREAM).or_else(|| defaults.upstream.clone());
    if let Some(u) = &upstream {
        check_upstream(u)?;
    }

    let redis = match (get(REDIS_SECRET), get(REDIS_URL)) {
        (Some(s), _) => secret_ref(REDIS_SECRET, &s)?,
        (None, Some(u)) => redis_url(REDIS_URL, u)?,
        (None, None) => match (&defaults.redis_secret, &defaults.redis) {
            (Some(s), _) => secret_ref(REDIS_SECRET, s)?,
            (None, Some(u)) => redis_url(REDIS_URL, u.clone())?,
            (None, None) => RedisSource::None,
        },
    };

    let redis_access = redis_access(&get, &redis)?;

    let lock_budget_ms = millis(LOCK_BUDGET_MS, get(LOCK_BUDGET_MS))?;
    let wait_deadline_ms = millis(WAIT_DEADLINE_MS, get(WAIT_DEADLINE_MS))?;

    let store_url_env = get(STORE_URL_ENV).or_else(|| defaults.store_url_env.clone());
    if let Some(name) = &store_url_env {
        if !is_env_name(name) {
            return Err(invalid(
                STORE_URL_ENV,
                format!("{name:?} is not an environment variable name"),
            ));
        }
    }

    let containers = match get(CONTAINERS) {
        None => None,
        Some(v) => {
            let names: Vec<String> = v
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect();
            if names.is_empty() {
                return Err(invalid(CONTAINERS, "names no container".into()));
            }
            Some(names)
        }
    };

    let quantity = |key: &'static str, default: &str| -> Result<String, InvalidAnnotation> {
        let v = get(key).unwrap_or_else(|| default.to_owned());
        // An empty limit is no limit (the default for CPU).
        if is_quantity(&v) || (v.is_empty() && (key == CPU_LIMIT || key == MEMORY_LIMIT)) {
            Ok(v)
        } else {
            Err(invalid(key, format!("{v:?} is not a Kubernetes quantity")))
        }
    };
    let resources = Resources {
        cpu_request: quantity(CPU_REQUEST, &defaults.cpu_request)?,
        memory_request: quantity(MEMORY_REQUEST, &defaults.memory_request)?,
        cpu_limit: quantity(CPU_LIMIT, &defaults.cpu_limit)?,
        memory_limit: quantity(MEMORY_LIMIT, &defaults.memory_limit)?,
    };

    let log_level = get(LOG_LEVEL).unwrap_or_else(|| defaults.log_level.clone());
    if log_level.is_empty()
        || !log_level
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_=,:.-".contains(c))
    {
        return Err(invalid(LOG_LEVEL, format!("{log_level:?} is not a log filter")));
    }

    let native = match get(NATIVE_SIDECAR) {
        None => defaults.native_sidecar,
        Some(v) => flag(NATIVE_SIDECAR, &v)?,
    };

    let transparent = match get(TRANSPARENT) {
        None => false,
        Some(v) => flag(TRANSPARENT, &v)?,
    };
    let transparent = if transparent {
        Some(intercept_ports(get(INTERCEPT_PORTS), upstream.as_deref())?)
    } else {
        None
    };
    if transparent.is_none() && upstream.is_none() {
        return Err(invalid(
            UPSTREAM,
            "no store URL: set the annotation, or the injector's --upstream default".into(),
        ));
    }

    Ok(Settings {
        upstream,
        redis,
        redis_access,
        lock_budget_ms,
        wait_deadline_ms,
        store_url_env,
        containers,
        resources,
        log_level,
        native,
        transparent,
    })
}

/// A millisecond setting the sidecar accepts: 1 to 60000 (the bounds of its own flags, so an
/// annotated pod never gets a sidecar that refuses to start).
fn millis(annotation: &'static str, value: Option<String>) -> Result<Option<u64>, InvalidAnnotation> {
    let Some(v) = value else { return Ok(None) };
    match v.parse::<u64>() {
        Ok(n) if (1..=60_000).contains(&n) => Ok(Some(n)),
        _ => Err(invalid(
            annotation,
            format!("{v:?} is not a number of milliseconds from 1 to 60000"),
        )),
    }
}

fn invalid(key: &'static str, reason: String) -> InvalidAnnotation {
    InvalidAnnotation { key, reason }
}

fn flag(key: &'static str, v: &str) -> Result<bool, InvalidAnnotation> {
    match v.trim().to_ascii_lowercase().as_str() {
        "true" | "enabled" => Ok(true),
        "false" | "disabled" => Ok(false),
        _ => Err(invalid(key, format!("{v:?} is neither \"true\" nor \"false\""))),
    }
}

fn check_upstream(u: &str) -> Result<(), InvalidAnnotation> {
    match u.parse::<http::Uri>() {
        Ok(uri) if uri.scheme_str() == Some("http") && uri.authority().is_some() => Ok(()),
        _ => Err(invalid(UPSTREAM, format!("{u:?} is not an http:// URL"))),
    }
}

/// The sidecar's own check of its `--redis` URL, so an admitted pod's sidecar accepts it.
fn redis_url(key: &'static str, u: String) -> Result<RedisSource, InvalidAnnotation> {
    match crate::redis_url::check(&u) {
        Ok(()) => Ok(RedisSource::Url(u)),
        Err(reason) => Err(invalid(
            key,
            format!("the sidecar would refuse this Redis URL: {reason}"),
        )),
    }
}

/// The TLS and ACL annotations, checked against the URL when the injector can see it.
fn redis_access(get: &dyn Fn(&str) -> Option<String>, redis: &RedisSource) -> Result<RedisAccess, InvalidAnnotation> {
    let ca = match get(REDIS_CA_SECRET) {
        None => None,
        Some(v) if !v.contains('/') => Some((secret_name(REDIS_CA_SECRET, &v)?, "ca.crt".to_owned())),
        Some(v) => match secret_ref(REDIS_CA_SECRET, &v)? {
            RedisSource::Secret { name, key } => Some((name, key)),
            _ => None,
        },
    };
    let client_cert = get(REDIS_CLIENT_CERT_SECRET)
        .map(|v| secret_name(REDIS_CLIENT_CERT_SECRET, &v))
        .transpose()?;
    let password = match get(REDIS_PASSWORD_SECRET) {
        None => None,
        Some(v) => match secret_ref(REDIS_PASSWORD_SECRET, &v)? {
            RedisSource::Secret { name, key } => Some((name, key)),
            _ => None,
        },
    };
    let username = get(REDIS_USERNAME);
    if let Some(u) = &username {
        if u.is_empty() || u.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(invalid(REDIS_USERNAME, format!("{u:?} is not a Redis user name")));
        }
    }
    let server_name = get(REDIS_TLS_SERVER_NAME);
    if let Some(n) = &server_name {
        if rustls_pki_types::ServerName::try_from(n.as_str()).is_err() {
            return Err(invalid(
                REDIS_TLS_SERVER_NAME,
                format!("{n:?} is not a DNS name or IP address"),
            ));
        }
    }
    let access = RedisAccess {
        ca,
        client_cert,
        password,
        username,
        server_name,
    };
    if access != RedisAccess::default() && *redis == RedisSource::None {
        return Err(invalid(
            REDIS_URL,
            "the Redis TLS or ACL annotations need a Redis URL (turnlock.dev/redis-url or turnlock.dev/redis-secret)"
                .into(),
        ));
    }
    let tls_set = access.ca.is_some() || access.client_cert.is_some() || access.server_name.is_some();
    if let RedisSource::Url(u) = redis {
        let tls = crate::redis_url::parse(u).map(|t| t.tls()).unwrap_or(false);
        if tls_set && !tls {
            let key = [
                (REDIS_CA_SECRET, access.ca.is_some()),
                (REDIS_CLIENT_CERT_SECRET, access.client_cert.is_some()),
                (REDIS_TLS_SERVER_NAME, true),
            ]
            .into_iter()
            .find_map(|(k, set)| set.then_some(k))
            .unwrap_or(REDIS_CA_SECRET);
            return Err(invalid(
                key,
                "needs a rediss:// or rediss+sentinel:// Redis URL (the sidecar would refuse it)".into(),
            ));
        }
    }
    Ok(access)
}

fn secret_name(key: &'static str, name: &str) -> Result<String, InvalidAnnotation> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    if ok {
        Ok(name.to_owned())
    } else {
        Err(invalid(key, format!("{name:?} is not a Secret name")))
    }
}

fn secret_ref(key: &'static str, v: &str) -> Result<RedisSource, InvalidAnnotation> {
    let Some((name, k)) = v.split_once('/') else {
        return Err(invalid(key, format!("{v:?} is not <secret-name>/<key>")));
    };
    let name_ok = !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    let key_ok = !k.is_empty() && k.len() <= 253 && k.chars().all(|c| c.is_ascii_alphanumeric() || "-._".contains(c));
    if name_ok && key_ok {
        Ok(RedisSource::Secret {
            name: name.to_owned(),
            key: k.to_owned(),
        })
    } else {
        Err(invalid(key, format!("{v:?} is not <secret-name>/<key>")))
    }
}

fn intercept_ports(annotation: Option<String>, upstream: Option<&str>) -> Result<Vec<u16>, InvalidAnnotation> {
    if let Some(v) = annotation {
        let ports: Result<Vec<u16>, _> = v.split(',').map(|p| p.trim().parse::<u16>()).collect();
        return match ports {
            Ok(p) if !p.is_empty() && p.len() <= 15 && !p.contains(&0) => Ok(p),
            _ => Err(invalid(
                INTERCEPT_PORTS,
                format!("{v:?} is not 1 to 15 comma-separated ports"),
            )),
        };
    }
    let port = upstream
        .and_then(|u| u.parse::<http::Uri>().ok())
        .map(|uri| uri.port_u16().unwrap_or(80));
    match port {
        Some(p) => Ok(vec![p]),
        None => Err(invalid(
            INTERCEPT_PORTS,
            "transparent mode needs the store's port(s): set this annotation or turnlock.dev/upstream".into(),
        )),
    }
}

fn is_env_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A Kubernetes resource quantity: a decimal number with an optional SI or binary suffix, or
/// an exponent (`100m`, `0.5`, `64Mi`, `1e3`).
pub fn is_quantity(s: &str) -> bool {
    let digits_end = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, suffix) = s.split_at(digits_end);
    let number_ok = !number.is_empty()
        && number.chars().filter(|&c| c == '.').count() <= 1
        && number.chars().any(|c| c.is_ascii_digit());
    let suffix_ok = matches!(
        suffix,
        "" | "m" | "k" | "M" | "G" | "T" | "P" | "E" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei"
    ) || (suffix.len() > 1
        && (suffix.starts_with('e') || suffix.starts_with('E'))
        && suffix[1..]
            .trim_start_matches(['+', '-'])
            .chars()
            .all(|c| c.is_ascii_digit())
        && !suffix[1..].trim_start_matches(['+', '-']).is_empty());
    number_ok && suffix_ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn defaults() -> WebhookArgs {
        WebhookArgs::local(PathBuf::new(), PathBuf::new())
    }

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn annotation_decides_over_namespace_default() {
        let none = BTreeMap::new();
        assert!(!wants_injection(&none, &none, false).unwrap());
        assert!(wants_injection(&none, &none, true).unwrap());
        assert!(!wants_injection(&map(&[(INJECT, "false")]), &none, true).unwrap());
        assert!(wants_injection(&map(&[(INJECT, "true")]), &none, false).unwrap());
        assert!(wants_injection(&none, &map(&[(INJECT, "true")]), false).unwrap());
        assert!(wants_injection(&map(&[(INJECT, "yes please")]), &none, false).is_err());
    }

    #[test]
    fn overrides_replace_defaults() {
        let mut d = defaults();
        d.upstream = Some("http://store:8080".into());
        let s = resolve(
            &map(&[
                (UPSTREAM, "http://other:9000"),
                (LOCK_BUDGET_MS, "80"),
                (WAIT_DEADLINE_MS, "5000"),
                (REDIS_SECRET, "redis-auth/url"),
                (MEMORY_LIMIT, "256Mi"),
                (LOG_LEVEL, "turnlock=debug"),
                (NATIVE_SIDECAR, "true"),
            ]),
            &d,
        )
        .unwrap();
        assert_eq!(s.upstream.as_deref(), Some("http://other:9000"));
        assert_eq!(s.lock_budget_ms, Some(80));
        assert_eq!(s.wait_deadline_ms, Some(5000));
        assert_eq!(
            s.redis,
            RedisSource::Secret {
                name: "redis-auth".into(),
                key: "url".into()
            }
        );
        assert_eq!(s.resources.memory_limit, "256Mi");
        assert_eq!(s.resources.cpu_request, d.cpu_request);
        assert!(s.native);
        assert_eq!(s.transparent, None);
    }

    #[test]
    fn invalid_values_name_their_annotation() {
        let mut d = defaults();
        d.upstream = Some("http://store:8080".into());
        for (key, value) in [
            (LOCK_BUDGET_MS, "0"),
            (LOCK_BUDGET_MS, "fast"),
            (LOCK_BUDGET_MS, "60001"),
            (WAIT_DEADLINE_MS, "0"),
            (WAIT_DEADLINE_MS, "600000"),
            (UPSTREAM, "https://store"),
            (REDIS_URL, "http://redis"),
            (REDIS_SECRET, "no-slash"),
            (CPU_LIMIT, "lots"),
            (STORE_URL_ENV, "1BAD"),
            (LOG_LEVEL, "info; rm -rf"),
            (INTERCEPT_PORTS, "80,x"),
        ] {
            let mut a = map(&[(key, value)]);
            if key == INTERCEPT_PORTS {
                a.insert(TRANSPARENT.into(), "true".into());
            }
            let e = resolve(&a, &d).expect_err(value);
            assert_eq!(e.key, key, "{value}");
        }
    }

    #[test]
    fn redis_tls_and_acl_annotations_name_their_secrets_and_need_a_tls_url() {
        let mut d = defaults();
        d.upstream = Some("http://store:8080".into());
        let s = resolve(
            &map(&[
                (REDIS_URL, "rediss://10.0.0.5:6380"),
                (REDIS_CA_SECRET, "redis-ca"),
                (REDIS_CLIENT_CERT_SECRET, "redis-client"),
                (REDIS_PASSWORD_SECRET, "redis-acl/password"),
                (REDIS_USERNAME, "turnlock"),
                (REDIS_TLS_SERVER_NAME, "redis.internal"),
            ]),
            &d,
        )
        .unwrap();
        assert_eq!(s.redis_access.ca, Some(("redis-ca".into(), "ca.crt".into())));
        assert_eq!(s.redis_access.client_cert.as_deref(), Some("redis-client"));
        assert_eq!(s.redis_access.password, Some(("redis-acl".into(), "password".into())));
        for (pairs, key) in [
            (
                vec![(REDIS_URL, "redis://r:6379"), (REDIS_CA_SECRET, "redis-ca")],
                REDIS_CA_SECRET,
            ),
            (vec![(REDIS_PASSWORD_SECRET, "redis-acl/password")], REDIS_URL),
            (
                vec![(REDIS_URL, "rediss://r:6379"), (REDIS_CA_SECRET, "Bad_Name")],
                REDIS_CA_SECRET,
            ),
            (
                vec![(REDIS_URL, "rediss://r:6379"), (REDIS_PASSWORD_SECRET, "no-key")],
                REDIS_PASSWORD_SECRET,
            ),
            (
                vec![(REDIS_URL, "rediss://r:6379"), (REDIS_USERNAME, "two words")],
                REDIS_USERNAME,
            ),
            (vec![(REDIS_URL, "rediss://r:6379/#insecure")], REDIS_URL),
        ] {
            let e = resolve(&map(&pairs), &d).expect_err(key);
            assert_eq!(e.key, key, "{pairs:?}: {e}");
        }
    }

    #[test]
    fn upstream_is_required_unless_transparent() {
        assert_eq!(resolve(&BTreeMap::new(), &defaults()).unwrap_err().key, UPSTREAM);
        let s = resolve(
            &map(&[(TRANSPARENT, "true"), (INTERCEPT_PORTS, "8080, 9000")]),
            &defaults(),
        )
        .unwrap();
        assert_eq!(s.transparent, Some(vec![8080, 9000]));
        let s = resolve(&map(&[(TRANSPARENT, "true"), (UPSTREAM, "http://store")]), &defaults()).unwrap();
        assert_eq!(s.transparent, Some(vec![80]));
    }

    #[test]
    fn quantities() {
        for ok in ["1", "100m", "0.5", "64Mi", "1Gi", "1e3", "2E-2", "128974848"] {
            assert!(is_quantity(ok), "{ok}");
        }
        for bad in ["", "m", "1.2.3", "64MB", "1e", "-1", "ten"] {
            assert!(!is_quantity(bad), "{bad}");
        }
    }
}
