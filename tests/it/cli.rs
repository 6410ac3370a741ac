//! The binary as a user meets it: the demo's claim, configuration errors, the health check.

use std::process::Command;
use std::time::Duration;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_loses_updates_straight_to_the_store_and_none_through_turnlock() {
    let reports = turnlock::demo::run(turnlock::demo::DemoArgs {
        replicas: 8,
        sessions: 4,
        writes: 25,
    })
    .await
    .expect("demo runs");
    let (direct, proxied) = (&reports[0], &reports[1]);
    println!("{}", turnlock::demo::table(&reports));
    assert!(direct.acknowledged > 0 && proxied.acknowledged > 0);
    assert!(
        direct.lost > 0,
        "naive GET-modify-PUT lost nothing: the demo shows no problem"
    );
    assert_eq!((proxied.lost, proxied.duplicated, proxied.stale_accepted), (0, 0, 0));
}

#[test]
fn bad_configuration_exits_64_with_a_clear_message() {
    for (args, needle) in [
        (vec!["proxy", "--upstream", "ftp://store"], "http:// or https://"),
        (vec!["proxy", "--redis", "mysql://x"], "expected redis://"),
        (vec!["proxy", "--lock-budget-ms", "0"], "--lock-budget-ms"),
        (
            vec!["proxy", "--routes", "/nonexistent/routes.toml"],
            "cannot read routes file",
        ),
        // The injector's default URL is checked as the sidecar checks it, before any pod.
        (
            vec!["inject", "--redis", "redis+cluster://u:pw@10.0.0.11:6379/0"],
            "--redis redis+cluster://***@10.0.0.11:6379/0",
        ),
    ] {
        let out = Command::new(turnlock_bin()).args(&args).output().expect("run turnlock");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr:?} lacks {needle:?}");
    }
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let out = Command::new(turnlock_bin())
        .args(["proxy", "--listen", &addr])
        .output()
        .expect("run turnlock");
    assert_eq!(out.status.code(), Some(turnlock::config::EXIT_BIND.into()));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot listen"));
}

#[test]
fn health_subcommand_reports_readiness() {
    let admin = free_port();
    let down = Command::new(turnlock_bin())
        .args(["health", "--admin", &format!("127.0.0.1:{admin}")])
        .output()
        .expect("health");
    assert!(!down.status.success(), "healthy with nothing running");
    let (_store, store_port) = Proc::store();
    let proxy = ProxyProc::spawn(&format!("http://127.0.0.1:{store_port}"), None, &[]);
    let up = Command::new(turnlock_bin())
        .args(["health", "--admin", &proxy.admin.to_string()])
        .output()
        .expect("health");
    assert!(up.status.success(), "{}", String::from_utf8_lossy(&up.stderr));
}

#[test]
fn values_that_would_break_writes_are_refused_with_64_and_no_secret() {
    let secret = "s3cr3t-pa55";
    let bad_url = format!("redis://user:{secret}@127.0.0.1:notaport/0");
    let unknown_scheme = format!("mysql://user:{secret}@db:3306");
    for (args, needle) in [
        (vec!["proxy", "--idempotency-ttl-secs", "0"], "--idempotency-ttl-secs"),
        (vec!["proxy", "--history-ttl-secs", "0"], "--history-ttl-secs"),
        (vec!["proxy", "--redis-timeout-ms", "0"], "--redis-timeout-ms"),
        (vec!["proxy", "--upstream-timeout-ms", "0"], "--upstream-timeout-ms"),
        (vec!["proxy", "--lock-ttl-ms", "18446744073709551615"], "--lock-ttl-ms"),
        (vec!["proxy", "--lock-budget-ms", "999999999"], "--lock-budget-ms"),
        (vec!["proxy", "--wait-deadline-ms", "0"], "--wait-deadline-ms"),
        (vec!["proxy", "--wait-deadline-ms", "60001"], "--wait-deadline-ms"),
        (
            vec!["proxy", "--upstream-max-connections", "0"],
            "--upstream-max-connections",
        ),
        (vec!["proxy", "--lock-ttl-ms", "lots"], "invalid value"),
        (vec!["proxy", "--no-such-flag"], "unexpected argument"),
        (vec!["proxy", "--redis", &bad_url], "invalid Redis URL"),
        (vec!["proxy", "--redis", &unknown_scheme], "expected redis://"),
    ] {
        let out = Command::new(turnlock_bin()).args(&args).output().expect("run turnlock");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr:?} lacks {needle:?}");
        assert!(!stderr.contains(secret), "{args:?} printed the password: {stderr}");
    }
    let out = Command::new(turnlock_bin())
        .arg("proxy")
        .env("TURNLOCK_LOG_FORMAT", "xml")
        .output()
        .expect("run turnlock");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(stderr.contains("TURNLOCK_LOG_FORMAT"), "{stderr}");
    // A bad value from an environment variable is traced to the variable, not only the flag.
    for (var, value, args) in [
        ("TURNLOCK_WORKER_THREADS", "abc", vec!["store"]),
        ("TURNLOCK_LOCK_TTL_MS", "lots", vec!["proxy"]),
    ] {
        let out = Command::new(turnlock_bin())
            .args(&args)
            .env(var, value)
            .output()
            .expect("run turnlock");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{var}: {stderr}");
        assert!(stderr.contains(var), "{var}: {stderr}");
    }
    let help = Command::new(turnlock_bin()).arg("--help").output().expect("help");
    assert_eq!(help.status.code(), Some(0));
}

#[test]
fn an_invalid_rust_log_is_refused_and_boolean_env_vars_take_1_and_0() {
    let out = Command::new(turnlock_bin())
        .args(["proxy", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        .env("RUST_LOG", "turnlock=loud")
        .output()
        .expect("run turnlock");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(stderr.contains("RUST_LOG"), "{stderr}");

    // A boolean env var set to 1 is accepted: the proxy starts (and is stopped).
    let (port, admin) = (free_port(), free_port());
    let store_port = free_port();
    let mut proc = Proc::spawn(&["store", "--listen", &format!("127.0.0.1:{store_port}")]);
    wait_for_port(store_port, Duration::from_secs(10));
    let child = Command::new(turnlock_bin())
        .args([
            "proxy",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--admin",
            &format!("127.0.0.1:{admin}"),
            "--upstream",
            &format!("http://127.0.0.1:{store_port}"),
        ])
        .env("TURNLOCK_ADMIN_PUBLIC_METRICS", "1")
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn proxy");
    let mut proxy = Proc { child };
    wait_for_port(admin, Duration::from_secs(10));
    proxy.signal("TERM");
    let status = proxy.child.wait().expect("wait");
    assert_eq!(status.code(), Some(0));
    let _ = proc.child.kill();
}
