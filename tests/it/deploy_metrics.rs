//! The alert rules and the dashboard under `deploy/` name only metrics a proxy really exposes:
//! every `turnlock_*` name they mention is found in the `/metrics` text of a proxy that has
//! served writes (a typo or a renamed metric makes an alert that can never fire).

use std::collections::BTreeSet;
use std::path::Path;

use crate::support::*;

/// The files an operator loads: the plain rules, the PrometheusRule and the dashboard.
const FILES: &[&str] = &[
    "deploy/alerts/turnlock-rules.yml",
    "deploy/alerts/turnlock-prometheusrule.yaml",
    "deploy/alerts/turnlock-rules.test.yml",
    "deploy/grafana/turnlock-dashboard.json",
];

/// Every `turnlock_…` metric name in a text. A name inside a recording rule's name
/// (`job:turnlock_writes:rate5m`) is not a metric the proxy exposes and is skipped.
fn names_in(text: &str) -> BTreeSet<String> {
    let bytes = text.as_bytes();
    let is_name = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let mut names = BTreeSet::new();
    let mut from = 0;
    while let Some(at) = text[from..].find("turnlock_").map(|i| i + from) {
        let mut end = at;
        while end < bytes.len() && is_name(bytes[end]) {
            end += 1;
        }
        let inside_other = at > 0 && is_name(bytes[at - 1]);
        let name = &text[at..end];
        if !inside_other && !name.contains(':') {
            names.insert(name.to_owned());
        }
        from = end.max(at + 1);
    }
    names
}

/// The names a `/metrics` text declares: each family (`# TYPE name kind`) with the sample names
/// its kind gives it, and every sample name.
fn exposed(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            names.insert(name.to_owned());
            let suffixes: &[&str] = match kind {
                "counter" => &["_total", "_created"],
                "histogram" => &["_bucket", "_sum", "_count"],
                _ => &[],
            };
            names.extend(suffixes.iter().map(|s| format!("{name}{s}")));
        } else if !line.starts_with('#') {
            if let Some(name) = line.split(['{', ' ']).next().filter(|n| !n.is_empty()) {
                names.insert(name.to_owned());
            }
        }
    }
    names
}

#[test]
fn names_in_finds_metric_names_and_skips_recording_rules() {
    let text = r#"expr: job:turnlock_writes:rate5m / sum(rate(turnlock_requests_total{a="b"}[5m])) see turnlock_upstream_request_seconds."#;
    let found: Vec<_> = names_in(text).into_iter().collect();
    assert_eq!(found, ["turnlock_requests_total", "turnlock_upstream_request_seconds"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_in_the_alert_rules_and_dashboard_is_exposed() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut wanted = BTreeSet::new();
    for file in FILES {
        let text = std::fs::read_to_string(root.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        let names = names_in(&text);
        assert!(!names.is_empty(), "{file} names no turnlock metric");
        wanted.extend(names.into_iter().map(|n| (n, *file)));
    }

    // A proxy that has served writes: acknowledged ones, a stale one, and one after its Redis
    // went away (so the families with labels have children).
    let store = store().await;
    let mut redis = RedisServer::start();
    let proxy = proxy(proxy_args(store.addr, Some(&redis))).await;
    let c = client(proxy.addr);
    for turn in 1..=3 {
        let r = append(&c, "alerts-1", turn, &format!("m{turn}")).await;
        assert!(r.status.is_success(), "{}", String::from_utf8_lossy(&r.body));
    }
    let stale = append(&c, "alerts-1", 1, "old").await;
    assert_eq!(stale.status.as_u16(), 409, "{}", String::from_utf8_lossy(&stale.body));
    redis.kill();
    let refused = append(&c, "alerts-2", 1, "m").await;
    assert_eq!(
        refused.status.as_u16(),
        503,
        "{}",
        String::from_utf8_lossy(&refused.body)
    );
    let text = metrics(proxy.admin).await;
    let have = exposed(&text);

    let missing: Vec<String> = wanted
        .iter()
        .filter(|(name, _)| !have.contains(name))
        .map(|(name, file)| format!("{name} (in {file})"))
        .collect();
    assert!(
        missing.is_empty(),
        "named in deploy/ but not exposed by /metrics: {missing:?}\n--- /metrics ---\n{text}"
    );
    proxy.stop().await;
}
