//! vLLM's KV-cache events on the wire (as of vLLM 0.32): the types, an encoder that writes what
//! vLLM writes, and a tolerant decoder.
//!
//! A message is three ZMQ frames: topic (UTF-8), sequence number (8 bytes big-endian, per
//! publisher process from 0, one per batch; see [`encode_seq`] / [`decode_seq`]) and a MessagePack
//! payload, the [`EventBatch`] `[ts, events, data_parallel_rank]`.
//!
//! Events are maps tagged by `"type"` (vLLM PR #42892); vLLM before it sent positional arrays
//! with the tag first. The decoder accepts both, hashes as unsigned int, negative int or bytes, a
//! batch of two or three elements (or a map), and ignores unknown keys, unknown trailing
//! positional fields and unknown event types, because every vLLM release so far has added fields
//! and consumers that insist on an exact shape broke on upgrade. It never panics and never
//! allocates more than the payload's length justifies.
//!
//! The encoder writes what msgspec writes for vLLM's structs: fields in declaration order, fields
//! without a default always present (nil when `None`), fields with a default omitted when
//! `None` (`omit_defaults`), and the batch's trailing `data_parallel_rank` omitted when `None`.

pub use crate::msgpack::DecodeError;
use crate::msgpack::{Head, Reader, write};

/// Sequence number of the end-of-replay marker (vLLM sends `-1` as 8 signed big-endian bytes).
pub const END_SEQ: u64 = u64::MAX;

/// The medium vLLM reports for blocks in the engine's own KV cache (also on the CPU platform).
pub const MEDIUM_GPU: &str = "GPU";

/// What vLLM reports as `kv_cache_spec_kind` for ordinary attention layers.
pub const SPEC_FULL_ATTENTION: &str = "full_attention";

/// One block's hash as the engine sent it. vLLM sends the low 8 bytes of its 32-byte digest as
/// an unsigned int by default, the whole digest as bytes with
/// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`; some older releases and forks send signed ints.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BlockHash {
    /// A non-negative integer.
    Uint(u64),
    /// A negative integer.
    Int(i64),
    /// Raw digest bytes.
    Bytes(Vec<u8>),
}

impl BlockHash {
    /// A 64-bit identity for this hash, the same one vLLM's int mode would send: bytes are read
    /// big-endian from their last 8 bytes (shorter ones zero-extended), negative ints
    /// reinterpreted. Only used to match an engine's hashes against each other, never against
    /// another engine's or our own keys, so any injective-enough map does; this one also makes
    /// an engine's bytes and int modes agree.
    pub fn as_u64(&self) -> u64 {
        match self {
            BlockHash::Uint(v) => *v,
            BlockHash::Int(v) => *v as u64,
            BlockHash::Bytes(b) => {
                let tail = &b[b.len().saturating_sub(8)..];
                tail.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x))
            }
        }
    }

    fn write(&self, out: &mut Vec<u8>) {
        match self {
            BlockHash::Uint(v) => write::uint(out, *v),
            BlockHash::Int(v) => write::int(out, *v),
            BlockHash::Bytes(b) => write::bin(out, b),
        }
    }
}

impl From<u64> for BlockHash {
    fn from(v: u64) -> Self {
        BlockHash::Uint(v)
    }
}

/// One block's extra hash keys (LoRA, multimodal, cache salt, prompt embeddings), kept as the
/// MessagePack bytes of the engine's tuple: consumers only need to know that they are there and
/// to tell them apart, and the encoder reproduces them exactly.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ExtraKeys(pub Vec<u8>);

impl ExtraKeys {
    /// The extra keys vLLM's KV events give every block of a request for LoRA adapter `name`
    /// and nothing else (no media, no salt): the untagged 1-tuple `(name,)` (what it hashes is
    /// the tagged `("lora", name, path)`: `vllm_hash::lora_key`).
    pub fn lora(name: &str) -> Self {
        let mut out = Vec::with_capacity(name.len() + 6);
        write::array_len(&mut out, 1);
        write::str(&mut out, name);
        ExtraKeys(out)
    }
}

