//! Data-parallel ranks on the wire: where each rank of an engine publishes its KV events.
//!
//! vLLM runs one engine core per data-parallel rank, each with its own KV cache and its own
//! event publisher, on the configured endpoint moved by the rank; each batch carries the rank
//! too (`[ts, events, data_parallel_rank]`). pdsim publishes the same way and pdgate subscribes
//! to each rank where it publishes.

/// Where data-parallel rank `rank` of an engine publishes when rank 0 publishes on `endpoint`,
/// as vLLM's publisher moves it: a `tcp://` port offset by the rank; other transports
/// (`ipc://`, `inproc://`) get the suffix `_dp<rank>` (vLLM does so for `inproc` and refuses
/// `ipc` with more than one rank; pdsim follows the suffix rule for both). Rank 0 keeps the
/// endpoint. `None` for a `tcp://` endpoint whose port is not a number or overflows.
pub fn rank_endpoint(endpoint: &str, rank: u32) -> Option<String> {
    if rank == 0 {
        return Some(endpoint.to_owned());
    }
    if endpoint.starts_with("tcp://") {
        let (base, port) = endpoint.rsplit_once(':')?;
        let port: u16 = port.parse().ok()?;
        let port = u16::try_from(u32::from(port) + rank).ok()?;
        return Some(format!("{base}:{port}"));
    }
    Some(format!("{endpoint}_dp{rank}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_endpoints_move_as_vllm_moves_them() {
        assert_eq!(
            rank_endpoint("tcp://10.0.0.5:5557", 0).as_deref(),
            Some("tcp://10.0.0.5:5557")
        );
        assert_eq!(
            rank_endpoint("tcp://10.0.0.5:5557", 3).as_deref(),
            Some("tcp://10.0.0.5:5560")
        );
        assert_eq!(
            rank_endpoint("tcp://[::1]:5557", 1).as_deref(),
            Some("tcp://[::1]:5558")
        );
        assert_eq!(
            rank_endpoint("ipc:///tmp/kv.sock", 2).as_deref(),
            Some("ipc:///tmp/kv.sock_dp2")
        );
        assert_eq!(rank_endpoint("tcp://h:65535", 1), None, "port overflow");
        assert_eq!(rank_endpoint("tcp://h:x", 1), None, "no port");
    }
}
