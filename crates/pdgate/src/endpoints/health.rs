//! Endpoint health: active checks and passive outlier detection.
//!
//! Every known endpoint has one entry. It is *unhealthy* (left out of the routable snapshot)
//! while either
//! - its active checks failed `unhealthy_threshold` times in a row (`GET /health`, plus the
//!   Mooncake bootstrap `/query` for Mooncake prefills), until `healthy_threshold` checks pass; or
//! - real traffic failed on it `outlier_consecutive_failures` times in a row: it is *ejected* for
//!   a back-off period (`outlier_base_ejection`, doubled on each repeat, at most
//!   `outlier_max_ejection`). When the period ends it comes back *half-open*: its next request
//!   decides — a failure ejects it again at once, a success clears its record.
//!
//! Passive ejection never removes the last endpoint of a role that is still healthy: a fleet
//! that fails everywhere keeps answering errors (and retries stay bounded by the budget) rather
//! than 503s for everything. Changes wake the reconciler, which republishes the snapshot.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tracing::{info, warn};

use crate::endpoints::Role;
use crate::endpoints::adapters::{AdapterParents, Refresh};
use crate::error::{ConfigError, field_error};
use crate::metrics::{Cause, Metrics};

/// What an active check requests for one endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeTarget {
    /// Endpoint name.
    pub name: String,
    /// Prefill or decode.
    pub role: Role,
    /// `http://host:port/health`.
    pub health_url: String,
    /// `http://host:bootstrap_port/query` for a Mooncake prefill.
    pub query_url: Option<String>,
    /// `http://host:port/v1/models`: read on each check for the engine's LoRA adapters, and
    /// for its models where nobody configured them (`learn_models`).
    pub models_url: Option<String>,
    /// Whether the models `models_url` names are learned as the endpoint's (none configured).
    pub learn_models: bool,
    /// `Authorization` for `models_url` (the engines' key).
    pub authorization: Option<http::HeaderValue>,
}

#[derive(Debug)]
struct Entry {
    target: ProbeTarget,
    check_failures: u32,
    check_passes: u32,
    check_down: bool,
    /// Models the engine's `/v1/models` named at its last check.
    learned: Vec<String>,
    /// LoRA adapters the engine's `/v1/models` named at its last check, with their base models.
    adapters: AdapterParents,
    /// Some active check has passed (readiness waits for one).
    ever_passed: bool,
    traffic_failures: u32,
    ejected_until: Option<Instant>,
    ejections: u32,
    half_open: bool,
    /// Half-open with its one probe request under way (since then): not routable meanwhile.
    probing: Option<Instant>,
    window_start: Instant,
    window_total: u32,
    window_failures: u32,
    /// Recent answer times (prefills), for latency outliers.
    latency: latency::Samples,
}

impl Entry {
    fn new(target: ProbeTarget) -> Self {
        Entry {
            target,
            check_failures: 0,
            check_passes: 0,
            check_down: false,
            learned: Vec::new(),
            adapters: AdapterParents::new(),
            ever_passed: false,
            traffic_failures: 0,
            ejected_until: None,
            ejections: 0,
            half_open: false,
            probing: None,
            window_start: Instant::now(),
            window_total: 0,
            window_failures: 0,
            latency: latency::Samples::default(),
        }
    }

    fn healthy(&self) -> bool {
        !self.down()
    }

    /// Failing its checks or ejected (a half-open probe under way is neither).
    fn down(&self) -> bool {
        self.check_down || self.ejected_until.is_some()
    }

    /// Up and not waiting for its half-open probe: takes full traffic.
    fn serving(&self) -> bool {
        !self.down() && self.probing.is_none()
    }
}

