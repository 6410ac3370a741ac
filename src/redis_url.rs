//! The Redis URL forms turnlock connects to, checked in one place: the proxy parses its
//! `--redis` here at startup, and the injector checks the `turnlock.dev/redis-url` annotation
//! with the same function, so an admitted pod never gets a sidecar that refuses its URL.
//!
//! Forms:
//! - `redis://[user:pass@]host:port[/db]` and `unix:///path` (plaintext);
//! - `rediss://[user:pass@]host:port[/db]` (TLS);
//! - `redis+sentinel://[user:pass@]host:port[,host:port…]/<primary>[/db][?sentinel_username=U&sentinel_password=P]`,
//!   and `rediss+sentinel://…` for TLS to the Sentinels and to the primary: the credentials
//!   before `@` and the `/db` are the primary's; the Sentinels' own go in the query;
//! - `redis+cluster://[user:pass@]host:port[,host:port…]` (Redis Cluster: the nodes to learn
//!   the cluster's layout from; the credentials are every node's), and `rediss+cluster://…`
//!   for TLS to every node. No `/db`: a cluster has database 0 only.

use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo};

/// A URL that cannot be used; `url` is shown without its secrets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid Redis URL {url:?}: {reason}")]
pub struct UrlError {
    pub url: String,
    pub reason: String,
}

/// A parsed Redis URL.
#[derive(Debug, Clone)]
pub enum Target {
    /// One server, plaintext (TCP or a Unix socket) or TLS (`rediss://`).
    Direct { info: ConnectionInfo, tls: bool },
    /// A primary found through Sentinel.
    Sentinel { spec: SentinelSpec, tls: bool },
    /// A Redis Cluster, found through any of its nodes.
    Cluster { spec: ClusterSpec, tls: bool },
}

impl Target {
    /// Whether connections use TLS.
    pub fn tls(&self) -> bool {
        match self {
            Self::Direct { tls, .. } | Self::Sentinel { tls, .. } | Self::Cluster { tls, .. } => *tls,
        }
    }
}

/// Parses and checks a Redis URL: the one check shared by the proxy and the injector.
pub fn parse(url: &str) -> Result<Target, UrlError> {
    // Neither the URL nor the parser's reason may carry the password into a log.
    let shown = redact(url);
    let secrets = secrets_of(url);
    let invalid = |reason: &str| UrlError {
        url: shown.clone(),
        reason: secrets
            .iter()
            .filter(|s| !s.is_empty())
            .fold(reason.to_owned(), |r, s| r.replace(s, "***")),
    };
    if bad_escape(userinfo(url)) {
        return Err(invalid(
            "a % in the user or password must start an escape of two hex digits (write a literal % as %25)",
        ));
    }
    if let Some(rest) = url.strip_prefix("redis+sentinel://") {
        let spec = SentinelSpec::parse(rest).map_err(invalid)?;
        return Ok(Target::Sentinel { spec, tls: false });
    }
    if let Some(rest) = url.strip_prefix("rediss+sentinel://") {
        let spec = SentinelSpec::parse(rest).map_err(invalid)?;
        return Ok(Target::Sentinel { spec, tls: true });
    }
    if let Some(rest) = url.strip_prefix("redis+cluster://") {
        let spec = ClusterSpec::parse(rest).map_err(invalid)?;
        return Ok(Target::Cluster { spec, tls: false });
    }
    if let Some(rest) = url.strip_prefix("rediss+cluster://") {
        let spec = ClusterSpec::parse(rest).map_err(invalid)?;
        return Ok(Target::Cluster { spec, tls: true });
    }
    let tls = url.starts_with("rediss://");
    if !(tls || url.starts_with("redis://") || url.starts_with("unix://")) {
        return Err(invalid(
            "expected redis://, rediss://, unix://, redis+sentinel://, rediss+sentinel://, redis+cluster:// or rediss+cluster://",
        ));
    }
    if url.contains('#') {
        return Err(invalid(
            "a #fragment is not accepted (certificate checks cannot be turned off; use --redis-ca)",
        ));
    }
    let info = url.into_connection_info().map_err(|e| invalid(&e.to_string()))?;
    match info.addr() {
        ConnectionAddr::Tcp(host, _) | ConnectionAddr::TcpTls { host, .. } if host.is_empty() => {
            return Err(invalid("missing host"))
        }
        ConnectionAddr::Tcp(_, 0) | ConnectionAddr::TcpTls { port: 0, .. } => {
            return Err(invalid("port 0 is not a port Redis listens on"))
        }
        _ => {}
    }
    if info.redis_settings().db() < 0 {
        return Err(invalid("the database number cannot be negative"));
    }
    Ok(Target::Direct { info, tls })
}

