//! What a vLLM engine would reject before doing any work, decided from the
//! client body alone, so that a gateway can refuse the request before the
//! prefill leg computes (and pins) KV that no decode will pull.
//!
//! [`check_request`] answers `Ok` or an [`EngineReject`] with the status,
//! message and `param` vLLM gives: the texts of vLLM's request validators
//! (`CompletionRequest`/`ChatCompletionRequest`) and of
//! `SamplingParams._verify_args`, including the ` (parameter=..., value=...)`
//! suffix that `VLLMValidationError` prints. Only what vLLM rejects whatever
//! its configuration is checked; anything that depends on the model or the
//! server's flags (context length, vocabulary, `--max-logprobs` other than
//! the default) is either a [`Limits`] field or left to the engine, so the
//! gateway never refuses what an engine would serve.
//!
//! Where vLLM and this module differ on purpose:
//! - vLLM reports a failure of its pydantic validators ([`Stage::Schema`]) as
//!   `"N validation error: {...}"` with the sentence below inside and type
//!   `"Bad Request"`; this module gives the sentence itself and type
//!   `"BadRequestError"`, as its sampling checks do (the status and `param`
//!   are the same).
//! - Type errors (`"max_tokens": 1.5`, `"top_p": {}`) give a short sentence
//!   naming the field instead of pydantic's dump.
//! - Version-dependent cases are left to the engine: `temperature > 2`,
//!   `logprobs: -1`, `min_tokens` above a `max_tokens: null`.
//!
//! The engine simulator (pdsim) implements the same list on its own, so the
//! two can be compared in tests.

use serde::Serialize;
use serde_json::value::RawValue;

use crate::body::{BodyError, JsonBody};

mod python;

use python::{
    Int, empty_container, number_text, parse_int, py_float, py_logprob_count, py_value, truthy,
};

/// The OpenAI generation endpoint a body was sent to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/chat/completions`
    ChatCompletions,
}

/// Engine settings the checks depend on. [`Limits::default`] is vLLM's
/// default configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// `--max-logprobs` (vLLM default 20). `None`: the engine's limit is not
    /// known (e.g. `-1`, the vocabulary size), so logprob counts are not
    /// checked against a maximum.
    pub max_logprobs: Option<u64>,
    /// `VLLM_MAX_N_SEQUENCES` (vLLM default 16384).
    pub max_n: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_logprobs: Some(20),
            max_n: 16384,
        }
    }
}

/// Default `max_tokens` of vLLM's `CompletionRequest` when the client sends none.
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: i128 = 16;

/// Where in vLLM the rejection would come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// The request body as a whole (not JSON, not an object).
    Body,
    /// A rule of the gateway, not of vLLM: repeated keys, nesting depth, one
    /// sequence per request for connectors that cannot serve more.
    Gateway,
    /// A pydantic validator of the request model (field types, required
    /// fields, `stream_options`, logprobs fields).
    Schema,
    /// `SamplingParams` (value bounds).
    Sampling,
    /// The served-model check (404).
    Model,
}

/// A request an engine would refuse, in vLLM's terms. Render it with
/// [`EngineReject::to_json`] as `{"error":{"message","type","param","code"}}`
/// with HTTP status [`EngineReject::status`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct EngineReject {
    /// HTTP status (400, or 404 for an unknown model).
    pub status: u16,
    /// vLLM's message.
    pub message: String,
    /// The offending parameter where vLLM names one.
    pub param: Option<&'static str>,
    /// Which vLLM layer would have answered.
    pub stage: Stage,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorInfo<'a>,
}

#[derive(Serialize)]
struct ErrorInfo<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'static str>,
    code: u16,
}

impl EngineReject {
    fn new(stage: Stage, message: String, param: Option<&'static str>) -> Self {
        EngineReject {
            status: 400,
            message,
            param,
            stage,
        }
    }

