//! turnlock on a Redis Cluster: six real `redis-server --cluster-enabled yes` (three primaries,
//! three replicas) joined by `redis-cli --cluster create`, proxies started with
//! `redis+cluster://`, and the contention workload of the fault suite over sessions on every
//! shard.

use std::collections::{BTreeMap, HashMap};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::ledger::*;
use crate::support::*;

/// One cluster node: a `redis-server` process with its own directory, killed on drop.
struct Node {
    port: u16,
    child: Option<Child>,
    _dir: tempfile::TempDir,
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Node {
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn query<T: redis::FromRedisValue>(&self, args: &[&str]) -> redis::RedisResult<T> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{}", self.port))?;
        let mut conn = client.get_connection_with_timeout(Duration::from_secs(2))?;
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(&mut conn)
    }
}

struct Cluster {
    nodes: Vec<Node>,
}

/// A loopback port ≤ 55000 whose cluster bus port (+10000) is free too.
fn cluster_port(taken: &[u16]) -> u16 {
    for _ in 0..2000 {
        let port = 20000 + (rand::random::<u16>() % 35000);
        if taken.contains(&port) {
            continue;
        }
        let free = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(port) && free(port + 10000) {
            return port;
        }
    }
    panic!("no free loopback port pair for a cluster node");
}

fn redis_cli_bin() -> String {
    let bin = std::env::var("TURNLOCK_REDIS_CLI").unwrap_or_else(|_| "redis-cli".into());
    let found = Command::new(&bin)
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok();
    assert!(
        found,
        "{bin} not found: install Redis tools (e.g. `apt-get install -y redis-tools`) or set TURNLOCK_REDIS_CLI"
    );
    bin
}

impl Cluster {
    /// Six nodes, three primaries with a replica each, every slot covered, failover after one
    /// second of silence.
    fn start() -> Self {
        Self::start_with(|_| Vec::new())
    }

    /// With more arguments for each node (given its port).
    fn start_with(extra: impl Fn(u16) -> Vec<String>) -> Self {
        let cli = redis_cli_bin();
        let mut ports = Vec::new();
        let mut nodes = Vec::new();
        for _ in 0..6 {
            let port = cluster_port(&ports);
            ports.push(port);
            let dir = tempfile::tempdir().expect("tempdir");
            let child = Command::new(redis_server_bin())
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
                .args([
                    "--cluster-config-file",
                    "nodes.conf",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                .args(["--dir", dir.path().to_str().expect("utf-8 path")])
                .args(extra(port))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start redis-server");
            nodes.push(Node {
                port,
                child: Some(child),
                _dir: dir,
            });
            wait_for_port(port, Duration::from_secs(10));
        }
        let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let out = Command::new(&cli)
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Self { nodes };
        let started = Instant::now();
        while !cluster.ready() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the cluster did not become ready"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        cluster
    }

    /// Every live node says the cluster is ok and knows three primaries serving slots.
    fn ready(&self) -> bool {
        self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
            let ok = n
                .query::<String>(&["CLUSTER", "INFO"])
                .is_ok_and(|info| info.contains("cluster_state:ok"));
            // A primary has its replica in sync (a replica: its link to the primary is up).
            let synced = n.query::<String>(&["INFO", "replication"]).is_ok_and(|info| {
                (info.contains("role:master") && info.contains("state=online"))
                    || info.contains("master_link_status:up")
            });
            ok && synced
                && n.query::<String>(&["CLUSTER", "NODES"])
                    .is_ok_and(|t| primaries(&t).len() == 3)
        })
    }

    fn url(&self) -> String {
        let hosts: Vec<String> = self.nodes[..3]
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    fn live(&self) -> &Node {
        self.nodes.iter().find(|n| n.child.is_some()).expect("a live node")
    }

    /// The port of the primary serving each slot range, as a live node sees it.
    fn owners(&self) -> Vec<(u16, u16, u16)> {
        let text: String = self.live().query(&["CLUSTER", "NODES"]).expect("CLUSTER NODES");
        primaries(&text)
    }

    /// The port of the primary that serves `key`, with the slot the server computes.
    fn owner_of(&self, key: &str) -> (u16, u16) {
        let slot: u16 = self.live().query(&["CLUSTER", "KEYSLOT", key]).expect("KEYSLOT");
        let port = self
            .owners()
            .iter()
            .find(|(lo, hi, _)| (*lo..=*hi).contains(&slot))
            .map(|(_, _, p)| *p)
            .expect("every slot is served");
        (slot, port)
    }

    fn node(&mut self, port: u16) -> &mut Node {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .expect("a node on that port")
    }
}

/// `(first slot, last slot, port)` of every primary serving slots, from `CLUSTER NODES`.
fn primaries(nodes: &str) -> Vec<(u16, u16, u16)> {
    let mut out = Vec::new();
    for line in nodes.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 9 || !f[2].contains("master") || f[2].contains("fail") {
            continue;
        }
        let Some(port) = f[1]
            .split('@')
            .next()
            .and_then(|a| a.rsplit(':').next())
            .and_then(|p| p.parse::<u16>().ok())
        else {
            continue;
        };
        for range in &f[8..] {
            if range.starts_with('[') {
                continue;
            }
            let (lo, hi) = range.split_once('-').unwrap_or((range, range));
            if let (Ok(lo), Ok(hi)) = (lo.parse(), hi.parse()) {
                out.push((lo, hi, port));
            }
        }
    }
    out
}

