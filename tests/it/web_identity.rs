//! S3 credentials from a web identity token file, as on EKS: a sidecar with no AWS keys, only
//! `AWS_WEB_IDENTITY_TOKEN_FILE` and `AWS_ROLE_ARN`, signs its requests to a private bucket
//! with the role's temporary credentials from STS (`AssumeRoleWithWebIdentity`, moto's), and
//! refreshes them before they expire, reading the token file anew.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::real_stores::tally;
use crate::support::third_party::{
    moto_server_with, python_server, routes_file, run_python, run_python_env, sidecar_process, signed, S3_ROUTES,
};
use crate::support::RedisServer;

/// How long the role's credentials live (asked of STS by the stand-in for its endpoint).
const LIFE_SECS: u64 = 6;

/// The calls STS answered so far, from the stand-in's log.
fn sts_calls(log: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Waits (bounded) until STS answered a call that carried `token`.
async fn wait_for_call(log: &std::path::Path, token: &str, within: Duration) -> Vec<Value> {
    let deadline = Instant::now() + within;
    loop {
        let calls = sts_calls(log);
        if calls.iter().any(|c| c["token"] == token && c["status"] == 200) || Instant::now() > deadline {
            return calls;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn py(script: &'static str, args: Vec<String>, env: Vec<(String, String)>) -> Value {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_python_env(script, &args, &env)
    })
    .await
    .expect("python")
}

/// Creates the session object `key` through `sidecar`, runs 2×3 boto3 agents on it through
/// the sidecar, and checks that every write was acknowledged, stored once, without an error.
async fn agents_write(moto: &str, sidecar: &str, bucket: &str, key: &str, env: &[(String, String)]) {
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    py("s3_tool.py", args(&["setup", moto, bucket, key, sidecar]), env.to_vec()).await;
    let run = py("s3_agents.py", args(&[sidecar, bucket, key, "2", "3"]), env.to_vec()).await;
    let stored = py("s3_tool.py", args(&["read", moto, bucket, key]), env.to_vec()).await;
    let (acked, lost, dup) = tally(&run, &stored);
    assert_eq!(run["errors"], serde_json::json!([]), "{run}");
    assert_eq!(acked, 6, "{run}");
    assert!(lost.is_empty() && dup.is_empty(), "lost {lost:?}, duplicated {dup:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_bucket_is_written_with_web_identity_credentials_refreshed_from_the_token_file() {
    // moto checks every request's signature once the IAM user and the role are made.
    let moto = moto_server_with(&[("INITIAL_NO_AUTH_ACTION_COUNT", "5")]);
    let redis = RedisServer::start();
    let bucket = "private";
    let url = moto.url();
    let made = tokio::task::spawn_blocking(move || run_python("s3_tool.py", &["role", &url, bucket, "-"]))
        .await
        .expect("python");
    let (user_key, user_secret) = (
        made["key"].as_str().expect("key"),
        made["secret"].as_str().expect("secret"),
    );
    let role = made["role"].as_str().expect("role ARN").to_owned();

    let dir = tempfile::tempdir().expect("tempdir");
    let (token, log) = (dir.path().join("token"), dir.path().join("sts.jsonl"));
    std::fs::write(&token, "token-1\n").expect("token");
    let log_arg = log.display().to_string();
    let life = LIFE_SECS.to_string();
    let sts = python_server(
        "sts_front.py",
        &[&moto.url(), "{port}", &log_arg, user_key, user_secret, &life],
    );
    let sidecar_env = vec![
        ("AWS_WEB_IDENTITY_TOKEN_FILE".to_owned(), token.display().to_string()),
        ("AWS_ROLE_ARN".to_owned(), role.clone()),
        ("AWS_ROLE_SESSION_NAME".to_owned(), "sidecar-test".to_owned()),
        ("AWS_ENDPOINT_URL_STS".to_owned(), sts.url()),
    ];
    let routes = routes_file(&signed(S3_ROUTES));
    let (_sidecar, sidecar) = sidecar_process(&moto, &redis, &routes, &sidecar_env);
    let first = wait_for_call(&log, "token-1", Duration::from_secs(15)).await;
    assert_eq!(
        first.first().map(|c| c["token"].clone()),
        Some("token-1".into()),
        "{first:?}"
    );
    assert!(
        first.iter().all(|c| c["role"] == role.as_str()),
        "every call names the role: {first:?}"
    );

    // The agents sign their own requests to the sidecar as the user; the sidecar signs its
    // own with the role's credentials (it has no keys of its own).
    let agent_env = vec![
        ("AWS_ACCESS_KEY_ID".to_owned(), user_key.to_owned()),
        ("AWS_SECRET_ACCESS_KEY".to_owned(), user_secret.to_owned()),
    ];
    agents_write(&moto.url(), &sidecar, bucket, "sessions/s-1.json", &agent_env).await;

    // The kubelet rotates the token: the next refresh, before the credentials expire, reads it.
    std::fs::write(&token, "token-2\n").expect("token");
    let calls = wait_for_call(&log, "token-2", Duration::from_secs(LIFE_SECS * 3)).await;
    assert!(
        calls.iter().any(|c| c["token"] == "token-2" && c["status"] == 200),
        "the credentials were refreshed with the rotated token: {calls:?}"
    );
    // Past the first credentials' life: the writes are signed with the refreshed ones.
    tokio::time::sleep(Duration::from_secs(2)).await;
    agents_write(&moto.url(), &sidecar, bucket, "sessions/s-2.json", &agent_env).await;

    // The negative control: with the token file gone, no credentials are obtained, and the
    // store refuses what the sidecar cannot sign (nothing is acknowledged).
    let (_bare, bare) = sidecar_process(
        &moto,
        &redis,
        &routes,
        &[
            (
                "AWS_WEB_IDENTITY_TOKEN_FILE".to_owned(),
                dir.path().join("absent").display().to_string(),
            ),
            ("AWS_ROLE_ARN".to_owned(), role.clone()),
            ("AWS_ENDPOINT_URL_STS".to_owned(), sts.url()),
        ],
    );
    let args = vec![
        bare,
        bucket.to_owned(),
        "sessions/s-2.json".to_owned(),
        "1".to_owned(),
        "1".to_owned(),
    ];
    let run = py("s3_agents.py", args, agent_env.clone()).await;
    assert_eq!(
        run["acked"],
        serde_json::json!([]),
        "written without credentials: {run}"
    );
}
