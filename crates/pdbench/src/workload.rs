//! Request bodies: what a client sends, and the two PD legs of direct mode.
//!
//! Bodies are written straight into a buffer (no JSON tree) so that the load generator spends
//! its CPU on the network, not on serialisation. A prompt of `n` words is `r<id>` followed by
//! `n - 1` copies of `x`; the leading id keeps prompts distinct between requests.

use std::fmt::Write as _;

use bytes::Bytes;
use serde::Serialize;

pub use crate::api::Api;
use crate::trace::Prompt;

/// What a request's prompt is: the synthetic words, or a trace prompt.
#[derive(Clone, Copy, Debug)]
pub enum Input<'a> {
    /// Synthetic `r<id> x x ...` (ASCII, written without escaping).
    Words(&'a str),
    /// A trace prompt (escaped as JSON).
    Trace(&'a Prompt),
}

fn push_json_str(out: &mut String, s: &str) {
    if s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b' ') {
        out.push('"');
        out.push_str(s);
        out.push('"');
    } else {
        out.push_str(&serde_json::to_string(s).unwrap_or_else(|_| String::from("\"\"")));
    }
}

/// KV-transfer connector used by direct mode to shape the two legs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum DirectConnector {
    /// vLLM NixlConnector wire format: `kv_transfer_params` out of the prefill, into the decode.
    Shfs,
    /// Neuron style: the whole prefill response under `disagg_prefill_resp` in the decode body.
    Nixl,
}

/// The `kv_transfer_params` a shfs prefill leg carries (contracts §3).
const SHFS_PREFILL_PARAMS: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// Builds request bodies for one run.
#[derive(Debug, Clone)]
pub struct Bodies {
    api: Api,
    stream: bool,
    model_json: String,
    /// `" x x x ..."`, sliced to make prompts without allocating per word.
    pad: String,
}

impl Bodies {
    /// Bodies for `api`, `model`, streaming or not, with prompts up to `max_prompt` words.
    pub fn new(api: Api, model: &str, stream: bool, max_prompt: u32) -> Self {
        let model_json = serde_json::to_string(model).unwrap_or_else(|_| String::from("\"pdsim\""));
        Bodies {
            api,
            stream,
            model_json,
            pad: " x".repeat(max_prompt.saturating_sub(1) as usize),
        }
    }

    /// The API these bodies are for.
    pub fn api(&self) -> Api {
        self.api
    }

    /// The prompt of request `id`: exactly `words` whitespace-separated words (at least one).
    pub fn prompt(&self, id: u64, words: u32) -> String {
        let extra = (words.saturating_sub(1) as usize * 2).min(self.pad.len());
        let mut p = String::with_capacity(24 + extra);
        let _ = write!(p, "r{id}");
        p.push_str(&self.pad[..extra]);
        p
    }

    fn open_input(&self, out: &mut String, input: Input<'_>) {
        let msgs = match input {
            Input::Words(w) => return self.open(out, w),
            Input::Trace(Prompt::Text(t)) => {
                out.push_str("{\"model\":");
                out.push_str(&self.model_json);
                out.push_str(",\"prompt\":");
                push_json_str(out, t);
                return;
            }
            Input::Trace(Prompt::Chat(m)) => m,
        };
        out.push_str("{\"model\":");
        out.push_str(&self.model_json);
        out.push_str(",\"messages\":[");
        for (i, (role, content)) in msgs.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let _ = write!(out, "{{\"role\":\"{role}\",\"content\":");
            push_json_str(out, content);
            out.push('}');
        }
        out.push(']');
    }

    fn open(&self, out: &mut String, prompt: &str) {
        out.push_str("{\"model\":");
        out.push_str(&self.model_json);
        // Prompts are ASCII letters, digits and spaces: no JSON escaping needed.
        match self.api {
            Api::Completions => {
                out.push_str(",\"prompt\":\"");
                out.push_str(prompt);
                out.push('"');
            }
            Api::Chat => {
                out.push_str(",\"messages\":[{\"role\":\"user\",\"content\":\"");
                out.push_str(prompt);
                out.push_str("\"}]");
            }
        }
    }

    fn tail(&self, out: &mut String, max_tokens: u32) {
        let _ = write!(out, ",\"max_tokens\":{max_tokens},\"ignore_eos\":true");
        if self.stream {
            out.push_str(",\"stream\":true,\"stream_options\":{\"include_usage\":true}");
        } else {
            out.push_str(",\"stream\":false");
        }
    }

    /// What a client sends to a gateway (or a single engine).
    pub fn client(&self, prompt: &str, max_tokens: u32) -> Bytes {
        self.client_input(Input::Words(prompt), max_tokens)
    }

    /// [`Bodies::client`] for any input.
    pub fn client_input(&self, input: Input<'_>, max_tokens: u32) -> Bytes {
        let mut out = String::with_capacity(input_len(input) + 160);
        self.open_input(&mut out, input);
        self.tail(&mut out, max_tokens);
        out.push('}');
        Bytes::from(out)
    }

    /// The prefill leg of direct mode: one token, not streamed, asking for a remote decode.
    pub fn prefill(&self, prompt: &str, connector: DirectConnector) -> Bytes {
        self.prefill_input(Input::Words(prompt), connector)
    }

    /// [`Bodies::prefill`] for any input.
    pub fn prefill_input(&self, input: Input<'_>, connector: DirectConnector) -> Bytes {
        let mut out = String::with_capacity(input_len(input) + 300);
        self.open_input(&mut out, input);
        out.push_str(",\"max_tokens\":1");
        if self.api == Api::Chat {
            out.push_str(",\"max_completion_tokens\":1");
        }
        out.push_str(",\"ignore_eos\":true,\"stream\":false");
        if connector == DirectConnector::Shfs {
            out.push_str(",\"kv_transfer_params\":");
            out.push_str(SHFS_PREFILL_PARAMS);
        }
        out.push('}');
        Bytes::from(out)
    }

    /// The decode leg of direct mode: the client's body plus `key: raw_json`.
    pub fn decode(&self, prompt: &str, max_tokens: u32, key: &str, raw_json: &str) -> Bytes {
        self.decode_input(Input::Words(prompt), max_tokens, key, raw_json)
    }

    /// [`Bodies::decode`] for any input.
    pub fn decode_input(
        &self,
        input: Input<'_>,
        max_tokens: u32,
        key: &str,
        raw_json: &str,
    ) -> Bytes {
        let mut out = String::with_capacity(input_len(input) + raw_json.len() + 200);
        self.open_input(&mut out, input);
        self.tail(&mut out, max_tokens);
        out.push_str(",\"");
        out.push_str(key);
        out.push_str("\":");
        out.push_str(raw_json);
        out.push('}');
        Bytes::from(out)
    }
}

