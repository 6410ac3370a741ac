//! The binary as a user meets it: the demo's claim, configuration errors, the health check.

use std::process::Command;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_loses_updates_straight_to_the_store_and_none_through_turnlock() {
    let reports = turnlock::demo::run(turnlock::config::DemoArgs {
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
        (vec!["proxy", "--upstream", "ftp://store"], "only http://"),
        (vec!["proxy", "--redis", "mysql://x"], "expected redis://"),
        (vec!["proxy", "--lock-budget-ms", "0"], "--lock-budget-ms"),
        (
            vec!["proxy", "--routes", "/nonexistent/routes.toml"],
            "cannot read routes file",
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
    assert_eq!(out.status.code(), Some(64));
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
