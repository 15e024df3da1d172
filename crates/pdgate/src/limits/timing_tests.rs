//! Paused-time tests for admission's queue timeout and for the retry budget (which refills per
//! request, never with time).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::*;

const QUEUE_TIMEOUT: Duration = Duration::from_secs(5);

fn admission(metrics: Arc<Metrics>) -> Arc<Admission> {
    let config = LimitsConfig {
        max_in_flight: 1,
        max_queue: 4,
        queue_timeout: QUEUE_TIMEOUT,
        ..LimitsConfig::default()
    };
    Arc::new(Admission::new(&config, metrics))
}

/// Spawns a waiter and returns once it is queued.
async fn queue_one(a: &Arc<Admission>) -> tokio::task::JoinHandle<(Result<(), u16>, Instant)> {
    let before = a.queued();
    let waiter = {
        let a = a.clone();
        tokio::spawn(async move {
            let result = a.admit().await.map(drop).map_err(|e| e.status().as_u16());
            (result, Instant::now())
        })
    };
    while a.queued() == before {
        tokio::task::yield_now().await;
    }
    waiter
}

#[tokio::test(start_paused = true)]
async fn a_queued_request_is_refused_exactly_at_the_queue_timeout() {
    let metrics = Arc::new(Metrics::new());
    let a = admission(metrics.clone());
    let _held = a.admit().await.unwrap();
    let start = Instant::now();
    let waiter = queue_one(&a).await;

    tokio::time::advance(QUEUE_TIMEOUT - Duration::from_millis(1)).await;
    tokio::task::yield_now().await;
    assert!(!waiter.is_finished(), "refused before the queue timeout");
    assert_eq!(a.queued(), 1);

    let (result, at) = waiter.await.unwrap();
    assert_eq!(result, Err(429));
    assert_eq!(at - start, QUEUE_TIMEOUT);
    assert_eq!(a.queued(), 0);
    let text = metrics.render();
    assert!(
        text.contains(r#"pdgate_admission_rejected_total{reason="queue_timeout"} 1"#),
        "{text}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_slot_freed_within_the_queue_timeout_admits_the_waiter() {
    let metrics = Arc::new(Metrics::new());
    let a = admission(metrics.clone());
    let held = a.admit().await.unwrap();
    let start = Instant::now();
    let waiter = queue_one(&a).await;

    tokio::time::advance(QUEUE_TIMEOUT - Duration::from_secs(1)).await;
    drop(held);
    let (result, at) = waiter.await.unwrap();
    assert_eq!(result, Ok(()));
    assert_eq!(at - start, QUEUE_TIMEOUT - Duration::from_secs(1));
    assert!(!metrics.render().contains("queue_timeout"));
}

#[tokio::test(start_paused = true)]
async fn each_waiter_gets_its_own_queue_timeout() {
    let a = admission(Arc::new(Metrics::new()));
    let _held = a.admit().await.unwrap();
    let start = Instant::now();
    let early = queue_one(&a).await;
    tokio::time::advance(Duration::from_secs(2)).await;
    let late = queue_one(&a).await;

    let (early, early_at) = early.await.unwrap();
    let (late, late_at) = late.await.unwrap();
    assert_eq!((early, late), (Err(429), Err(429)));
    assert_eq!(early_at - start, QUEUE_TIMEOUT);
    assert_eq!(late_at - start, QUEUE_TIMEOUT + Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn the_retry_budget_refills_with_requests_not_with_time() {
    let config = LimitsConfig {
        retry_budget_ratio: 0.25,
        retry_budget_min: 1,
        ..LimitsConfig::default()
    };
    let b = RetryBudget::new(&config);
    assert!(b.try_withdraw());
    assert!(!b.try_withdraw());
    // A failing fleet that goes quiet for an hour has earned no retries by waiting.
    tokio::time::advance(Duration::from_secs(3600)).await;
    assert!(!b.try_withdraw());
    // Four requests at a ratio of 0.25 earn exactly one.
    for _ in 0..3 {
        b.deposit();
    }
    assert!(!b.try_withdraw());
    b.deposit();
    assert!(b.try_withdraw());
    assert!(!b.try_withdraw());
}
