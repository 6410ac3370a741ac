//! Real agent frameworks' session stores through turnlock: Strands Agents (`strands-agents`
//! from PyPI) keeping a session in S3 with `S3SessionManager`, one object per message, with a
//! stand-in model class (no model provider, no network), against moto's S3 server.
//!
//! Two replicas of a stateless service (a fresh `Agent` per request) serve one session, one
//! request each at once, for several rounds (`tests/it/scripts/strands_replicas.py`).

use serde_json::Value;

use crate::support::third_party::{
    aws_env, moto_server, moto_server_with, routes_file, run_python, run_python_env, sidecar_process, sidecars, signed,
    Server,
};
use crate::support::RedisServer;

/// The shipped routes file, used as a user uses it (its bucket is `agent-sessions`, its
/// prefix `strands`).
const STRANDS_ROUTES: &str = include_str!("../../deploy/routes/strands-s3.toml");
const BUCKET: &str = "agent-sessions";
const ROUNDS: usize = 5;

async fn python(args: Vec<String>) -> Value {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_python("strands_replicas.py", &args)
    })
    .await
    .expect("python")
}

/// The race's assertions through sidecars: nothing lost, nothing replaced, every loser
/// refused 412 at once without retries, the next request served.
fn assert_nothing_lost(run: &Value) {
    assert_eq!(run["lost"], serde_json::json!([]), "{run}");
    assert_eq!(run["replaced"], serde_json::json!([]), "{run}");
    let failed = run["failed"].as_array().cloned().unwrap_or_default();
    assert!(
        !failed.is_empty(),
        "no request lost a race: the test proves nothing: {run}"
    );
    for f in &failed {
        assert_eq!(f["code"], "PreconditionFailed", "{f}");
        assert_eq!(f["status"], 412, "{f}");
        assert_eq!(f["attempts"], 0, "botocore retried: {f}");
        assert!(
            f["seconds"].as_f64().is_some_and(|s| s < 5.0),
            "the losing request hung: {f}"
        );
    }
    assert_eq!(run["requests"], 2 * ROUNDS + 2, "{run}");
    assert_eq!(
        run["ok"].as_u64().unwrap_or(0) as usize + failed.len(),
        2 * ROUNDS + 2,
        "{run}"
    );
    assert_eq!(run["after_ok"], true, "{run}");
}

