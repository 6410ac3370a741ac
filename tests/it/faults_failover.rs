//! Fault 4, Redis failover through Sentinel at a moment when a lock grant was not yet replicated:
//! the promoted replica grants the same lock to a second writer while the first still
//! believes it holds it; the version check at the store keeps the first one's late write from
//! losing the second one's update. Also: `--redis-wait-replicas` refuses to write under a
//! grant no replica acknowledged, and what that option costs.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use turnlock::config::ProxyArgs;

use crate::support::ledger::*;
use crate::support::relay::{Link, OnPut, Relay};
use crate::support::*;

const LEASE_MS: u64 = 1000;
const PRIMARY_NAME: &str = "turnlock-primary";

/// A Redis Sentinel watching one primary, on a free port, killed on drop.
struct Sentinel {
    port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Sentinel {
    fn start(primary_port: u16) -> Self {
        Self::start_with(primary_port, "")
    }

    /// With extra configuration lines (credentials).
    fn start_with(primary_port: u16, extra: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\n\
                 sentinel monitor {PRIMARY_NAME} 127.0.0.1 {primary_port} 1\n\
                 sentinel down-after-milliseconds {PRIMARY_NAME} 400\n\
                 sentinel failover-timeout {PRIMARY_NAME} 3000\n\
                 sentinel parallel-syncs {PRIMARY_NAME} 1\n{extra}",
                dir.path().display()
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
        wait_for_port(port, Duration::from_secs(10));
        Self { port, child, _dir: dir }
    }

    fn query(&self, args: &[&str]) -> Option<redis::Value> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{}", self.port)).ok()?;
        let mut conn = client.get_connection().ok()?;
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(&mut conn).ok()
    }

    fn primary_port(&self) -> Option<u16> {
        let v = self.query(&["SENTINEL", "get-master-addr-by-name", PRIMARY_NAME])?;
        let (_, port): (String, String) = redis::from_redis_value(v).ok()?;
        port.parse().ok()
    }

    fn replicas(&self) -> usize {
        self.query(&["SENTINEL", "replicas", PRIMARY_NAME])
            .and_then(|v| redis::from_redis_value::<Vec<redis::Value>>(v).ok())
            .map(|v| v.len())
            .unwrap_or(0)
    }