/// The check the injector makes on an annotated URL: the proxy's own, with its reason.
pub fn check(url: &str) -> Result<(), String> {
    parse(url).map(|_| ()).map_err(|e| e.reason)
}

/// A parsed `redis+cluster://` URL (after the scheme).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSpec {
    /// Each starting node's `host:port` (any reachable one tells the client the layout).
    pub hosts: Vec<(String, u16)>,
    pub username: Option<String>,
    pub password: Option<String>,
}

impl ClusterSpec {
    fn parse(rest: &str) -> Result<Self, &'static str> {
        if rest.contains(['?', '#']) {
            return Err("a cluster URL takes no query or fragment");
        }
        let authority = match rest.split_once('/') {
            None => rest,
            Some((a, "")) => a,
            Some(_) => return Err("a cluster URL takes no /db (a cluster has database 0 only)"),
        };
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let (username, password) = userinfo_parts(userinfo);
        let hosts = hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| host_port(h, 6379))
            .collect::<Result<Vec<_>, _>>()?;
        if hosts.is_empty() {
            return Err("no cluster node address");
        }
        Ok(Self {
            hosts,
            username,
            password,
        })
    }
}

/// `user:pass` before `@`: an empty user is none.
fn userinfo_parts(userinfo: Option<&str>) -> (Option<String>, Option<String>) {
    match userinfo {
        None => (None, None),
        Some(u) => match u.split_once(':') {
            Some((user, pass)) => (Some(user.to_owned()).filter(|u| !u.is_empty()), Some(pass.to_owned())),
            None => (Some(u.to_owned()).filter(|u| !u.is_empty()), None),
        },
    }
}

/// A parsed `redis+sentinel://` URL (after the scheme).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentinelSpec {
    /// Each Sentinel's `host:port`.
    pub hosts: Vec<(String, u16)>,
    pub primary: String,
    pub username: Option<String>,
    pub password: Option<String>,
    pub db: i64,
    /// The Sentinels' own credentials.
    pub sentinel_username: Option<String>,
    pub sentinel_password: Option<String>,
}

impl SentinelSpec {
    fn parse(rest: &str) -> Result<Self, &'static str> {
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (authority, path) = rest.split_once('/').ok_or("missing /<primary-name>")?;
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let (username, password) = userinfo_parts(userinfo);
        let mut parts = path.split('/');
        let primary = parts
            .next()
            .filter(|n| !n.is_empty())
            .ok_or("missing primary name")?
            .to_owned();
        let db = match parts.next().filter(|d| !d.is_empty()) {
            None => 0,
            Some(d) => d
                .parse::<i64>()
                .map_err(|_| "the database after the primary name must be a number")?,
        };
        if db < 0 {
            return Err("the database number cannot be negative");
        }
        if parts.next().is_some() {
            return Err("unexpected path after /<primary-name>/<db>");
        }
        let (mut sentinel_username, mut sentinel_password) = (None, None);
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("sentinel_username", v)) => sentinel_username = Some(v.to_owned()),
                Some(("sentinel_password", v)) => sentinel_password = Some(v.to_owned()),
                _ => return Err("unknown query parameter (expected sentinel_username, sentinel_password)"),
            }
        }
        let hosts = hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| host_port(h, 26379))
            .collect::<Result<Vec<_>, _>>()?;
        if hosts.is_empty() {
            return Err("no sentinel address");
        }
        Ok(Self {
            hosts,
            primary,
            username,
            password,
            db,
            sentinel_username,
            sentinel_password,
        })
    }

    /// `redis://[sentinel credentials@]host:port` for each Sentinel.
    pub fn node_urls(&self) -> Vec<String> {
        let auth = match (&self.sentinel_username, &self.sentinel_password) {
            (None, None) => String::new(),
            (user, pass) => format!("{}:{}@", user.as_deref().unwrap_or(""), pass.as_deref().unwrap_or("")),
        };
        self.hosts
            .iter()
            .map(|(h, p)| format!("redis://{auth}{}:{p}", bracket(h)))
            .collect()
    }
}

