//! Production traces in the Mooncake format, replayed open loop at their recorded times.
//!
//! One request a line (JSON): `timestamp` (ms from the start of the trace), `input_length` and
//! `output_length` (tokens) and `hash_ids`, one id per 512-token block of the prompt, chained:
//! two requests share a prefix exactly as far as their leading ids agree. A file may be gzipped
//! (recognised by its magic bytes, whatever its name).
//!
//! A request's prompt is text built from its ids in pdsim's word-token model (BOS, then one token
//! per whitespace-separated word): trace block `j` covers tokens `512 j .. 512 (j + 1)`, so the
//! first block is BOS plus 511 words and every later block 512 words. A block's words depend only
//! on its id and position class (first or not) and the seed, so equal ids give byte-identical
//! text, hence equal token blocks in pdsim, and every pdsim block size dividing 512 cuts each
//! trace block into whole blocks. The text is cut to `input_length` tokens. Ids missing at the
//! end of a line (fewer ids than its length needs) are filled with words unique to the request.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::BenchError;
use crate::trace::{LimitedOracle, Oracle, WORDS, pinned_lru_reuse};

/// Tokens per trace block (the format's fixed block size).
pub const TRACE_BLOCK: usize = 512;

/// One request of a trace file.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct TraceRequest {
    /// Arrival, milliseconds from the start of the trace.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Output tokens (`max_tokens`, with `ignore_eos`).
    pub output_length: u32,
    /// One id per 512-token block of the prompt.
    #[serde(default)]
    pub hash_ids: Vec<u64>,
}

impl TraceRequest {
    /// The prompt text of this request (`index` is its place in the file: it makes the filler
    /// of missing ids unique to the request).
    pub fn prompt(&self, seed: u64, index: usize) -> String {
        let words = self.input_length.saturating_sub(1).max(1) as usize;
        let mut out = String::with_capacity(words * 5);
        let mut left = words;
        let mut block = 0usize;
        while left > 0 {
            let in_block = if block == 0 {
                TRACE_BLOCK - 1
            } else {
                TRACE_BLOCK
            };
            let take = in_block.min(left);
            match self.hash_ids.get(block) {
                Some(&id) => block_words(&mut out, seed, id, block == 0, take),
                None => filler_words(&mut out, index, block, take),
            }
            left -= take;
            block += 1;
        }
        out
    }

    /// Prompt tokens in pdsim's model (BOS plus the words of [`TraceRequest::prompt`]).
    pub fn prompt_tokens(&self) -> u64 {
        u64::from(self.input_length.max(2))
    }
}

fn push_word(out: &mut String, w: &str) {
    if !out.is_empty() {
        out.push(' ');
    }
    out.push_str(w);
}

/// The first `take` words of block `id`: a tag word naming the id, then seeded common words.
fn block_words(out: &mut String, seed: u64, id: u64, first: bool, take: usize) {
    let mut rng = SmallRng::seed_from_u64(
        seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)
            ^ id.wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
            ^ u64::from(first),
    );
    if !out.is_empty() {
        out.push(' ');
    }
    let _ = write!(out, "h{id}");
    for _ in 1..take {
        push_word(out, WORDS[rng.random_range(0..WORDS.len())]);
    }
}

/// Words no other request has (for lines with fewer ids than their length needs).
fn filler_words(out: &mut String, index: usize, block: usize, take: usize) {
    if !out.is_empty() {
        out.push(' ');
    }
    let _ = write!(out, "u{index}b{block}");
    for _ in 1..take {
        push_word(out, "z");
    }
}

/// A trace file, in arrival order.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    /// Where it was read from.
    pub path: String,
    /// The requests, sorted by timestamp (stable: equal times keep the file's order).
    pub requests: Vec<TraceRequest>,
}

