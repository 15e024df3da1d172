//! Parsing and validating generation requests the way vLLM does.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::lora::{Adapters, Served};
use crate::mm::{self, MmItem};
use crate::tokens::{PromptTokens, Tok, Tokenizer};

/// Which OpenAI endpoint a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Completions,
    Chat,
    /// `/v1/responses` (OpenAI Responses API; vLLM renders it through the chat template).
    Responses,
    /// `/v1/messages` (Anthropic Messages API; vLLM runs it as a chat completion).
    Messages,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Responses => "/v1/responses",
            Endpoint::Messages => "/v1/messages",
        }
    }
}

/// Default `max_tokens` when the client sends none.
pub(crate) const DEFAULT_MAX_TOKENS: u32 = 16;

/// `stream_options` as vLLM checks it: on the raw object, where `{}` counts as absent.
#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
    /// Other keys (vLLM's `continuous_usage_stats`, ...): only whether there are any matters.
    #[serde(flatten)]
    other: std::collections::BTreeMap<String, serde::de::IgnoredAny>,
}

impl StreamOptions {
    /// Python's truthiness of the object: non-empty.
    fn is_set(&self) -> bool {
        self.include_usage.is_some() || !self.other.is_empty()
    }
}

#[derive(Deserialize)]
struct Wire<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    /// Responses API: the conversation (a string or a list of items) and the system text.
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    instructions: Option<&'a RawValue>,
    /// Messages API: the system text (a string or text blocks).
    #[serde(borrow, default)]
    system: Option<&'a RawValue>,
    /// Responses API's output bound (its `max_tokens` is not read).
    #[serde(default)]
    max_output_tokens: Option<i64>,
    #[serde(borrow, default)]
    stop_sequences: Option<&'a RawValue>,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    max_completion_tokens: Option<i64>,
    #[serde(default)]
    min_tokens: Option<i64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    n: Option<i64>,
    #[serde(borrow, default)]
    stop: Option<&'a RawValue>,
    #[serde(default)]
    kv_transfer_params: Option<Map<String, Value>>,
    #[serde(borrow, default)]
    disagg_prefill_resp: Option<&'a RawValue>,
    #[serde(default)]
    bootstrap_host: Option<Value>,
    #[serde(default)]
    bootstrap_port: Option<Value>,
    #[serde(default)]
    bootstrap_room: Option<Value>,
    #[serde(default)]
    rid: Option<String>,
    #[serde(default)]
    disaggregated_params: Option<Map<String, Value>>,
    #[serde(default)]
    ec_transfer_params: Option<Map<String, Value>>,
}

/// A validated generation request.
#[derive(Debug)]
pub(crate) struct GenRequest {
    pub prompt: PromptTokens,
    pub max_tokens: u32,
    pub min_tokens: u32,
    pub n: u32,
    pub stream: bool,
    pub include_usage: bool,
    pub stop: Vec<String>,
    pub kv_transfer_params: Option<Map<String, Value>>,
    /// Raw `disagg_prefill_resp` (Neuron nixl decode).
    pub disagg_prefill_resp: Option<Box<RawValue>>,
    pub bootstrap: Bootstrap,
    pub rid: Option<String>,
    /// TensorRT-LLM `disaggregated_params` (phase and transfer state).
    pub disaggregated_params: Option<Map<String, Value>>,
    /// The chat request's multimodal items (empty for other endpoints).
    pub mm: Vec<MmItem>,
    /// Encoder-cache transfer parameters, keyed by item hash (encoder disaggregation).
    pub ec_transfer_params: Option<Map<String, Value>>,
    /// The LoRA adapter the request's `model` names; `None` for the base model.
    pub lora: Served,
}

/// SGLang bootstrap fields as received (any of them may be missing or mistyped).
#[derive(Debug, Default)]
pub(crate) struct Bootstrap {
    pub host: Option<Value>,
    pub port: Option<Value>,
    pub room: Option<Value>,
}

impl Bootstrap {
    pub fn any(&self) -> bool {
        self.host.is_some() || self.port.is_some() || self.room.is_some()
    }
}

fn bad_json(e: &serde_json::Error) -> ApiError {
    ApiError::bad(format!("JSON decode error: {e}"))
}

/// Parses and validates `body` for `endpoint` against the served `model`, with the
/// deterministic tokenizer.
#[cfg(test)]
pub(crate) fn parse(endpoint: Endpoint, body: &[u8], model: &str) -> Result<GenRequest, ApiError> {
    parse_with(endpoint, body, (model, &Adapters::default()), &Tok::Words)
}

