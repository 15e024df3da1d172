//! Unit tests of endpoint health: passive ejection, error rates, recovery.

use super::*;

fn target(name: &str, role: Role) -> ProbeTarget {
    ProbeTarget {
        name: name.into(),
        role,
        health_url: format!("http://{name}/health"),
        query_url: None,
        models_url: None,
        learn_models: false,
        authorization: None,
    }
}

/// A 5xx when `fail`, else a sane answer.
fn ok_unless(fail: bool) -> Result<(), Cause> {
    if fail {
        Err(Cause::ServerError)
    } else {
        Ok(())
    }
}

fn health(consecutive: u32) -> Health {
    let config = HealthConfig {
        consecutive_failures: consecutive,
        error_rate: 0.0,
        base_ejection: Duration::from_secs(10),
        max_ejection: Duration::from_secs(25),
        unhealthy_threshold: 2,
        healthy_threshold: 2,
        ..HealthConfig::default()
    };
    let h = Health::new(&config, Arc::new(Metrics::new()));
    h.sync(vec![
        target("p1", Role::Prefill),
        target("p2", Role::Prefill),
        target("d1", Role::Decode),
    ]);
    h
}

#[test]
fn consecutive_traffic_failures_eject_and_half_open_decides() {
    let h = health(3);
    h.observe("p1", Err(Cause::ServerError));
    h.observe("p1", Err(Cause::ServerError));
    h.observe("p1", Ok(()));
    h.observe("p1", Err(Cause::ServerError));
    h.observe("p1", Err(Cause::ServerError));
    assert!(h.unhealthy().is_empty(), "a success resets the count");
    h.observe("p1", Err(Cause::ServerError));
    assert_eq!(h.unhealthy(), BTreeSet::from(["p1".to_string()]));
    // The last healthy prefill is never ejected.
    for _ in 0..10 {
        h.observe("p2", Err(Cause::ServerError));
    }
    assert!(h.is_healthy("p2"));
    // Back-off over: half-open; one failure ejects again for twice as long.
    let later = Instant::now() + Duration::from_secs(11);
    h.tick(later);
    assert!(h.unhealthy().is_empty());
    h.observe("p1", Err(Cause::ServerError));
    assert!(!h.is_healthy("p1"));
    h.tick(Instant::now() + Duration::from_secs(15));
    assert!(!h.is_healthy("p1"), "second period is 20 s");
    h.tick(Instant::now() + Duration::from_secs(21));
    assert!(h.is_healthy("p1"));
    h.observe("p1", Ok(()));
    h.observe("p1", Err(Cause::ServerError));
    assert!(
        h.is_healthy("p1"),
        "a success on probation clears the record"
    );
}

/// Routing leaves a half-open endpoint out while its probe is under way (at once, not when the
/// snapshot is republished), unless nothing else is left.
#[test]
fn a_probe_under_way_holds_its_endpoint_back_from_selection() {
    use crate::endpoints::test_endpoint;
    let h = health(1);
    let p1 = test_endpoint("p1", Role::Prefill);
    let p2 = test_endpoint("p2", Role::Prefill);
    let both = || vec![&p1, &p2];
    let names = |v: Vec<&Arc<crate::endpoints::Endpoint>>| {
        v.iter().map(|e| e.name.clone()).collect::<Vec<_>>()
    };
    assert_eq!(names(h.hold_back_probed(both())), ["p1", "p2"]);
    h.observe("p1", Err(Cause::ServerError));
    h.tick(Instant::now() + Duration::from_secs(11));
    // Half-open, no probe yet: it may take the probe.
    assert_eq!(names(h.hold_back_probed(both())), ["p1", "p2"]);
    h.begin("p1");
    assert_eq!(
        names(h.hold_back_probed(both())),
        ["p2"],
        "the probe is under way"
    );
    assert_eq!(
        names(h.hold_back_probed(vec![&p1])),
        ["p1"],
        "the only one left"
    );
    h.observe("p1", Ok(()));
    assert_eq!(
        names(h.hold_back_probed(both())),
        ["p1", "p2"],
        "probe succeeded"
    );
}