    /// The OpenAI error `type`: `"NotFoundError"` for 404, else `"BadRequestError"`.
    pub fn error_type(&self) -> &'static str {
        if self.status == 404 {
            "NotFoundError"
        } else {
            "BadRequestError"
        }
    }

    /// The OpenAI-shaped error body: `{"error":{"message","type","param","code"}}`.
    pub fn to_json(&self) -> Vec<u8> {
        let body = ErrorBody {
            error: ErrorInfo {
                message: &self.message,
                kind: self.error_type(),
                param: self.param,
                code: self.status,
            },
        };
        // A struct of strings and integers always serialises.
        serde_json::to_vec(&body).unwrap_or_default()
    }
}

/// The rejection for a body [`JsonBody::parse`] refused: vLLM answers 400 for
/// a body that is not JSON or not an object. A duplicate key is a gateway
/// rule (contracts §2: Python keeps the last one silently, so a client could
/// hide a value from a gateway that reads the first).
pub fn reject_body_error(err: &BodyError) -> EngineReject {
    let (stage, message) = match err {
        BodyError::NotObject => (
            Stage::Body,
            "Input should be a valid dictionary or object to extract fields from".to_owned(),
        ),
        BodyError::Invalid(e) => (Stage::Body, format!("JSON decode error: {e}")),
        other => (Stage::Gateway, other.to_string()),
    };
    EngineReject::new(stage, message, None)
}

/// Default bound for [`check_depth`]: serde_json's own recursion limit, and far
/// below the depth at which Python's `json.loads` in an engine raises
/// `RecursionError` (a 500 there, not a 400).
pub const MAX_JSON_DEPTH: usize = 128;

