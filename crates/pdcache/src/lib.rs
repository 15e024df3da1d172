//! pdcache: what pdgate and pdsim need to know about engines' prefix caches.
//!
//! No I/O except behind the `subscriber` feature. pdgate uses it to route by cache (which
//! endpoint already holds a request's prefix); pdsim uses it to behave like a vLLM engine with
//! a prefix cache (the same block hashes, the same KV events on the wire).
//!
//! Modules:
//! - [`events`]: vLLM's KV-cache events (0.32 wire format): types, a byte-exact encoder, a
//!   tolerant decoder.
//! - [`keys`]: chained xxh3 block keys, over token blocks (also computed from events'
//!   `token_ids`: "dual key") or over byte blocks of the prompt or conversation (approximate),
//!   in the base model's key space or a LoRA adapter's (`keys::Space`).
//! - [`index`]: the cache index of one model: endpoint -> blocks, longest consecutive prefix per
//!   endpoint, precise / approximate / speculative entries, LRU and TTL, memory counters.
//! - [`ranks`]: where each data-parallel rank of an engine publishes its events.
//! - `subscribe` (feature `subscriber`): ZMQ SUB for engines' events, with sequence-gap replay,
//!   feeding an index.
//! - [`tokenizer`]: a Hugging Face `tokenizer.json` and chat template, for token keys equal to
//!   the engine's.
//! - [`vllm_hash`]: vLLM's own `sha256_cbor` block hash, with LoRA extra keys (for pdsim; the
//!   gateway never needs it).
//!
//! ```no_run
//! use std::time::Instant;
//! use pdcache::events::decode_batch;
//! use pdcache::index::{CacheIndex, IndexConfig, Match, predicted_cached_tokens};
//! use pdcache::keys::token_keys;
//!
//! let mut index = CacheIndex::new(IndexConfig::default(), Instant::now());
//! let engine = index.add_endpoint()?;
//! // Precise mode: apply the engine's KV events as they arrive (frame 3 of each message).
//! let payload: Vec<u8> = Vec::new();
//! if let Ok(batch) = decode_batch(&payload) {
//!     index.apply_batch(engine, &batch, Instant::now());
//! }
//! // Routing: the request's keys, then the longest cached prefix per endpoint.
//! let tokens: Vec<u32> = (0..4096).collect();
//! let keys = token_keys(&tokens, 16);
//! let mut matches: Vec<Match> = Vec::new();
//! index.match_prefix(&keys, &mut matches);
//! if let Some(best) = matches.iter().max_by_key(|m| m.blocks) {
//!     let cached = predicted_cached_tokens(best.blocks, 16, tokens.len() as u32);
//!     println!("{:?} holds {cached} tokens", best.endpoint);
//!     // Cover the event lag until the engine's BlockStored confirms it.
//!     index.insert_speculative(best.endpoint, &keys, Instant::now());
//! }
//! # Ok::<(), pdcache::index::TooManyEndpoints>(())
//! ```

#[doc(hidden)]
pub mod bench_prompts;
pub mod events;
pub mod index;
pub mod keys;
mod msgpack;
pub mod ranks;
#[cfg(feature = "subscriber")]
pub mod subscribe;
pub mod tokenizer;
pub mod vllm_hash;