impl Trace {
    /// Reads a trace file, gzipped or not.
    pub fn load(path: &Path) -> Result<Self, BenchError> {
        let bad = |why: String| BenchError::Config(format!("trace {}: {why}", path.display()));
        let file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
        let mut reader = BufReader::new(file);
        let gzipped = reader
            .fill_buf()
            .map_err(|e| bad(e.to_string()))?
            .starts_with(&[0x1f, 0x8b]);
        let text: Box<dyn Read> = if gzipped {
            Box::new(flate2::read::MultiGzDecoder::new(reader))
        } else {
            Box::new(reader)
        };
        let requests = parse(BufReader::new(text)).map_err(bad)?;
        Ok(Trace {
            path: path.display().to_string(),
            requests,
        })
    }

    /// Seconds from the first arrival to the last.
    pub fn span_s(&self) -> f64 {
        match (self.requests.first(), self.requests.last()) {
            (Some(a), Some(b)) => b.timestamp.saturating_sub(a.timestamp) as f64 / 1000.0,
            _ => 0.0,
        }
    }
}

/// Parses JSON lines (blank lines skipped) and sorts them by timestamp.
pub fn parse(input: impl BufRead) -> Result<Vec<TraceRequest>, String> {
    let mut out = Vec::new();
    for (i, line) in input.lines().enumerate() {
        let line = line.map_err(|e| format!("line {}: {e}", i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let r: TraceRequest =
            serde_json::from_str(&line).map_err(|e| format!("line {}: {e}", i + 1))?;
        if r.input_length == 0 {
            return Err(format!("line {}: input_length is 0", i + 1));
        }
        out.push(r);
    }
    if out.is_empty() {
        return Err("no requests".into());
    }
    out.sort_by_key(|r| r.timestamp);
    Ok(out)
}

/// The trace's own bound on the prefix-cache hit share: the oracle.
///
/// Infinite cache: a request reuses its leading ids already seen in an earlier request, 512
/// tokens each, capped at its length (the definition the fixtures' README gives). Limited
/// (`engines`, `cache_blocks` blocks of `block` tokens per engine): requests are pinned to
/// engines by their first id (a prefix tree stays on one engine; greedy static assignment,
/// largest working set first) and each engine is an LRU of `cache_blocks * block / 512` trace
/// blocks.
pub fn oracle(requests: &[TraceRequest], block: usize, limit: Option<(usize, usize)>) -> Oracle {
    let prompt_tokens: u64 = requests.iter().map(|r| u64::from(r.input_length)).sum();
    let reuse =
        |r: &TraceRequest, k: usize| (k as u64 * TRACE_BLOCK as u64).min(r.input_length.into());
    let mut seen = HashSet::new();
    let mut reusable = 0u64;
    for r in requests {
        let k = r.hash_ids.iter().take_while(|h| seen.contains(*h)).count();
        reusable += reuse(r, k);
        seen.extend(r.hash_ids.iter().copied());
    }
    let share = |a: u64| {
        if prompt_tokens == 0 {
            0.0
        } else {
            a as f64 / prompt_tokens as f64
        }
    };
    let limited = limit.map(|(engines, cache_blocks)| {
        let engines = engines.max(1);
        let trace_blocks = cache_blocks.saturating_mul(block.max(1)) / TRACE_BLOCK;
        let groups: Vec<u64> = requests
            .iter()
            .map(|r| r.hash_ids.first().copied().unwrap_or(u64::MAX))
            .collect();
        let hashes: Vec<Vec<u64>> = requests.iter().map(|r| r.hash_ids.clone()).collect();
        let reusable_tokens = pinned_lru_reuse(
            &groups,
            &hashes,
            engines,
            trace_blocks,
            |i| hashes[i].len(),
            |i, k| reuse(&requests[i], k),
        );
        LimitedOracle {
            engines,
            cache_blocks,
            reusable_tokens,
            hit_share: share(reusable_tokens),
        }
    });
    Oracle {
        block_size: TRACE_BLOCK,
        prompt_tokens,
        reusable_tokens: reusable,
        hit_share: share(reusable),
        limited,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ts: u64, len: u32, ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp: ts,
            input_length: len,
            output_length: 4,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn equal_ids_give_equal_text_cut_to_length() {
        let a = req(0, 1200, &[7, 8, 9]);
        let b = req(5, 700, &[7, 3]);
        let (ta, tb) = (a.prompt(1, 0), b.prompt(1, 1));
        let wa: Vec<&str> = ta.split_whitespace().collect();
        let wb: Vec<&str> = tb.split_whitespace().collect();
        // BOS + words = input_length tokens.
        assert_eq!(wa.len(), 1199);
        assert_eq!(wb.len(), 699);
        // The first trace block (BOS + 511 words) is shared word for word; the second is not.
        assert_eq!(wa[..511], wb[..511]);
        assert_eq!(wa[511], "h8");
        assert_eq!(wb[511], "h3");
        assert_ne!(wa[512..699], wb[512..699]);
        // Deterministic for a seed, different for another.
        assert_eq!(a.prompt(1, 0), ta);
        assert_ne!(a.prompt(2, 0), ta);
        // A block's text does not depend on where the request cuts it.
        let c = req(9, 900, &[7, 8]);
        assert!(ta.starts_with(&c.prompt(1, 2)));
    }

    #[test]
    fn missing_ids_are_filled_with_words_of_the_request() {
        let r = req(0, 600, &[1]);
        let t = r.prompt(1, 4);
        let w: Vec<&str> = t.split_whitespace().collect();
        assert_eq!(w.len(), 599);
        assert_eq!(w[511], "u4b1");
        assert_eq!(req(0, 1, &[]).prompt(1, 0).split_whitespace().count(), 1);
    }

    #[test]
    fn parses_sorts_and_refuses_bad_lines() {
        let text = "{\"timestamp\": 30, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1]}\n\n\
                    {\"timestamp\": 10, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [2, 3], \"extra\": 1}\n";
        let r = parse(text.as_bytes()).expect("parses");
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].timestamp, 10);
        assert_eq!(r[0].hash_ids, [2, 3]);
        let e = parse("{\"timestamp\": 1}\n".as_bytes()).expect_err("missing fields");
        assert!(e.starts_with("line 1:"), "{e}");
        let e = parse("{\"timestamp\":1,\"input_length\":0,\"output_length\":1}".as_bytes())
            .expect_err("empty prompt");
        assert!(e.contains("input_length"), "{e}");
        assert!(parse("".as_bytes()).is_err());
    }

    #[test]
    fn oracle_by_hand() {
        // r0 [1 2 3] 1500 tokens: nothing seen. r1 [1 2 4] 1100: 2 leading ids seen -> 1024.
        // r2 [1] 300: 1 id seen, capped at its length -> 300. r3 [5 2] 1024: first id new -> 0.
        let t = [
            req(0, 1500, &[1, 2, 3]),
            req(1, 1100, &[1, 2, 4]),
            req(2, 300, &[1]),
            req(3, 1024, &[5, 2]),
        ];
        let o = oracle(&t, 16, None);
        assert_eq!(o.prompt_tokens, 3924);
        assert_eq!(o.reusable_tokens, 1324);
        assert_eq!(o.block_size, 512);
        // One engine holding 2 trace blocks (64 blocks of 16 tokens): r0 leaves [1 2] (its
        // deepest block, 3, is evicted first), so r1 reuses 1024; r1 leaves [1 2] again (4
        // evicted), r2 reuses 300; r3 evicts 1 and 2 by its own.
        let l = oracle(&t, 16, Some((1, 64))).limited.expect("limited");
        assert_eq!(l.reusable_tokens, 1324);
        // One trace block: r0 keeps only [1]; r1 reuses 512, then keeps [1]; r2 reuses 300.
        let l = oracle(&t, 16, Some((1, 32))).limited.expect("limited");
        assert_eq!(l.reusable_tokens, 812);
        // Two engines: groups by first id (1 and 5) land on different engines.
        let l = oracle(&t, 16, Some((2, 32))).limited.expect("limited");
        assert_eq!(l.reusable_tokens, 812);
    }
}