/// The `health` section: active checks and passive outlier ejection (the file's keys of the
/// same names, `outlier_`-prefixed for the passive ones).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// Active health checks (`GET /health`, plus `/query` for Mooncake prefills) on every endpoint.
    pub health_checks: bool,
    /// Time between two active checks of one endpoint.
    #[serde(with = "crate::durations::text")]
    pub health_check_interval: Duration,
    /// Bound on one active check.
    #[serde(with = "crate::durations::text")]
    pub health_check_timeout: Duration,
    /// Consecutive failed checks that make an endpoint unhealthy.
    pub unhealthy_threshold: u32,
    /// Consecutive passed checks that make an unhealthy endpoint healthy again.
    pub healthy_threshold: u32,
    /// Consecutive failures on real traffic that eject an endpoint (0 disables passive ejection).
    #[serde(rename = "outlier_consecutive_failures")]
    pub consecutive_failures: u32,
    /// Share of failed requests within one `interval` that ejects an endpoint (0 disables).
    #[serde(rename = "outlier_error_rate")]
    pub error_rate: f64,
    /// Requests an endpoint must have served within the interval before its error rate counts.
    #[serde(rename = "outlier_min_requests")]
    pub min_requests: u32,
    /// Window of the error-rate detection.
    #[serde(rename = "outlier_interval", with = "crate::durations::text")]
    pub interval: Duration,
    /// First ejection period; doubled on each repeated ejection, up to `max_ejection`.
    #[serde(rename = "outlier_base_ejection", with = "crate::durations::text")]
    pub base_ejection: Duration,
    /// Longest ejection period.
    #[serde(rename = "outlier_max_ejection", with = "crate::durations::text")]
    pub max_ejection: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            health_checks: true,
            health_check_interval: Duration::from_secs(5),
            health_check_timeout: Duration::from_secs(2),
            unhealthy_threshold: 3,
            healthy_threshold: 2,
            consecutive_failures: 5,
            error_rate: 0.5,
            min_requests: 20,
            interval: Duration::from_secs(10),
            base_ejection: Duration::from_secs(10),
            max_ejection: Duration::from_secs(300),
        }
    }
}

impl HealthConfig {
    /// Checks the section, naming the key at fault.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        for (field, d) in [
            ("health_check_interval", self.health_check_interval),
            ("health_check_timeout", self.health_check_timeout),
            ("outlier_base_ejection", self.base_ejection),
            ("outlier_interval", self.interval),
        ] {
            if d.is_zero() {
                return Err(field_error(field, "must be greater than zero"));
            }
        }
        for (field, n) in [
            ("unhealthy_threshold", self.unhealthy_threshold),
            ("healthy_threshold", self.healthy_threshold),
        ] {
            if n == 0 {
                return Err(field_error(field, "must be at least 1"));
            }
        }
        if self.max_ejection < self.base_ejection {
            return Err(field_error(
                "outlier_max_ejection",
                "must be at least outlier_base_ejection",
            ));
        }
        if !(self.error_rate.is_finite() && (0.0..=1.0).contains(&self.error_rate)) {
            return Err(field_error("outlier_error_rate", "must be between 0 and 1"));
        }
        Ok(())
    }
}

/// Entries by endpoint name (names come from configuration and discovery, not from clients: a
/// fast hasher is safe, and each request looks its endpoints up several times).
type Entries = HashMap<String, Entry, foldhash::fast::RandomState>;

/// Health of every known endpoint.
#[derive(Debug)]
pub struct Health {
    entries: Mutex<Entries>,
    changed: Notify,
    /// Bumped whenever an endpoint goes down (ejected or failing its checks): legs waiting on
    /// it wake up ([`Health::went_down`]).
    downs: tokio::sync::watch::Sender<u64>,
    /// A half-open endpoint takes one probe request before full traffic
    /// (`reliability.half_open_probe`).
    half_open_probe: bool,
    /// Latency outlier ejection of prefills (`reliability.latency_outlier_*`), if on.
    latency: Option<LatencyRule>,
    /// Some entry may be half-open (set under the lock with the entry): [`Health::begin`] takes
    /// the lock only then.
    any_half_open: AtomicBool,
    /// How many entries are down (kept under the lock with the entries): while none is,
    /// [`Health::went_down`] has nothing to look up.
    down_count: AtomicUsize,
    knobs: HealthConfig,
    metrics: Arc<Metrics>,
    /// Early rounds asked for by requests (an engine refused an adapter).
    refresh: Refresh,
}

impl Health {
    /// Empty table with the knobs of `config`.
    pub fn new(config: &HealthConfig, metrics: Arc<Metrics>) -> Self {
        let mut knobs = config.clone();
        knobs.unhealthy_threshold = knobs.unhealthy_threshold.max(1);
        knobs.healthy_threshold = knobs.healthy_threshold.max(1);
        knobs.min_requests = knobs.min_requests.max(1);
        Health {
            entries: Mutex::new(Entries::default()),
            changed: Notify::new(),
            downs: tokio::sync::watch::Sender::new(0),
            half_open_probe: true,
            latency: None,
            any_half_open: AtomicBool::new(false),
            down_count: AtomicUsize::new(0),
            knobs,
            metrics,
            refresh: Refresh::default(),
        }
    }

    /// With `on` false, a half-open endpoint takes full traffic at once.
    pub fn with_half_open_probe(mut self, on: bool) -> Self {
        self.half_open_probe = on;
        self
    }