fn input_len(input: Input<'_>) -> usize {
    match input {
        Input::Words(w) => w.len(),
        Input::Trace(Prompt::Text(t)) => t.len() + 8,
        Input::Trace(Prompt::Chat(m)) => m.iter().map(|(_, c)| c.len() + 32).sum(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn json(b: &Bytes) -> Value {
        serde_json::from_slice(b).expect("valid JSON")
    }

    #[test]
    fn prompt_has_exact_word_count() {
        let b = Bodies::new(Api::Completions, "m", false, 50);
        assert_eq!(b.prompt(7, 1), "r7");
        assert_eq!(b.prompt(7, 4), "r7 x x x");
        assert_eq!(b.prompt(1, 50).split_whitespace().count(), 50);
        // Never longer than the pool allows.
        assert_eq!(b.prompt(1, 80).split_whitespace().count(), 50);
    }

    #[test]
    fn client_bodies_are_valid_openai_requests() {
        let b = Bodies::new(Api::Completions, "my \"model\"", true, 8);
        let v = json(&b.client(&b.prompt(1, 3), 16));
        assert_eq!(v["model"], "my \"model\"");
        assert_eq!(v["prompt"], "r1 x x");
        assert_eq!(v["max_tokens"], 16);
        assert_eq!(v["stream"], true);
        assert_eq!(v["stream_options"]["include_usage"], true);

        let c = Bodies::new(Api::Chat, "m", false, 8);
        let v = json(&c.client("hi", 4));
        assert_eq!(v["messages"][0]["role"], "user");
        assert_eq!(v["messages"][0]["content"], "hi");
        assert_eq!(v["stream"], false);
        assert!(v.get("stream_options").is_none());
    }

    #[test]
    fn shfs_prefill_leg_follows_the_contract() {
        let b = Bodies::new(Api::Chat, "m", true, 8);
        let v = json(&b.prefill("hi", DirectConnector::Shfs));
        assert_eq!(v["max_tokens"], 1);
        assert_eq!(v["max_completion_tokens"], 1);
        assert_eq!(v["stream"], false);
        assert!(v.get("stream_options").is_none());
        let kv = &v["kv_transfer_params"];
        assert_eq!(kv["do_remote_decode"], true);
        assert_eq!(kv["do_remote_prefill"], false);
        for k in [
            "remote_engine_id",
            "remote_block_ids",
            "remote_host",
            "remote_port",
        ] {
            assert!(kv[k].is_null(), "{k}");
        }
        let n = json(&b.prefill("hi", DirectConnector::Nixl));
        assert!(n.get("kv_transfer_params").is_none());
    }

    #[test]
    fn trace_prompts_are_escaped_json() {
        let b = Bodies::new(Api::Chat, "m", false, 8);
        let p = Prompt::Chat(vec![
            ("system", "be kind".into()),
            ("assistant", "say \"hi\"\n".into()),
        ]);
        let v = json(&b.client_input(Input::Trace(&p), 4));
        assert_eq!(v["messages"][0]["role"], "system");
        assert_eq!(v["messages"][1]["content"], "say \"hi\"\n");
        let t = Prompt::Text("a b c".into());
        let v = json(&b.prefill_input(Input::Trace(&t), DirectConnector::Shfs));
        assert_eq!(v["prompt"], "a b c");
        assert_eq!(v["kv_transfer_params"]["do_remote_decode"], true);
    }

    #[test]
    fn decode_leg_restores_stream_and_adds_params() {
        let b = Bodies::new(Api::Completions, "m", true, 8);
        let v = json(&b.decode("hi", 32, "kv_transfer_params", r#"{"a":[1,2]}"#));
        assert_eq!(v["stream"], true);
        assert_eq!(v["max_tokens"], 32);
        assert_eq!(v["kv_transfer_params"]["a"][1], 2);
    }
}