/// Blocks that became cached (full blocks only).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    /// One hash per block, in prompt order.
    pub block_hashes: Vec<BlockHash>,
    /// The hash of the block the first one chains onto; `None` at the start of a prompt.
    pub parent_block_hash: Option<BlockHash>,
    /// The blocks' tokens, `block_hashes.len() * block_size` of them.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// Deprecated by vLLM in favour of `lora_name`; still sent (nil).
    pub lora_id: Option<i64>,
    /// Where the blocks live (`"GPU"` for the engine's own cache).
    pub medium: Option<String>,
    /// The LoRA adapter's name, if any.
    pub lora_name: Option<String>,
    /// One entry per block: `None` when the block has no extra keys.
    pub extra_keys: Option<Vec<Option<ExtraKeys>>>,
    /// The KV cache group (hybrid models have several).
    pub group_idx: Option<i64>,
    /// The group's cache spec (`"full_attention"`, `"sliding_window"`, ...).
    pub kv_cache_spec_kind: Option<String>,
    /// The sliding window, for sliding-window groups.
    pub kv_cache_spec_sliding_window: Option<i64>,
}

impl BlockStored {
    /// A store event with the values vLLM 0.32 sends for plain text in a single-group model:
    /// medium GPU, no LoRA, nil extra keys per block, group 0, full attention.
    pub fn new(
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: u32,
    ) -> Self {
        let n = block_hashes.len();
        Self {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id: None,
            medium: Some(MEDIUM_GPU.to_owned()),
            lora_name: None,
            extra_keys: Some(vec![None; n]),
            group_idx: Some(0),
            kv_cache_spec_kind: Some(SPEC_FULL_ATTENTION.to_owned()),
            kv_cache_spec_sliding_window: None,
        }
    }
}

impl BlockStored {
    /// Marks the blocks as stored for LoRA adapter `name` (vLLM's `lora_int_id` `id`):
    /// `lora_id`, `lora_name` and each block's extra keys `(name,)`, as vLLM's block pool
    /// sends them.
    pub fn set_lora(&mut self, name: &str, id: i64) {
        self.lora_id = Some(id);
        self.lora_name = Some(name.to_owned());
        self.extra_keys = Some(vec![Some(ExtraKeys::lora(name)); self.block_hashes.len()]);
    }
}

/// Blocks evicted from the cache (one event per eviction step, not when a request ends).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    /// The evicted blocks' hashes.
    pub block_hashes: Vec<BlockHash>,
    /// Where they lived.
    pub medium: Option<String>,
    /// Their KV cache group.
    pub group_idx: Option<i64>,
}

impl BlockRemoved {
    /// A removal as vLLM 0.32 sends it for a single-group model (medium GPU, group 0).
    pub fn new(block_hashes: Vec<BlockHash>) -> Self {
        Self {
            block_hashes,
            medium: Some(MEDIUM_GPU.to_owned()),
            group_idx: Some(0),
        }
    }
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks became cached.
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The whole prefix cache was reset.
    AllBlocksCleared,
}

impl KvEvent {
    /// vLLM's tag for the event (`"BlockStored"`, `"BlockRemoved"`, `"AllBlocksCleared"`), also
    /// a closed set for metric labels.
    pub fn tag(&self) -> &'static str {
        match self {
            KvEvent::BlockStored(_) => "BlockStored",
            KvEvent::BlockRemoved(_) => "BlockRemoved",
            KvEvent::AllBlocksCleared => "AllBlocksCleared",
        }
    }
}

/// One published batch: the events of one scheduler step, in order (a removal may precede a
/// store in the same batch, and order matters).
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Wall-clock time of publication, seconds since the Unix epoch.
    pub ts: f64,
    /// The events.
    pub events: Vec<KvEvent>,
    /// The publishing engine's data-parallel rank.
    pub data_parallel_rank: Option<i64>,
}

/// The 8-byte big-endian sequence frame for `seq`.
pub fn encode_seq(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

/// Reads a sequence frame; [`END_SEQ`] marks the end of a replay.
pub fn decode_seq(frame: &[u8]) -> Result<u64, DecodeError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| DecodeError::SeqLen(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

// ---------------------------------------------------------------------------------------------
// Encoder

/// Encodes a batch as vLLM does.
pub fn encode_batch(batch: &EventBatch) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + batch.events.len() * 64);
    encode_batch_into(batch, &mut out);
    out
}

