//! Limits: admission, the per-endpoint cap and the retry budget.
//!
//! Admission control: at most `max_in_flight` requests are served at once, at most `max_queue`
//! more wait (each at most `queue_timeout`), and everything beyond is refused at once with
//! `429 Too Many Requests` and `Retry-After`. A request holds its slot until its response body
//! ends or is dropped, so memory stays bounded however many clients connect. The slot is taken
//! before the request body is read.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::endpoints::Endpoint;
use crate::error::{ConfigError, GatewayError, field_error};
use crate::metrics::Metrics;

/// The `limits` section (the file's top-level keys of the same names).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Requests served at once (PD and pass-through); 0 means unlimited.
    pub max_in_flight: usize,
    /// Requests waiting for a slot beyond `max_in_flight`; more are refused at once.
    pub max_queue: usize,
    /// Longest wait in the queue before a request is refused.
    #[serde(with = "crate::durations::text")]
    pub queue_timeout: Duration,
    /// Requests one endpoint holds at once; 0 means unlimited.
    pub max_in_flight_per_endpoint: usize,
    /// Retries allowed per request, on average (a token bucket: each request adds this much).
    pub retry_budget_ratio: f64,
    /// Retry tokens available at start and the bucket's floor capacity.
    pub retry_budget_min: u32,
    /// The bucket holds `retry_budget_ratio` times the requests of the last window (at least
    /// `retry_budget_min`): the budget scales with traffic.
    #[serde(with = "crate::durations::text")]
    pub retry_budget_window: Duration,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_in_flight: 1024,
            max_queue: 1024,
            queue_timeout: Duration::from_secs(5),
            max_in_flight_per_endpoint: 0,
            retry_budget_ratio: 0.2,
            retry_budget_min: 10,
            retry_budget_window: Duration::from_secs(10),
        }
    }
}

impl LimitsConfig {
    /// Checks the section, naming the key at fault.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.retry_budget_window.is_zero() {
            return Err(field_error(
                "retry_budget_window",
                "must be greater than zero",
            ));
        }
        if self.queue_timeout.is_zero() {
            return Err(field_error("queue_timeout", "must be greater than zero"));
        }
        if !(self.retry_budget_ratio.is_finite() && (0.0..=10.0).contains(&self.retry_budget_ratio))
        {
            return Err(field_error(
                "retry_budget_ratio",
                "must be between 0 and 10",
            ));
        }
        Ok(())
    }
}

/// Seconds a refused client is told to wait.
pub const RETRY_AFTER_SECS: u64 = 1;

/// The gateway-wide request limit.
#[derive(Debug)]
pub struct Admission {
    slots: Option<Arc<Semaphore>>,
    queued: AtomicUsize,
    max_queue: usize,
    queue_timeout: Duration,
    metrics: Arc<Metrics>,
}

/// One admitted request's slot (nothing when admission is unlimited).
#[derive(Debug)]
pub struct Slot {
    _permit: Option<OwnedSemaphorePermit>,
    metrics: Arc<Metrics>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.metrics.admitted.dec();
    }
}

struct Waiting<'a>(&'a Admission);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::AcqRel);
        self.0.metrics.queued.dec();
    }
}

impl Admission {
    /// Limits from `config`.
    pub fn new(config: &LimitsConfig, metrics: Arc<Metrics>) -> Self {
        Admission {
            slots: (config.max_in_flight > 0)
                .then(|| Arc::new(Semaphore::new(config.max_in_flight))),
            queued: AtomicUsize::new(0),
            max_queue: config.max_queue,
            queue_timeout: config.queue_timeout,
            metrics,
        }
    }

    fn slot(&self, permit: Option<OwnedSemaphorePermit>) -> Slot {
        self.metrics.admitted.inc();
        Slot {
            _permit: permit,
            metrics: self.metrics.clone(),
        }
    }

    fn refuse(&self, reason: &'static str) -> GatewayError {
        self.metrics.count_rejected(reason);
        GatewayError::Overloaded {
            retry_after_secs: RETRY_AFTER_SECS,
        }
    }

    /// Waits (bounded) for a slot, or refuses with [`GatewayError::Overloaded`].
    pub async fn admit(&self) -> Result<Slot, GatewayError> {
        let Some(slots) = &self.slots else {
            return Ok(self.slot(None));
        };
        if let Ok(permit) = slots.clone().try_acquire_owned() {
            return Ok(self.slot(Some(permit)));
        }
        if self.queued.fetch_add(1, Ordering::AcqRel) >= self.max_queue {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(self.refuse("queue_full"));
        }
        self.metrics.queued.inc();
        let _waiting = Waiting(self);
        match tokio::time::timeout(self.queue_timeout, slots.clone().acquire_owned()).await {
            Ok(Ok(permit)) => Ok(self.slot(Some(permit))),
            Ok(Err(_)) => Err(self.refuse("closed")),
            Err(_) => Err(self.refuse("queue_timeout")),
        }
    }

    /// Requests waiting now.
    #[cfg(test)]
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }
}