    /// Prefills far slower than their peers are ejected by `rule`.
    pub fn with_latency_outliers(mut self, rule: LatencyRule) -> Self {
        self.latency = (rule.ratio > 0.0).then_some(rule);
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Resolves when health changed since the last call (no lost wake-ups).
    pub async fn changed(&self) {
        self.changed.notified().await;
    }

    /// Called under the lock after any entry may have gone down or come back up.
    fn recount_down(&self, map: &Entries) {
        let down = map.values().filter(|e| e.down()).count();
        self.down_count.store(down, Ordering::Release);
    }

    fn set_gauge(&self, e: &Entry) {
        self.metrics
            .set_healthy(e.target.role.as_str(), &e.target.name, e.healthy());
    }

    /// Makes the table follow the fleet: new endpoints start healthy, gone ones are forgotten.
    pub fn sync(&self, targets: Vec<ProbeTarget>) {
        let mut map = self.lock();
        let names: BTreeSet<&str> = targets.iter().map(|t| t.name.as_str()).collect();
        map.retain(|name, e| {
            let keep = names.contains(name.as_str());
            if !keep {
                self.metrics.forget_endpoint(e.target.role.as_str(), name);
            }
            keep
        });
        for t in targets {
            match map.get_mut(&t.name) {
                Some(e) => e.target = t,
                None => {
                    let e = Entry::new(t);
                    self.set_gauge(&e);
                    map.insert(e.target.name.clone(), e);
                }
            }
        }
        self.recount_down(&map);
    }

    /// Names of endpoints that must not be routed to now.
    /// A half-open endpoint whose probe is under way is left out too, unless it is the only
    /// one of its role that is up.
    pub fn unhealthy(&self) -> BTreeSet<String> {
        let map = self.lock();
        let serving = |role: Role| {
            map.values()
                .filter(move |e| e.target.role == role && e.serving())
        };
        map.iter()
            .filter(|(_, e)| {
                !e.healthy() || (e.probing.is_some() && serving(e.target.role).next().is_some())
            })
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Records the models `name`'s engine serves (its `/v1/models`).
    pub fn learned(&self, name: &str, models: Vec<String>) {
        if let Some(e) = self.lock().get_mut(name) {
            e.learned = models;
        }
    }

    /// Records the LoRA adapters endpoint `name` serves now; a change wakes the reconciler,
    /// which republishes the snapshot with them.
    pub fn learned_adapters(&self, name: &str, adapters: AdapterParents) {
        let mut map = self.lock();
        let Some(e) = map.get_mut(name) else { return };
        if e.adapters != adapters {
            info!(endpoint = %name, adapters = ?adapters.keys().collect::<Vec<_>>(), "LoRA adapters changed");
            e.adapters = adapters;
            self.changed.notify_one();
        }
    }

    /// The LoRA adapters of every endpoint that has any, by endpoint name.
    pub fn adapters(&self) -> std::collections::BTreeMap<String, AdapterParents> {
        self.lock()
            .iter()
            .filter(|(_, e)| !e.adapters.is_empty())
            .map(|(n, e)| (n.clone(), e.adapters.clone()))
            .collect()
    }

    /// Asks the checker for an early round (an engine refused an adapter pdgate thought it
    /// held), at most once a second; true if this call asked.
    fn refresh_soon(&self) -> bool {
        self.knobs.health_checks && self.refresh.ask(Instant::now())
    }

    /// Called with the status of every generation leg's answer: an engine answering 404 no
    /// longer serves the request's model (an adapter unloaded since the last round), so the
    /// next round starts early (at most one a second) and requests stop going there within
    /// about a second.
    pub fn model_refused(&self, status: http::StatusCode) {
        if status == http::StatusCode::NOT_FOUND && self.refresh_soon() {
            info!("an engine refused a model: early health round to relearn its adapters");
        }
    }

    /// Resolves when an early round was asked for.
    pub(crate) async fn refresh_asked(&self) {
        self.refresh.asked().await;
    }

    /// The models the healthy engines named (for `/v1/models` when none is configured).
    pub fn learned_models(&self) -> BTreeSet<String> {
        self.lock()
            .values()
            .filter(|e| e.healthy())
            .flat_map(|e| e.learned.iter().cloned())
            .collect()
    }

    /// Whether `name` is healthy and has passed an active check at least once (always, with
    /// active checks off): what `/ready` counts, so that a fleet nobody has reached yet is not
    /// ready.
    pub fn verified(&self, name: &str) -> bool {
        if !self.knobs.health_checks {
            return true;
        }
        self.lock()
            .get(name)
            .is_some_and(|e| e.ever_passed && e.healthy())
    }

    /// Whether `name` is known and healthy (unknown endpoints count as healthy).
    #[cfg(test)]
    pub fn is_healthy(&self, name: &str) -> bool {
        self.lock().get(name).is_none_or(Entry::healthy)
    }

    /// Resolves once `name` is down (ejected or failing its checks); pending while it is up or
    /// unknown. A leg waiting on the endpoint selects on it to give up at once.
    pub async fn went_down(&self, name: &str) {
        let mut downs = self.downs.subscribe();
        loop {
            // Subscribed first: a change after this check still wakes the wait below.
            if self.down_count.load(Ordering::Acquire) > 0
                && self.lock().get(name).is_some_and(Entry::down)
            {
                return;
            }
            if downs.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    /// A request is being sent to `name`: a half-open endpoint's first one is its probe, and
    /// until it reports, no other request is routed there.
    pub fn begin(&self, name: &str) {
        if !self.half_open_probe || !self.any_half_open.load(Ordering::Acquire) {
            return;
        }
        let mut map = self.lock();
        if !map.values().any(|e| e.half_open) {
            self.any_half_open.store(false, Ordering::Release);
            return;
        }
        let Some(e) = map.get_mut(name) else { return };
        if e.half_open && e.probing.is_none() {
            e.probing = Some(Instant::now());
            info!(endpoint = %name, "half-open: one probe request");
            self.changed.notify_one();
        }
    }

    /// Whether [`Health::hold_back_probed`] keeps every candidate now (nothing is half-open, or
    /// half-open probing is off): one atomic load.
    pub(crate) fn holds_back_none(&self) -> bool {
        !self.half_open_probe || !self.any_half_open.load(Ordering::Acquire)
    }

    /// `candidates` without the half-open endpoints whose probe is under way, unless that
    /// leaves none (then the probed one is all there is). Routing asks this at selection, so a
    /// burst right after [`Health::begin`] does not follow the probe before the reconciler
    /// republishes the snapshot without it. One atomic load while nothing is half-open.
    pub(crate) fn hold_back_probed<E: AsRef<crate::endpoints::Endpoint>>(
        &self,
        mut candidates: Vec<E>,
    ) -> Vec<E> {
        if self.holds_back_none() {
            return candidates;
        }
        let map = self.lock();
        let probed = |e: &E| {
            map.get(&e.as_ref().name)
                .is_some_and(|entry| entry.probing.is_some())
        };
        if candidates.iter().any(probed) && !candidates.iter().all(probed) {
            candidates.retain(|e| !probed(e));
        }
        candidates
    }

    fn bump_downs(&self) {
        self.downs.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// What the active checker should probe.
    pub fn targets(&self) -> Vec<ProbeTarget> {
        self.lock().values().map(|e| e.target.clone()).collect()
    }

    /// Records the outcome of one active check.
    pub fn check_result(&self, name: &str, ok: bool, why: &str) {
        let mut map = self.lock();
        let Some(e) = map.get_mut(name) else { return };
        let before = e.healthy();
        if ok {
            e.ever_passed = true;
            e.check_failures = 0;
            e.check_passes = e.check_passes.saturating_add(1);
            if e.check_down && e.check_passes >= self.knobs.healthy_threshold {
                e.check_down = false;
                info!(endpoint = %name, "endpoint passes its health checks again");
            }
        } else {
            e.check_passes = 0;
            e.check_failures = e.check_failures.saturating_add(1);
            if !e.check_down && e.check_failures >= self.knobs.unhealthy_threshold {
                e.check_down = true;
                warn!(endpoint = %name, reason = %why, "endpoint failed its health checks");
                let role = e.target.role.as_str();
                self.metrics.count_ejection(role, name, Cause::HealthCheck);
            }
        }
        if before != e.healthy() {
            self.set_gauge(e);
            // Counted before waiters wake: they read the count.
            self.recount_down(&map);
            if before {
                self.bump_downs();
            }
            self.changed.notify_one();
        }
    }

    /// Records the outcome of real traffic on `name` (`Ok`: the engine answered sanely; the
    /// cause of a failure is the ejection's reason when it trips the outlier rules).
    pub fn observe(&self, name: &str, outcome: Result<(), Cause>) {
        let by_count = self.knobs.consecutive_failures > 0;
        let by_rate = self.knobs.error_rate > 0.0;
        if !by_count && !by_rate {
            return;
        }
        let mut map = self.lock();
        let Some(e) = map.get_mut(name) else { return };
        let now = Instant::now();
        if now.duration_since(e.window_start) > self.knobs.interval {
            e.window_start = now;
            e.window_total = 0;
            e.window_failures = 0;
        }
        e.window_total = e.window_total.saturating_add(1);
        let Err(cause) = outcome else {
            e.traffic_failures = 0;
            if e.half_open {
                e.half_open = false;
                e.ejections = 0;
                if e.probing.take().is_some() {
                    info!(endpoint = %name, "half-open probe succeeded; full traffic again");
                    self.changed.notify_one();
                }
            }
            return;
        };
        e.window_failures = e.window_failures.saturating_add(1);
        if e.ejected_until.is_some() {
            return;
        }
        let role = e.target.role;
        let rate_tripped = by_rate
            && e.window_total >= self.knobs.min_requests
            && f64::from(e.window_failures) >= self.knobs.error_rate * f64::from(e.window_total);
        let count_tripped = by_count && e.traffic_failures + 1 >= self.knobs.consecutive_failures;
        let trip = e.half_open || rate_tripped || count_tripped;
        // Never eject the last healthy endpoint of a role.
        let healthy_peers = map
            .values()
            .filter(|p| p.target.role == role && p.healthy() && p.target.name != name)
            .count();
        let Some(e) = map.get_mut(name) else { return };
        e.traffic_failures = e.traffic_failures.saturating_add(1);
        if !trip || healthy_peers == 0 {
            if e.probing.take().is_some() {
                self.changed.notify_one();
            }
            return;
        }
        self.eject(&mut map, name, cause);
    }

    /// Records how long prefill `name` took to answer a request it served: one whose median is
    /// far above its serving peers' (the latency rule) is ejected like a failing one.
    pub fn observe_latency(&self, name: &str, took: Duration) {
        let Some(rule) = self.latency else { return };
        let now = tokio::time::Instant::now();
        let mut map = self.lock();
        let Some(e) = map.get_mut(name) else { return };
        if e.target.role != Role::Prefill || e.down() {
            return;
        }
        e.latency.push(now, took);
        let Some(e) = map.get(name) else { return };
        let mut peers = map
            .values()
            .filter(|p| p.target.role == Role::Prefill && p.target.name != name && p.serving())
            .peekable();
        if peers.peek().is_none() {
            return;
        }
        let Some((own, theirs)) = rule.outlier(&e.latency, peers.map(|p| &p.latency), now) else {
            return;
        };
        warn!(endpoint = %name, median = ?own, peers_median = ?theirs, "prefill far slower than its peers");
        self.eject(&mut map, name, Cause::LatencyOutlier);
    }

    /// Takes `name` out of rotation for its back-off period; requests waiting on it are woken.
    fn eject(&self, map: &mut Entries, name: &str, cause: Cause) {
        let Some(e) = map.get_mut(name) else { return };
        let factor = 1u32 << e.ejections.min(16);
        let period = self
            .knobs
            .base_ejection
            .saturating_mul(factor)
            .min(self.knobs.max_ejection);
        e.ejections = e.ejections.saturating_add(1);
        e.ejected_until = Some(Instant::now() + period);
        e.half_open = false;
        e.probing = None;
        e.traffic_failures = 0;
        e.window_total = 0;
        e.window_failures = 0;
        e.latency.clear();
        warn!(endpoint = %name, ?period, reason = cause.as_str(), "endpoint ejected");
        self.metrics
            .count_ejection(e.target.role.as_str(), name, cause);
        self.set_gauge(e);
        self.recount_down(map);
        self.changed.notify_one();
        self.bump_downs();
    }

    /// Ends ejection periods that are over (the endpoint comes back half-open).
    pub fn tick(&self, now: Instant) {
        let mut map = self.lock();
        let mut any = false;
        for e in map.values_mut() {
            if e.ejected_until.is_some_and(|t| t <= now) {
                e.ejected_until = None;
                e.half_open = true;
                self.any_half_open.store(true, Ordering::Release);
                info!(endpoint = %e.target.name, "ejection over; endpoint back on probation");
                self.set_gauge(e);
                any = true;
            }
            // A probe that never reported (its client left): let another request probe.
            if e.probing
                .is_some_and(|t| now.duration_since(t) >= self.knobs.base_ejection)
            {
                e.probing = None;
                any = true;
            }
        }
        if any {
            self.recount_down(&map);
            self.changed.notify_one();
        }
    }
}

mod checks;
mod latency;
pub use checks::run;
pub use latency::LatencyRule;

#[cfg(test)]
mod tests;
