//! Engine I/O: the connection pool, one leg's request and answer (typed failures, timeouts),
//! control-plane probes, and the body wrapper that tells a guard how a body ended.

pub(crate) mod client;
pub(crate) mod conn;
pub(crate) mod guarded;
pub(crate) mod pool;
pub(crate) mod probe;

pub(crate) use pool::{EngineAddr, EngineBody, EnginePool};
