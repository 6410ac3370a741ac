//! Redis over TLS and ACL users: a real `redis-server` with `--tls-port` and certificates made
//! here; writes through proxies over TLS, an untrusted certificate refused at start, mutual TLS,
//! rotated files picked up without a restart, an ACL user whose password comes from a file and
//! is never shown; and the injector accepting exactly the Redis URLs the proxy starts with.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use turnlock::config::{ProxyArgs, StartError, EXIT_BACKEND};
use turnlock::inject::annotations;
use turnlock::inject::WebhookArgs;

use crate::support::ledger::*;
use crate::support::tls::{path, TestCa, TlsRedis};
use crate::support::*;

/// The narrowest ACL turnlock needs (with the default key prefix `turnlock:`), as the README
/// documents it.
pub const NARROW_ACL: &[&str] = &[
    "resetkeys",
    "~turnlock:*",
    "resetchannels",
    "&turnlock:*",
    "-@all",
    "+ping",
    "+get",
    "+set",
    "+del",
    "+hget",
    "+hmget",
    "+hset",
    "+pexpire",
    "+pttl",
    "+time",
    "+publish",
    "+subscribe",
    "+unsubscribe",
    "+zadd",
    "+zrem",
    "+zrange",
    "+zrangebyscore",
    "+evalsha",
    "+eval",
    "+script|load",
    "+wait",
    "+scan",
    "+info",
];

fn tls_args(upstream: std::net::SocketAddr, redis: &TlsRedis, ca: &TestCa) -> ProxyArgs {
    let mut args = ProxyArgs::local(format!("http://{upstream}"));
    args.redis = Some(redis.url());
    args.redis_ca = Some(ca.ca_file());
    args
}

