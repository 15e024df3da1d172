//! `cache_aware`: prefer the endpoint that already holds the request's prefix, weighed against
//! its load. The decision itself needs the request's prefix view and the cache index, so it is
//! made in `pd::select` (with `cache::score`); this type names the policy and answers the
//! choices that have no prefix to go by (retries, pass-through routes) by load alone.

use std::sync::Arc;

use super::{LeastRequest, Policy};
use crate::endpoints::Endpoint;

/// The `cache_aware` policy.
#[derive(Debug, Default)]
pub struct CacheAware;

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }
    fn cache_aware(&self) -> bool {
        true
    }
    fn pick(&self, candidates: &[Arc<Endpoint>]) -> Option<usize> {
        LeastRequest.pick(candidates)
    }
}
