//! Routing policies: pick one endpoint among candidates. An open set, selected by name.
//! [`cache_aware`] is the one that also looks at the request (its prefix), which `pd::select`
//! asks of it through [`Policy::cache_aware`].

mod cache_aware;

pub use cache_aware::CacheAware;

use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::endpoints::Endpoint;
use crate::error::{ConfigError, field_error};

/// Picks one endpoint among non-empty candidates.
pub trait Policy: Send + Sync + Debug {
    /// The policy's configuration name.
    fn name(&self) -> &'static str;
    /// Index of the chosen candidate; `None` only when `candidates` is empty.
    fn pick(&self, candidates: &[Arc<Endpoint>]) -> Option<usize>;
    /// Whether the choice should weigh the request's cached prefix (`cache_aware`); the
    /// selection then scores candidates itself and [`Policy::pick`] serves only choices
    /// without a prefix.
    fn cache_aware(&self) -> bool {
        false
    }
}

/// Names accepted by [`by_name`].
pub const NAMES: &[&str] = &[
    "round_robin",
    "random",
    "least_request",
    "power_of_two",
    "cache_aware",
];

/// A policy by its configuration name.
pub fn by_name(name: &str) -> Option<Box<dyn Policy>> {
    match name.trim().to_ascii_lowercase().replace('-', "_").as_str() {
        "round_robin" => Some(Box::new(RoundRobin::default())),
        "random" => Some(Box::new(Random)),
        "least_request" => Some(Box::new(LeastRequest)),
        "power_of_two" => Some(Box::new(PowerOfTwo)),
        "cache_aware" => Some(Box::new(CacheAware)),
        _ => None,
    }
}

/// The `policy` section: which policy picks each role's endpoint.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// Prefill selection policy.
    pub prefill_policy: String,
    /// Decode selection policy.
    pub decode_policy: String,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            prefill_policy: "round_robin".into(),
            decode_policy: "least_request".into(),
        }
    }
}

impl PolicyConfig {
    /// Checks the section, naming the key at fault.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        for (field, name) in [
            ("prefill_policy", &self.prefill_policy),
            ("decode_policy", &self.decode_policy),
        ] {
            if by_name(name).is_none() {
                return Err(field_error(
                    field,
                    format!("unknown policy {name:?} (valid: {})", NAMES.join(", ")),
                ));
            }
        }
        Ok(())
    }
}

/// Each candidate in turn.
#[derive(Debug, Default)]
pub struct RoundRobin(AtomicUsize);

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }
    fn pick(&self, candidates: &[Arc<Endpoint>]) -> Option<usize> {
        (!candidates.is_empty()).then(|| self.0.fetch_add(1, Ordering::Relaxed) % candidates.len())
    }
}

/// Uniformly random.
#[derive(Debug)]
pub struct Random;

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }
    fn pick(&self, candidates: &[Arc<Endpoint>]) -> Option<usize> {
        (!candidates.is_empty()).then(|| rand::rng().random_range(0..candidates.len()))
    }
}

/// Fewest in-flight requests; among those, the fewest prompt tokens being computed for them (a
/// decode: whose KV it holds), so that two of a trace's longest prompts do not land on one
/// engine while others hold short ones; remaining ties broken at random, so equal endpoints
/// share the load.
#[derive(Debug)]
pub struct LeastRequest;

impl Policy for LeastRequest {
    fn name(&self) -> &'static str {
        "least_request"
    }
    fn pick(&self, candidates: &[Arc<Endpoint>]) -> Option<usize> {
        let min = candidates.iter().map(|e| e.load.held()).min()?;
        let ties = candidates.iter().filter(|e| e.load.held() == min).count();
        let nth = if ties > 1 {
            rand::rng().random_range(0..ties)
        } else {
            0
        };
        candidates
            .iter()
            .enumerate()
            .filter(|(_, e)| e.load.held() == min)
            .nth(nth)
            .map(|(i, _)| i)
            .or(Some(0))
    }
}

/// Two random candidates, the less loaded wins.
#[derive(Debug)]
pub struct PowerOfTwo;

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power_of_two"
    }
    fn pick(&self, candidates: &[Arc<Endpoint>]) -> Option<usize> {
        match candidates.len() {
            0 => None,
            1 => Some(0),
            n => {
                let mut rng = rand::rng();
                let a = rng.random_range(0..n);
                let b = (a + rng.random_range(1..n)) % n;
                if candidates[b].load.in_flight() < candidates[a].load.in_flight() {
                    Some(b)
                } else {
                    Some(a)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::{Load, LoadGuard, Role};
    use kvtransfer::Pod;

    fn endpoints(n: usize) -> Vec<Arc<Endpoint>> {
        (0..n)
            .map(|i| {
                Arc::new(Endpoint {
                    name: format!("e{i}"),
                    rank: None,
                    addr: crate::engine::EngineAddr::parse(&format!("http://127.0.0.1:{i}"))
                        .expect("address"),
                    pod: Pod::default(),
                    role: Role::Decode,
                    models: vec![],
                    adapters: Default::default(),
                    connector: None,
                    agent: None,
                    load: Arc::new(Load::default()),
                    authorization: None,
                })
            })
            .collect()
    }

    #[test]
    fn every_policy_handles_empty_and_single() {
        for name in NAMES {
            let p = by_name(name).unwrap();
            assert_eq!(p.name(), *name);
            assert_eq!(p.pick(&[]), None);
            assert_eq!(p.pick(&endpoints(1)), Some(0));
        }
        assert!(by_name("fastest").is_none());
        assert!(by_name("Round-Robin").is_some());
    }

    #[test]
    fn round_robin_cycles() {
        let eps = endpoints(3);
        let p = RoundRobin::default();
        let picks: Vec<_> = (0..6).map(|_| p.pick(&eps).unwrap()).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn load_aware_policies_avoid_the_busy_endpoint() {
        let eps = endpoints(2);
        let _busy: Vec<_> = (0..3).map(|_| LoadGuard::acquire(&eps[0].load)).collect();
        for _ in 0..50 {
            assert_eq!(LeastRequest.pick(&eps), Some(1));
            assert_eq!(PowerOfTwo.pick(&eps), Some(1));
        }
    }

    #[test]
    fn least_request_breaks_ties_by_the_tokens_in_flight() {
        let eps = endpoints(3);
        // One request each; the first two hold long prompts, the third a short one.
        let _held = [
            LoadGuard::computing(&eps[0].load, 90_000),
            LoadGuard::computing(&eps[1].load, 40_000),
            LoadGuard::computing(&eps[2].load, 1_000),
        ];
        for _ in 0..50 {
            assert_eq!(LeastRequest.pick(&eps), Some(2));
        }
        // Fewer requests still come first, whatever their tokens.
        let _more = LoadGuard::computing(&eps[2].load, 0);
        assert_eq!(LeastRequest.pick(&eps), Some(1));
    }
}