/// Encodes a batch as vLLM does, appending to `out` (to reuse one buffer per publisher).
pub fn encode_batch_into(batch: &EventBatch, out: &mut Vec<u8>) {
    write::array_len(
        out,
        if batch.data_parallel_rank.is_some() {
            3
        } else {
            2
        },
    );
    write::f64(out, batch.ts);
    write::array_len(out, batch.events.len());
    for event in &batch.events {
        encode_event(event, out);
    }
    if let Some(rank) = batch.data_parallel_rank {
        write::int(out, rank);
    }
}

fn opt_str(out: &mut Vec<u8>, v: Option<&str>) {
    match v {
        Some(s) => write::str(out, s),
        None => write::nil(out),
    }
}

fn opt_int(out: &mut Vec<u8>, v: Option<i64>) {
    match v {
        Some(i) => write::int(out, i),
        None => write::nil(out),
    }
}

fn hashes(out: &mut Vec<u8>, hs: &[BlockHash]) {
    write::array_len(out, hs.len());
    for h in hs {
        h.write(out);
    }
}

fn encode_event(event: &KvEvent, out: &mut Vec<u8>) {
    match event {
        KvEvent::BlockStored(e) => {
            let optional = usize::from(e.extra_keys.is_some())
                + usize::from(e.group_idx.is_some())
                + usize::from(e.kv_cache_spec_kind.is_some())
                + usize::from(e.kv_cache_spec_sliding_window.is_some());
            write::map_len(out, 8 + optional);
            write::str(out, "type");
            write::str(out, event.tag());
            write::str(out, "block_hashes");
            hashes(out, &e.block_hashes);
            write::str(out, "parent_block_hash");
            match &e.parent_block_hash {
                Some(h) => h.write(out),
                None => write::nil(out),
            }
            write::str(out, "token_ids");
            write::array_len(out, e.token_ids.len());
            for &t in &e.token_ids {
                write::uint(out, u64::from(t));
            }
            write::str(out, "block_size");
            write::uint(out, u64::from(e.block_size));
            write::str(out, "lora_id");
            opt_int(out, e.lora_id);
            write::str(out, "medium");
            opt_str(out, e.medium.as_deref());
            write::str(out, "lora_name");
            opt_str(out, e.lora_name.as_deref());
            if let Some(keys) = &e.extra_keys {
                write::str(out, "extra_keys");
                write::array_len(out, keys.len());
                for k in keys {
                    match k {
                        Some(ExtraKeys(raw)) => out.extend_from_slice(raw),
                        None => write::nil(out),
                    }
                }
            }
            if let Some(g) = e.group_idx {
                write::str(out, "group_idx");
                write::int(out, g);
            }
            if let Some(kind) = &e.kv_cache_spec_kind {
                write::str(out, "kv_cache_spec_kind");
                write::str(out, kind);
            }
            if let Some(w) = e.kv_cache_spec_sliding_window {
                write::str(out, "kv_cache_spec_sliding_window");
                write::int(out, w);
            }
        }
        KvEvent::BlockRemoved(e) => {
            write::map_len(out, 3 + usize::from(e.group_idx.is_some()));
            write::str(out, "type");
            write::str(out, event.tag());
            write::str(out, "block_hashes");
            hashes(out, &e.block_hashes);
            write::str(out, "medium");
            opt_str(out, e.medium.as_deref());
            if let Some(g) = e.group_idx {
                write::str(out, "group_idx");
                write::int(out, g);
            }
        }
        KvEvent::AllBlocksCleared => {
            write::map_len(out, 1);
            write::str(out, "type");
            write::str(out, event.tag());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Decoder

/// Decodes one payload (frame 3). Unknown event types are skipped; anything malformed is an
/// error for the whole batch, since applying half a scheduler step would leave the index wrong
/// in ways nobody could see (the caller treats it like a lost batch).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut r = Reader::new(payload);
    let batch = match r.head()? {
        Head::Array(n) if n >= 2 => {
            let ts = number(&mut r, "ts")?;
            let events = events(&mut r)?;
            let data_parallel_rank = if n >= 3 {
                opt_i64(&mut r, "data_parallel_rank")?
            } else {
                None
            };
            for _ in 3..n {
                r.skip()?;
            }
            EventBatch {
                ts,
                events,
                data_parallel_rank,
            }
        }
        // msgspec writes a map for structs that are not `array_like`; accept it in case a
        // release changes that.
        Head::Map(n) => {
            let (mut ts, mut evs, mut rank) = (None, None, None);
            for _ in 0..n {
                match key(&mut r, "batch key")? {
                    b"ts" => ts = Some(number(&mut r, "ts")?),
                    b"events" => evs = Some(events(&mut r)?),
                    b"data_parallel_rank" => rank = opt_i64(&mut r, "data_parallel_rank")?,
                    _ => r.skip()?,
                }
            }
            EventBatch {
                ts: ts.ok_or(DecodeError::Missing {
                    event: "EventBatch",
                    field: "ts",
                })?,
                events: evs.ok_or(DecodeError::Missing {
                    event: "EventBatch",
                    field: "events",
                })?,
                data_parallel_rank: rank,
            }
        }
        other => return Err(type_err("batch", "array of 2 or 3, or map", other)),
    };
    match r.remaining() {
        0 => Ok(batch),
        n => Err(DecodeError::Trailing(n)),
    }
}

fn type_err(field: &'static str, expected: &'static str, found: Head<'_>) -> DecodeError {
    DecodeError::Type {
        field,
        expected,
        found: found.kind(),
    }
}

fn key<'a>(r: &mut Reader<'a>, field: &'static str) -> Result<&'a [u8], DecodeError> {
    match r.head()? {
        Head::Str(s) => Ok(s),
        other => Err(type_err(field, "str", other)),
    }
}

fn number(r: &mut Reader<'_>, field: &'static str) -> Result<f64, DecodeError> {
    match r.head()? {
        Head::Float(f) => Ok(f),
        Head::Uint(u) => Ok(u as f64),
        Head::Int(i) => Ok(i as f64),
        other => Err(type_err(field, "number", other)),
    }
}

fn opt_i64(r: &mut Reader<'_>, field: &'static str) -> Result<Option<i64>, DecodeError> {
    match r.head()? {
        Head::Nil => Ok(None),
        Head::Uint(u) => i64::try_from(u)
            .map(Some)
            .map_err(|_| DecodeError::Range(field)),
        Head::Int(i) => Ok(Some(i)),
        other => Err(type_err(field, "int or nil", other)),
    }
}

fn opt_string(r: &mut Reader<'_>, field: &'static str) -> Result<Option<String>, DecodeError> {
    match r.head()? {
        Head::Nil => Ok(None),
        Head::Str(s) => std::str::from_utf8(s)
            .map(|s| Some(s.to_owned()))
            .map_err(|_| DecodeError::Utf8(field)),
        other => Err(type_err(field, "str or nil", other)),
    }
}

fn hash_from(head: Head<'_>, field: &'static str) -> Result<BlockHash, DecodeError> {
    match head {
        Head::Uint(u) => Ok(BlockHash::Uint(u)),
        Head::Int(i) => Ok(BlockHash::Int(i)),
        Head::Bin(b) => Ok(BlockHash::Bytes(b.to_vec())),
        other => Err(type_err(field, "int or bin", other)),
    }
}

fn array_len(r: &mut Reader<'_>, field: &'static str) -> Result<usize, DecodeError> {
    match r.head()? {
        Head::Array(n) => Ok(n as usize),
        other => Err(type_err(field, "array", other)),
    }
}

fn hash_list(r: &mut Reader<'_>, field: &'static str) -> Result<Vec<BlockHash>, DecodeError> {
    let n = array_len(r, field)?;
    let mut out = Vec::with_capacity(n.min(r.remaining()));
    for _ in 0..n {
        out.push(hash_from(r.head()?, field)?);
    }
    Ok(out)
}

fn token_list(r: &mut Reader<'_>) -> Result<Vec<u32>, DecodeError> {
    let n = array_len(r, "token_ids")?;
    let mut out = Vec::with_capacity(n.min(r.remaining()));
    for _ in 0..n {
        match r.head()? {
            Head::Uint(u) => {
                out.push(u32::try_from(u).map_err(|_| DecodeError::Range("token_ids"))?)
            }
            Head::Int(_) => return Err(DecodeError::Range("token_ids")),
            other => return Err(type_err("token_ids", "int", other)),
        }
    }
    Ok(out)
}

fn extra_keys(r: &mut Reader<'_>) -> Result<Option<Vec<Option<ExtraKeys>>>, DecodeError> {
    let n = match r.head()? {
        Head::Nil => return Ok(None),
        Head::Array(n) => n as usize,
        other => return Err(type_err("extra_keys", "array or nil", other)),
    };
    let mut out = Vec::with_capacity(n.min(r.remaining()));
    for _ in 0..n {
        let raw = r.raw()?;
        out.push(if raw == [0xc0] {
            None
        } else {
            Some(ExtraKeys(raw.to_vec()))
        });
    }
    Ok(Some(out))
}

fn events(r: &mut Reader<'_>) -> Result<Vec<KvEvent>, DecodeError> {
    let n = array_len(r, "events")?;
    let mut out = Vec::with_capacity(n.min(r.remaining()));
    for _ in 0..n {
        if let Some(e) = event(r)? {
            out.push(e);
        }
    }
    Ok(out)
}

/// Every field either event type has; filled from a map by name or from a legacy array by
/// position, then checked per type.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<BlockHash>>,
    parent_block_hash: Option<BlockHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    extra_keys: Option<Vec<Option<ExtraKeys>>>,
    group_idx: Option<i64>,
    kv_cache_spec_kind: Option<String>,
    kv_cache_spec_sliding_window: Option<i64>,
}

/// Field order of vLLM's structs, which legacy positional arrays follow after the tag.
const STORED_ORDER: &[&[u8]] = &[
    b"block_hashes",
    b"parent_block_hash",
    b"token_ids",
    b"block_size",
    b"lora_id",
    b"medium",
    b"lora_name",
    b"extra_keys",
    b"group_idx",
    b"kv_cache_spec_kind",
    b"kv_cache_spec_sliding_window",
];
const REMOVED_ORDER: &[&[u8]] = &[b"block_hashes", b"medium", b"group_idx"];

impl Fields {
    /// Reads the value of field `name`; unknown names are skipped.
    fn read(&mut self, name: &[u8], r: &mut Reader<'_>) -> Result<(), DecodeError> {
        match name {
            b"block_hashes" => self.block_hashes = Some(hash_list(r, "block_hashes")?),
            b"parent_block_hash" => {
                self.parent_block_hash = match r.head()? {
                    Head::Nil => None,
                    h => Some(hash_from(h, "parent_block_hash")?),
                }
            }
            b"token_ids" => self.token_ids = Some(token_list(r)?),
            b"block_size" => {
                self.block_size = match r.head()? {
                    Head::Uint(u) => {
                        Some(u32::try_from(u).map_err(|_| DecodeError::Range("block_size"))?)
                    }
                    other => return Err(type_err("block_size", "unsigned int", other)),
                }
            }
            b"lora_id" => self.lora_id = opt_i64(r, "lora_id")?,
            b"medium" => self.medium = opt_string(r, "medium")?,
            b"lora_name" => self.lora_name = opt_string(r, "lora_name")?,
            b"extra_keys" => self.extra_keys = extra_keys(r)?,
            b"group_idx" => self.group_idx = opt_i64(r, "group_idx")?,
            b"kv_cache_spec_kind" => self.kv_cache_spec_kind = opt_string(r, "kv_cache_spec_kind")?,
            b"kv_cache_spec_sliding_window" => {
                self.kv_cache_spec_sliding_window = opt_i64(r, "kv_cache_spec_sliding_window")?
            }
            _ => r.skip()?,
        }
        Ok(())
    }

    fn build(self, tag: &[u8]) -> Result<Option<KvEvent>, DecodeError> {
        Ok(Some(match tag {
            b"BlockStored" => {
                const E: &str = "BlockStored";
                KvEvent::BlockStored(BlockStored {
                    block_hashes: self.block_hashes.ok_or(DecodeError::Missing {
                        event: E,
                        field: "block_hashes",
                    })?,
                    parent_block_hash: self.parent_block_hash,
                    token_ids: self.token_ids.ok_or(DecodeError::Missing {
                        event: E,
                        field: "token_ids",
                    })?,
                    block_size: self.block_size.ok_or(DecodeError::Missing {
                        event: E,
                        field: "block_size",
                    })?,
                    lora_id: self.lora_id,
                    medium: self.medium,
                    lora_name: self.lora_name,
                    extra_keys: self.extra_keys,
                    group_idx: self.group_idx,
                    kv_cache_spec_kind: self.kv_cache_spec_kind,
                    kv_cache_spec_sliding_window: self.kv_cache_spec_sliding_window,
                })
            }
            b"BlockRemoved" => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: self.block_hashes.ok_or(DecodeError::Missing {
                    event: "BlockRemoved",
                    field: "block_hashes",
                })?,
                medium: self.medium,
                group_idx: self.group_idx,
            }),
            b"AllBlocksCleared" => KvEvent::AllBlocksCleared,
            _ => return Ok(None),
        }))
    }
}

