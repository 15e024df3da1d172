//! The `[cache]` section: cache-aware routing's knobs, with their defaults.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::error::ConfigError;

/// Per-model overrides of `[cache]` (`[cache.models."name"]`).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelCacheConfig {
    /// Tokens per KV block of this model's engines (must match theirs).
    pub block_size: Option<usize>,
    /// The model's `tokenizer.json` (with `tokenizer_config.json` beside it for the chat
    /// template): requests are then keyed by token blocks, as the engines' caches are.
    pub tokenizer: Option<PathBuf>,
}

/// Cache-aware routing (`prefill_policy` / `decode_policy = "cache_aware"`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Tokens per KV block of the engines (vLLM: `--block-size`; 16 on GPUs by default).
    pub block_size: usize,
    /// A `tokenizer.json` for models without their own (`[cache.models."m"] tokenizer`).
    pub tokenizer: Option<PathBuf>,
    /// Per-model block size and tokenizer.
    pub models: BTreeMap<String, ModelCacheConfig>,
    /// Cost of one uncached prompt token (the prefill work a miss costs).
    pub cache_weight: f64,
    /// Where an endpoint's cache is full (its engine evicts: a `BlockRemoved` event, or in
    /// approximate mode its index entries reached its capacity), each uncached
    /// prompt token costs this many times `cache_weight` more: storing it there evicts a cached
    /// token that a later request may want. So where caches are full, a prefix family stays on
    /// the engine holding it until that engine's queue costs more than recomputing the prefix
    /// twice over, and a new prefix goes to an engine with room, partitioning the families so
    /// the fleet's caches hold more of them. Where caches have room it changes nothing; 0
    /// ignores capacity.
    pub eviction_weight: f64,
    /// Cost of one prompt token an endpoint is still computing for the requests it holds (the
    /// uncached tokens pdgate predicted for the prefill legs it sent there and that have not
    /// answered yet): the work queued ahead of a new request. 0 ignores it. Below 1 a family
    /// stays longer with the prefill holding its prefix (more hits where caches are small,
    /// longer queues where a family is hot: docs/operations.md).
    pub queued_weight: f64,
    /// Cost of one in-flight request on a decode (and on a decode that may serve a request
    /// alone), in uncached-token units: a decode holds a request for its whole generation, and
    /// each one it runs lengthens its steps.
    pub load_weight: f64,
    /// Cost of one in-flight request on a prefill, in uncached-token units. A prefill's
    /// requests already cost what it still computes for them (`queued_weight` x their
    /// predicted uncached tokens), so by default (0) a prefill is chosen by predicted time
    /// alone, its queued tokens plus the request's uncached ones, and the in-flight count only
    /// breaks ties. A per-request term on top counts the queue twice and, with short prompts,
    /// outweighs a hit: a prefix family then spills to a second prefill, and where caches are
    /// small both thrash.
    pub prefill_load_weight: f64,
    /// Cost of one prompt token the decode of a disaggregated request does not hold, in place
    /// of `cache_weight` when the decode is chosen. That decode computes none of the prompt (it
    /// receives the KV cache), so by default (0) it is chosen by its load alone: the KV it
    /// holds for its requests (their prompt tokens, weighed by `queued_weight`) and their
    /// count. A higher value keeps a family's requests on the decode that holds its prefix
    /// (less to transfer) at the price of piling a hot family onto one decode. Where the
    /// decode may serve alone (`decode_only_below_tokens`), its cache still decides that.
    pub decode_cache_weight: f64,
    /// Imbalance guard: when the busiest candidate holds more than `balance_abs` in-flight
    /// requests above the idlest one *and* more than `balance_rel` times as many, the cache is
    /// ignored for that decision and the least loaded endpoint wins.
    pub balance_abs: usize,
    /// See `balance_abs`.
    pub balance_rel: f64,
    /// Entries kept per endpoint in a model's index (least recently used evicted first). An
    /// endpoint without KV events is also bounded by the KV its engine's metrics report
    /// (`engine_load_interval`), so approximate mode models each engine's size unset.
    pub capacity_per_endpoint: usize,
    /// Lifetime of an approximate entry (a decision's guess about an endpoint without events).
    #[serde(deserialize_with = "crate::durations::de_duration")]
    pub approximate_ttl: Duration,
    /// Lifetime of a speculative entry (a decision's guess until the endpoint's event confirms).
    #[serde(deserialize_with = "crate::durations::de_duration")]
    pub speculative_ttl: Duration,
    /// An endpoint publishing KV events whose events stop (no batch this long after a decision
    /// that should have stored blocks there) is scored approximately until they resume; 0
    /// never gives up on events.
    #[serde(deserialize_with = "crate::durations::de_duration")]
    pub events_timeout: Duration,
    /// Serve a request on the decode alone (no prefill leg) when at most this many of its prompt
    /// tokens are uncached there; 0 disables decode-only serving.
    pub decode_only_below_tokens: u32,
    /// ... and only when the uncached share of the prompt is below this ratio (Dynamo's
    /// `isl_bounding`); 1.0 lets the token threshold alone decide.
    pub decode_only_max_uncached_ratio: f64,
    /// Admission: refuse (429 with `Retry-After`, as admission control does) a request whose
    /// chosen prefill already has more than this many predicted prompt tokens to compute ahead
    /// of it: past saturation it would miss any TTFT objective and delay the ones behind it.
    /// 0 (the default) admits everything.
    pub max_queued_prefill_tokens: u32,
    /// Every endpoint publishes KV events on `tcp://<its host>:<port>` (vLLM
    /// `--kv-events-config '{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557"}'`);
    /// an endpoint's own `kv_events` wins.
    pub kv_events_port: Option<u16>,
    /// Every endpoint's replay socket is `tcp://<its host>:<port>` (vLLM `replay_endpoint`).
    pub kv_events_replay_port: Option<u16>,
    /// Token keys for models without a local tokenizer from an engine's `POST /tokenize`
    /// (remembered per prompt): a new prompt waits one engine round trip. Unset (the default):
    /// on for the models some endpoint publishes KV events for, since their events can only
    /// match token keys; `true` for every model; `false` never (a model with events and no
    /// tokenizer is then warned about: precise matching cannot work for it).
    pub engine_tokenize: Option<bool>,
    /// How long a `/tokenize` may take before the request keeps approximate keys.
    #[serde(deserialize_with = "crate::durations::de_duration")]
    pub engine_tokenize_timeout: Duration,
    /// Prompts whose engine tokens are remembered (least recently used forgotten first).
    pub engine_tokenize_cache: usize,
    /// Scrape every prefill and decode engine's `/metrics` this often for the requests it
    /// runs and queues (`vllm:num_requests_running` + `vllm:num_requests_waiting`), and count
    /// those this gateway did not send (other replicas', other clients') in its cost; 0 never
    /// scrapes, and each gateway then sees only its own load. On by default (500 ms):
    /// production runs several replicas, and each one blind to the others' load picks the
    /// engines they just filled (docs/benchmarks.md, "Fleet scale").
    #[serde(deserialize_with = "crate::durations::de_duration")]
    pub engine_load_interval: Duration,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            block_size: 16,
            tokenizer: None,
            models: BTreeMap::new(),
            cache_weight: 1.0,
            queued_weight: 1.0,
            eviction_weight: 1.0,
            load_weight: 256.0,
            prefill_load_weight: 0.0,
            decode_cache_weight: 0.0,
            balance_abs: 32,
            balance_rel: 1.5,
            capacity_per_endpoint: 1 << 20,
            approximate_ttl: Duration::from_secs(120),
            speculative_ttl: Duration::from_secs(2),
            events_timeout: Duration::from_secs(5),
            decode_only_below_tokens: 0,
            decode_only_max_uncached_ratio: 0.7,
            max_queued_prefill_tokens: 0,
            kv_events_port: None,
            kv_events_replay_port: None,
            engine_tokenize: None,
            engine_tokenize_timeout: Duration::from_millis(50),
            engine_tokenize_cache: 10_000,
            engine_load_interval: Duration::from_millis(500),
        }
    }
}