/// Session ids with at least `per_shard` on each of the three primaries (the server's own
/// `CLUSTER KEYSLOT` decides), and which primary serves each.
fn sessions_on_every_shard(cluster: &Cluster, tag: &str, per_shard: usize) -> (Vec<String>, HashMap<String, u16>) {
    let mut by_shard: BTreeMap<u16, Vec<String>> = BTreeMap::new();
    let mut owner = HashMap::new();
    for i in 0..1000 {
        if by_shard.len() == 3 && by_shard.values().all(|s| s.len() >= per_shard) {
            break;
        }
        let id = format!("{tag}-{i}");
        let (_, port) = cluster.owner_of(&format!("{{{id}}}"));
        let shard = by_shard.entry(port).or_default();
        if shard.len() < per_shard {
            shard.push(id.clone());
            owner.insert(id, port);
        }
    }
    assert_eq!(by_shard.len(), 3, "sessions on only {} shards", by_shard.len());
    (by_shard.into_values().flatten().collect(), owner)
}

async fn cluster_proxies(cluster: &Cluster, store: std::net::SocketAddr, n: usize) -> Vec<turnlock::sidecar::Running> {
    let mut out = Vec::new();
    for _ in 0..n {
        let mut args = proxy_args(store, None);
        args.redis = Some(cluster.url());
        out.push(proxy(args).await);
    }
    out
}

