//! Tokens and vLLM `sha256_cbor` block hashes of prompts, as pdcache computes them.
//!
//! `cargo run -p pdcache --example tokens -- TOKENIZER_JSON BLOCK_SIZE < requests.jsonl`
//!
//! Each input line is a JSON object with either `"prompt": "text"` (a completion prompt) or
//! `"messages": [...]` (a chat request, rendered with the generation prompt). Each output line is
//! `{"tokens": [...], "hashes": [...]}`, the hashes being the u64 values vLLM's KV events carry
//! for the prompt's full blocks. The real-engine check (tests/e2e/kv_events_check.py) compares
//! them with the engine's `/tokenize` and `BlockStored` events.

use std::io::{BufRead, Write};
use std::path::Path;
use std::process::ExitCode;

use pdcache::tokenizer::HfTokenizer;
use pdcache::vllm_hash::{BlockHasher, event_value};
use serde_json::{Value, json};

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [tokenizer, block_size] = args.as_slice() else {
        return Err("usage: tokens TOKENIZER_JSON BLOCK_SIZE < requests.jsonl".into());
    };
    let block_size: usize = block_size
        .parse()
        .map_err(|e| format!("block size {block_size:?}: {e}"))?;
    let tok = HfTokenizer::load(Path::new(tokenizer)).map_err(|e| e.to_string())?;
    let mut hasher = BlockHasher::default();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        if line.trim().is_empty() {
            continue;
        }
        let req: Value = serde_json::from_str(&line).map_err(|e| format!("{line:?}: {e}"))?;
        let tokens = if let Some(messages) = req.get("messages") {
            tok.encode_chat(messages, true)
        } else if let Some(prompt) = req.get("prompt").and_then(Value::as_str) {
            tok.encode_prompt(prompt)
        } else {
            return Err(format!("{line:?}: neither prompt nor messages"));
        }
        .map_err(|e| e.to_string())?;
        let hashes: Vec<u64> = hasher
            .chain(&tokens, block_size)
            .iter()
            .map(event_value)
            .collect();
        let reply = json!({ "tokens": tokens, "hashes": hashes });
        // One line per request and a flush, so a driving script can read replies in lockstep.
        writeln!(out, "{reply}").map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tokens: {e}");
            ExitCode::FAILURE
        }
    }
}