/// The shortest `engine_load_interval` accepted (other than 0, off).
pub const MIN_ENGINE_LOAD_INTERVAL: Duration = Duration::from_millis(10);

fn field(name: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        field: format!("cache.{name}"),
        message: message.into(),
    }
}

impl CacheConfig {
    /// Whether what a decode caches can decide anything, under a decode policy that is
    /// `cache_aware` or not: decode-only serving (`decode_only_below_tokens`) or a decode
    /// cache weight. Elsewhere a decode is chosen by its load, and its cache is not tracked.
    pub(crate) fn decodes_read(&self, decode_cache_aware: bool) -> bool {
        decode_cache_aware && (self.decode_only_below_tokens > 0 || self.decode_cache_weight > 0.0)
    }

    /// Block size for `model` (`None`: the client named none).
    pub fn block_size_for(&self, model: Option<&str>) -> usize {
        model
            .and_then(|m| self.models.get(m))
            .and_then(|m| m.block_size)
            .unwrap_or(self.block_size)
    }

    /// Checks the values (names the field on error).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let sizes = std::iter::once(("block_size".to_string(), self.block_size)).chain(
            self.models
                .iter()
                .filter_map(|(m, c)| c.block_size.map(|b| (format!("models.{m}.block_size"), b))),
        );
        for (name, size) in sizes {
            if size == 0 || size > 4096 {
                return Err(field(&name, "must be between 1 and 4096 tokens"));
            }
        }
        let finite = [
            ("cache_weight", self.cache_weight),
            ("queued_weight", self.queued_weight),
            ("eviction_weight", self.eviction_weight),
            ("load_weight", self.load_weight),
            ("prefill_load_weight", self.prefill_load_weight),
            ("decode_cache_weight", self.decode_cache_weight),
        ];
        for (name, v) in finite {
            if !v.is_finite() || v < 0.0 {
                return Err(field(name, "must be a non-negative number"));
            }
        }
        if !self.balance_rel.is_finite() || self.balance_rel < 1.0 {
            return Err(field("balance_rel", "must be at least 1.0"));
        }
        let r = self.decode_only_max_uncached_ratio;
        if !r.is_finite() || !(0.0..=1.0).contains(&r) {
            return Err(field(
                "decode_only_max_uncached_ratio",
                "must be between 0 and 1",
            ));
        }
        if self.capacity_per_endpoint == 0 {
            return Err(field("capacity_per_endpoint", "must be positive"));
        }
        // Every engine is scraped each interval: below this the scrapes cost the engines more
        // than a fresher view can win.
        if !self.engine_load_interval.is_zero()
            && self.engine_load_interval < MIN_ENGINE_LOAD_INTERVAL
        {
            return Err(field(
                "engine_load_interval",
                format!("must be 0 (off) or at least {MIN_ENGINE_LOAD_INTERVAL:?}"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decodes_cache_is_read_only_where_it_can_decide() {
        let base = CacheConfig::default();
        assert!(
            !base.decodes_read(true),
            "the defaults: a decode chosen by load"
        );
        let weighed = CacheConfig {
            decode_cache_weight: 0.5,
            ..CacheConfig::default()
        };
        let alone = CacheConfig {
            decode_only_below_tokens: 64,
            ..CacheConfig::default()
        };
        assert!(weighed.decodes_read(true) && alone.decodes_read(true));
        // Without a cache-aware decode policy nothing reads it.
        assert!(!weighed.decodes_read(false) && !alone.decodes_read(false));
    }

    #[test]
    fn defaults_validate_and_bad_values_name_the_field() {
        assert!(CacheConfig::default().validate().is_ok());
        let mut c = CacheConfig {
            block_size: 0,
            ..CacheConfig::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("cache.block_size"), "{e}");
        c.block_size = 32;
        c.models.insert(
            "m".into(),
            ModelCacheConfig {
                block_size: Some(0),
                tokenizer: None,
            },
        );
        assert!(c.validate().unwrap_err().to_string().contains("models.m"));
        c.models.clear();
        c.balance_rel = 0.5;
        assert!(c.validate().is_err());
        c.balance_rel = 1.5;
        c.decode_only_max_uncached_ratio = 2.0;
        assert!(c.validate().is_err());
        c.decode_only_max_uncached_ratio = 0.7;
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            c.queued_weight = bad;
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("cache.queued_weight"), "{e}");
        }
        c.queued_weight = 0.0;
        assert!(c.validate().is_ok());
        c.engine_load_interval = Duration::from_millis(5);
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("cache.engine_load_interval"), "{e}");
        c.engine_load_interval = Duration::from_millis(250);
        assert!(c.validate().is_ok());
    }

    #[test]
    fn block_size_per_model() {
        let mut c = CacheConfig::default();
        c.models.insert(
            "big".into(),
            ModelCacheConfig {
                block_size: Some(64),
                tokenizer: None,
            },
        );
        assert_eq!(c.block_size_for(Some("big")), 64);
        assert_eq!(c.block_size_for(Some("other")), 16);
        assert_eq!(c.block_size_for(None), 16);
    }
}