/// Parses and validates `body` for `endpoint` against the served base model and adapters.
pub(crate) fn parse_with(
    endpoint: Endpoint,
    body: &[u8],
    (model, adapters): (&str, &Adapters),
    tok: &Tok,
) -> Result<GenRequest, ApiError> {
    let w: Wire<'_> = serde_json::from_slice(body).map_err(|e| bad_json(&e))?;
    let lora = adapters.resolve(model, w.model.as_deref())?;
    let stream = w.stream.unwrap_or(false);
    if endpoint == Endpoint::Messages && w.max_tokens.is_none() {
        return Err(ApiError::BadRequest {
            message: "Field required: max_tokens".into(),
            param: Some("max_tokens"),
        });
    }
    if matches!(endpoint, Endpoint::Completions | Endpoint::Chat)
        && w.stream_options.as_ref().is_some_and(StreamOptions::is_set)
        && !stream
    {
        return Err(ApiError::BadRequest {
            message:
                "Stream options can only be defined when `stream=True`. (parameter=stream_options)"
                    .into(),
            param: Some("stream_options"),
        });
    }
    let include_usage = matches!(endpoint, Endpoint::Completions | Endpoint::Chat)
        && w.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);

    let prompt = match endpoint {
        Endpoint::Completions => tokenize_prompt(w.prompt, tok)?,
        Endpoint::Chat => tokenize_messages(w.messages, tok)?,
        Endpoint::Responses => {
            let messages = responses_messages(w.instructions, w.input)?;
            tokenize_messages(Some(&messages), tok)?
        }
        Endpoint::Messages => {
            let messages = anthropic_messages(w.system, w.messages)?;
            tokenize_messages(Some(&messages), tok)?
        }
    };

    let max = match endpoint {
        Endpoint::Completions | Endpoint::Messages => w.max_tokens,
        Endpoint::Chat => w.max_completion_tokens.or(w.max_tokens),
        Endpoint::Responses => w.max_output_tokens,
    };
    let max_tokens = match max {
        None => DEFAULT_MAX_TOKENS,
        Some(m) if m < 1 => {
            return Err(ApiError::BadRequest {
                message: format!("max_tokens must be at least 1, got {m}."),
                param: Some("max_tokens"),
            });
        }
        Some(m) => u32::try_from(m).unwrap_or(u32::MAX),
    };
    let min_tokens = match w.min_tokens {
        None => 0,
        Some(m) if m < 0 => {
            return Err(ApiError::BadRequest {
                message: format!("min_tokens must be greater than or equal to 0, got {m}."),
                param: Some("min_tokens"),
            });
        }
        Some(m) if m > i64::from(max_tokens) => {
            return Err(ApiError::BadRequest {
                message: format!(
                    "min_tokens must be less than or equal to max_tokens={max_tokens}, got {m}."
                ),
                param: Some("min_tokens"),
            });
        }
        Some(m) => u32::try_from(m).unwrap_or(0),
    };
    // Neither the Responses nor the Messages API has `n`.
    let n = match w
        .n
        .filter(|_| matches!(endpoint, Endpoint::Completions | Endpoint::Chat))
    {
        None => 1,
        Some(n) if !(1..=128).contains(&n) => {
            return Err(ApiError::BadRequest {
                message: format!("n must be between 1 and 128, got {n}."),
                param: Some("n"),
            });
        }
        Some(n) => u32::try_from(n).unwrap_or(1),
    };
    let stop_field = match endpoint {
        Endpoint::Messages => w.stop_sequences,
        _ => w.stop,
    };
    let stop = match stop_field {
        None => Vec::new(),
        Some(raw) => parse_stop(raw)?,
    };
    let disagg_prefill_resp = w.disagg_prefill_resp.map(|r| r.to_owned());
    let mm = match (endpoint, w.messages) {
        // Most chats have no media: the list is read again only when it may have some.
        (Endpoint::Chat, Some(raw)) if mm::PART_TYPES.iter().any(|t| raw.get().contains(t)) => {
            let messages: Value = serde_json::from_str(raw.get()).map_err(|e| bad_json(&e))?;
            mm::items(&messages).map_err(ApiError::bad)?
        }
        _ => Vec::new(),
    };
    Ok(GenRequest {
        lora,
        mm,
        ec_transfer_params: w.ec_transfer_params,
        prompt,
        max_tokens,
        min_tokens,
        n,
        stream,
        include_usage,
        stop,
        kv_transfer_params: w.kv_transfer_params,
        disagg_prefill_resp,
        bootstrap: Bootstrap {
            host: w.bootstrap_host,
            port: w.bootstrap_port,
            room: w.bootstrap_room,
        },
        rid: w.rid,
        disaggregated_params: w.disaggregated_params,
    })
}

