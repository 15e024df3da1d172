//! `mooncake`: vLLM MooncakeConnector (contracts §5). Concurrent legs joined by
//! a transfer id; decode dials the prefill pod's bootstrap server.

use serde::Serialize;

use crate::agent::{
    AgentError, DATA_PARALLEL_RANK_HEADER, Dispatch, KvTransferAgent, MergeOutcome, PrefillRequest,
    decode_base, require_ip,
};
use crate::body::JsonBody;
use crate::context::RoutingContext;
use crate::pod::{MooncakeBootstrap, Pod, url_host};
use crate::rules::{KV_TRANSFER_PARAMS, apply_prefill_leg_rules, strip_client_transfer_fields};

/// The `mooncake` agent: concurrent; prefill and decode share
/// `transfer_id = "xfer-<transfer key>"` (the context's `transfer_key`), decode names the prefill's bootstrap
/// address and the engine id of the chosen data-parallel rank.
#[derive(Clone, Copy, Debug, Default)]
pub struct MooncakeAgent;

/// The transfer id both legs of the request with transfer key `key` carry.
pub fn mooncake_transfer_id(key: &str) -> String {
    format!("xfer-{key}")
}

/// FNV-1a: a stable hash (unlike `DefaultHasher`, fixed across releases), so
/// a request id always maps to the same rank.
fn fnv1a(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The data-parallel rank a request runs on: the router's choice when it made one (the
/// context's `dp_rank`, set before augment: the rank it weighed by cache and load, and sends as
/// `X-data-parallel-rank`), else a stable hash of `request_id` over the bootstrap's ranks. A
/// router's rank the bootstrap does not list is an error: the decode could not name its engine.
fn rank_for(
    ctx: &RoutingContext,
    pod: &Pod,
    bootstrap: &MooncakeBootstrap,
) -> Result<u32, AgentError> {
    match ctx.transfer.dp_rank {
        Some(rank) if bootstrap.ranks.contains_key(&rank) => Ok(rank),
        Some(_) => Err(AgentError::MissingState(
            "the data-parallel rank chosen for this request is not in the prefill's bootstrap info",
        )),
        None => pick_rank(&ctx.request_id, bootstrap).ok_or_else(|| AgentError::NoBootstrap {
            pod: pod.name.clone(),
        }),
    }
}

/// Picks a data-parallel rank for `request_id`: a stable hash over the sorted
/// ranks. `None` when there is none.
fn pick_rank(request_id: &str, bootstrap: &MooncakeBootstrap) -> Option<u32> {
    let n = bootstrap.ranks.len() as u64;
    if n == 0 {
        return None;
    }
    let idx = usize::try_from(fnv1a(request_id.as_bytes()) % n).ok()?;
    bootstrap.ranks.keys().nth(idx).copied()
}

fn bootstrap(pod: &Pod) -> Result<&MooncakeBootstrap, AgentError> {
    pod.mooncake_bootstrap
        .as_ref()
        .filter(|b| !b.ranks.is_empty())
        .ok_or_else(|| AgentError::NoBootstrap {
            pod: pod.name.clone(),
        })
}

#[derive(Serialize)]
struct PrefillParams<'a> {
    do_remote_decode: bool,
    do_remote_prefill: bool,
    transfer_id: &'a str,
}

#[derive(Serialize)]
struct DecodeParams<'a> {
    do_remote_decode: bool,
    do_remote_prefill: bool,
    remote_bootstrap_addr: &'a str,
    remote_engine_id: &'a str,
    transfer_id: &'a str,
}

