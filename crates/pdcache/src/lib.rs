//! pdcache: what pdgate and pdsim need to know about engines' prefix caches.

pub mod events;
pub mod index;
pub mod keys;
mod msgpack;
#[cfg(feature = "subscriber")]
pub mod subscribe;
pub mod tokenizer;
pub mod vllm_hash;
