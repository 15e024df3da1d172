//! The KV-event codec against messages captured from real vLLM 0.32 engines
//! (`fixtures/vllm-0.32-kv-events.jsonl`: topic, sequence and payload bytes as hex, and the
//! payload as Python's msgpack decoded it).

use pdcache::events::{
    BlockHash, BlockRemoved, BlockStored, DecodeError, EventBatch, KvEvent, decode_batch,
    decode_seq, encode_batch,
};
use proptest::prelude::*;
use serde_json::Value;

const FIXTURE: &str = include_str!("fixtures/vllm-0.32-kv-events.jsonl");

struct Message {
    topic: String,
    seq: Vec<u8>,
    payload: Vec<u8>,
    decoded: Value,
    /// The batch timestamp as written in the line: serde_json's default float parsing may be
    /// off by an ulp, std's `parse` is exact.
    ts: f64,
}

fn unhex(s: &str) -> Vec<u8> {
    assert_eq!(s.len() % 2, 0);
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn messages() -> Vec<Message> {
    FIXTURE
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(l).expect("json line");
            Message {
                topic: v["topic"].as_str().expect("topic").to_owned(),
                seq: unhex(v["seq_hex"].as_str().expect("seq")),
                payload: unhex(v["payload_hex"].as_str().expect("payload")),
                decoded: v["decoded"].clone(),
                ts: l
                    .split_once("\"decoded\": [")
                    .and_then(|(_, rest)| rest.split_once(','))
                    .and_then(|(ts, _)| ts.trim().parse().ok())
                    .expect("decoded ts"),
            }
        })
        .collect()
}

fn json_hash(v: &Value) -> BlockHash {
    BlockHash::Uint(v.as_u64().expect("the fixture's hashes are u64"))
}

fn json_str(v: &Value) -> Option<String> {
    v.as_str().map(str::to_owned)
}

/// The batch the `decoded` column describes, built independently of the decoder.
fn expected(m: &Message) -> EventBatch {
    let a = m.decoded.as_array().expect("batch array");
    let events = a[1]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| match e["type"].as_str().expect("type") {
            "BlockStored" => KvEvent::BlockStored(BlockStored {
                block_hashes: e["block_hashes"]
                    .as_array()
                    .expect("hashes")
                    .iter()
                    .map(json_hash)
                    .collect(),
                parent_block_hash: (!e["parent_block_hash"].is_null())
                    .then(|| json_hash(&e["parent_block_hash"])),
                token_ids: e["token_ids"]
                    .as_array()
                    .expect("tokens")
                    .iter()
                    .map(|t| u32::try_from(t.as_u64().expect("token")).expect("u32"))
                    .collect(),
                block_size: u32::try_from(e["block_size"].as_u64().expect("bs")).expect("u32"),
                lora_id: e["lora_id"].as_i64(),
                medium: json_str(&e["medium"]),
                lora_name: json_str(&e["lora_name"]),
                extra_keys: e["extra_keys"].as_array().map(|ks| {
                    ks.iter()
                        .map(|k| {
                            assert!(k.is_null(), "the fixture has no extra keys");
                            None
                        })
                        .collect()
                }),
                group_idx: e["group_idx"].as_i64(),
                kv_cache_spec_kind: json_str(&e["kv_cache_spec_kind"]),
                kv_cache_spec_sliding_window: e
                    .get("kv_cache_spec_sliding_window")
                    .and_then(Value::as_i64),
            }),
            "BlockRemoved" => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: e["block_hashes"]
                    .as_array()
                    .expect("hashes")
                    .iter()
                    .map(json_hash)
                    .collect(),
                medium: json_str(&e["medium"]),
                group_idx: e["group_idx"].as_i64(),
            }),
            "AllBlocksCleared" => KvEvent::AllBlocksCleared,
            other => panic!("unexpected event type {other}"),
        })
        .collect();
    EventBatch {
        ts: m.ts,
        events,
        data_parallel_rank: a.get(2).and_then(Value::as_i64),
    }
}