/// A Responses API request as chat messages: `instructions` as the system message, then
/// `input` (a string is one user message; items with a role and content are messages).
fn responses_messages(
    instructions: Option<&RawValue>,
    input: Option<&RawValue>,
) -> Result<Box<RawValue>, ApiError> {
    let input = input.ok_or_else(|| ApiError::BadRequest {
        message: "Field required: input".into(),
        param: Some("input"),
    })?;
    let mut out: Vec<Value> = Vec::new();
    if let Some(i) = instructions.filter(|i| i.get() != "null") {
        out.push(serde_json::json!({"role": "system", "content": i}));
    }
    if input.get().starts_with('"') {
        out.push(serde_json::json!({"role": "user", "content": input}));
    } else {
        let items: Vec<Map<String, Value>> =
            serde_json::from_str(input.get()).map_err(|e| bad_json(&e))?;
        for item in items {
            match (item.get("role"), item.get("content")) {
                (Some(role), Some(content)) => {
                    out.push(serde_json::json!({"role": role, "content": content}));
                }
                _ => {
                    let text = Value::Object(item).to_string();
                    out.push(serde_json::json!({"role": "tool", "content": text}));
                }
            }
        }
    }
    to_raw(&out)
}

/// A Messages API request as chat messages: `system` first, then `messages`.
fn anthropic_messages(
    system: Option<&RawValue>,
    messages: Option<&RawValue>,
) -> Result<Box<RawValue>, ApiError> {
    let messages = messages.ok_or_else(|| ApiError::BadRequest {
        message: "Field required: messages".into(),
        param: Some("messages"),
    })?;
    let mut out: Vec<Value> = Vec::new();
    if let Some(s) = system.filter(|s| s.get() != "null") {
        out.push(serde_json::json!({"role": "system", "content": s}));
    }
    let rest: Vec<Value> = serde_json::from_str(messages.get()).map_err(|e| bad_json(&e))?;
    out.extend(rest);
    to_raw(&out)
}

fn to_raw(messages: &[Value]) -> Result<Box<RawValue>, ApiError> {
    serde_json::value::to_raw_value(messages).map_err(|e| bad_json(&e))
}

fn parse_stop(raw: &RawValue) -> Result<Vec<String>, ApiError> {
    let s = raw.get();
    if s == "null" {
        return Ok(Vec::new());
    }
    if s.starts_with('"') {
        let one: String = serde_json::from_str(s).map_err(|e| bad_json(&e))?;
        return Ok(vec![one]);
    }
    serde_json::from_str(s).map_err(|e| bad_json(&e))
}

fn missing_prompt() -> ApiError {
    ApiError::BadRequest {
        message: "Either prompt or prompt_embeds must be provided and non-empty.".into(),
        param: Some("prompt"),
    }
}

fn tokenizer_error(e: &pdcache::tokenizer::TokenizerError) -> ApiError {
    ApiError::bad(e.to_string())
}

/// Text through the engine's tokenizer.
fn text_tokens(text: &str, tok: &Tok) -> Result<PromptTokens, ApiError> {
    match tok {
        Tok::Words => {
            let mut t = Tokenizer::new();
            t.push_text(text);
            Ok(t.finish())
        }
        Tok::Hf(h) => {
            let ids = h.encode_prompt(text).map_err(|e| tokenizer_error(&e))?;
            Ok(id_tokens(&ids))
        }
    }
}

/// Token ids as given (the digest is over the ids, whatever the tokenizer).
fn id_tokens(ids: &[u32]) -> PromptTokens {
    let mut t = Tokenizer::empty();
    ids.iter().for_each(|&id| t.push_id(u64::from(id)));
    t.finish()
}

pub(crate) fn tokenize_prompt(raw: Option<&RawValue>, tok: &Tok) -> Result<PromptTokens, ApiError> {
    let raw = raw.ok_or_else(missing_prompt)?;
    let s = raw.get();
    let mut t = Tokenizer::new();
    if s.starts_with('"') {
        let text: Cow<'_, str> = serde_json::from_str(s).map_err(|e| bad_json(&e))?;
        if text.is_empty() {
            return Err(missing_prompt());
        }
        return text_tokens(&text, tok);
    }
    if s.starts_with('[') {
        if let Ok(ids) = serde_json::from_str::<Vec<u64>>(s) {
            if ids.is_empty() {
                return Err(missing_prompt());
            }
            if let Tok::Hf(_) = tok {
                // vLLM passes token-id prompts through untouched: no BOS added.
                t = Tokenizer::empty();
            }
            ids.into_iter().for_each(|id| t.push_id(id));
            return Ok(t.finish());
        }
        if let Ok(texts) = serde_json::from_str::<Vec<Cow<'_, str>>>(s) {
            return match texts.as_slice() {
                [one] if !one.is_empty() => text_tokens(one, tok),
                [_] | [] => Err(missing_prompt()),
                _ => Err(ApiError::BadRequest {
                    message:
                        "pdsim serves one prompt per request; batched prompts are not supported."
                            .into(),
                    param: Some("prompt"),
                }),
            };
        }
        if serde_json::from_str::<Vec<Vec<u64>>>(s).is_ok() {
            return Err(ApiError::BadRequest {
                message: "pdsim serves one prompt per request; batched prompts are not supported."
                    .into(),
                param: Some("prompt"),
            });
        }
    }
    Err(ApiError::BadRequest {
        message: "prompt must be a string, an array of strings or an array of token ids.".into(),
        param: Some("prompt"),
    })
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