/// Refuses a body whose arrays and objects nest deeper than `max_depth`
/// (the top-level object is depth 1). [`JsonBody`] skips nested values
/// without a depth limit, so without this a deeply nested `prompt` would go
/// through the gateway and fail in the engine.
///
/// # Errors
/// A 400 [`EngineReject`] at [`Stage::Gateway`].
pub fn check_depth(raw: &[u8], max_depth: usize) -> Result<(), EngineReject> {
    let mut depth = 0usize;
    let mut i = 0;
    while i < raw.len() {
        match raw[i] {
            b'"' => i = string_end(raw, i + 1),
            b'[' | b'{' => {
                depth += 1;
                if depth > max_depth {
                    return Err(EngineReject::new(
                        Stage::Gateway,
                        format!("JSON body nests deeper than {max_depth} levels"),
                        None,
                    ));
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    Ok(())
}

/// The deepest body (as [`check_depth`] counts levels) the scanner behind [`parse_bounded`]
/// accepts: the top-level object, 63 non-empty containers inside it (the scanner's bound, one
/// bit per level in a `u64`), and an empty one inside those (which the scanner reads as a value and
/// does not count). A proptest found the empty innermost one at 64 when this was taken as 64.
pub const SCANNED_DEPTH: usize = crate::scan::MAX_NESTING as usize + 2;

/// Why [`parse_bounded`] refused a body.
#[derive(Debug)]
pub enum Refused {
    /// It nests deeper than allowed: [`check_depth`]'s 400.
    TooDeep(EngineReject),
    /// [`JsonBody::parse`] refused it.
    Body(BodyError),
}

/// [`check_depth`] and then [`JsonBody::parse`], with their results, from one scan of the body
/// when `max_depth` is at least [`SCANNED_DEPTH`], the deepest body the scanner accepts.
/// Anything else takes the two steps.
///
/// # Errors
/// [`Refused::TooDeep`] first, then [`Refused::Body`], as the two steps would.
pub fn parse_bounded(raw: bytes::Bytes, max_depth: usize) -> Result<JsonBody, Refused> {
    let raw = if max_depth >= SCANNED_DEPTH {
        match JsonBody::scanned(raw) {
            Ok(parsed) => return parsed.map_err(Refused::Body),
            Err(raw) => raw,
        }
    } else {
        raw
    };
    check_depth(&raw, max_depth).map_err(Refused::TooDeep)?;
    JsonBody::parse(raw).map_err(Refused::Body)
}

/// The index of the `"` that closes the string whose text starts at `i`
/// (or `raw.len()`). Skips eight bytes at a time up to the first that can end
/// the run (the scanner's word test): prompts are most of a body, and a
/// byte-by-byte scan costs more than the parse itself.
fn string_end(raw: &[u8], mut i: usize) -> usize {
    loop {
        while let Some(chunk) = raw.get(i..i + 8) {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            let stop = crate::scan::string_stop(u64::from_le_bytes(word));
            i += stop;
            if stop < 8 {
                break;
            }
        }
        match raw.get(i) {
            None => return raw.len(),
            Some(b'"') => return i,
            // An escape: whatever follows cannot end the string.
            Some(b'\\') => i += 2,
            // A control character stops the word test too; it does not end the string.
            Some(_) => i += 1,
        }
    }
}

/// The vLLM 404 for a `model` the engines do not serve. `None` (no `model`
/// in the body) passes: vLLM serves its default model then.
pub fn check_model<S: AsRef<str>>(
    requested: Option<&str>,
    served: &[S],
) -> Result<(), EngineReject> {
    match requested {
        Some(m) if !served.iter().any(|s| s.as_ref() == m) => Err(EngineReject {
            status: 404,
            message: format!("The model `{m}` does not exist."),
            param: Some("model"),
            stage: Stage::Model,
        }),
        _ => Ok(()),
    }
}

/// Checks `body` for `endpoint` the way vLLM validates it before scheduling,
/// in vLLM's order (request validators, then sampling parameters).
///
/// # Errors
/// The first [`EngineReject`] vLLM would answer with.
pub fn check_request(
    body: &JsonBody,
    endpoint: Endpoint,
    limits: &Limits,
) -> Result<(), EngineReject> {
    let v = View::read(body);
    check_schema(&v, endpoint)?;
    check_sampling(&v, endpoint, limits)
}

/// The parameter that makes `body` ask for more than one sequence (`n > 1`,
/// or, on completions, an array of several prompts), if any. Connectors that
/// return one set of transfer parameters per request cannot serve it.
///
/// # Errors
/// An [`EngineReject`] when `n` or `prompt` has a type vLLM refuses.
pub fn batch_param(
    body: &JsonBody,
    endpoint: Endpoint,
) -> Result<Option<&'static str>, EngineReject> {
    let v = View::read(body);
    if let Some(n) = v.int("n")?
        && n.value > 1
    {
        return Ok(Some("n"));
    }
    if endpoint == Endpoint::Completions
        && let Some(raw) = v.bytes("prompt")
        && raw.starts_with(b"[")
    {
        let items: Vec<&RawValue> = serde_json::from_slice(&raw).map_err(|_| {
            schema(
                "prompt: Input should be a valid string or list".to_owned(),
                Some("prompt"),
            )
        })?;
        // A flat array of token ids is one prompt; strings or nested arrays are one each.
        let nested = items
            .first()
            .is_some_and(|i| i.get().starts_with('"') || i.get().starts_with('['));
        if nested && items.len() > 1 {
            return Ok(Some("prompt"));
        }
    }
    Ok(None)
}

/// [`batch_param`] as the gateway's 400 for a connector that serves one
/// sequence per request (`connector` names it in the message).
///
/// # Errors
/// The 400 when the body asks for several sequences.
pub fn check_single_sequence(
    body: &JsonBody,
    endpoint: Endpoint,
    connector: &str,
) -> Result<(), EngineReject> {
    match batch_param(body, endpoint)? {
        None => Ok(()),
        Some(param) => Err(EngineReject::new(
            Stage::Gateway,
            format!(
                "connector {connector} serves one prompt with n=1 per request; send the prompts as separate requests"
            ),
            Some(param),
        )),
    }
}

/// The top-level members the checks read, as raw JSON text.
struct View<'a> {
    body: &'a JsonBody,
}

fn type_error(field: &'static str, what: &str) -> EngineReject {
    schema(
        format!("{field}: Input should be a valid {what}"),
        Some(field),
    )
}

impl<'a> View<'a> {
    fn read(body: &'a JsonBody) -> Self {
        View { body }
    }

    /// The raw value of `key`, `None` when absent or `null` (pydantic's
    /// optional fields treat both alike).
    fn raw(&self, key: &str) -> Option<&'a str> {
        self.body.get_raw(key).filter(|r| *r != "null")
    }

    /// The raw bytes of `key` (zero copy, no UTF-8 check), `None` when absent or `null`.
    fn bytes(&self, key: &str) -> Option<bytes::Bytes> {
        self.body.get_raw_bytes(key).filter(|r| &r[..] != b"null")
    }

    /// An integer field as pydantic (lax mode) reads it: integers, floats
    /// without a fraction, booleans and numeric strings.
    fn int(&self, key: &'static str) -> Result<Option<Int>, EngineReject> {
        let Some(raw) = self.raw(key) else {
            return Ok(None);
        };
        let text = match raw.as_bytes().first() {
            Some(b't') => "1",
            Some(b'f') => "0",
            Some(b'"') => {
                let s = py_value(raw);
                return parse_int(s.trim())
                    .map(Some)
                    .ok_or_else(|| type_error(key, "integer"));
            }
            _ => raw,
        };
        parse_int(text).map(Some).ok_or_else(|| {
            let what = if number_text(text).is_some() {
                "integer, got a number with a fractional part"
            } else {
                "integer"
            };
            type_error(key, what)
        })
    }

    /// A float field as pydantic (lax mode) reads it.
    fn float(&self, key: &'static str) -> Result<Option<f64>, EngineReject> {
        let Some(raw) = self.raw(key) else {
            return Ok(None);
        };
        let value = match raw.as_bytes().first() {
            Some(b't') => Some(1.0),
            Some(b'f') => Some(0.0),
            Some(b'"') => py_value(raw).trim().parse::<f64>().ok(),
            Some(b'[' | b'{') => None,
            _ => number_text(raw),
        };
        value
            .filter(|f| f.is_finite())
            .map(Some)
            .ok_or_else(|| type_error(key, "number"))
    }
}

/// A logprobs-style field read by vLLM's `check_logprobs` before pydantic:
/// any number (or boolean) passes, anything else is "must be an integer".
fn logprob_field(v: &View<'_>, key: &'static str) -> Result<Option<(f64, String)>, EngineReject> {
    let Some(raw) = v.raw(key) else {
        return Ok(None);
    };
    let value = match raw.as_bytes().first() {
        Some(b't') => Some(1.0),
        Some(b'f') => Some(0.0),
        Some(b'-' | b'0'..=b'9') => number_text(raw),
        _ => None,
    };
    match value {
        Some(f) => Ok(Some((f, py_value(raw)))),
        None => Err(schema(
            format!(
                "`{key}` must be an integer. (parameter={key}, value={})",
                py_value(raw)
            ),
            Some(key),
        )),
    }
}

fn check_schema(v: &View<'_>, endpoint: Endpoint) -> Result<(), EngineReject> {
    match endpoint {
        Endpoint::Completions => {
            // Read as bytes: these are the large members, not worth a UTF-8 check here.
            let prompt_empty = v.bytes("prompt").is_none_or(|p| &p[..] == b"\"\"");
            let embeds_empty = v
                .bytes("prompt_embeds")
                .is_none_or(|e| e.starts_with(b"[") && empty_container(&e));
            if prompt_empty && embeds_empty {
                return Err(schema("Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"
                        .to_owned(),
                    Some("prompt"),
                ));
            }
        }
        Endpoint::ChatCompletions => match v.body.get_raw_bytes("messages") {
            None => {
                return Err(schema(
                    "Field required: messages".to_owned(),
                    Some("messages"),
                ));
            }
            Some(m) if !m.starts_with(b"[") => return Err(type_error("messages", "list")),
            Some(_) => {}
        },
    }
    check_formats_and_tools(v, endpoint)?;
    if truthy(v.raw("stream_options")) && !truthy(v.raw("stream")) {
        return Err(schema(
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)"
                .to_owned(),
            Some("stream_options"),
        ));
    }
    let count_field = match endpoint {
        Endpoint::Completions => "logprobs",
        Endpoint::ChatCompletions => "top_logprobs",
    };
    let prompt_logprobs = logprob_field(v, "prompt_logprobs")?;
    let count = logprob_field(v, count_field)?;
    if let Some((p, text)) = &prompt_logprobs {
        if truthy(v.raw("stream")) && (*p > 0.0 || *p == -1.0) {
            return Err(schema("`prompt_logprobs` are not available when `stream=True`. (parameter=prompt_logprobs)"
                    .to_owned(),
                Some("prompt_logprobs"),
            ));
        }
        if *p < 0.0 && *p != -1.0 {
            return Err(schema(
                format!(
                    "`prompt_logprobs` must be a positive value or -1. (parameter=prompt_logprobs, value={text})"
                ),
                Some("prompt_logprobs"),
            ));
        }
    }
    if let Some((c, text)) = &count {
        if *c < 0.0 && *c != -1.0 {
            return Err(schema(
                format!(
                    "`{count_field}` must be a positive value or -1. (parameter={count_field}, value={text})"
                ),
                Some(count_field),
            ));
        }
        if endpoint == Endpoint::ChatCompletions
            && (*c == -1.0 || *c > 0.0)
            && !truthy(v.raw("logprobs"))
        {
            return Err(schema("when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)"
                    .to_owned(),
                Some("top_logprobs"),
            ));
        }
    }
    Ok(())
}