#[test]
fn an_error_rate_ejects_without_consecutive_failures() {
    let config = HealthConfig {
        consecutive_failures: 0,
        error_rate: 0.3,
        min_requests: 10,
        ..HealthConfig::default()
    };
    let h = Health::new(&config, Arc::new(Metrics::new()));
    h.sync(vec![
        target("p1", Role::Prefill),
        target("p2", Role::Prefill),
    ]);
    // Every third request fails: never two in a row, but a third of the traffic.
    for i in 0..9 {
        h.observe("p1", ok_unless(i % 3 == 0));
    }
    assert!(h.is_healthy("p1"), "not enough requests yet");
    h.observe("p1", Err(Cause::ServerError));
    assert!(!h.is_healthy("p1"), "4 of 10 failed");
    for i in 0..30 {
        h.observe("p2", ok_unless(i % 5 == 0));
    }
    assert!(h.is_healthy("p2"), "20% stays under the 30% threshold");
}

#[test]
fn active_checks_use_thresholds_and_passive_can_be_disabled() {
    let h = health(0);
    for _ in 0..10 {
        h.observe("d1", Err(Cause::ServerError));
    }
    assert!(h.is_healthy("d1"));
    h.check_result("d1", false, "503");
    assert!(h.is_healthy("d1"));
    h.check_result("d1", false, "503");
    assert!(!h.is_healthy("d1"));
    h.check_result("d1", true, "");
    assert!(!h.is_healthy("d1"));
    h.check_result("d1", true, "");
    assert!(h.is_healthy("d1"));
    h.sync(vec![target("d2", Role::Decode)]);
    assert_eq!(h.targets().len(), 1);
    assert!(h.is_healthy("p1"), "unknown endpoints count as healthy");
}

/// A prefill whose answers take far longer than its peers' is ejected once both have enough
/// answers in the window; a lone slow prefill (no serving peer) is never ejected.
#[tokio::test(start_paused = true)]
async fn a_prefill_far_slower_than_its_peers_is_ejected() {
    let rule = LatencyRule {
        ratio: 3.0,
        window: Duration::from_secs(30),
        min_requests: 5,
        min_excess: Duration::from_millis(500),
    };
    let h = health(5).with_latency_outliers(rule);
    for _ in 0..5 {
        h.observe_latency("p2", Duration::from_millis(100));
    }
    for i in 0..4 {
        h.observe_latency("p1", Duration::from_millis(2100));
        assert!(h.is_healthy("p1"), "answer {i}: too few to judge");
    }
    // Decodes are not judged.
    for _ in 0..10 {
        h.observe_latency("d1", Duration::from_secs(5));
    }
    assert!(h.is_healthy("d1"));
    h.observe_latency("p1", Duration::from_millis(2100));
    assert_eq!(h.unhealthy(), BTreeSet::from(["p1".to_string()]));
    let reason = r#"pdgate_endpoint_ejections_total{role="prefill",endpoint="p1",reason="latency_outlier"} 1"#;
    assert!(h.metrics.render().contains(reason));
    // The peer, now alone, is never judged against nobody.
    for _ in 0..10 {
        h.observe_latency("p2", Duration::from_secs(9));
    }
    assert!(h.is_healthy("p2"));
    // Old answers leave the window: back from ejection, p1 is judged afresh.
    tokio::time::advance(Duration::from_secs(31)).await;
    h.tick(Instant::now() + Duration::from_secs(11));
    h.observe_latency("p1", Duration::from_millis(2100));
    assert!(h.is_healthy("p1"));
}