#[test]
fn every_captured_message_decodes_to_what_python_decoded() {
    let msgs = messages();
    assert_eq!(msgs.len(), 13);
    let mut kinds = (0, 0);
    for (i, m) in msgs.iter().enumerate() {
        assert!(m.topic.starts_with("kv@"), "line {i}");
        decode_seq(&m.seq).expect("8-byte sequence");
        let got = decode_batch(&m.payload).unwrap_or_else(|e| panic!("line {i}: {e}"));
        assert_eq!(got, expected(m), "line {i}");
        for e in &got.events {
            match e {
                KvEvent::BlockStored(s) => {
                    kinds.0 += 1;
                    assert_eq!(
                        s.token_ids.len(),
                        s.block_hashes.len() * s.block_size as usize,
                        "line {i}"
                    );
                }
                KvEvent::BlockRemoved(_) => kinds.1 += 1,
                KvEvent::AllBlocksCleared => {}
            }
        }
    }
    assert_eq!(kinds.1, 1, "the last line holds one BlockRemoved");
    assert!(kinds.0 > 13);
    // The second message of engine A chains onto the first message's third block.
    let first = decode_batch(&msgs[0].payload).expect("decodes");
    let second = decode_batch(&msgs[1].payload).expect("decodes");
    let (KvEvent::BlockStored(a), KvEvent::BlockStored(b)) = (&first.events[0], &second.events[0])
    else {
        panic!("stores")
    };
    assert_eq!(b.parent_block_hash.as_ref(), Some(&a.block_hashes[2]));
}

#[test]
fn the_removal_sits_between_stores_of_the_same_step() {
    let last = messages().pop().expect("lines");
    assert_eq!(decode_seq(&last.seq), Ok(0x5b));
    let b = decode_batch(&last.payload).expect("decodes");
    let kinds: Vec<&str> = b.events.iter().map(KvEvent::tag).collect();
    assert_eq!(
        kinds,
        ["BlockStored", "BlockStored", "BlockRemoved", "BlockStored"]
    );
}

#[test]
fn the_encoder_writes_vllms_bytes_exactly() {
    for (i, m) in messages().iter().enumerate() {
        let batch = decode_batch(&m.payload).expect("decodes");
        assert_eq!(encode_batch(&batch), m.payload, "line {i}");
    }
}

#[test]
fn every_truncation_of_a_captured_payload_is_an_error() {
    for m in messages().iter().take(3) {
        for cut in 0..m.payload.len() {
            assert_eq!(
                decode_batch(&m.payload[..cut]),
                Err(DecodeError::Truncated),
                "cut at {cut}"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
    }

    #[test]
    fn corrupted_captured_payloads_never_panic(
        line in 0usize..13,
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        static PAYLOADS: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
        let mut payload = PAYLOADS.get_or_init(|| messages().into_iter().map(|m| m.payload).collect())[line].clone();
        for (at, byte) in flips {
            let i = at.index(payload.len());
            payload[i] = byte;
        }
        // NaN timestamps are left out: NaN != NaN would fail the comparison, not the codec.
        if let Ok(batch) = decode_batch(&payload).map_err(drop).and_then(|b| if b.ts.is_nan() { Err(()) } else { Ok(b) }) {
            // Whatever decodes re-encodes into something that decodes to the same batch.
            prop_assert_eq!(decode_batch(&encode_batch(&batch)), Ok(batch));
        }
    }
}

#[test]
fn captured_events_index_under_our_own_keys() {
    use pdcache::index::{CacheIndex, IndexConfig, Match};
    use pdcache::keys::token_keys;
    let now = std::time::Instant::now();
    let mut idx = CacheIndex::new(IndexConfig::default(), now);
    let (a, b) = (
        idx.add_endpoint().expect("room"),
        idx.add_endpoint().expect("room"),
    );
    let msgs = messages();
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    for m in &msgs {
        let ep = if m.topic.starts_with("kv@A") { a } else { b };
        let batch = decode_batch(&m.payload).expect("decodes");
        let st = idx.apply_batch(ep, &batch, now);
        assert_eq!((st.orphaned, st.ignored), (0, 0), "{}", m.topic);
        for e in &batch.events {
            if let KvEvent::BlockStored(s) = e {
                prompts.push(s.token_ids.clone());
            }
        }
    }
    // Engine A: the second message's block continues the first message's third block, so a
    // request of those 3 + 1 blocks matches 4 on A, though A never stored them as one event.
    let mut req = prompts[0][..96].to_vec();
    req.extend_from_slice(&prompts[1]);
    let mut out: Vec<Match> = Vec::new();
    idx.match_prefix(&token_keys(&req, 32), &mut out);
    assert_eq!(
        out,
        [Match {
            endpoint: a,
            blocks: 4
        }]
    );
    // Engine B (block 128): its evicted block is gone, the others are there.
    let removed = &prompts[3];
    idx.match_prefix(&token_keys(removed, 128), &mut out);
    assert!(
        out.iter().all(|m| m.endpoint != b),
        "the block B evicted matches nothing on B"
    );
    idx.match_prefix(&token_keys(&prompts[4], 128), &mut out);
    assert_eq!(
        out,
        [Match {
            endpoint: b,
            blocks: 3
        }]
    );
}