/// vLLM's validators of `response_format` and (chat) of tools and the
/// generation prompt.
fn check_formats_and_tools(v: &View<'_>, endpoint: Endpoint) -> Result<(), EngineReject> {
    if let Some(raw) = v.raw("response_format")
        && raw.starts_with('{')
        && let Ok(format) = JsonBody::parse(bytes::Bytes::copy_from_slice(raw.as_bytes()))
        && format.get_raw("type") == Some("\"json_schema\"")
        && format.get_raw("json_schema").is_none_or(|s| s == "null")
    {
        return Err(schema(
            "When response_format type is 'json_schema', the 'json_schema' field must be provided. (parameter=response_format)".to_owned(),
            Some("response_format"),
        ));
    }
    if endpoint != Endpoint::ChatCompletions {
        return Ok(());
    }
    let tools = v.raw("tools");
    if tools.is_some_and(|t| empty_container(t.as_bytes()) && t.starts_with('[')) {
        return Err(schema(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely. (parameter=tools)".to_owned(),
            Some("tools"),
        ));
    }
    if let Some(choice) = v.raw("tool_choice")
        && choice != "\"none\""
        && tools.is_none()
    {
        return Err(schema(
            "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)".to_owned(),
            Some("tool_choice"),
        ));
    }
    if truthy(v.raw("continue_final_message")) && truthy(v.raw("add_generation_prompt")) {
        return Err(schema(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
                .to_owned(),
            None,
        ));
    }
    Ok(())
}