/// `went_down` wakes for a down that happens after the wait began (by ejection and by failed
/// checks), resolves at once for an endpoint already down, and stays pending for one that is up
/// while another is down.
#[tokio::test]
async fn went_down_follows_ejections_and_checks() {
    let pending = |h: &Health, name: &'static str| {
        use futures_util::FutureExt;
        h.went_down(name).now_or_never().is_none()
    };
    let h = health(2);
    assert!(pending(&h, "p1"), "nothing is down");
    // Ejected while waiting.
    {
        let wait = h.went_down("p1");
        tokio::pin!(wait);
        assert!(futures_util::poll!(wait.as_mut()).is_pending());
        h.observe("p1", Err(Cause::Broken));
        h.observe("p1", Err(Cause::Broken));
        tokio::time::timeout(Duration::from_secs(5), wait)
            .await
            .expect("woken by the ejection");
    }
    assert!(!pending(&h, "p1"), "already down: resolves at once");
    assert!(
        pending(&h, "p2"),
        "a peer being down is not this one being down"
    );
    // Back on probation: up again, so a new wait is pending.
    h.tick(Instant::now() + Duration::from_secs(11));
    assert!(pending(&h, "p1"));
    // Failing its checks while waiting.
    let wait = h.went_down("d1");
    tokio::pin!(wait);
    assert!(futures_util::poll!(wait.as_mut()).is_pending());
    h.check_result("d1", false, "refused");
    assert!(
        futures_util::poll!(wait.as_mut()).is_pending(),
        "one failure is not enough"
    );
    h.check_result("d1", false, "refused");
    tokio::time::timeout(Duration::from_secs(5), wait)
        .await
        .expect("woken by the failed checks");
    // Forgotten endpoints are not counted as down.
    h.sync(vec![
        target("p1", Role::Prefill),
        target("p2", Role::Prefill),
    ]);
    assert_eq!(h.down_count.load(Ordering::Acquire), 0);
}

#[test]
fn ejections_are_counted_per_endpoint_with_their_reason() {
    let metrics = Arc::new(Metrics::new());
    let config = HealthConfig {
        consecutive_failures: 2,
        error_rate: 0.0,
        unhealthy_threshold: 1,
        ..HealthConfig::default()
    };
    let h = Health::new(&config, metrics.clone());
    h.sync(vec![
        target("p1", Role::Prefill),
        target("p2", Role::Prefill),
        target("d1", Role::Decode),
        target("d2", Role::Decode),
    ]);
    // A decode that breaks its streams twice, a prefill that fails its check.
    h.observe("d1", Err(Cause::Broken));
    h.observe("d1", Err(Cause::Broken));
    h.check_result("p1", false, "connection refused");
    // The last healthy prefill is never ejected: no series for it.
    h.observe("p2", Err(Cause::Timeout));
    h.observe("p2", Err(Cause::Timeout));
    let text = metrics.render();
    for line in [
        r#"pdgate_endpoint_ejections_total{role="decode",endpoint="d1",reason="broken"} 1"#,
        r#"pdgate_endpoint_ejections_total{role="prefill",endpoint="p1",reason="health_check"} 1"#,
        r#"pdgate_ejections_total{role="decode"} 1"#,
        r#"pdgate_ejections_total{role="prefill"} 1"#,
    ] {
        assert!(text.contains(line), "{line} in {text}");
    }
    assert!(!text.contains(r#"endpoint="p2",reason"#), "{text}");
    // An endpoint that leaves the fleet takes its series along.
    h.sync(vec![
        target("p2", Role::Prefill),
        target("d2", Role::Decode),
    ]);
    assert!(!metrics.render().contains(r#"endpoint="d1",reason"#));
}

#[test]
fn a_failed_exchange_names_its_cause() {
    let status = crate::error::GatewayError::UpstreamStatus {
        leg: crate::error::Leg::Prefill,
        status: http::StatusCode::BAD_GATEWAY,
        body: bytes::Bytes::new(),
        content_type: None,
    };
    assert_eq!(Cause::of(&status), Cause::ServerError);
    let timeout = crate::error::GatewayError::Upstream {
        leg: crate::error::Leg::Decode,
        endpoint: "d1".into(),
        kind: crate::error::UpstreamKind::Timeout,
        detail: String::new(),
    };
    assert_eq!(Cause::of(&timeout), Cause::Timeout);
    let labels: std::collections::BTreeSet<_> = Cause::ALL.iter().map(|c| c.as_str()).collect();
    assert_eq!(labels.len(), Cause::ALL.len(), "labels are distinct");
}