pub(crate) fn tokenize_messages(
    raw: Option<&RawValue>,
    tok: &Tok,
) -> Result<PromptTokens, ApiError> {
    let raw = raw.ok_or_else(|| ApiError::BadRequest {
        message: "Field required: messages".into(),
        param: Some("messages"),
    })?;
    if let Tok::Hf(h) = tok {
        let messages: serde_json::Value =
            serde_json::from_str(raw.get()).map_err(|e| bad_json(&e))?;
        let ids = h
            .encode_chat(&messages, true)
            .map_err(|e| tokenizer_error(&e))?;
        return Ok(id_tokens(&ids));
    }
    let messages: Vec<Message<'_>> = serde_json::from_str(raw.get()).map_err(|e| bad_json(&e))?;
    let mut t = Tokenizer::new();
    for m in &messages {
        // A role marker token, like a chat template's header.
        t.push_text(&format!("<|{}|>", m.role));
        let Some(content) = m.content else { continue };
        let s = content.get();
        if s.starts_with('"') {
            let text: Cow<'_, str> = serde_json::from_str(s).map_err(|e| bad_json(&e))?;
            t.push_text(&text);
        } else if s.starts_with('[') {
            let parts: Vec<Part<'_>> = serde_json::from_str(s).map_err(|e| bad_json(&e))?;
            for p in parts.iter().filter_map(|p| p.text.as_deref()) {
                t.push_text(p);
            }
        }
    }
    // The generation prompt the template appends.
    t.push_text("<|assistant|>");
    Ok(t.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(endpoint: Endpoint, body: &str) -> ApiError {
        parse(endpoint, body.as_bytes(), "m").unwrap_err()
    }

    #[test]
    fn vllm_validation_errors() {
        let e = err(
            Endpoint::Completions,
            r#"{"prompt":"x","stream":false,"stream_options":{"include_usage":true}}"#,
        );
        assert_eq!(
            e.to_string(),
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)"
        );
        let e = err(
            Endpoint::Completions,
            r#"{"prompt":"x","max_tokens":2,"min_tokens":3}"#,
        );
        assert_eq!(e.status(), 400);
        assert!(e.to_string().contains("min_tokens"));
        let e = err(Endpoint::Completions, r#"{"model":"other","prompt":"x"}"#);
        assert_eq!(e.status(), 404);
        assert_eq!(err(Endpoint::Completions, r#"{"model":"m"}"#).status(), 400);
        assert_eq!(err(Endpoint::Chat, r#"{"model":"m"}"#).status(), 400);
        assert_eq!(err(Endpoint::Completions, "not json").status(), 400);
        assert_eq!(
            err(Endpoint::Completions, r#"{"prompt":"x","max_tokens":0}"#).status(),
            400
        );
    }

    #[test]
    fn accepts_prompt_shapes_and_chat() {
        let a = parse(Endpoint::Completions, br#"{"prompt":"a b c"}"#, "m").unwrap();
        assert_eq!(a.prompt.count, 4);
        assert_eq!(a.max_tokens, DEFAULT_MAX_TOKENS);
        let b = parse(
            Endpoint::Completions,
            br#"{"prompt":["a b c"],"max_tokens":3}"#,
            "m",
        )
        .unwrap();
        assert_eq!(b.prompt, a.prompt);
        let c = parse(Endpoint::Completions, br#"{"prompt":[1,2,3]}"#, "m").unwrap();
        assert_eq!(c.prompt.count, 4);
        let d = parse(
            Endpoint::Chat,
            br#"{"messages":[{"role":"user","content":"hi there"}],"max_completion_tokens":5,"max_tokens":9,"stream":true,"stream_options":{"include_usage":true}}"#,
            "m",
        )
        .unwrap();
        assert_eq!(d.max_tokens, 5);
        assert!(d.stream && d.include_usage);
        assert_eq!(d.prompt.count, 5);
    }
}
