//! turnlock in front of real stores, driven as agents drive them: S3 (moto's standalone server,
//! boto3 agents doing GET-modify-PUT) and CouchDB (`pouchdb-server` in memory, `_rev` agents).

use std::collections::{HashMap, HashSet};

use serde_json::Value;

use crate::support::third_party::{
    aws_env, moto_server, moto_server_with, pouchdb_server, routes_file, run_node, run_python, run_python_env,
    sidecar_process, sidecars, signed, Server, COUCHDB_ROUTES, S3_ROUTES,
};
use crate::support::RedisServer;

async fn python(script: &'static str, args: Vec<String>) -> Value {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_python(script, &args)
    })
    .await
    .expect("python")
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

/// What the agents were told, against what the store holds: (acked, lost, duplicated).
pub(crate) fn tally(run: &Value, stored: &Value) -> (usize, Vec<String>, Vec<String>) {
    let acked = strings(&run["acked"]);
    let ids: Vec<String> = stored["doc"]["messages"]
        .as_array()
        .map(|m| m.iter().filter_map(|m| m["id"].as_str().map(str::to_owned)).collect())
        .unwrap_or_default();
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for id in &ids {
        *counts.entry(id).or_default() += 1;
    }
    let stored_set: HashSet<&str> = ids.iter().map(String::as_str).collect();
    let lost = acked
        .iter()
        .filter(|id| !stored_set.contains(id.as_str()))
        .cloned()
        .collect();
    let dup = counts
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, _)| id.to_string())
        .collect();
    (acked.len(), lost, dup)
}