/// One event, or `None` for a type this crate does not know (skipped whole).
fn event(r: &mut Reader<'_>) -> Result<Option<KvEvent>, DecodeError> {
    let mut fields = Fields::default();
    match r.head()? {
        Head::Map(n) => {
            let mut tag: Option<&[u8]> = None;
            for _ in 0..n {
                let name = key(r, "event key")?;
                if name == b"type" {
                    tag = Some(key(r, "type")?);
                } else {
                    fields.read(name, r)?;
                }
            }
            let tag = tag.ok_or(DecodeError::Missing {
                event: "event",
                field: "type",
            })?;
            fields.build(tag)
        }
        Head::Array(0) => Err(DecodeError::Missing {
            event: "event",
            field: "type",
        }),
        Head::Array(n) => {
            let tag = key(r, "type")?;
            let order = match tag {
                b"BlockStored" => STORED_ORDER,
                b"BlockRemoved" => REMOVED_ORDER,
                _ => &[],
            };
            for i in 1..n as usize {
                match order.get(i - 1) {
                    Some(name) => fields.read(name, r)?,
                    None => r.skip()?,
                }
            }
            fields.build(tag)
        }
        other => Err(type_err("event", "map or array", other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> BlockStored {
        BlockStored::new(
            vec![BlockHash::Uint(u64::MAX), BlockHash::Uint(7)],
            Some(BlockHash::Uint(3)),
            (0..8).collect(),
            4,
        )
    }

    #[test]
    fn roundtrip_every_event_kind_and_hash_form() {
        let mut bytes_hash = stored();
        bytes_hash.block_hashes = vec![BlockHash::Bytes(vec![9; 32]), BlockHash::Int(-5)];
        bytes_hash.extra_keys = Some(vec![
            None,
            Some(ExtraKeys(vec![0x92, 0xa4, b'l', b'o', b'r', b'a', 0x01])),
        ]);
        bytes_hash.kv_cache_spec_sliding_window = Some(128);
        let batch = EventBatch {
            ts: 1.5,
            events: vec![
                KvEvent::BlockStored(stored()),
                KvEvent::BlockRemoved(BlockRemoved::new(vec![BlockHash::Uint(7)])),
                KvEvent::BlockStored(bytes_hash),
                KvEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(2),
        };
        assert_eq!(decode_batch(&encode_batch(&batch)), Ok(batch.clone()));
        let no_rank = EventBatch {
            data_parallel_rank: None,
            ..batch
        };
        let enc = encode_batch(&no_rank);
        assert_eq!(enc[0], 0x92, "a batch without rank is a 2-array");
        assert_eq!(decode_batch(&enc), Ok(no_rank));
    }

    #[test]
    fn legacy_arrays_and_unknown_types_and_keys() {
        // [ts, [["BlockStored", [1], nil, [5,6], 2, nil, "GPU", <unknown trailing>],
        //       ["Future", 1], {"type":"BlockRemoved","block_hashes":[1],"new":{}}]]
        let mut p = vec![0x92, 0xcb];
        p.extend_from_slice(&2.0f64.to_be_bytes());
        p.push(0x93);
        p.extend_from_slice(&[0x98, 0xab]);
        p.extend_from_slice(b"BlockStored");
        p.extend_from_slice(&[
            0x91, 0x01, 0xc0, 0x92, 0x05, 0x06, 0x02, 0xc0, 0xa3, b'G', b'P', b'U', 0xc0,
        ]);
        p.extend_from_slice(&[0x92, 0xa6]);
        p.extend_from_slice(b"Future");
        p.push(0x01);
        p.extend_from_slice(&[0x83, 0xa4]);
        p.extend_from_slice(b"type");
        p.push(0xac);
        p.extend_from_slice(b"BlockRemoved");
        p.push(0xac);
        p.extend_from_slice(b"block_hashes");
        p.extend_from_slice(&[0x91, 0x01, 0xa3, b'n', b'e', b'w', 0x80]);
        let b = decode_batch(&p).expect("decodes");
        assert_eq!(b.events.len(), 2, "the unknown event type is skipped");
        let KvEvent::BlockStored(s) = &b.events[0] else {
            panic!("stored first")
        };
        assert_eq!(
            (s.token_ids.as_slice(), s.block_size, s.medium.as_deref()),
            (&[5, 6][..], 2, Some("GPU"))
        );
        assert_eq!(
            s.extra_keys, None,
            "the nil after medium is lora_name; extra_keys absent"
        );
        assert_eq!(
            b.events[1],
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![1.into()],
                medium: None,
                group_idx: None
            })
        );
    }

    #[test]
    fn malformed_payloads_are_errors() {
        assert_eq!(decode_batch(&[]), Err(DecodeError::Truncated));
        assert!(matches!(
            decode_batch(&[0x91, 0x00]),
            Err(DecodeError::Type { field: "batch", .. })
        ));
        // Token id above u32.
        let mut s = stored();
        s.token_ids = vec![1];
        let mut enc = encode_batch(&EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(s)],
            data_parallel_rank: None,
        });
        let pos = enc.iter().rposition(|&b| b == 0x01).expect("token");
        enc.splice(pos..=pos, [0xcf, 1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(decode_batch(&enc), Err(DecodeError::Range("token_ids")));
        let mut ok = encode_batch(&EventBatch {
            ts: 0.0,
            events: vec![],
            data_parallel_rank: None,
        });
        ok.push(0);
        assert_eq!(decode_batch(&ok), Err(DecodeError::Trailing(1)));
    }

    #[test]
    fn seq_frames() {
        assert_eq!(decode_seq(&encode_seq(0x5b)), Ok(0x5b));
        assert_eq!(decode_seq(&[0xff; 8]), Ok(END_SEQ));
        assert_eq!(decode_seq(&[0; 4]), Err(DecodeError::SeqLen(4)));
    }

    #[test]
    fn hash_identity_matches_vllm_int_mode() {
        let mut digest = vec![0u8; 24];
        digest.extend_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        assert_eq!(BlockHash::Bytes(digest).as_u64(), 0x0102_0304_0506_0708);
        assert_eq!(BlockHash::Bytes(vec![1, 2]).as_u64(), 0x0102);
        assert_eq!(BlockHash::Int(-1).as_u64(), u64::MAX);
    }

    #[test]
    fn lora_extra_keys_are_the_name_tuple_and_round_trip() {
        assert_eq!(ExtraKeys::lora("ad").0, [0x91, 0xa2, b'a', b'd']);
        let mut stored = BlockStored::new(
            vec![BlockHash::Uint(1), BlockHash::Uint(2)],
            None,
            vec![0; 8],
            4,
        );
        stored.set_lora("ad", 3);
        assert_eq!(stored.lora_id, Some(3));
        let batch = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(stored.clone())],
            data_parallel_rank: None,
        };
        let back = decode_batch(&encode_batch(&batch)).unwrap();
        assert_eq!(back.events, [KvEvent::BlockStored(stored)]);
    }
}