/// `host[:port]` (IPv6 hosts in brackets); `default_port` when none is given.
fn host_port(s: &str, default_port: u16) -> Result<(String, u16), &'static str> {
    let (host, port) = match s.strip_prefix('[') {
        Some(v6) => {
            let (host, after) = v6.split_once(']').ok_or("an IPv6 address needs its closing ]")?;
            (host, after.strip_prefix(':'))
        }
        None => match s.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        },
    };
    let port = match port {
        None => default_port,
        Some(p) => p.parse::<u16>().map_err(|_| "a port is not a number")?,
    };
    if host.is_empty() || port == 0 {
        return Err("each address needs host[:port]");
    }
    Ok((host.to_owned(), port))
}

/// The `user:password` part of a URL (empty when there is none).
fn userinfo(url: &str) -> &str {
    let rest = url.split_once("://").map_or("", |(_, r)| r);
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    authority.rsplit_once('@').map_or("", |(u, _)| u)
}

/// Whether `s` holds a `%` that does not start a two-hex-digit escape (which the URL parser
/// would keep as typed, so the password sent would not be the one meant).
fn bad_escape(s: &str) -> bool {
    let b = s.as_bytes();
    b.iter().enumerate().any(|(i, &c)| {
        c == b'%'
            && !(b.get(i + 1).is_some_and(u8::is_ascii_hexdigit) && b.get(i + 2).is_some_and(u8::is_ascii_hexdigit))
    })
}