/// Drops candidates at `max_in_flight_per_endpoint`; all of them there is an overload (429).
pub(crate) fn under_cap<E: AsRef<Endpoint>>(
    cap: usize,
    metrics: &Metrics,
    mut candidates: Vec<E>,
) -> Result<Vec<E>, GatewayError> {
    if cap == 0 || candidates.is_empty() {
        return Ok(candidates);
    }
    // In place: a decision over a large fleet allocates no second list.
    candidates.retain(|e| e.as_ref().load.in_flight() < cap);
    if candidates.is_empty() {
        metrics.count_rejected("endpoint_cap");
        return Err(GatewayError::Overloaded {
            retry_after_secs: RETRY_AFTER_SECS,
        });
    }
    Ok(candidates)
}

/// A token bucket bounding retries: each request adds `retry_budget_ratio` of a token, each
/// retry takes one. The bucket's capacity scales with traffic: `retry_budget_ratio` times the
/// requests of the last complete `retry_budget_window`, at least `retry_budget_min` (also the
/// start level). A fleet failing everywhere then sees at most that share of extra requests, not
/// a retry storm, while a busy fleet with one failing endpoint keeps retrying.
#[derive(Debug)]
pub struct RetryBudget {
    milli_tokens: AtomicI64,
    per_request: i64,
    floor: i64,
    /// The current capacity (milli-tokens).
    cap: AtomicI64,
    window: Duration,
    /// Requests in the current window, and when it began.
    rate: std::sync::Mutex<(tokio::time::Instant, u64)>,
}

impl RetryBudget {
    /// The budget of `config`.
    pub fn new(config: &LimitsConfig) -> Self {
        let floor = i64::from(config.retry_budget_min.max(1)) * 1000;
        RetryBudget {
            milli_tokens: AtomicI64::new(floor),
            per_request: (config.retry_budget_ratio * 1000.0).round() as i64,
            floor,
            cap: AtomicI64::new(floor),
            window: config.retry_budget_window.max(Duration::from_millis(1)),
            rate: std::sync::Mutex::new((tokio::time::Instant::now(), 0)),
        }
    }

    /// Counts one request in the window; a window that is over sets the capacity. Within a
    /// window, once a tenth of it has passed, the capacity is at least the current rate's share
    /// projected over a whole window: a cold gateway (no window closed yet) or a surge earns its
    /// retries as the traffic comes, not only when the window closes.
    fn count(&self) -> i64 {
        let now = tokio::time::Instant::now();
        let mut rate = self.rate.lock().unwrap_or_else(|p| p.into_inner());
        rate.1 += 1;
        let elapsed = now.duration_since(rate.0);
        let requests = i64::try_from(rate.1).unwrap_or(i64::MAX);
        if elapsed >= self.window {
            let cap = self.per_request.saturating_mul(requests).max(self.floor);
            self.set_cap(cap);
            *rate = (now, 0);
        } else if elapsed >= self.window / 10 {
            let projected = self.per_request.saturating_mul(requests) as f64
                * (self.window.as_secs_f64() / elapsed.as_secs_f64());
            let projected = projected.min(i64::MAX as f64) as i64;
            if projected > self.cap.load(Ordering::Acquire) {
                self.set_cap(projected);
            }
        }
        self.cap.load(Ordering::Acquire)
    }

    /// Sets the capacity; tokens above a lowered capacity are given up with it (the bucket
    /// never holds more than it can).
    fn set_cap(&self, cap: i64) {
        self.cap.store(cap, Ordering::Release);
        self.milli_tokens.fetch_min(cap, Ordering::AcqRel);
    }

    /// One request arrived.
    pub fn deposit(&self) {
        let (per, cap) = (self.per_request, self.count());
        let _ = self
            .milli_tokens
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                (t < cap).then(|| (t + per).min(cap))
            });
    }

    /// The tokens and the capacity, read together for the gauges (tokens never above capacity).
    pub fn levels(&self) -> (f64, f64) {
        let cap = self.cap.load(Ordering::Acquire);
        let tokens = self.milli_tokens.load(Ordering::Acquire).min(cap);
        (tokens as f64 / 1000.0, cap as f64 / 1000.0)
    }

    /// The bucket's capacity now, in tokens.
    #[cfg(test)]
    pub fn capacity(&self) -> f64 {
        self.cap.load(Ordering::Acquire) as f64 / 1000.0
    }

    /// Takes one retry token, if any.
    pub fn try_withdraw(&self) -> bool {
        self.milli_tokens
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                (t >= 1000).then_some(t - 1000)
            })
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn limits_queues_and_refuses() {
        let config = LimitsConfig {
            max_in_flight: 1,
            max_queue: 1,
            queue_timeout: Duration::from_millis(50),
            ..LimitsConfig::default()
        };
        let metrics = Arc::new(Metrics::new());
        let a = Arc::new(Admission::new(&config, metrics.clone()));
        let first = a.admit().await.unwrap();
        // The queue holds one waiter; the next is refused at once.
        let waiter = {
            let a = a.clone();
            tokio::spawn(async move { a.admit().await.map(|_| ()) })
        };
        while a.queued() == 0 {
            tokio::task::yield_now().await;
        }
        let refused = a.admit().await.unwrap_err();
        assert_eq!(refused.status(), http::StatusCode::TOO_MANY_REQUESTS);
        // The waiter times out.
        assert!(waiter.await.unwrap().is_err());
        assert_eq!(a.queued(), 0);
        drop(first);
        let again = a.admit().await.unwrap();
        drop(again);
        let text = metrics.render();
        assert!(
            text.contains(r#"pdgate_admission_rejected_total{reason="queue_full"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"pdgate_admission_rejected_total{reason="queue_timeout"} 1"#),
            "{text}"
        );
        assert!(text.contains("pdgate_admission_in_flight 0"), "{text}");
    }

    #[test]
    fn retry_budget_refills_per_request() {
        let config = LimitsConfig {
            retry_budget_ratio: 0.5,
            retry_budget_min: 2,
            ..LimitsConfig::default()
        };
        let b = RetryBudget::new(&config);
        assert!(b.try_withdraw());
        assert!(b.try_withdraw());
        assert!(!b.try_withdraw());
        b.deposit();
        assert!(!b.try_withdraw());
        b.deposit();
        assert!(b.try_withdraw());
        for _ in 0..100 {
            b.deposit();
        }
        assert!(b.try_withdraw() && b.try_withdraw() && !b.try_withdraw());
    }
}