    fn url(&self) -> String {
        format!("redis+sentinel://127.0.0.1:{}/{PRIMARY_NAME}", self.port)
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn args(upstream: &str, redis: &str) -> ProxyArgs {
    let mut a = ProxyArgs::local(upstream.to_owned());
    a.redis = Some(redis.to_owned());
    a.lock_ttl_ms = LEASE_MS;
    a.lock_budget_ms = 300;
    a
}

/// Median write latency of two proxies, measured alternately (`n` writes each) so that
/// background load weighs on both alike.
async fn median_writes(
    a: &turnlock::client::JsonClient,
    b: &turnlock::client::JsonClient,
    n: usize,
) -> (Duration, Duration) {
    let mut took = [Vec::with_capacity(n), Vec::with_capacity(n)];
    for i in 0..n {
        for (k, c) in [a, b].into_iter().enumerate() {
            let started = tokio::time::Instant::now();
            let r = try_append(c, &format!("failover-cost-{k}"), 1, &format!("cost-{k}-{i}"), true, &[])
                .await
                .expect("write");
            assert!(r.status.is_success(), "{} {}", r.status, r.json);
            took[k].push(started.elapsed());
        }
    }
    for t in &mut took {
        t.sort();
    }
    (took[0][n / 2], took[1][n / 2])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_with_unreplicated_grant_loses_no_update() {
    let mut primary = RedisServer::start();
    // The replica reaches its primary through a relay, so replication can be held back.
    let repl_link = Relay::start(SocketAddr::from(([127, 0, 0, 1], primary.port))).await;
    let repl_port = repl_link.addr.port().to_string();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &repl_port]);
    assert!(
        eventually(Duration::from_secs(15), Duration::from_millis(50), || async {
            replica.info("replication", "master_link_status") == "up"
        })
        .await
        .is_some(),
        "the replica never synchronised"
    );
    let sentinel = Sentinel::start(primary.port);
    assert!(
        eventually(Duration::from_secs(20), Duration::from_millis(100), || async {
            sentinel.replicas() == 1
        })
        .await
        .is_some(),
        "the sentinel never discovered the replica"
    );

    let store = store().await;
    let store_relay = Relay::start(store.addr).await;
    let a = proxy(args(&store_relay.url("http"), &sentinel.url())).await;
    let b = proxy(args(&format!("http://{}", store.addr), &sentinel.url())).await;
    let mut waiting = args(&format!("http://{}", store.addr), &sentinel.url());
    waiting.redis_wait_replicas = 1;
    waiting.redis_wait_timeout_ms = 100;
    let w = proxy(waiting).await;
    let (ac, bc, wc) = (client(a.addr), client(b.addr), client(w.addr));

    // What waiting for the replica costs, measured side by side while replication is healthy.
    let (plain, acked) = median_writes(&bc, &wc, 300).await;
    eprintln!(
        "WAIT-COST median write: {plain:?} without --redis-wait-replicas, {acked:?} with 1 replica ({:.2}x)",
        acked.as_secs_f64() / plain.as_secs_f64()
    );

    let all = sessions("failover", 5);
    let target = all[0].clone();
    let others: Vec<String> = all[1..].to_vec();
    let main = Ledger::default();
    let hint = AtomicU64::new(0);
    let seed = try_append(&bc, &target, 1, "failover-seed", true, &[])
        .await
        .expect("seed");
    assert!(seed.status.is_success());
    record(&main, &hint, &target, 1, "failover-seed", Ok(seed));
    let writers = Writers::start(
        "failover",
        vec![bc.clone()],
        others.clone(),
        3,
        3000,
        Duration::from_secs(90),
    );

    // Replication stalls: grants from now on exist on the primary only.
    repl_link.set_link(Link::Blackhole);
    let refused = try_append(&wc, &target, 1, "failover-unacked-grant", true, &[])
        .await
        .expect("answer");
    assert_eq!(
        refused.status, 503,
        "a write went ahead under an unreplicated grant: {}",
        refused.json
    );
    assert_eq!(refused.json["error"], "lock_unavailable");
    main.unknown(&target, "failover-unacked-grant");

    // A is granted the target's lock and sends its write-back; the network holds it.
    store_relay.on_put(OnPut::Hold);
    let t = target.clone();
    let ac2 = ac.clone();
    let first = tokio::spawn(async move { try_append(&ac2, &t, 1, "failover-first", true, &[]).await });
    assert!(
        store_relay.wait_held(1, Duration::from_secs(10)).await,
        "A never wrote back"
    );
    let lock_key = format!("turnlock:session:{{{target}}}:1");
    assert_eq!(primary.keys(&lock_key).len(), 1, "A's grant is not on the primary");

    // The primary dies before replicating the grant; Sentinel promotes the replica.
    primary.kill();
    repl_link.set_link(Link::Refuse);
    let promoted = eventually(Duration::from_secs(30), Duration::from_millis(100), || async {
        sentinel.primary_port() == Some(replica.port) && replica.info("replication", "role") == "master"
    })
    .await;
    assert!(promoted.is_some(), "the replica was never promoted");
    eprintln!(
        "replica promoted {:?} after the primary died",
        promoted.unwrap_or_default()
    );
    assert!(
        replica.keys(&lock_key).is_empty(),
        "the grant was replicated after all: the scenario did not happen"
    );

    // B follows the new primary and is granted the same lock: two writers believe they hold it.
    let second_version = AtomicU64::new(0);
    let second = eventually(Duration::from_secs(20), Duration::from_millis(50), || async {
        let r = try_append(&bc, &target, 1, "failover-second", true, &[]).await;
        let ok = matches!(&r, Ok(r) if r.status.is_success());
        if let Ok(r) = &r {
            second_version.store(r.json["version"].as_u64().unwrap_or(0), Ordering::Relaxed);
        }
        if ok {
            record(&main, &hint, &target, 1, "failover-second", r);
        }
        ok
    })
    .await;
    assert!(second.is_some(), "B never wrote through the new primary");

    // A's write-back arrives late: the version check must refuse it. Within its wait
    // deadline A may then re-read and re-merge under a grant of the new primary: acknowledged
    // only at a version after B's, never as the late write-back itself.
    store_relay.release_held();
    let first = tokio::time::timeout(Duration::from_secs(20), first)
        .await
        .expect("A answers")
        .expect("task");
    let first_status = first.as_ref().map(|r| r.status.as_u16()).unwrap_or(0);
    let first_version = first
        .as_ref()
        .map(|r| r.json["version"].as_u64().unwrap_or(0))
        .unwrap_or(0);
    let second_version = second_version.load(Ordering::Relaxed);
    record(&main, &hint, &target, 1, "failover-first", first);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let ledger = writers.finish().await;
    let counts = check(store.addr, &all, &[&main, &ledger]).await;
    report("Redis failover via Sentinel, grant not replicated", &counts);
    assert!(
        !(200..300).contains(&first_status) || first_version > second_version,
        "A's write under a lost grant was acknowledged ({first_status}) at version {first_version}, \
         not after B's ({second_version})"
    );
    assert!(counts.clean(), "{counts:?}");
    let ids = message_ids(&get_doc(&client(store.addr), &target).await.json);
    assert!(
        ids.contains(&"failover-second".to_owned()),
        "B's acknowledged write was lost: {ids:?}"
    );
    assert!(ledger.acked_count() > 0);
    // The proxies follow the new primary on their own.
    for admin in [a.admin, b.admin] {
        assert!(
            eventually(Duration::from_secs(10), Duration::from_millis(100), || async {
                dependency_up(admin, "redis").await == Some(true)
            })
            .await
            .is_some(),
            "a proxy did not become ready again on the new primary"
        );
    }
    a.stop().await;
    b.stop().await;
    w.stop().await;
}

/// A password-protected primary behind a password-protected Sentinel: the URL's credentials
/// and `/db` go to the primary, the query's to the Sentinel; wrong credentials show in
/// `/status` with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_with_auth_reaches_the_protected_primary_and_its_database() {
    let primary = RedisServer::start_with(&["--requirepass", "primary-pw"]);
    let sentinel = Sentinel::start_with(
        primary.port,
        &format!("sentinel auth-pass {PRIMARY_NAME} primary-pw\nrequirepass sentinel-pw\n"),
    );
    let store = store().await;
    let url = format!(
        "redis+sentinel://:primary-pw@127.0.0.1:{}/{PRIMARY_NAME}/2?sentinel_password=sentinel-pw",
        sentinel.port
    );
    let proxy = ProxyProc::spawn(&format!("http://{}", store.addr), Some(&url), &[]);
    let client = proxy.client();
    let written = eventually(Duration::from_secs(10), Duration::from_millis(100), || async {
        matches!(try_append(&client, "auth-1", 1, "m1", true, &[]).await, Ok(r) if r.status.is_success())
    })
    .await;
    assert!(written.is_some(), "no write went through Sentinel with AUTH");
    let db2 = redis::Client::open(format!("redis://:primary-pw@127.0.0.1:{}/2", primary.port)).expect("url");
    let mut conn = db2.get_connection().expect("connect to db 2");
    let keys: Vec<String> = redis::cmd("KEYS").arg("turnlock:*").query(&mut conn).expect("KEYS");
    assert!(!keys.is_empty(), "nothing written to database 2");

    let wrong = format!(
        "redis+sentinel://:wrong-pw@127.0.0.1:{}/{PRIMARY_NAME}?sentinel_password=sentinel-pw",
        sentinel.port
    );
    let refused = ProxyProc::spawn(&format!("http://{}", store.addr), Some(&wrong), &[]);
    let said = eventually(Duration::from_secs(10), Duration::from_millis(100), || async {
        let c = turnlock::client::JsonClient::new(format!("http://{}", refused.admin));
        match c.send(http::Method::GET, "/status", None, &[]).await {
            Ok(r) => {
                let dep = &r.json["dependencies"]["redis"];
                dep["up"] == false
                    && dep["error"]
                        .as_str()
                        .is_some_and(|e| !e.is_empty() && !e.contains("wrong-pw"))
            }
            Err(_) => false,
        }
    })
    .await;
    assert!(said.is_some(), "/status does not say why Redis is unusable");
}