async fn race(endpoints: &[String], session: &str, store: &Server) -> Value {
    python(vec![
        "race".into(),
        endpoints.join(","),
        BUCKET.into(),
        session.into(),
        ROUNDS.to_string(),
        store.url(),
    ])
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strands_replicas_straight_to_s3_lose_messages_silently() {
    aws_env();
    let moto = moto_server();
    let run = race(&[moto.url(), moto.url()], "direct", &moto).await;
    eprintln!("straight to the store: {run}");
    assert_eq!(run["failed"], serde_json::json!([]), "no request raised: {run}");
    assert!(
        run["replaced"].as_array().is_some_and(|r| !r.is_empty()),
        "no stored message was replaced by another request's: the negative control proves nothing: {run}"
    );
    assert!(
        run["lost"].as_array().is_some_and(|l| !l.is_empty()),
        "no request that returned normally lost a message: {run}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strands_replicas_through_sidecars_lose_no_message_and_the_loser_fails_at_once() {
    aws_env();
    let moto = moto_server();
    let redis = RedisServer::start();
    let routes = routes_file(STRANDS_ROUTES);
    let proxies = sidecars(&moto, &redis, &routes, 2).await;
    let endpoints: Vec<String> = proxies.iter().map(|p| format!("http://{}", p.addr)).collect();
    let run = race(&endpoints, "through", &moto).await;
    eprintln!("through the sidecars: {run}");
    // Every request that returned normally has all its messages stored; no acknowledged
    // message object holds another request's message; the replicas raced (each round both
    // read the same session) and each loser was refused in S3's terms, which botocore raises
    // without retrying, at once; the next request on the session succeeds.
    assert_nothing_lost(&run);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strands_redaction_of_the_latest_message_goes_through_the_sidecar() {
    aws_env();
    let moto = moto_server();
    let redis = RedisServer::start();
    let routes = routes_file(STRANDS_ROUTES);
    let proxies = sidecars(&moto, &redis, &routes, 1).await;
    let endpoint = format!("http://{}", proxies[0].addr);
    let out = python(vec![
        "redact".into(),
        endpoint,
        BUCKET.into(),
        "redacted".into(),
        moto.url(),
    ])
    .await;
    assert_eq!(out["redacted"], true, "{out}");
    assert_eq!(out["stored_redact"]["content"][0]["text"], "[redacted]", "{out}");
    // The original stays beside it, as the framework keeps it; a fresh agent sees the redaction.
    assert_eq!(out["stored_message"], "answer to my card is 4111", "{out}");
    assert_eq!(out["seen"], "[redacted]", "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strands_replicas_on_a_private_bucket_through_signing_sidecars_lose_no_message() {
    // moto checks every request's signature once the IAM user is made.
    let moto = moto_server_with(&[("INITIAL_NO_AUTH_ACTION_COUNT", "3")]);
    let redis = RedisServer::start();
    let url = moto.url();
    let creds = tokio::task::spawn_blocking(move || run_python("s3_tool.py", &["private", &url, BUCKET, "-"]))
        .await
        .expect("python");
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
    let signed = routes_file(&signed(STRANDS_ROUTES));
    let (_a, a) = sidecar_process(&moto, &redis, &signed, &env);
    let (_b, b) = sidecar_process(&moto, &redis, &signed, &env);
    let args = [
        "race".to_owned(),
        format!("{a},{b}"),
        BUCKET.into(),
        "private".into(),
        ROUNDS.to_string(),
        moto.url(),
    ];
    let env2 = env.clone();
    let run = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_python_env("strands_replicas.py", &args, &env2)
    })
    .await
    .expect("python");
    eprintln!("private bucket, signing sidecars: {run}");
    assert_nothing_lost(&run);
    // An object no route lists (the framework's multi-agent state) is passed through, signed
    // by the sidecar: boto3's `Expect: 100-continue` is not part of that signature.
    let key = "strands/session_private/multi_agents/multi_agent_m/multi_agent.json".to_owned();
    let put =
        tokio::task::spawn_blocking(move || run_python_env("strands_replicas.py", &["put", &a, BUCKET, &key], &env))
            .await
            .expect("python");
    assert_eq!(put["ok"], true, "{put}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strands_replicas_creating_one_session_at_once_never_replace_its_session_object() {
    aws_env();
    let moto = moto_server();
    let redis = RedisServer::start();
    let routes = routes_file(STRANDS_ROUTES);
    let proxies = sidecars(&moto, &redis, &routes, 2).await;
    let endpoints: Vec<String> = proxies.iter().map(|p| format!("http://{}", p.addr)).collect();
    // Straight to the store, a `session.json` created by one request is at times replaced by
    // the other's (both found it absent); a few new sessions give the race its chances.
    for n in 0..4 {
        let out = python(vec![
            "first".into(),
            endpoints.join(","),
            BUCKET.into(),
            format!("new-{n}"),
            moto.url(),
        ])
        .await;
        eprintln!("first requests of a new session: {out}");
        assert_eq!(out["replaced"], serde_json::json!([]), "{out}");
        let results = out["results"].as_array().cloned().unwrap_or_default();
        assert!(
            results.iter().any(|r| r["ok"] == true),
            "no request created the session: {out}"
        );
        for r in results.iter().filter(|r| r["ok"] != true) {
            // Refused by the sidecar (412, at once), or the framework's own "already exists".
            let refused = r["code"] == "PreconditionFailed" && r["status"] == 412 && r["attempts"] == 0;
            let exists = r["error"].as_str().is_some_and(|e| e.contains("already exists"));
            assert!(refused || exists, "{r}");
            assert!(
                r["seconds"].as_f64().is_some_and(|s| s < 5.0),
                "the losing request hung: {r}"
            );
        }
    }
}
