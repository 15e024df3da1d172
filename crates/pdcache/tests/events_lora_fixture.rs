//! LoRA adapters' KV events and block hashes against messages captured from a real vLLM 0.32.0
//! engine (`fixtures/vllm-0.32-kv-events-lora.jsonl`, made by serving one prompt under the base
//! model `tiny` and adapters `a` and `b` loaded from `/work/lora-exp/a` and `/work/lora-exp/b`,
//! block size 32, `sha256_cbor`; each line: topic, sequence and payload bytes as hex, and the
//! payload as Python's msgpack decoded it).

use pdcache::events::{BlockHash, KvEvent, decode_batch, encode_batch};
use pdcache::vllm_hash::{BlockHasher, event_value, lora_key, none_hash};
use serde_json::Value;

const FIXTURE: &str = include_str!("fixtures/vllm-0.32-kv-events-lora.jsonl");

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// Every captured store event: (payload bytes, the event as Python decoded it).
fn stored() -> Vec<(Vec<u8>, Value)> {
    FIXTURE
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(l).expect("json line");
            let payload = unhex(v["payload_hex"].as_str().expect("payload"));
            (payload, v["decoded"].clone())
        })
        .collect()
}

#[test]
fn adapter_events_carry_their_name_and_round_trip() {
    let mut names = Vec::new();
    for (payload, decoded) in stored() {
        let batch = decode_batch(&payload).expect("a vLLM batch decodes");
        assert_eq!(encode_batch(&batch), payload, "re-encoded byte for byte");
        let [KvEvent::BlockStored(e)] = batch.events.as_slice() else {
            panic!("one store event per batch: {:?}", batch.events);
        };
        let want = decoded[1][0]["lora_name"].as_str().map(str::to_owned);
        assert_eq!(e.lora_name, want);
        // Every block of an adapter's prompt has extra keys; the base model's have none.
        let extra = e.extra_keys.as_ref().expect("extra_keys sent");
        assert_eq!(extra.len(), e.block_hashes.len());
        assert!(extra.iter().all(|k| k.is_some() == want.is_some()));
        names.push(want);
    }
    assert_eq!(
        names,
        [None, Some("a".to_owned()), Some("b".to_owned())],
        "the base model's prompt, then adapter a's, then b's"
    );
}

#[test]
fn adapter_block_hashes_are_the_base_chain_salted_with_the_tagged_key() {
    let mut hasher = BlockHasher::default();
    let mut chains = Vec::new();
    for (payload, _) in stored() {
        let batch = decode_batch(&payload).unwrap();
        let KvEvent::BlockStored(e) = &batch.events[0] else {
            panic!("a store event");
        };
        assert!(e.parent_block_hash.is_none(), "each prompt starts a chain");
        // The adapter's path is hashed too (where the capture loaded it from).
        let path = e.lora_name.as_ref().map(|n| format!("/work/lora-exp/{n}"));
        let key = e
            .lora_name
            .as_deref()
            .zip(path.as_deref())
            .map(|(name, path)| lora_key(name, path));
        let extra = key.as_ref().map(|k| k.as_slice());
        let mut digests = Vec::new();
        hasher.extend_with(
            &none_hash(),
            &e.token_ids,
            e.block_size as usize,
            extra.as_slice(),
            &mut digests,
        );
        let ours: Vec<BlockHash> = digests
            .iter()
            .map(|d| BlockHash::Uint(event_value(d)))
            .collect();
        assert_eq!(ours, e.block_hashes, "lora {:?}", e.lora_name);
        chains.push((e.token_ids.clone(), e.block_hashes.clone()));
    }
    // One prompt, three models: the same tokens, no block hash in common.
    assert!(chains.iter().all(|(t, _)| *t == chains[0].0));
    for (i, (_, a)) in chains.iter().enumerate() {
        for (_, b) in &chains[i + 1..] {
            assert!(a.iter().all(|h| !b.contains(h)));
        }
    }
}
