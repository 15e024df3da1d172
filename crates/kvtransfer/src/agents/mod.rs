//! Built-in agents, one file per connector. A new backend is one more file
//! here plus one line in [`crate::registry::Registry::with_builtins`].

mod mooncake;
mod moriio;
mod nixl;
mod p2p_nccl;
mod sglang;
mod shfs;
mod trtllm;

pub use mooncake::{MooncakeAgent, mooncake_transfer_id};
pub use moriio::{
    CONNECTOR_TYPE_MORIIO, CONNECTOR_TYPE_MORIIO_READ, DEFAULT_MORIIO_HANDSHAKE_PORT,
    DEFAULT_MORIIO_NOTIFY_PORT, MORIIO_DP_SIZE, MORIIO_HANDSHAKE_PORT, MORIIO_NOTIFY_PORT,
    MORIIO_TP_SIZE, MoriioAgent,
};
pub use nixl::NixlAgent;
pub use p2p_nccl::{
    CONNECTOR_TYPE_P2P_NCCL, DECODE_ADDR_MARKER, DEFAULT_P2P_NCCL_KV_PORT, P2P_NCCL_KV_PORT,
    P2pNcclAgent, PREFILL_ADDR_MARKER, addressed_request_id, parse_addressed_request_id,
    split_zmq_address,
};
pub use sglang::{SglangAgent, sglang_batch_size};
pub use shfs::{SHFS_PREFILL_KV_TRANSFER_PARAMS, ShfsAgent};
pub use trtllm::{CONNECTOR_TYPE_TRTLLM, DISAGGREGATED_PARAMS, TrtllmAgent};