const AGENTS: usize = 6;
const WRITES: usize = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boto3_agents_through_signing_sidecars_lose_nothing_and_see_no_error() {
    aws_env();
    let moto = moto_server();
    let redis = RedisServer::start();
    let routes = routes_file(&signed(S3_ROUTES));
    let proxies = sidecars(&moto, &redis, &routes, 3).await;
    let endpoints: Vec<String> = proxies.iter().map(|p| format!("http://{}", p.addr)).collect();
    let (bucket, key) = ("agents", "sessions/s-1.json");
    python(
        "s3_tool.py",
        vec![
            "setup".into(),
            moto.url(),
            bucket.into(),
            key.into(),
            endpoints[0].clone(),
        ],
    )
    .await;
    let run = python(
        "s3_agents.py",
        vec![
            endpoints.join(","),
            bucket.into(),
            key.into(),
            AGENTS.to_string(),
            WRITES.to_string(),
        ],
    )
    .await;
    let stored = python("s3_tool.py", vec!["read".into(), moto.url(), bucket.into(), key.into()]).await;
    let (acked, lost, dup) = tally(&run, &stored);
    assert_eq!(run["errors"], serde_json::json!([]), "boto3 raised: {run}");
    assert_eq!(run["extra_attempts"], 0, "botocore retried a put_object: {run}");
    assert_eq!(acked, AGENTS * WRITES, "{run}");
    assert!(lost.is_empty(), "acknowledged writes lost: {lost:?}");
    assert!(dup.is_empty(), "messages stored twice: {dup:?}");
    // The write-back kept the client's metadata.
    assert!(stored["metadata"]["agent"].is_string(), "{stored}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boto3_agents_straight_to_the_store_lose_writes() {
    let moto = moto_server();
    let (bucket, key) = ("direct", "sessions/s-1.json");
    python(
        "s3_tool.py",
        vec!["setup".into(), moto.url(), bucket.into(), key.into(), moto.url()],
    )
    .await;
    let run = python(
        "s3_agents.py",
        vec![
            moto.url(),
            bucket.into(),
            key.into(),
            AGENTS.to_string(),
            WRITES.to_string(),
        ],
    )
    .await;
    let stored = python("s3_tool.py", vec!["read".into(), moto.url(), bucket.into(), key.into()]).await;
    let (acked, lost, _) = tally(&run, &stored);
    assert_eq!(acked, AGENTS * WRITES, "{run}");
    assert!(
        !lost.is_empty(),
        "the same agents straight to S3 lost nothing: the negative control proves nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_if_match_headers_and_answers_work_through_the_sidecar() {
    let moto = moto_server();
    let redis = RedisServer::start();
    let routes = routes_file(S3_ROUTES);
    let proxies = sidecars(&moto, &redis, &routes, 1).await;
    let endpoint = format!("http://{}", proxies[0].addr);
    let (bucket, key) = ("cond", "sessions/s-2.json");
    // Seeded straight to the store: a document turnlock never wrote.
    python(
        "s3_tool.py",
        vec!["setup".into(), moto.url(), bucket.into(), key.into(), moto.url()],
    )
    .await;
    let r = python(
        "s3_tool.py",
        vec!["conditional".into(), endpoint, bucket.into(), key.into()],
    )
    .await;
    let stored = python("s3_tool.py", vec!["read".into(), moto.url(), bucket.into(), key.into()]).await;
    // IfMatch with the object's ETag (the store's format) is understood; the agent gets the
    // store's answer: a 200 with the object's ETag, once.
    assert_eq!(r["current"]["ok"], true, "IfMatch with the object's ETag: {r}");
    assert_eq!(r["current"]["status"], 200, "{r}");
    assert_eq!(r["current"]["attempts"], 1, "{r}");
    // A stale IfMatch is refused as S3 refuses it, and botocore does not retry it.
    assert_eq!(r["stale"]["ok"], false, "{r}");
    assert_eq!(r["stale"]["code"], "PreconditionFailed", "{r}");
    assert_eq!(r["stale"]["status"], 412, "{r}");
    assert_eq!(r["stale"]["attempts"], 1, "{r}");
    assert_eq!(r["with_headers"]["ok"], true, "{r}");
    assert_eq!(
        r["with_headers"]["etag"], stored["etag"],
        "the ETag answered is the store's: {r} {stored}"
    );
    let ids: Vec<String> = stored["doc"]["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter_map(|m| m["id"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(ids, ["if-match", "with-headers"], "{stored}");
    // The write-back kept the client's end-to-end headers.
    assert_eq!(stored["content_type"], "application/octet-stream", "{stored}");
    assert_eq!(stored["metadata"]["owner"], "agent-7", "{stored}");
    assert_eq!(stored["sse"], "AES256", "{stored}");
}

/// A ready routes file for a CouchDB-style store: one document per session in database `{db}`.
/// Creates database `db` and the session document `doc` (through `seed`).
async fn couch_setup(store: &Server, seed: &str, db: &str, doc: &str) {
    let direct = turnlock::client::JsonClient::new(store.url());
    let r = direct
        .send(http::Method::PUT, &format!("/{db}"), None, &[])
        .await
        .expect("create db");
    assert!(r.status.is_success(), "create db: {}", r.status);
    let seed = turnlock::client::JsonClient::new(seed.to_owned());
    let body = serde_json::json!({"messages": []});
    let r = seed
        .send(http::Method::PUT, &format!("/{db}/{doc}"), Some(&body), &[])
        .await
        .expect("seed");
    assert!(r.status.is_success(), "seed: {} {:?}", r.status, r.body);
}

fn couch_tally(run: &Value) -> (usize, Vec<String>, Vec<String>) {
    tally(run, &serde_json::json!({"doc": run["final"]}))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_agents_through_sidecars_lose_nothing_and_a_stores_409_is_re_merged() {
    let couch = pouchdb_server();
    let redis = RedisServer::start();
    let routes = routes_file(COUCHDB_ROUTES);
    let proxies = sidecars(&couch, &redis, &routes, 2).await;
    let endpoints: Vec<String> = proxies.iter().map(|p| format!("http://{}", p.addr)).collect();
    let direct = turnlock::client::JsonClient::new(couch.url());
    direct
        .send(http::Method::PUT, "/sessions", None, &[])
        .await
        .expect("create db");
    // One more agent writes straight to the store (re-reading on its 409s): turnlock's
    // write-backs then meet the store's 409 and must re-read and re-merge, never answer 502.
    // The store's 409 needs the direct agent's write to land inside a sidecar's read-merge-write,
    // a race: rounds on fresh documents until some write-back met one (most runs need one or two;
    // the bound keeps a run that never meets one finite).
    const ROUNDS: usize = 15;
    let mut store_409s = 0.0;
    for round in 1..=ROUNDS {
        let doc = format!("s-{round}");
        let seed = turnlock::client::JsonClient::new(endpoints[0].clone());
        let r = seed
            .send(
                http::Method::PUT,
                &format!("/sessions/{doc}"),
                Some(&serde_json::json!({"messages": []})),
                &[],
            )
            .await
            .expect("seed");
        assert!(r.status.is_success(), "seed: {}", r.status);
        let run = python(
            "couch_agents.py",
            vec![
                endpoints.join(","),
                format!("/sessions/{doc}"),
                AGENTS.to_string(),
                WRITES.to_string(),
                couch.url(),
            ],
        )
        .await;
        let (acked, lost, dup) = couch_tally(&run);
        assert_eq!(
            run["errors"],
            serde_json::json!([]),
            "no 502 nor any other error: {run}"
        );
        // The six agents through the sidecars make WRITES writes each; the direct one at least
        // WRITES, more while theirs last.
        let careful = format!("a{AGENTS}-");
        let through_sidecars = strings(&run["acked"])
            .iter()
            .filter(|id| !id.starts_with(&careful))
            .count();
        assert_eq!(through_sidecars, AGENTS * WRITES, "{run}");
        assert!(acked >= (AGENTS + 1) * WRITES, "{run}");
        assert!(lost.is_empty(), "acknowledged writes lost: {lost:?}");
        assert!(dup.is_empty(), "messages stored twice: {dup:?}");
        // Agents through the sidecar get CouchDB's own answer.
        let answer = &run["answers"][0];
        assert_eq!(answer["ok"], true, "{run}");
        assert_eq!(answer["id"], doc.as_str(), "{run}");
        assert!(answer["rev"].as_str().is_some_and(|r| !r.is_empty()), "{run}");
        store_409s = 0.0;
        for p in &proxies {
            let text = crate::support::metrics(p.admin).await;
            store_409s += crate::support::metric(&text, "turnlock_upstream_responses_total{op=\"put\",status=\"409\"}");
        }
        if store_409s > 0.0 {
            eprintln!("a write-back met the store's 409 in round {round}");
            break;
        }
    }
    assert!(
        store_409s > 0.0,
        "no write-back met the store's 409 in {ROUNDS} rounds: the re-merge was not exercised"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_agents_straight_to_the_store_lose_writes() {
    let couch = pouchdb_server();
    couch_setup(&couch, &couch.url(), "sessions", "s-1").await;
    let run = python(
        "couch_agents.py",
        vec![couch.url(), "/sessions/s-1".into(), "6".into(), WRITES.to_string()],
    )
    .await;
    let (_, lost, _) = couch_tally(&run);
    assert!(
        !lost.is_empty(),
        "the same agents straight to the store lost nothing: the negative control proves nothing ({run})"
    );
}

/// nano agents (`db.get`, append, `db.insert(doc)`: a `POST /{db}` naming the document by its
/// `_id`; with `mode` "bulk", `db.bulk({docs: [doc]})`), on a document none of them created
/// yet, through `endpoints`; the run's figures.
async fn nano_agents(endpoints: Vec<String>, store: &Server, doc: &str, mode: &str) -> Value {
    let direct = turnlock::client::JsonClient::new(store.url());
    let r = direct
        .send(http::Method::PUT, "/sessions", None, &[])
        .await
        .expect("create db");
    assert!(r.status.is_success(), "create db: {}", r.status);
    let args = [
        endpoints.join(","),
        "sessions".to_owned(),
        doc.to_owned(),
        AGENTS.to_string(),
        WRITES.to_string(),
        store.url(),
        mode.to_owned(),
    ];
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_node("nano_agents.js", &args)
    })
    .await
    .expect("node")
}

/// nano agents writing in `mode` through 2 sidecars: every write acknowledged and stored once,
/// merged under the lock (no store 409 met), answered as CouchDB answers.
async fn nano_agents_through_sidecars_lose_nothing(mode: &str) {
    let couch = pouchdb_server();
    let redis = RedisServer::start();
    let routes = routes_file(COUCHDB_ROUTES);
    let proxies = sidecars(&couch, &redis, &routes, 2).await;
    let endpoints = proxies.iter().map(|p| format!("http://{}", p.addr)).collect();
    let run = nano_agents(endpoints, &couch, "s-1", mode).await;
    let (acked, lost, dup) = couch_tally(&run);
    assert_eq!(run["errors"], serde_json::json!([]), "{run}");
    assert_eq!(acked, AGENTS * WRITES, "every write acknowledged: {run}");
    assert!(lost.is_empty(), "acknowledged writes lost: {lost:?} ({run})");
    assert!(dup.is_empty(), "messages stored twice: {dup:?}");
    // Merged under the lock, not met with the store's 409 and sent again.
    assert_eq!(run["conflicts"], 0, "{run}");
    let answer = &run["answers"][0];
    assert_eq!(answer["ok"], true, "nano resolves CouchDB's own answer: {run}");
    assert_eq!(answer["id"], "s-1", "{run}");
    assert!(answer["rev"].as_str().is_some_and(|r| r.contains('-')), "{run}");
}

/// The same nano agents straight to the store lose acknowledged writes.
async fn nano_agents_straight_to_the_store_lose_writes(mode: &str) {
    let couch = pouchdb_server();
    let run = nano_agents(vec![couch.url()], &couch, "s-1", mode).await;
    let (_, lost, _) = couch_tally(&run);
    assert!(
        !lost.is_empty(),
        "the same nano agents straight to the store lost nothing: the negative control proves nothing ({run})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_nano_inserts_through_sidecars_are_locked_writes_and_lose_nothing() {
    nano_agents_through_sidecars_lose_nothing("insert").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_nano_inserts_straight_to_the_store_lose_writes() {
    nano_agents_straight_to_the_store_lose_writes("insert").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_nano_bulk_writes_through_sidecars_are_locked_writes_and_lose_nothing() {
    nano_agents_through_sidecars_lose_nothing("bulk").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_nano_bulk_writes_straight_to_the_store_lose_writes() {
    nano_agents_straight_to_the_store_lose_writes("bulk").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_bucket_is_written_through_sidecars_that_sign_their_own_requests() {
    // moto checks every request's signature once the IAM user is made.
    let moto = moto_server_with(&[("INITIAL_NO_AUTH_ACTION_COUNT", "3")]);
    let redis = RedisServer::start();
    let (bucket, key) = ("private", "sessions/s-1.json");
    let creds = python(
        "s3_tool.py",
        vec!["private".into(), moto.url(), bucket.into(), "-".into()],
    )
    .await;
    let env = vec![
        (
            "AWS_ACCESS_KEY_ID".to_owned(),
            creds["key"].as_str().expect("key").to_owned(),
        ),
        (
            "AWS_SECRET_ACCESS_KEY".to_owned(),
            creds["secret"].as_str().expect("secret").to_owned(),
        ),
    ];
    let signed_routes = routes_file(&signed(S3_ROUTES));
    let (_a, a) = sidecar_process(&moto, &redis, &signed_routes, &env);
    let (_b, b) = sidecar_process(&moto, &redis, &signed_routes, &env);
    let py = |args: Vec<String>, env: Vec<(String, String)>| {
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run_python_env(
                if args[0] == "agents" {
                    "s3_agents.py"
                } else {
                    "s3_tool.py"
                },
                &args[1..],
                &env,
            )
        })
    };
    py(
        vec![
            "tool".into(),
            "setup".into(),
            moto.url(),
            bucket.into(),
            key.into(),
            a.clone(),
        ],
        env.clone(),
    )
    .await
    .expect("setup");
    let run = py(
        vec![
            "agents".into(),
            format!("{a},{b}"),
            bucket.into(),
            key.into(),
            "4".into(),
            "4".into(),
        ],
        env.clone(),
    )
    .await
    .expect("agents");
    let stored = py(
        vec!["tool".into(), "read".into(), moto.url(), bucket.into(), key.into()],
        env.clone(),
    )
    .await
    .expect("read");
    let (acked, lost, dup) = tally(&run, &stored);
    assert_eq!(run["errors"], serde_json::json!([]), "{run}");
    assert_eq!(run["extra_attempts"], 0, "{run}");
    assert_eq!(acked, 16, "{run}");
    assert!(lost.is_empty() && dup.is_empty(), "lost {lost:?}, duplicated {dup:?}");

    // The negative control: a sidecar that does not sign reads with the client's signature
    // of another request, which the store refuses; nothing is written.
    let unsigned_routes = routes_file(S3_ROUTES);
    let (_c, c) = sidecar_process(&moto, &redis, &unsigned_routes, &env);
    let run = py(
        vec!["agents".into(), c, bucket.into(), key.into(), "1".into(), "1".into()],
        env.clone(),
    )
    .await
    .expect("agents");
    assert_eq!(
        run["acked"],
        serde_json::json!([]),
        "an unsigned read was accepted: {run}"
    );
}
