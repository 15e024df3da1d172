//! The Grafana dashboard (`deploy/grafana/pdgate.json`) and pdgate's `/metrics` cannot drift:
//! every `pdgate_*` metric a panel queries is a family a gateway exports once it has served one
//! request (the rarer events, retries, ejections, fallbacks, admission refusals, have their
//! closed label sets created at 0, so they are there before they first happen).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::BTreeSet;

use common::*;
use pdsim::Connector;
use serde_json::Value;

/// Every query string of the dashboard (`expr` of targets, `query` of variables).
fn queries(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("expr" | "query", Value::String(q)) => out.push(q.clone()),
                    _ => queries(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| queries(v, out)),
        _ => {}
    }
}

/// The `pdgate_...` names in a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("pdgate_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

/// The families `# TYPE` declares, and what each sample may be called (`_total`, `_bucket`, ...).
fn exported(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (family, kind) = rest.split_once(' ').unwrap();
            names.insert(family.to_string());
            let suffixes: &[&str] = match kind {
                "counter" => &["_total", "_created"],
                "histogram" => &["_bucket", "_sum", "_count", "_created"],
                _ => &[],
            };
            for s in suffixes {
                names.insert(format!("{family}{s}"));
            }
        }
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_queries_is_exported() {
    let dashboard: Value =
        serde_json::from_str(include_str!("../../../deploy/grafana/pdgate.json")).unwrap();
    let mut exprs = Vec::new();
    queries(&dashboard, &mut exprs);
    let wanted: BTreeSet<String> = exprs.iter().flat_map(|e| metric_names(e)).collect();
    assert!(wanted.len() > 10, "the dashboard queries {wanted:?}");
    // cache_aware on both roles, so the cache panels' metrics are registered too.
    let fleet = pair(Connector::Shfs, |c| {
        c.policy.prefill_policy = "cache_aware".into();
        c.policy.decode_policy = "cache_aware".into();
    })
    .await;
    let r = fleet
        .post_bounded("/v1/completions", &completion(true))
        .await;
    assert_eq!(r.status(), 200);
    let _ = r.bytes().await.unwrap();
    let have = exported(&fleet.metrics().await);
    let missing: Vec<&String> = wanted.iter().filter(|n| !have.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "the dashboard queries metrics pdgate does not export: {missing:?}"
    );
}