impl KvTransferAgent for MooncakeAgent {
    fn connector_type(&self) -> &'static str {
        crate::CONNECTOR_TYPE_MOONCAKE
    }

    /// vLLM takes `kv_transfer_params` on `/v1/responses` and `/v1/messages` too, and Mooncake
    /// carries its parameters the same way.
    fn carries_responses_and_messages(&self) -> bool {
        true
    }

    fn accepts_ec_transfer_params(&self) -> bool {
        true
    }

    fn dispatch(&self) -> Dispatch {
        Dispatch::Concurrent
    }

    /// The decode dials the engine id of a rank that only the prefill's bootstrap server knows.
    fn needs_bootstrap_lookup(&self) -> bool {
        true
    }

    fn augment_prefill_request(
        &self,
        ctx: &mut RoutingContext,
        prefill_pod: &Pod,
        request: &JsonBody,
    ) -> Result<PrefillRequest, AgentError> {
        require_ip(prefill_pod)?;
        let bootstrap = bootstrap(prefill_pod)?;
        let rank = rank_for(ctx, prefill_pod, bootstrap)?;
        let transfer_id = mooncake_transfer_id(&ctx.transfer_key);
        let mut body = request.clone();
        strip_client_transfer_fields(&mut body);
        apply_prefill_leg_rules(&mut body);
        body.set(
            KV_TRANSFER_PARAMS,
            &PrefillParams {
                do_remote_decode: true,
                do_remote_prefill: false,
                transfer_id: &transfer_id,
            },
        )?;
        ctx.transfer.transfer_id = Some(transfer_id);
        ctx.transfer.dp_rank = Some(rank);
        Ok(PrefillRequest {
            body: body.to_bytes(),
            headers: vec![(DATA_PARALLEL_RANK_HEADER, http::HeaderValue::from(rank))],
        })
    }

    /// Ignores `prefill_response` (the gateway calls this before the prefill
    /// answers); reuses the transfer id and rank augment chose, or derives the
    /// same ones from the request id when augment ran elsewhere.
    fn merge_prefill_response(
        &self,
        ctx: &mut RoutingContext,
        _prefill_response: &[u8],
        prefill_pod: &Pod,
    ) -> Result<MergeOutcome, AgentError> {
        let mut decode = decode_base(ctx)?;
        let ip = require_ip(prefill_pod)?;
        let bootstrap = bootstrap(prefill_pod)?;
        let rank = rank_for(ctx, prefill_pod, bootstrap)?;
        let engine = bootstrap.ranks.get(&rank).ok_or(AgentError::MissingState(
            "dp_rank chosen by augment is not in the pod's bootstrap info",
        ))?;
        let transfer_id = ctx
            .transfer
            .transfer_id
            .clone()
            .unwrap_or_else(|| mooncake_transfer_id(&ctx.transfer_key));
        let addr = format!("http://{}:{}", url_host(ip), bootstrap.port);
        decode.set(
            KV_TRANSFER_PARAMS,
            &DecodeParams {
                do_remote_decode: false,
                do_remote_prefill: true,
                remote_bootstrap_addr: &addr,
                remote_engine_id: &engine.engine_id,
                transfer_id: &transfer_id,
            },
        )?;
        ctx.req_body = decode.to_bytes();
        ctx.transfer.transfer_id = Some(transfer_id);
        ctx.transfer.dp_rank = Some(rank);
        Ok(MergeOutcome::KvAttached)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::pod::MooncakeRank;
    use std::collections::BTreeMap;

    fn boot(ranks: &[u32]) -> MooncakeBootstrap {
        MooncakeBootstrap {
            port: 8998,
            ranks: ranks
                .iter()
                .map(|r| {
                    (
                        *r,
                        MooncakeRank {
                            engine_id: format!("e{r}"),
                            worker_addr: BTreeMap::new(),
                        },
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn rank_choice_is_stable_and_spreads() {
        let b = boot(&[0, 1, 2, 3]);
        assert_eq!(pick_rank("req-1", &b), pick_rank("req-1", &b));
        let mut seen = std::collections::BTreeSet::new();
        for i in 0..64 {
            seen.insert(pick_rank(&format!("req-{i}"), &b));
        }
        assert_eq!(seen.len(), 4, "64 ids should hit all 4 ranks: {seen:?}");
        assert_eq!(pick_rank("x", &boot(&[])), None);
        assert_eq!(pick_rank("x", &boot(&[7])), Some(7));
    }

    #[test]
    fn the_routers_rank_wins_over_the_hash() {
        let mut pod = Pod::new("p", "10.0.0.1", 8000);
        pod.mooncake_bootstrap = Some(boot(&[0, 1, 2, 3]));
        let body = JsonBody::parse(bytes::Bytes::from_static(br#"{"prompt":"x"}"#)).unwrap();
        for rank in 0..4 {
            let mut ctx = RoutingContext::new("req-1", bytes::Bytes::new());
            ctx.transfer.dp_rank = Some(rank);
            let leg = MooncakeAgent
                .augment_prefill_request(&mut ctx, &pod, &body)
                .unwrap();
            assert_eq!(leg.headers[0].1, http::HeaderValue::from(rank));
            assert_eq!(ctx.transfer.dp_rank, Some(rank));
            ctx.req_body = body.to_bytes();
            MooncakeAgent
                .merge_prefill_response(&mut ctx, b"", &pod)
                .unwrap();
            let decode = String::from_utf8(ctx.req_body.to_vec()).unwrap();
            assert!(
                decode.contains(&format!("\"remote_engine_id\":\"e{rank}\"")),
                "{decode}"
            );
        }
        // A rank the bootstrap server does not list fails: no engine id to name.
        let mut ctx = RoutingContext::new("req-1", bytes::Bytes::new());
        ctx.transfer.dp_rank = Some(9);
        assert!(matches!(
            MooncakeAgent.augment_prefill_request(&mut ctx, &pod, &body),
            Err(AgentError::MissingState(_))
        ));
    }
}