/// Runs writers through `clients` for `secs` seconds and checks the store: nothing lost.
async fn write_and_check(
    tag: &str,
    store: std::net::SocketAddr,
    clients: Vec<turnlock::client::JsonClient>,
    secs: u64,
) {
    let all = sessions(tag, 4);
    let writers = Writers::start(tag, clients, all.clone(), 8, 10_000, Duration::from_secs(secs));
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let ledger = writers.finish().await;
    let counts = check(store, &all, &[&ledger]).await;
    report(tag, &counts);
    assert!(counts.acknowledged > 20, "too few writes acknowledged: {counts:?}");
    assert!(counts.clean(), "{counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_through_two_proxies_over_tls_lose_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(dir.path(), "ca");
    let redis = TlsRedis::start(&ca, false, &[]);
    let store = store().await;
    let p1 = proxy(tls_args(store.addr, &redis, &ca)).await;
    let p2 = proxy(tls_args(store.addr, &redis, &ca)).await;
    write_and_check("tls", store.addr, vec![client(p1.addr), client(p2.addr)], 3).await;
    assert!(
        !redis.server.keys("turnlock:*").is_empty(),
        "the proxies wrote no keys over TLS"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_server_certificate_stops_the_start_with_the_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(dir.path(), "ca");
    let other = TestCa::new(dir.path(), "other-ca");
    let redis = TlsRedis::start(&ca, false, &[]);
    let (_store, store_port) = Proc::store();
    let out = Command::new(turnlock_bin())
        .args([
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--upstream",
            &format!("http://127.0.0.1:{store_port}"),
            "--redis",
            &redis.url(),
            "--redis-ca",
            &path(&other.ca_file()),
        ])
        .env("RUST_LOG", "warn")
        .output()
        .expect("run turnlock");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(i32::from(EXIT_BACKEND)), "{stderr}");
    assert!(
        stderr.contains("refused the connection") && stderr.contains("certificate"),
        "the reason is not clear: {stderr}"
    );

    // A server name the certificate does not carry is refused the same way; the right one
    // (connecting by IP address) is accepted.
    let store = store().await;
    let mut args = tls_args(store.addr, &redis, &ca);
    args.redis_tls_server_name = Some("redis.elsewhere.example".into());
    match turnlock::sidecar::start(args).await {
        Err(e @ StartError::Backend(_)) => assert!(e.to_string().contains("redis.elsewhere.example"), "{e}"),
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("a certificate for another name was accepted"),
    }
    let mut args = tls_args(store.addr, &redis, &ca);
    args.redis_tls_server_name = Some("localhost".into());
    let p = proxy(args).await;
    assert!(append(&client(p.addr), "by-name", 1, "m1").await.status.is_success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_down_at_start_lets_the_proxy_start_and_readyz_says_why() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(dir.path(), "ca");
    let other = TestCa::new(dir.path(), "other-ca");
    let port = free_port();
    let store = store().await;
    let mut args = ProxyArgs::local(format!("http://{}", store.addr));
    args.redis = Some(format!("rediss://127.0.0.1:{port}"));
    args.redis_ca = Some(other.ca_file());
    let p = proxy(args).await;
    // Redis comes up with a certificate the proxy does not trust: /readyz says so.
    let _redis = TlsRedis::start_on(port, &ca, false, &[]);
    let admin = client(p.admin);
    let mut last = String::new();
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        let r = admin
            .send(http::Method::GET, "/readyz", None, &[])
            .await
            .expect("readyz");
        last = r.json["down"]["redis"].as_str().unwrap_or_default().to_owned();
        if last.contains("certificate") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(last.contains("certificate"), "/readyz does not say why: {last:?}");
    let r = append(&client(p.addr), "untrusted", 1, "m1").await;
    assert!(!r.status.is_success(), "a write succeeded over an untrusted connection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_needs_the_client_certificate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(dir.path(), "ca");
    let redis = TlsRedis::start(&ca, true, &[]);
    let store = store().await;
    let args = tls_args(store.addr, &redis, &ca);
    match turnlock::sidecar::start(args.clone()).await {
        Err(e @ StartError::Backend(_)) => assert!(e.to_string().contains("refused the connection"), "{e}"),
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("started without the client certificate Redis asks for"),
    }
    let (cert, key) = ca.issue("turnlock-client", &["turnlock"]);
    let mut with_cert = args;
    with_cert.redis_cert = Some(cert);
    with_cert.redis_key = Some(key);
    let p1 = proxy(with_cert.clone()).await;
    let p2 = proxy(with_cert).await;
    write_and_check("mtls", store.addr, vec![client(p1.addr), client(p2.addr)], 2).await;
}

/// Replaces a file the way a Secret volume update does: written beside it, then renamed over.
fn replace(target: &Path, from: &Path) {
    let tmp = target.with_extension("new");
    std::fs::copy(from, &tmp).expect("copy");
    std::fs::rename(&tmp, target).expect("rename");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_certificates_are_picked_up_without_a_restart_or_a_lost_write() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(dir.path(), "ca");
    let redis = TlsRedis::start(&ca, true, &[]);
    let mounted = dir.path().join("mounted");
    std::fs::create_dir(&mounted).expect("mkdir");
    let (cert, key) = ca.issue("client-1", &["turnlock"]);
    let (m_ca, m_cert, m_key) = (mounted.join("ca.crt"), mounted.join("tls.crt"), mounted.join("tls.key"));
    replace(&m_ca, &ca.ca_file());
    replace(&m_cert, &cert);
    replace(&m_key, &key);
    let store = store().await;
    let mut args = ProxyArgs::local(format!("http://{}", store.addr));
    args.redis = Some(redis.url());
    args.redis_ca = Some(m_ca.clone());
    args.redis_cert = Some(m_cert.clone());
    args.redis_key = Some(m_key.clone());
    let p1 = proxy(args.clone()).await;
    let p2 = proxy(args).await;

    let all = sessions("rotate", 4);
    let writers = Writers::start(
        "rotate",
        vec![client(p1.addr), client(p2.addr)],
        all.clone(),
        8,
        100_000,
        Duration::from_secs(30),
    );
    tokio::time::sleep(Duration::from_secs(1)).await;

    // A new CA: Redis's certificate and the one it asks of clients change; the old files are
    // no longer accepted by Redis, so only a proxy that reloaded them can reconnect.
    let new_ca = TestCa::new(dir.path(), "ca-2");
    let (server_cert, server_key) = new_ca.issue("redis-server-2", &["localhost", "127.0.0.1"]);
    let (cert2, key2) = new_ca.issue("client-2", &["turnlock"]);
    replace(&m_ca, &new_ca.ca_file());
    replace(&m_key, &key2);
    replace(&m_cert, &cert2);
    let (c, k, a) = (path(&server_cert), path(&server_key), path(&new_ca.ca_file()));
    redis.server.cmd(&[
        "CONFIG",
        "SET",
        "tls-cert-file",
        &c,
        "tls-key-file",
        &k,
        "tls-ca-cert-file",
        &a,
    ]);
    // Cut every connection made with the old files; the writers keep going.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    redis.server.cmd(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"]);
    redis.server.cmd(&["CLIENT", "KILL", "TYPE", "pubsub"]);
    let before = writers.ledger.acked_count();
    let resumed = eventually(Duration::from_secs(10), Duration::from_millis(100), || {
        let ledger = writers.ledger.clone();
        async move { ledger.acked_count() > before + 20 }
    })
    .await;
    assert!(resumed.is_some(), "writes did not resume with the rotated certificates");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let ledger = writers.finish().await;
    let counts = check(store.addr, &all, &[&ledger]).await;
    report("certificate rotation", &counts);
    assert!(counts.clean(), "{counts:?}");
}

/// Spawns `turnlock proxy` with its stderr going to `log`.
fn spawn_logged(args: &[String], log: &Path) -> std::process::Child {
    let file = std::fs::File::create(log).expect("log file");
    Command::new(turnlock_bin())
        .args(args)
        .env("RUST_LOG", "debug")
        .stdout(Stdio::null())
        .stderr(file)
        .spawn()
        .expect("spawn turnlock")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_user_with_a_password_file_writes_and_its_password_is_never_shown() {
    let password = "pw-Zx81-never-shown";
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(dir.path(), "ca");
    let redis = TlsRedis::start(&ca, false, &[]);
    let mut setuser = vec!["ACL", "SETUSER", "turnlock", "reset", "on"];
    let secret = format!(">{password}");
    setuser.push(&secret);
    setuser.extend_from_slice(NARROW_ACL);
    redis.server.cmd(&setuser);
    redis.server.cmd(&["ACL", "LOG", "RESET"]);
    let (_store, store_port) = Proc::store();
    let upstream = format!("http://127.0.0.1:{store_port}");
    let pw_file = dir.path().join("password");
    let wrong_file = dir.path().join("wrong-password");
    std::fs::write(&pw_file, format!("{password}\n")).expect("password file");
    std::fs::write(&wrong_file, format!("{password}-old\n")).expect("password file");
    let args = |file: &PathBuf, addr: &str, admin: &str| -> Vec<String> {
        [
            "proxy",
            "--listen",
            addr,
            "--admin",
            admin,
            "--upstream",
            &upstream,
            "--redis",
            &redis.url(),
            "--redis-ca",
            &path(&ca.ca_file()),
            "--redis-username",
            "turnlock",
            "--redis-password-file",
            &path(file),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };

    // The wrong password: the proxy starts (a password rotated in Redis before its Secret
    // must not stop pods), writes fail, and /readyz says why, without printing it.
    let (w_addr, w_admin) = (
        std::net::SocketAddr::from(([127, 0, 0, 1], free_port())),
        std::net::SocketAddr::from(([127, 0, 0, 1], free_port())),
    );
    let wrong_log = dir.path().join("wrong.log");
    let mut wrong = spawn_logged(
        &args(&wrong_file, &w_addr.to_string(), &w_admin.to_string()),
        &wrong_log,
    );
    wait_for_port(w_addr.port(), Duration::from_secs(20));
    wait_for_port(w_admin.port(), Duration::from_secs(20));
    let mut reason = String::new();
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline && reason.is_empty() {
        let r = client(w_admin)
            .send(http::Method::GET, "/readyz", None, &[])
            .await
            .expect("readyz");
        reason = r.json["down"]["redis"].as_str().unwrap_or_default().to_owned();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        reason.to_lowercase().contains("auth"),
        "/readyz does not say the password was refused: {reason:?}"
    );
    let r = append(&client(w_addr), "wrong-pw", 1, "m1").await;
    assert_eq!(r.status.as_u16(), 503, "{:?}", r.json);
    let mut wrong_served = String::new();
    for p in ["/metrics", "/readyz", "/status"] {
        let r = client(w_admin).send(http::Method::GET, p, None, &[]).await.expect(p);
        wrong_served.push_str(&String::from_utf8_lossy(&r.body));
    }
    wrong_served.push_str(&r.json.to_string());
    let _ = wrong.kill();
    let _ = wrong.wait();
    let wrong_out = std::fs::read_to_string(&wrong_log).expect("log");
    assert!(wrong_out.contains("turnlock proxy listening"), "{wrong_out}");
    redis.server.cmd(&["ACL", "LOG", "RESET"]);

    // The right one: writes go through, contended (pub/sub wake-ups, scripts) and not.
    let (addr, admin) = (
        std::net::SocketAddr::from(([127, 0, 0, 1], free_port())),
        std::net::SocketAddr::from(([127, 0, 0, 1], free_port())),
    );
    let right_log = dir.path().join("right.log");
    let mut right = spawn_logged(&args(&pw_file, &addr.to_string(), &admin.to_string()), &right_log);
    wait_for_port(addr.port(), Duration::from_secs(20));
    wait_for_port(admin.port(), Duration::from_secs(20));
    let store_addr = std::net::SocketAddr::from(([127, 0, 0, 1], store_port));
    write_and_check("acl", store_addr, vec![client(addr), client(addr)], 2).await;
    let denied = redis.server.cmd(&["ACL", "LOG"]);
    assert_eq!(
        denied,
        redis::Value::Array(vec![]),
        "the narrow ACL denied something turnlock needs"
    );
    let mut served = String::new();
    for p in ["/metrics", "/readyz", "/status", "/healthz"] {
        let r = client(admin).send(http::Method::GET, p, None, &[]).await.expect(p);
        served.push_str(&String::from_utf8_lossy(&r.body));
    }
    let _ = right.kill();
    let _ = right.wait();
    let printed = std::fs::read_to_string(&right_log).expect("log");
    assert!(printed.contains("turnlock proxy listening"), "{printed}");
    for (what, text) in [
        ("printed", &printed),
        ("served", &served),
        ("printed", &wrong_out),
        ("served", &wrong_served),
    ] {
        // The wrong password is the right one with a suffix: neither may appear.
        assert!(!text.contains(password), "the password was {what}: {text}");
    }
}

/// Every Redis URL form the injector admits starts a proxy, and every one the proxy refuses
/// is refused at admission, with the proxy's reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_injector_admits_exactly_the_redis_urls_the_proxy_starts_with() {
    let redis = RedisServer::start();
    let free = free_port();
    let store = store().await;
    let candidates = [
        redis.url(),
        format!("redis://127.0.0.1:{}/3", redis.port),
        format!("redis://:pw@127.0.0.1:{free}"),
        format!("rediss://127.0.0.1:{free}"),
        format!("rediss://user:pw@localhost:{free}/2"),
        format!("redis+sentinel://127.0.0.1:{free}/primary"),
        format!("redis+sentinel://127.0.0.1:{free},127.0.0.1:{free}/primary/1?sentinel_password=x"),
        format!("rediss+sentinel://127.0.0.1:{free}/primary"),
        format!("redis+cluster://127.0.0.1:{free},127.0.0.1:{free}"),
        format!("rediss+cluster://:pw@127.0.0.1:{free}"),
        "unix:///tmp/turnlock-test-no-such.sock".into(),
        // Refused by both:
        "http://redis:6379".into(),
        "redis://127.0.0.1:notaport".into(),
        format!("redis://127.0.0.1:{free}/notadb"),
        format!("rediss://127.0.0.1:{free}/#insecure"),
        format!("redis+sentinel://127.0.0.1:{free}"),
        format!("redis+sentinel://127.0.0.1:{free}/primary?other=1"),
        format!("redis+cluster://127.0.0.1:{free}/1"),
        "redis://".into(),
    ];
    let mut defaults = WebhookArgs::local(PathBuf::new(), PathBuf::new());
    defaults.upstream = Some(format!("http://{}", store.addr));
    let (mut admitted, mut refused) = (0, 0);
    for url in candidates {
        let annotated = BTreeMap::from([(annotations::REDIS_URL.to_owned(), url.clone())]);
        let admission = annotations::resolve(&annotated, &defaults);
        let mut args = ProxyArgs::local(format!("http://{}", store.addr));
        args.redis = Some(url.clone());
        let started = tokio::time::timeout(Duration::from_secs(10), turnlock::sidecar::start(args))
            .await
            .expect("the proxy start hung");
        match (admission, started) {
            (Ok(_), Ok(running)) => {
                admitted += 1;
                running.stop().await;
            }
            (Err(e), Err(start)) => {
                refused += 1;
                assert!(
                    e.to_string().contains("the sidecar would refuse"),
                    "{url}: unclear admission message {e}"
                );
                assert_eq!(start.exit_code(), 64, "{url}: {start}");
            }
            (Ok(_), Err(e)) => panic!("{url}: admitted, but the proxy does not start: {e}"),
            (Err(e), Ok(_)) => panic!("{url}: refused at admission ({e}), but the proxy starts"),
        }
    }
    assert_eq!((admitted, refused), (11, 8));
}

/// A Redis Sentinel serving TLS on `tls_port` (and plaintext on another port), watching the
/// primary over TLS; killed on drop.
struct TlsSentinel {
    tls_port: u16,
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl TlsSentinel {
    fn start(ca: &TestCa, primary_tls_port: u16) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let (port, tls_port) = (free_port(), free_port());
        let (cert, key) = ca.issue("sentinel", &["localhost", "127.0.0.1"]);
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                 tls-port {tls_port}\ntls-cert-file {cert}\ntls-key-file {key}\ntls-ca-cert-file {ca}\n\
                 tls-auth-clients no\ntls-replication yes\n\
                 sentinel monitor primary 127.0.0.1 {primary_tls_port} 1\n\
                 sentinel down-after-milliseconds primary 1000\n",
                dir = dir.path().display(),
                cert = path(&cert),
                key = path(&key),
                ca = path(&ca.ca_file()),
            ),
        )
        .expect("write sentinel.conf");
        let child = Command::new(redis_server_bin())
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server --sentinel");
        wait_for_port(tls_port, Duration::from_secs(10));
        Self {
            tls_port,
            child,
            _dir: dir,
        }
    }
}

impl Drop for TlsSentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_over_tls_leads_to_the_primary_over_tls() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(dir.path(), "ca");
    let redis = TlsRedis::start(&ca, false, &["--tls-replication", "yes"]);
    let sentinel = TlsSentinel::start(&ca, redis.tls_port);
    let store = store().await;
    let mut args = ProxyArgs::local(format!("http://{}", store.addr));
    args.redis = Some(format!("rediss+sentinel://127.0.0.1:{}/primary", sentinel.tls_port));
    args.redis_ca = Some(ca.ca_file());
    let p = proxy(args.clone()).await;
    let c = client(p.addr);
    let written = eventually(Duration::from_secs(10), Duration::from_millis(100), || {
        let c = c.clone();
        async move { append(&c, "via-sentinel", 1, "m1").await.status.is_success() }
    })
    .await;
    assert!(written.is_some(), "no write went through Sentinel over TLS");
    assert!(
        !redis.server.keys("turnlock:*").is_empty(),
        "nothing written to the primary"
    );

    // Sentinel's own certificate is checked too: another CA is refused at start.
    let other = TestCa::new(dir.path(), "other-ca");
    args.redis_ca = Some(other.ca_file());
    match turnlock::sidecar::start(args).await {
        Err(e @ StartError::Backend(_)) => assert!(e.to_string().contains("refused the connection"), "{e}"),
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("an untrusted Sentinel was accepted"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connecting_by_ip_checks_the_certificate_against_the_server_name_given() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(dir.path(), "ca");
    // The certificate names only redis.internal, not the address connected to.
    let redis = TlsRedis::start_named(free_port(), &ca, &["redis.internal"], false, &[]);
    let store = store().await;
    let args = tls_args(store.addr, &redis, &ca);
    match turnlock::sidecar::start(args.clone()).await {
        Err(e @ StartError::Backend(_)) => assert!(e.to_string().contains("127.0.0.1"), "{e}"),
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("a certificate without the address connected to was accepted"),
    }
    let mut named = args;
    named.redis_tls_server_name = Some("redis.internal".into());
    let p = proxy(named).await;
    assert!(append(&client(p.addr), "by-ip", 1, "m1").await.status.is_success());
}
