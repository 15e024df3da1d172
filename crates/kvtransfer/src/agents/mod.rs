//! Built-in agents, one file per connector. A new backend is one more file
//! here plus one line in [`crate::registry::Registry::with_builtins`].

mod mooncake;
mod nixl;
mod sglang;
mod shfs;

pub use mooncake::{MooncakeAgent, mooncake_transfer_id};
pub use nixl::NixlAgent;
pub use sglang::{SglangAgent, sglang_batch_size};
pub use shfs::{SHFS_PREFILL_KV_TRANSFER_PARAMS, ShfsAgent};