pub(crate) fn bracket(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

/// The secrets in a URL: its credentials (`user:pass`, and the password alone) and any
/// `*password=` query value.
fn secrets_of(url: &str) -> Vec<&str> {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut found = Vec::new();
    if let (Some(s), Some(at)) = (base.find("://"), base.rfind('@')) {
        if at > s + 3 {
            let userinfo = &base[s + 3..at];
            found.push(userinfo);
            if let Some((_, pass)) = userinfo.split_once(':') {
                found.push(pass);
            }
        }
    }
    for pair in query.split('&') {
        if let Some((k, v)) = pair.split_once('=') {
            if k.contains("password") {
                found.push(v);
            }
        }
    }
    found
}

/// The URL with its credentials and any `*password=` query value replaced by `***`.
pub fn redact(url: &str) -> String {
    let (url, query) = match url.split_once('?') {
        Some((u, q)) => (u, Some(q)),
        None => (url, None),
    };
    let mut shown = match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://***@{}", &url[..s], &url[at + 1..]),
        _ => url.to_owned(),
    };
    if let Some(q) = query {
        let pairs: Vec<String> = q
            .split('&')
            .map(|p| match p.split_once('=') {
                Some((k, _)) if k.contains("password") => format!("{k}=***"),
                _ => p.to_owned(),
            })
            .collect();
        shown.push('?');
        shown.push_str(&pairs.join("&"));
    }
    shown
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_documented_form_parses() {
        for (url, tls) in [
            ("redis://127.0.0.1:6379", false),
            ("redis://user:pw@h:1/2", false),
            ("unix:///run/redis.sock", false),
            ("rediss://redis.example:6380", true),
            ("rediss://:pw@10.0.0.5:6380/1", true),
            ("redis+sentinel://h1:26379,h2:26380/primary", false),
            ("rediss+sentinel://h1:26379/primary/2?sentinel_password=x", true),
            ("redis+cluster://10.0.0.1:7000,10.0.0.2:7001", false),
            ("redis+cluster://app:pw@h1:7000/", false),
            ("rediss+cluster://:pw@[::1]:7000,h2", true),
        ] {
            let t = parse(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(t.tls(), tls, "{url}");
        }
    }

    #[test]
    fn bad_forms_are_refused_with_a_reason_and_no_secret() {
        for url in [
            "http://x",
            "redis+sentinel://h:1",
            "rediss://h:1/#insecure",
            "redis://h:1/notadb",
            "redis://h:notaport",
            "rediss://h:1/-1",
            "redis://h:0",
            "rediss://u:pa%ZZss@h:1",
            "redis://u:pa%4@h:1",
            "redis+sentinel://h1:1/primary/-2",
            "redis+sentinel://u:%zz@h1:1/primary",
            "redis+sentinel://h1:x/primary",
            "sentinel://h:1/p",
            "redis+cluster://",
            "redis+cluster://h:1/0",
            "redis+cluster://h:x",
            "redis+cluster://h:1?protocol=3",
            "cluster://h:1",
            "",
        ] {
            assert!(parse(url).is_err(), "{url}");
        }
        let e = parse("redis://u:supersecret@h:1/x").expect_err("bad db");
        assert!(!e.to_string().contains("supersecret"), "{e}");
    }

    #[test]
    fn cluster_urls_give_every_node_the_credentials() {
        let Ok(Target::Cluster { spec, tls: false }) = parse("redis+cluster://app:pw@h1:7000,[::1]:7001,h3") else {
            panic!("not a cluster URL");
        };
        assert_eq!(
            spec.hosts,
            vec![("h1".into(), 7000), ("::1".into(), 7001), ("h3".into(), 6379)]
        );
        assert_eq!(
            (spec.username.as_deref(), spec.password.as_deref()),
            (Some("app"), Some("pw"))
        );
        let e = parse("redis+cluster://u:supersecret@h:1/2").expect_err("a db");
        assert!(!e.to_string().contains("supersecret"), "{e}");
        assert_eq!(redact("rediss+cluster://u:pw@h:1,h:2"), "rediss+cluster://***@h:1,h:2");
    }

    #[test]
    fn urls_are_redacted() {
        assert_eq!(redact("redis://user:secret@h:1/0"), "redis://***@h:1/0");
        assert_eq!(
            redact("redis+sentinel://:pw@h:1/p/2?sentinel_password=spw"),
            "redis+sentinel://***@h:1/p/2?sentinel_password=***"
        );
    }

    #[test]
    fn sentinel_urls_give_the_primary_its_credentials_and_db_and_the_sentinels_theirs() {
        let spec = SentinelSpec::parse("app:pw@h1:1,h2:2/main/3?sentinel_password=spw").expect("parses");
        assert_eq!(spec.node_urls(), vec!["redis://:spw@h1:1", "redis://:spw@h2:2"]);
        assert_eq!(spec.primary, "main");
        assert_eq!(
            (spec.username.as_deref(), spec.password.as_deref()),
            (Some("app"), Some("pw"))
        );
        assert_eq!(spec.db, 3);
        let plain = SentinelSpec::parse("h1:1/main").expect("parses");
        assert_eq!(
            (plain.node_urls(), plain.password, plain.db),
            (vec!["redis://h1:1".to_owned()], None, 0)
        );
        assert!(SentinelSpec::parse("h1:1/main/x").is_err());
        assert!(SentinelSpec::parse("h1:1/main?other=1").is_err());
    }
}