/// Every session's keys are on its own shard: the fencing counter each write leaves behind is
/// counted in the session's slot by the primary that serves it.
fn assert_keys_on_their_shards(cluster: &Cluster, sessions: &[String]) {
    let mut shards_used = std::collections::BTreeSet::new();
    for id in sessions {
        let key = format!("turnlock:session:{{{id}}}:fence");
        let (slot, port) = cluster.owner_of(&key);
        let node = cluster.nodes.iter().find(|n| n.port == port).expect("owner node");
        let n: u64 = node
            .query(&["CLUSTER", "COUNTKEYSINSLOT", &slot.to_string()])
            .expect("COUNTKEYSINSLOT");
        let exists: u64 = node.query(&["EXISTS", &key]).expect("EXISTS");
        if exists == 1 && n > 0 {
            shards_used.insert(port);
        }
    }
    assert_eq!(shards_used.len(), 3, "session keys found on {shards_used:?} only");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn contention_across_three_shards_through_three_proxies_loses_nothing() {
    let cluster = Cluster::start();
    let store = store().await;
    let proxies = cluster_proxies(&cluster, store.addr, 3).await;
    let (sessions, _) = sessions_on_every_shard(&cluster, "shard", 4);

    let clients = proxies.iter().map(|p| client(p.addr)).collect();
    let writers = Writers::start("cluster", clients, sessions.clone(), 24, 100, Duration::from_secs(12));
    // Meanwhile, which release channels the primaries have subscribers on: sharded ones only.
    let ports: Vec<u16> = cluster.owners().iter().map(|o| o.2).collect();
    let sampler = tokio::task::spawn_blocking(move || {
        let (mut sharded, mut plain) = (0usize, 0usize);
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            for port in &ports {
                let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}")) else {
                    continue;
                };
                let Ok(mut c) = client.get_connection_with_timeout(Duration::from_secs(1)) else {
                    continue;
                };
                let shard: Vec<String> = redis::cmd("PUBSUB")
                    .arg("SHARDCHANNELS")
                    .query(&mut c)
                    .unwrap_or_default();
                let global: Vec<String> = redis::cmd("PUBSUB").arg("CHANNELS").query(&mut c).unwrap_or_default();
                sharded = sharded.max(shard.len());
                plain = plain.max(global.len());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        (sharded, plain)
    });
    tokio::time::sleep(Duration::from_secs(12)).await;
    let ledger = writers.finish().await;
    let (sharded, plain) = sampler.await.expect("sampler");
    assert!(sharded > 0, "no waiter ever subscribed to a shard channel");
    assert_eq!(plain, 0, "waiters subscribed with plain SUBSCRIBE on a cluster");
    let counts = check(store.addr, &sessions, &[&ledger]).await;
    report("redis cluster, 3 shards, 3 proxies", &counts);
    eprintln!("statuses: {:?}", ledger.statuses.lock().expect("ledger"));
    assert!(counts.clean(), "{counts:?}");
    assert!(counts.acknowledged >= 200, "too few writes went through: {counts:?}");
    assert_keys_on_their_shards(&cluster, &sessions);

    // A release is announced on the session's own shard: a sharded subscriber on its primary
    // hears it.
    let session = &sessions[0];
    let (_, owner) = cluster.owner_of(&format!("{{{session}}}"));
    let turn = get_doc(&client(proxies[0].addr), session).await.json["turn"]
        .as_u64()
        .unwrap_or(1);
    let channel = format!("turnlock:session:{{{session}}}:{turn}:released");
    let mut listener = Command::new(redis_cli_bin())
        .args(["-p", &owner.to_string(), "SSUBSCRIBE", &channel])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-cli SSUBSCRIBE");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let probe = Ledger::default();
    let r = try_append(&client(proxies[1].addr), session, turn, "announced", true, &[]).await;
    record(&probe, &AtomicU64::new(turn), session, turn, "announced", r);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = listener.kill();
    let heard = listener.wait_with_output().expect("redis-cli output");
    let heard = String::from_utf8_lossy(&heard.stdout);
    assert!(heard.contains("smessage"), "no sharded release announcement: {heard}");
    let counts = check(store.addr, &sessions, &[&ledger, &probe]).await;
    assert!(counts.clean(), "{counts:?}");

    // Every lock was released (no lease left to expire) on every shard.
    for (_, _, port) in cluster.owners() {
        let node = cluster.nodes.iter().find(|n| n.port == port).expect("owner node");
        let left: Vec<String> = node.query(&["KEYS", "turnlock:session:*}:[0-9]*"]).expect("KEYS");
        assert!(left.is_empty(), "locks left on the primary at {port}: {left:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_primary_killed_mid_run_pauses_its_sessions_and_loses_nothing() {
    let mut cluster = Cluster::start();
    let store = store().await;
    let proxies = cluster_proxies(&cluster, store.addr, 3).await;
    let (sessions, owner) = sessions_on_every_shard(&cluster, "failover", 3);
    let victim_port = owner[&sessions[0]];
    let probe_session = sessions[0].clone();

    let clients: Vec<_> = proxies.iter().map(|p| client(p.addr)).collect();
    let writers = Writers::start(
        "failover",
        clients.clone(),
        sessions.clone(),
        18,
        400,
        Duration::from_secs(30),
    );
    tokio::time::sleep(Duration::from_secs(3)).await;

    // Kill the primary of the probe session's shard; a probe writes to that session until a
    // write is acknowledged again.
    let probe_ledger = Arc::new(Ledger::default());
    let hint = AtomicU64::new(1);
    cluster.node(victim_port).kill();
    let killed = Instant::now();
    let mut resumed = None;
    let mut n = 0;
    while killed.elapsed() < Duration::from_secs(20) {
        n += 1;
        let token = format!("probe-{n}");
        let turn = hint.load(Ordering::SeqCst);
        let r = try_append(&clients[0], &probe_session, turn, &token, true, &[]).await;
        let ok = r.as_ref().is_ok_and(|r| r.status.is_success());
        if !ok && n % 10 == 1 {
            eprintln!(
                "probe {n} at {:?}: {:?}",
                killed.elapsed(),
                r.as_ref().map(|r| (r.status, r.json.clone()))
            );
        }
        record(&probe_ledger, &hint, &probe_session, turn, &token, r);
        if ok && n > 1 {
            resumed = Some(killed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let Some(paused) = resumed else {
        let nodes: String = cluster.live().query(&["CLUSTER", "NODES"]).unwrap_or_default();
        panic!("writes to the killed primary's sessions never resumed (killed {victim_port}):\n{nodes}");
    };
    eprintln!("CLUSTER-FAILOVER writes to the killed primary's slots resumed after {paused:?}");
    tokio::time::sleep(Duration::from_secs(3)).await;

    let ledger = writers.finish().await;
    let counts = check(store.addr, &sessions, &[&ledger, &probe_ledger]).await;
    report("redis cluster, primary SIGKILLed", &counts);
    eprintln!("statuses: {:?}", ledger.statuses.lock().expect("ledger"));
    assert!(
        counts.lost == 0 && counts.duplicated == 0 && counts.unexplained == 0,
        "{counts:?}"
    );
    assert!(counts.stale_accepted == 0, "{counts:?}");
    assert!(counts.acknowledged >= 100, "too few writes went through: {counts:?}");
}

/// The port of the replica of the primary on `primary_port`, from `CLUSTER NODES`.
fn replica_of(cluster: &Cluster, primary_port: u16) -> u16 {
    let text: String = cluster.live().query(&["CLUSTER", "NODES"]).expect("CLUSTER NODES");
    let port_of = |addr: &str| {
        addr.split('@')
            .next()
            .and_then(|a| a.rsplit(':').next())
            .and_then(|p| p.parse::<u16>().ok())
    };
    let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split_whitespace().collect()).collect();
    let primary_id = lines
        .iter()
        .find(|f| f.len() > 2 && port_of(f[1]) == Some(primary_port))
        .map(|f| f[0])
        .expect("the primary is listed");
    lines
        .iter()
        .find(|f| f.len() > 3 && f[2].contains("slave") && f[3] == primary_id)
        .and_then(|f| port_of(f[1]))
        .expect("the primary has a replica")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wait_replicas_asks_the_sessions_own_primary() {
    let mut cluster = Cluster::start();
    let store = store().await;
    let (sessions, owner) = sessions_on_every_shard(&cluster, "wait", 1);
    let mut args = proxy_args(store.addr, None);
    args.redis = Some(cluster.url());
    args.redis_wait_replicas = 1;
    args.redis_wait_timeout_ms = 200;
    args.lock_budget_ms = 1000;
    let p = proxy(args).await;
    let c = client(p.addr);
    for (i, s) in sessions.iter().enumerate() {
        let r = append(&c, s, 1, &format!("before-{i}")).await;
        assert!(r.status.is_success(), "{s}: {} {}", r.status, r.json);
    }

    // One shard loses its replica: its sessions' grants cannot be acknowledged any more, the
    // other shards' still are (a WAIT sent to every primary would fail them all).
    let (lonely, others): (Vec<&String>, Vec<&String>) =
        sessions.iter().partition(|s| owner[*s] == owner[&sessions[0]]);
    let replica = replica_of(&cluster, owner[lonely[0]]);
    cluster.node(replica).kill();
    for (i, s) in others.iter().enumerate() {
        let r = append(&c, s, 1, &format!("after-{i}")).await;
        assert!(
            r.status.is_success(),
            "{s} on a shard with its replica: {} {}",
            r.status,
            r.json
        );
    }
    let r = append(&c, lonely[0], 1, "after-lonely").await;
    assert_eq!(
        r.status.as_u16(),
        503,
        "a grant its primary's replica never saw: {}",
        r.json
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slots_moved_under_load_lose_nothing() {
    let cluster = Cluster::start();
    let store = store().await;
    let proxies = cluster_proxies(&cluster, store.addr, 3).await;
    // The primary serving slot 0 gives its first 300 slots away; the sessions live there.
    const MOVED: u16 = 300;
    let sessions: Vec<String> = (0..20_000)
        .map(|i| format!("moved-{i}"))
        .filter(|id| turnlock::session::cluster_slot(id.as_bytes()) < MOVED)
        .take(6)
        .collect();
    assert_eq!(sessions.len(), 6, "not enough session ids in the moved slots");
    let (_, from_port) = cluster.owner_of(&format!("{{{}}}", sessions[0]));
    let to_port = cluster
        .owners()
        .iter()
        .map(|o| o.2)
        .find(|p| *p != from_port)
        .expect("another primary");
    let id_of = |port: u16| -> String {
        let node = cluster.nodes.iter().find(|n| n.port == port).expect("node");
        node.query(&["CLUSTER", "MYID"]).expect("CLUSTER MYID")
    };
    let (from, to) = (id_of(from_port), id_of(to_port));

    let clients = proxies.iter().map(|p| client(p.addr)).collect();
    let writers = Writers::start("moved", clients, sessions.clone(), 12, 1000, Duration::from_secs(25));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cli = redis_cli_bin();
    let entry = format!("127.0.0.1:{from_port}");
    let started = Instant::now();
    let reshard = tokio::task::spawn_blocking(move || {
        Command::new(cli)
            .args([
                "--cluster",
                "reshard",
                &entry,
                "--cluster-from",
                &from,
                "--cluster-to",
                &to,
            ])
            .args(["--cluster-slots", &MOVED.to_string(), "--cluster-yes"])
            .args(["--cluster-pipeline", "1"])
            .output()
    })
    .await
    .expect("reshard task")
    .expect("redis-cli --cluster reshard");
    let took = started.elapsed();
    assert!(
        reshard.status.success(),
        "reshard failed: {}",
        String::from_utf8_lossy(&reshard.stdout)
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ledger = writers.finish().await;
    for s in &sessions {
        assert_eq!(cluster.owner_of(&format!("{{{s}}}")).1, to_port, "{s} was not moved");
    }
    let after = ledger.acked().len();
    // Writes go on at the new owner.
    let c = client(proxies[1].addr);
    let turn = get_doc(&c, &sessions[0]).await.json["turn"].as_u64().unwrap_or(1);
    let probe = Ledger::default();
    let r = try_append(&c, &sessions[0], turn, "after-the-move", true, &[]).await;
    let ok = r.as_ref().is_ok_and(|r| r.status.is_success());
    record(&probe, &AtomicU64::new(turn), &sessions[0], turn, "after-the-move", r);
    assert!(
        ok,
        "no write after the move: {:?}",
        probe.statuses.lock().expect("ledger")
    );
    let counts = check(store.addr, &sessions, &[&ledger, &probe]).await;
    report("redis cluster, slots moved under load", &counts);
    eprintln!(
        "CLUSTER-RESHARD {MOVED} slots moved in {took:?}; statuses: {:?}",
        ledger.statuses.lock().expect("ledger")
    );
    assert!(counts.clean(), "{counts:?}");
    assert!(after >= 100, "too few writes went through: {counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_over_tls_is_written_on_every_shard() {
    use crate::support::tls::{path, TestCa};
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(dir.path(), "cluster-ca");
    let (cert, key) = ca.issue("cluster-node", &["localhost", "127.0.0.1"]);
    let (cert, key, ca_file) = (path(&cert), path(&key), path(&ca.ca_file()));
    let tls_ports = std::sync::Mutex::new(HashMap::new());
    let cluster = Cluster::start_with(|port| {
        let tls_port = free_port();
        tls_ports.lock().expect("ports").insert(port, tls_port);
        [
            "--tls-port",
            &tls_port.to_string(),
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "--tls-ca-cert-file",
            &ca_file,
            "--tls-auth-clients",
            "no",
            "--tls-cluster",
            "yes",
            "--tls-replication",
            "yes",
        ]
        .map(String::from)
        .to_vec()
    });
    let tls_ports = tls_ports.into_inner().expect("ports");
    let store = store().await;
    let (sessions, _) = sessions_on_every_shard(&cluster, "tls", 2);
    let url = format!("rediss+cluster://127.0.0.1:{}", tls_ports[&cluster.nodes[0].port]);
    let mut args = proxy_args(store.addr, None);
    args.redis = Some(url.clone());
    args.redis_ca = Some(ca.ca_file());
    let p = proxy(args).await;
    let clients = vec![client(p.addr)];
    let writers = Writers::start("tls", clients, sessions.clone(), 8, 40, Duration::from_secs(8));
    tokio::time::sleep(Duration::from_secs(8)).await;
    let ledger = writers.finish().await;
    let counts = check(store.addr, &sessions, &[&ledger]).await;
    report("redis cluster over TLS", &counts);
    assert!(counts.clean(), "{counts:?}");
    assert!(counts.acknowledged >= 50, "too few writes went through: {counts:?}");
    assert_keys_on_their_shards(&cluster, &sessions);

    // Without the CA, the cluster's certificates are not trusted: no write goes through.
    let mut args = proxy_args(store.addr, None);
    args.redis = Some(url);
    args.lock_budget_ms = 200;
    match turnlock::sidecar::start(args).await {
        Ok(untrusting) => {
            let r = try_append(&client(untrusting.addr), &sessions[0], 99, "untrusted", true, &[]).await;
            eprintln!("untrusted cluster: {r:?}");
            let status = r.as_ref().map(|r| r.status.as_u16()).unwrap_or(0);
            assert_eq!(status, 503, "{r:?}");
        }
        Err(e) => {
            eprintln!("untrusted cluster: {e}");
            assert!(e.to_string().to_lowercase().contains("certificate"), "{e}");
        }
    }
}

/// What one write of [`retrying_writers`] met: every answer that was not an acceptance (when,
/// after the start, and its status and code), and when it was accepted.
#[derive(Debug, Default)]
struct Retried {
    session: String,
    token: String,
    first_try: Duration,
    accepted: Option<Duration>,
    refusals: Vec<(Duration, u16, String)>,
}

/// Writers as an agent retries: each writer appends to one session (turn 1), with the message
/// id as its `Idempotency-Key`, and sends the same write again 100 ms after any answer but an
/// acceptance, for up to `give_up`. New writes start until `run` has passed.
async fn retrying_writers(
    clients: Vec<turnlock::client::JsonClient>,
    sessions: Vec<String>,
    writers: usize,
    run: Duration,
    give_up: Duration,
    started: Instant,
) -> Vec<Retried> {
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let clients = clients.clone();
            let session = sessions[w % sessions.len()].clone();
            tokio::spawn(async move {
                let mut out = Vec::new();
                let mut n = 0;
                while started.elapsed() < run {
                    n += 1;
                    let token = format!("{session}-w{w}-{n}");
                    let mut r = Retried {
                        session: session.clone(),
                        token: token.clone(),
                        first_try: started.elapsed(),
                        ..Retried::default()
                    };
                    let key = [("idempotency-key", token.clone())];
                    let mut tries = 0usize;
                    loop {
                        tries += 1;
                        let client = &clients[(w + tries) % clients.len()];
                        let reply = try_append(client, &session, 1, &token, true, &key).await;
                        match reply {
                            Ok(reply) if reply.status.is_success() => {
                                r.accepted = Some(started.elapsed());
                                break;
                            }
                            Ok(reply) => r.refusals.push((
                                started.elapsed(),
                                reply.status.as_u16(),
                                reply.json["error"].as_str().unwrap_or("").to_owned(),
                            )),
                            Err(e) => r.refusals.push((started.elapsed(), 0, e)),
                        }
                        if started.elapsed() - r.first_try > give_up {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    out.push(r);
                }
                out
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("writer"));
    }
    all
}

/// Every accepted write is in its session's document exactly once, and nothing else is.
async fn assert_written_once(store: std::net::SocketAddr, sessions: &[String], writes: &[Retried]) {
    let ledger = Ledger::default();
    for w in writes.iter().filter(|w| w.accepted.is_some()) {
        ledger.ack(&w.session, &w.token, 1, &serde_json::Value::Null);
    }
    for w in writes.iter().filter(|w| w.accepted.is_none()) {
        ledger.unknown(&w.session, &w.token);
    }
    let counts = check(store, sessions, &[&ledger]).await;
    assert!(
        counts.lost == 0 && counts.duplicated == 0 && counts.unexplained == 0,
        "{counts:?}"
    );
}

/// A primary SIGKILLed under writes that agents retry with their `Idempotency-Key`: a write
/// answered with an error that means "nothing applied" goes through on a retry once its shard
/// has a primary again (its claim on the key is dropped once Redis takes the drop, not left
/// `request_in_progress` for the claim's whole lifetime), and nothing is applied twice. With
/// Redis's default `cluster-require-full-coverage yes`, every shard refuses commands while
/// the dead one has no primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_refused_during_a_failover_goes_through_when_retried() {
    let mut cluster = Cluster::start();
    let store = store().await;
    let proxies = cluster_proxies(&cluster, store.addr, 3).await;
    let (sessions, owner) = sessions_on_every_shard(&cluster, "retried", 2);
    let victim = owner[&sessions[0]];
    let clients: Vec<_> = proxies.iter().map(|p| client(p.addr)).collect();
    let started = Instant::now();
    let run = tokio::spawn(retrying_writers(
        clients,
        sessions.clone(),
        12,
        Duration::from_secs(12),
        Duration::from_secs(25),
        started,
    ));
    tokio::time::sleep(Duration::from_secs(4)).await;
    cluster.node(victim).kill();
    let killed = started.elapsed();
    let writes = run.await.expect("writers");

    let refused = writes.iter().filter(|w| !w.refusals.is_empty()).count();
    let slowest = writes
        .iter()
        .filter_map(|w| w.accepted.map(|a| a - w.first_try))
        .max()
        .unwrap_or_default();
    let codes: BTreeMap<String, usize> =
        writes
            .iter()
            .flat_map(|w| &w.refusals)
            .fold(BTreeMap::new(), |mut m, (_, status, code)| {
                *m.entry(format!("{status} {code}")).or_default() += 1;
                m
            });
    eprintln!(
        "CLUSTER-RETRIED killed at {killed:?}: {} writes, {refused} met a refusal, slowest accepted {slowest:?} after its first try, refusals {codes:?}",
        writes.len()
    );
    let stuck: Vec<_> = writes.iter().filter(|w| w.accepted.is_none()).collect();
    assert!(stuck.is_empty(), "writes never accepted on retry: {stuck:?}");
    assert!(
        slowest < Duration::from_secs(15),
        "a retried write waited {slowest:?} to be accepted"
    );
    assert_written_once(store.addr, &sessions, &writes).await;
}

/// With `cluster-require-full-coverage no` (what the README asks for), a primary SIGKILLed
/// stops no session of the other shards: they see no error at all; and the dead shard's
/// writes wait for its replica's promotion within their wait deadline instead of bouncing,
/// and no longer than the promotion.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failover_leaves_the_other_shards_untouched() {
    let mut cluster = Cluster::start_with(|_| vec!["--cluster-require-full-coverage".into(), "no".into()]);
    let store = store().await;
    // A store that takes 200 ms per write-back: each session's commit slot is held most of
    // the time, so the killed primary has granted one that reached its replica.
    let slow = front_store(store.addr, PutDelay::Every(Duration::from_millis(200))).await;
    let mut proxies = Vec::new();
    for _ in 0..3 {
        let mut args = proxy_args(slow, None);
        args.redis = Some(cluster.url());
        args.wait_deadline_ms = 8000;
        proxies.push(proxy(args).await);
    }
    let (sessions, owner) = sessions_on_every_shard(&cluster, "healthy", 2);
    let victim = owner[&sessions[0]];
    let clients: Vec<_> = proxies.iter().map(|p| client(p.addr)).collect();
    let started = Instant::now();
    let run = tokio::spawn(retrying_writers(
        clients,
        sessions.clone(),
        12,
        Duration::from_secs(10),
        Duration::from_secs(25),
        started,
    ));
    tokio::time::sleep(Duration::from_secs(3)).await;
    cluster.node(victim).kill();
    let killed = started.elapsed();
    let writes = run.await.expect("writers");

    let owner = &owner;
    let on = |dead: bool| {
        writes
            .iter()
            .filter(move |w| (owner[&w.session] == victim) == dead)
            .flat_map(|w| w.refusals.iter().map(move |r| (w.session.clone(), r.clone())))
            .collect::<Vec<_>>()
    };
    let (healthy, dead) = (on(false), on(true));
    let paused = writes
        .iter()
        .filter(|w| owner[&w.session] == victim)
        .filter_map(|w| w.accepted.map(|a| a - w.first_try))
        .max()
        .unwrap_or_default();
    eprintln!(
        "CLUSTER-HEALTHY killed at {killed:?}: healthy shards {} refusals, dead shard {} refusals, its longest write {paused:?}",
        healthy.len(),
        dead.len()
    );
    assert!(
        healthy.is_empty(),
        "the healthy shards' sessions were refused: {healthy:?}"
    );
    assert!(
        dead.is_empty(),
        "the dead shard's writes bounced within their deadline: {dead:?}"
    );
    assert!(writes.iter().all(|w| w.accepted.is_some()), "writes never accepted");
    // The promotion takes about 2 s. A commit slot the killed primary granted reached its
    // replica: given back once the new primary answers, not left to lapse (the store timeout
    // + a lease, 7 s here).
    assert!(
        paused < Duration::from_secs(5),
        "the dead shard's writes waited {paused:?}"
    );
    assert_written_once(store.addr, &sessions, &writes).await;
}

/// `/status` of an admin address, as JSON.
async fn status_of(admin: std::net::SocketAddr) -> serde_json::Value {
    client(admin)
        .send(http::Method::GET, "/status", None, &[])
        .await
        .map(|r| r.json)
        .unwrap_or_default()
}

/// The health check is cluster-aware: with a primary and its replica SIGKILLed (its slots
/// served by no one, `cluster_state:fail`), `/status` and `turnlock_dependency_up` say Redis
/// is down and name the node (`turnlock_redis_node_up{node}` = 0), while the pod stays
/// ready (a Redis outage is not the sidecar's fault). Before, a `PING` routed to any node
/// kept saying Redis was up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_shard_is_reported_by_node_and_leaves_the_pod_ready() {
    let mut cluster = Cluster::start();
    let store = store().await;
    let proxies = cluster_proxies(&cluster, store.addr, 1).await;
    let admin = proxies[0].admin;
    let primaries: Vec<u16> = cluster.owners().iter().map(|o| o.2).collect();
    let healthy = eventually(Duration::from_secs(10), Duration::from_millis(100), || async {
        let s = status_of(admin).await;
        s["dependencies"]["redis"]["up"] == serde_json::json!(true)
            && s["dependencies"]["redis"]["nodes"]
                .as_array()
                .is_some_and(|n| n.len() == 3)
    })
    .await;
    assert!(
        healthy.is_some(),
        "the cluster never reported up: {}",
        status_of(admin).await
    );
    let text = metrics(admin).await;
    for port in &primaries {
        let sample = format!("turnlock_redis_node_up{{node=\"127.0.0.1:{port}\"}}");
        assert_eq!(metric(&text, &sample), 1.0, "{sample} in\n{text}");
    }

    let victim = primaries[0];
    let replica = replica_of(&cluster, victim);
    cluster.node(replica).kill();
    cluster.node(victim).kill();
    let killed = Instant::now();
    let reported = eventually(Duration::from_secs(15), Duration::from_millis(100), || async {
        dependency_up(admin, "redis").await == Some(false)
    })
    .await;
    let status = status_of(admin).await;
    assert!(
        reported.is_some(),
        "Redis still reported up {:?} after a shard died: {status}",
        killed.elapsed()
    );
    eprintln!("CLUSTER-HEALTH a dead shard reported down after {reported:?}: {status}");
    let dead = format!("127.0.0.1:{victim}");
    let nodes = status["dependencies"]["redis"]["nodes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let node = nodes.iter().find(|n| n["node"] == serde_json::json!(dead));
    assert!(
        node.is_some_and(|n| n["up"] == serde_json::json!(false)),
        "the dead primary {dead} is not named down: {status}"
    );
    let error = status["dependencies"]["redis"]["error"].as_str().unwrap_or("");
    assert!(error.contains(&dead), "the error does not name {dead}: {error}");
    let text = metrics(admin).await;
    assert_eq!(
        metric(&text, "turnlock_dependency_up{dependency=\"redis\"}"),
        0.0,
        "{text}"
    );
    let sample = format!("turnlock_redis_node_up{{node=\"{dead}\"}}");
    assert!(text.contains(&format!("{sample} 0")), "{sample} is not 0 in\n{text}");
    assert_eq!(readyz(admin).await, 200, "a dead shard made the pod NotReady");

    // The start check for the older key layout still looks at the shards that answer: an old
    // counter on a live shard stops a new proxy even while another shard is dead.
    let live = primaries[1];
    let old_key = (0..64)
        .map(|i| format!("turnlock:fence:old-{i}"))
        .find(|key| {
            Command::new(redis_cli_bin())
                .args(["-c", "-p", &live.to_string(), "SET", key, "5"])
                .output()
                .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains("OK"))
        })
        .expect("an old-layout key on a live shard");
    let mut args = proxy_args(store.addr, None);
    args.redis = Some(cluster.url());
    let Err(e) = turnlock::sidecar::start(args).await else {
        panic!("a proxy started beside {old_key} because another shard was dead");
    };
    assert!(e.to_string().contains(&old_key), "{e}");
}

/// While the cluster cannot be reached at all, a write that runs out of time is told
/// `lock_unavailable`, never `session_busy` (load shedding: the wrong remedy for an outage).
#[tokio::test]
async fn an_unreachable_cluster_is_answered_lock_unavailable_not_session_busy() {
    let store = store().await;
    let mut args = proxy_args(store.addr, None);
    args.redis = Some(format!("redis+cluster://127.0.0.1:{}", free_port()));
    let p = proxy(args).await;
    let c = crate::support::client(p.addr);
    for i in 0..3 {
        let r = try_append(
            &c,
            &format!("down-{i}"),
            1,
            "a",
            true,
            &[("x-wait-deadline-ms", "400".into())],
        )
        .await
        .expect("answer");
        assert_eq!(
            (r.status.as_u16(), r.json["error"].as_str()),
            (503, Some("lock_unavailable")),
            "{}",
            r.json
        );
    }
}

/// A Redis holding keys of the older key layout (before hash tags): a proxy refuses to start
/// and names `turnlock migrate-keys`; that command refuses while an old proxy holds a lock,
/// then carries the fencing counter over (a token at least the old counter's next) and
/// removes the old keys; the proxy then starts and its first grant is above the old counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_key_layout_stops_the_start_until_migrated() {
    let redis = RedisServer::start();
    let store = store().await;
    let client = redis::Client::open(redis.url()).expect("client");
    let mut c = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .expect("connect");
    // Above any clock-based token (2^52 µs is the year 2112): only a carried-over counter
    // makes the next token larger.
    let old_counter: u64 = 1 << 52;
    let set = |c: &mut redis::Connection, args: &[&str]| {
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query::<()>(c).expect("redis command");
    };
    set(&mut c, &["SET", "turnlock:fence:old-1", &old_counter.to_string()]);
    set(&mut c, &["SET", "turnlock:idem:old-1:abc", "{}"]);
    set(&mut c, &["SET", "turnlock:session:old-1:1", "token", "PX", "1500"]);
    // A counter of the new layout that would lapse soon, and an old counter that is no number.
    set(&mut c, &["SET", "turnlock:session:{old-1}:fence", "7", "PX", "5000"]);
    set(&mut c, &["SET", "turnlock:fence:old-2", "12abc"]);

    let refused = turnlock::sidecar::start(proxy_args(store.addr, Some(&redis))).await;
    let Err(e) = refused else {
        panic!("a proxy started beside keys of the older layout");
    };
    let text = e.to_string();
    assert!(
        text.contains("migrate-keys") && text.contains("turnlock:fence:old-1"),
        "{text}"
    );

    let migrate = || {
        Command::new(turnlock_bin())
            .args(["migrate-keys", "--redis", &redis.url()])
            .output()
            .expect("turnlock migrate-keys")
    };
    let busy = migrate();
    assert!(!busy.status.success(), "migrated while an old proxy held a lock");
    assert!(
        String::from_utf8_lossy(&busy.stderr).contains("holds locks"),
        "{}",
        String::from_utf8_lossy(&busy.stderr)
    );
    tokio::time::sleep(Duration::from_millis(1700)).await;
    let done = migrate();
    let out = String::from_utf8_lossy(&done.stdout);
    assert!(done.status.success(), "{out} {}", String::from_utf8_lossy(&done.stderr));
    assert!(out.contains("1 fencing counters carried over, 3 keys"), "{out}");
    let left: Vec<String> = redis::cmd("KEYS").arg("turnlock:*").query(&mut c).expect("KEYS");
    assert_eq!(left, vec!["turnlock:session:{old-1}:fence".to_owned()], "{left:?}");
    let ttl: i64 = redis::cmd("PTTL")
        .arg("turnlock:session:{old-1}:fence")
        .query(&mut c)
        .expect("PTTL");
    assert!(
        ttl > 60_000,
        "the carried-over counter lapses in {ttl} ms, or never (-1), not with a session's TTL"
    );

    let p = proxy(proxy_args(store.addr, Some(&redis))).await;
    let r = append(&crate::support::client(p.addr), "old-1", 1, "after-upgrade").await;
    assert!(r.status.is_success(), "{:?}", r.json);
    let token: u64 = redis::cmd("GET")
        .arg("turnlock:session:{old-1}:fence")
        .query(&mut c)
        .expect("GET fence");
    assert!(
        token > old_counter,
        "token {token} not above the old counter {old_counter}"
    );
}