#[cfg(test)]
mod timing_tests;

#[cfg(test)]
mod budget_tests {
    use super::*;

    /// The capacity follows the last window's request count (a share of it may be retried);
    /// back to the floor when traffic stops.
    #[tokio::test(start_paused = true)]
    async fn the_retry_budget_scales_with_traffic() {
        let config = LimitsConfig {
            retry_budget_ratio: 0.2,
            retry_budget_min: 2,
            retry_budget_window: Duration::from_secs(10),
            ..LimitsConfig::default()
        };
        let b = RetryBudget::new(&config);
        assert_eq!(b.capacity(), 2.0);
        // 1,000 requests within one window, then the window ends.
        for _ in 0..1000 {
            b.deposit();
        }
        tokio::time::advance(Duration::from_secs(10)).await;
        b.deposit();
        assert_eq!(b.capacity(), 200.2);
        // The bucket fills up to it with the next requests' deposits.
        for _ in 0..1000 {
            b.deposit();
        }
        let mut retries = 0;
        while b.try_withdraw() {
            retries += 1;
        }
        assert_eq!(retries, 200, "a share of the recent traffic may be retried");
        // A quiet window: back to the floor.
        tokio::time::advance(Duration::from_secs(10)).await;
        b.deposit();
        tokio::time::advance(Duration::from_secs(10)).await;
        b.deposit();
        assert_eq!(b.capacity(), 2.0);
    }

    /// A new gateway under steady traffic: before its first window closes it may already retry
    /// a share of the requests it has seen, not only `retry_budget_min`.
    #[tokio::test(start_paused = true)]
    async fn a_cold_gateway_earns_retries_before_its_first_window_closes() {
        let config = LimitsConfig {
            retry_budget_ratio: 0.2,
            retry_budget_min: 2,
            retry_budget_window: Duration::from_secs(10),
            ..LimitsConfig::default()
        };
        let b = RetryBudget::new(&config);
        // 100 requests a second for 2 s: 200 requests, a fifth of the first window.
        for _ in 0..200 {
            b.deposit();
            tokio::time::advance(Duration::from_millis(10)).await;
        }
        let mut retries = 0;
        while b.try_withdraw() {
            retries += 1;
        }
        // The deposits earned 0.2 per request (the first second's beyond the floor capped).
        assert!(
            retries >= 20,
            "a cold gateway allowed only {retries} retries"
        );
        assert!(b.capacity() >= 200.0, "capacity {}", b.capacity());
    }

    /// The gauges' pair never shows more tokens than capacity, also when a busy window is
    /// followed by a quiet one that lowers the capacity.
    #[tokio::test(start_paused = true)]
    async fn tokens_never_exceed_the_capacity() {
        let config = LimitsConfig {
            retry_budget_ratio: 0.2,
            retry_budget_min: 2,
            retry_budget_window: Duration::from_secs(10),
            ..LimitsConfig::default()
        };
        let b = RetryBudget::new(&config);
        for _ in 0..1000 {
            b.deposit();
        }
        tokio::time::advance(Duration::from_secs(10)).await;
        for _ in 0..1000 {
            b.deposit();
        }
        let (tokens, capacity) = b.levels();
        assert!(
            tokens > 100.0 && tokens <= capacity,
            "{tokens} of {capacity}"
        );
        // Two quiet windows: the capacity falls to its floor, and the tokens with it.
        tokio::time::advance(Duration::from_secs(10)).await;
        b.deposit();
        tokio::time::advance(Duration::from_secs(10)).await;
        b.deposit();
        let (tokens, capacity) = b.levels();
        assert_eq!(capacity, 2.0);
        assert!(tokens <= capacity, "{tokens} of {capacity}");
        assert!(b.milli_tokens.load(Ordering::Acquire) <= 2000);
    }
}