fn schema(message: String, param: Option<&'static str>) -> EngineReject {
    EngineReject::new(Stage::Schema, message, param)
}

fn sampling(message: String, param: Option<&'static str>) -> EngineReject {
    EngineReject::new(Stage::Sampling, message, param)
}

fn check_sampling(v: &View<'_>, endpoint: Endpoint, limits: &Limits) -> Result<(), EngineReject> {
    // Field types first: pydantic validates every field before vLLM builds
    // the sampling parameters.
    let n = v.int("n")?;
    let presence = v.float("presence_penalty")?;
    let frequency = v.float("frequency_penalty")?;
    let repetition = v.float("repetition_penalty")?;
    let temperature = v.float("temperature")?;
    let top_p = v.float("top_p")?;
    let top_k = v.int("top_k")?;
    let min_p = v.float("min_p")?;
    let max_tokens = v.int("max_tokens")?;
    let max_completion_tokens = match endpoint {
        Endpoint::ChatCompletions => v.int("max_completion_tokens")?,
        Endpoint::Completions => None,
    };
    let min_tokens = v.int("min_tokens")?;
    // Beam search builds BeamSearchParams, which has none of the checks below.
    if truthy(v.raw("use_beam_search")) {
        return Ok(());
    }
    if let Some(n) = &n {
        if n.value < 1 {
            return Err(sampling(
                format!("n must be at least 1, got {}.", n.text),
                None,
            ));
        }
        if n.value > i128::from(limits.max_n) {
            return Err(sampling(
                format!(
                    "n must be at most {}, got {}. To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable.",
                    limits.max_n, n.text
                ),
                None,
            ));
        }
    }
    for (name, value) in [
        ("presence_penalty", presence),
        ("frequency_penalty", frequency),
    ] {
        if let Some(f) = value
            && !(-2.0..=2.0).contains(&f)
        {
            return Err(sampling(
                format!("{name} must be in [-2, 2], got {}.", py_float(f)),
                None,
            ));
        }
    }
    if let Some(f) = repetition
        && f <= 0.0
    {
        return Err(sampling(
            format!(
                "repetition_penalty must be greater than zero, got {}.",
                py_float(f)
            ),
            None,
        ));
    }
    if let Some(f) = temperature
        && f < 0.0
    {
        let t = py_float(f);
        return Err(sampling(
            format!(
                "temperature must be non-negative, got {t}. (parameter=temperature, value={t})"
            ),
            Some("temperature"),
        ));
    }
    if let Some(f) = top_p
        && !(f > 0.0 && f <= 1.0)
    {
        let t = py_float(f);
        return Err(sampling(
            format!("top_p must be in (0, 1], got {t}. (parameter=top_p, value={t})"),
            Some("top_p"),
        ));
    }
    if let Some(k) = &top_k
        && k.value < -1
    {
        return Err(sampling(
            format!("top_k must be 0 (disable), or at least 1, got {}.", k.text),
            None,
        ));
    }
    if let Some(f) = min_p
        && !(0.0..=1.0).contains(&f)
    {
        return Err(sampling(
            format!("min_p must be in [0, 1], got {}.", py_float(f)),
            None,
        ));
    }
    // The limit the engine applies: chat prefers max_completion_tokens;
    // completions default to 16 when the key is absent.
    let mut effective = match endpoint {
        Endpoint::ChatCompletions => max_completion_tokens.or(max_tokens),
        Endpoint::Completions => match (&max_tokens, v.body.contains_key("max_tokens")) {
            (Some(m), _) => Some(m.clone()),
            (None, false) => Some(Int {
                value: COMPLETIONS_DEFAULT_MAX_TOKENS,
                text: COMPLETIONS_DEFAULT_MAX_TOKENS.to_string(),
            }),
            (None, true) => None,
        },
    };
    // Completions with echo and max_tokens 0 only score the prompt (vLLM
    // runs them with one token).
    if endpoint == Endpoint::Completions
        && truthy(v.raw("echo"))
        && effective.as_ref().is_some_and(|m| m.value == 0)
    {
        effective = Some(Int {
            value: 1,
            text: "1".to_owned(),
        });
    }
    if let Some(m) = &effective
        && m.value < 1
    {
        return Err(sampling(
            format!(
                "max_tokens must be at least 1, got {0}. (parameter=max_tokens, value={0})",
                m.text
            ),
            Some("max_tokens"),
        ));
    }
    if let Some(min) = &min_tokens {
        if min.value < 0 {
            return Err(sampling(
                format!(
                    "min_tokens must be greater than or equal to 0, got {}.",
                    min.text
                ),
                None,
            ));
        }
        if let Some(m) = &effective
            && min.value > m.value
        {
            return Err(sampling(
                format!(
                    "min_tokens must be less than or equal to max_tokens={}, got {}.",
                    m.text, min.text
                ),
                None,
            ));
        }
    }
    if let Some(raw) = v.raw("stop") {
        let empty = match raw.as_bytes().first() {
            Some(b'"') => raw == "\"\"",
            Some(b'[') => serde_json::from_str::<Vec<&RawValue>>(raw)
                .is_ok_and(|items| items.iter().any(|i| i.get() == "\"\"")),
            _ => false,
        };
        if empty {
            return Err(sampling(
                "stop cannot contain an empty string.".to_owned(),
                None,
            ));
        }
    }
    if let Some(n) = &n
        && n.value > 1
        && temperature.is_some_and(|t| t < 1e-5)
    {
        return Err(sampling(
            format!("n must be 1 when using greedy sampling, got {}.", n.text),
            None,
        ));
    }
    if let Some(max) = limits.max_logprobs {
        check_logprob_max(v, endpoint, max)?;
    }
    Ok(())
}

/// `SamplingParams._validate_logprobs` against the engine's `--max-logprobs`.
fn check_logprob_max(v: &View<'_>, endpoint: Endpoint, max: u64) -> Result<(), EngineReject> {
    let wanted = |key: &'static str| -> Result<Option<f64>, EngineReject> {
        Ok(logprob_field(v, key)?.map(|(f, _)| f))
    };
    let sample = match endpoint {
        Endpoint::Completions => wanted("logprobs")?,
        Endpoint::ChatCompletions if truthy(v.raw("logprobs")) => wanted("top_logprobs")?,
        Endpoint::ChatCompletions => None,
    };
    let mut prompt = wanted("prompt_logprobs")?;
    if prompt.is_none() && truthy(v.raw("echo")) {
        prompt = match endpoint {
            Endpoint::Completions => wanted("logprobs")?,
            Endpoint::ChatCompletions => wanted("top_logprobs")?,
        };
    }
    // -1 means the vocabulary size, which only the engine knows.
    let over = |n: f64| n > 0.0 && n as u128 > u128::from(max);
    for (kind, param, value) in [
        ("sample", "logprobs", sample),
        ("prompt", "prompt_logprobs", prompt),
    ] {
        if let Some(n) = value.filter(|n| over(*n)) {
            let n = py_logprob_count(n);
            return Err(sampling(
                format!(
                    "Requested {kind} logprobs of {n}, which is greater than max allowed: {max} (parameter={param}, value={n})"
                ),
                Some(param),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn depth_counts_only_structure() {
        assert!(check_depth(br#"{"a":[[1]]}"#, 3).is_ok());
        let e = check_depth(br#"{"a":[[1]]}"#, 2).unwrap_err();
        assert_eq!((e.status, e.stage), (400, Stage::Gateway));
        // Brackets inside strings, also after escaped quotes, do not count.
        assert!(check_depth(br#"{"a":"[[[\"[[[","b":["\\"]}"#, 2).is_ok());
        let deep = format!("{{\"p\":{}{}}}", "[".repeat(200), "]".repeat(200));
        assert!(check_depth(deep.as_bytes(), MAX_JSON_DEPTH).is_err());
        assert!(check_depth(deep.as_bytes(), 201).is_ok());
        // Strings longer than a word, escapes at every offset, an unterminated string.
        for pad in 0..10 {
            let body = format!("{{\"a\":\"{}\\\"[[\\\\\",\"b\":[[1]]}}", "x".repeat(pad));
            assert!(check_depth(body.as_bytes(), 3).is_ok(), "{body}");
            assert!(check_depth(body.as_bytes(), 2).is_err(), "{body}");
        }
        assert!(check_depth(b"{\"a\":\"[[[[[[[[[[[[", 1).is_ok());
        assert!(check_depth(b"{\"a\":\"\\", 1).is_ok());
    }

    #[test]
    fn integers_read_like_pydantic() {
        let b = JsonBody::parse(Bytes::from_static(
            br#"{"a":1e3,"b":"7","c":true,"d":1.5,"e":"x","f":[1],"g":-0,"h":123456789012345678901234567890123456789012,"i":null}"#,
        ))
        .unwrap();
        let v = View::read(&b);
        assert_eq!(v.int("a").unwrap().unwrap().value, 1000);
        assert_eq!(v.int("b").unwrap().unwrap().value, 7);
        assert_eq!(v.int("c").unwrap().unwrap().value, 1);
        assert!(v.int("d").unwrap_err().message.contains("fractional part"));
        assert_eq!(v.int("e").unwrap_err().param, Some("e"));
        assert!(v.int("f").is_err());
        assert_eq!(v.int("g").unwrap().unwrap().text, "0");
        let big = v.int("h").unwrap().unwrap();
        assert_eq!(big.value, i128::MAX);
        assert_eq!(big.text, "123456789012345678901234567890123456789012");
        assert!(v.int("i").unwrap().is_none());
        assert!(v.int("missing").unwrap().is_none());
    }
}
