//! Table tests of `kvtransfer::checks`: each vLLM rejection next to the
//! closest body vLLM accepts.
#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use kvtransfer::JsonBody;
use kvtransfer::checks::{
    Endpoint, EngineReject, Limits, Stage, batch_param, check_model, check_request,
    check_single_sequence, reject_body_error,
};

fn check(endpoint: Endpoint, body: &str) -> Result<(), EngineReject> {
    let parsed = JsonBody::parse(Bytes::copy_from_slice(body.as_bytes())).unwrap();
    check_request(&parsed, endpoint, &Limits::default())
}

/// (endpoint, body, expected message or None for accepted, param)
type Case = (
    Endpoint,
    &'static str,
    Option<&'static str>,
    Option<&'static str>,
);

const C: Endpoint = Endpoint::Completions;
const H: Endpoint = Endpoint::ChatCompletions;

#[rustfmt::skip]
const CASES: &[Case] = &[
    // Accepted bodies (each an edge next to a rejected one below).
    (C, r#"{"prompt":"x"}"#, None, None),
    (H, r#"{"messages":[{"role":"user","content":"hi"}]}"#, None, None),
    (C, r#"{"prompt":"x","max_tokens":1,"min_tokens":1}"#, None, None),
    (C, r#"{"prompt":"x","max_tokens":0,"echo":true,"min_tokens":1}"#, None, None),
    (C, r#"{"prompt":"x","max_tokens":0,"echo":true,"min_tokens":2}"#, Some("min_tokens must be less than or equal to max_tokens=1, got 2."), None),
    (C, r#"{"prompt":"x","max_tokens":null,"min_tokens":17}"#, None, None),
    (C, r#"{"prompt":"x","min_tokens":16}"#, None, None),
    (H, r#"{"messages":[],"min_tokens":17}"#, None, None),
    (H, r#"{"messages":[],"max_tokens":4,"max_completion_tokens":32,"min_tokens":17}"#, None, None),
    (C, r#"{"prompt":"x","max_completion_tokens":0}"#, None, None),
    (C, r#"{"prompt":"x","stream_options":{}}"#, None, None),
    (C, r#"{"prompt":"x","stream_options":null}"#, None, None),
    (C, r#"{"prompt":"x","stream":true,"stream_options":{"include_usage":true}}"#, None, None),
    (C, r#"{"prompt":"x","n":16384,"temperature":1}"#, None, None),
    (C, r#"{"prompt":"x","temperature":0,"top_p":1,"top_k":-1,"min_p":0}"#, None, None),
    (C, r#"{"prompt":"x","temperature":2.5}"#, None, None),
    (C, r#"{"prompt":"x","presence_penalty":2,"frequency_penalty":-2,"repetition_penalty":2.5}"#, None, None),
    (C, r#"{"prompt":"x","logprobs":20,"prompt_logprobs":0,"stream":true}"#, None, None),
    (C, r#"{"prompt":"x","logprobs":-1}"#, None, None),
    (H, r#"{"messages":[],"top_logprobs":0,"logprobs":false}"#, None, None),
    (H, r#"{"messages":[],"top_logprobs":21}"#, Some("when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)"), Some("top_logprobs")),
    (H, r#"{"messages":[],"top_logprobs":-1,"logprobs":true}"#, None, None),
    (C, r#"{"prompt":"x","use_beam_search":true,"top_p":-1,"min_tokens":-1,"n":2,"temperature":0}"#, None, None),
    (C, r#"{"prompt_embeds":"ZQ=="}"#, None, None),
    (C, r#"{"prompt":"x","stop":["a"]}"#, None, None),

    // Body shape and required fields.
    (C, r#"{}"#, Some("Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"), Some("prompt")),
    (C, r#"{"prompt":""}"#, Some("Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"), Some("prompt")),
    (C, r#"{"prompt":null,"prompt_embeds":[]}"#, Some("Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"), Some("prompt")),
    (H, r#"{"model":"m"}"#, Some("Field required: messages"), Some("messages")),
    (H, r#"{"messages":"hi"}"#, Some("messages: Input should be a valid list"), Some("messages")),

    // stream_options without stream.
    (C, r#"{"prompt":"x","stream_options":{"include_usage":true}}"#, Some("Stream options can only be defined when `stream=True`. (parameter=stream_options)"), Some("stream_options")),
    (H, r#"{"messages":[],"stream":false,"stream_options":{"include_usage":false}}"#, Some("Stream options can only be defined when `stream=True`. (parameter=stream_options)"), Some("stream_options")),

    // max_tokens / max_completion_tokens.
    (C, r#"{"prompt":"x","max_tokens":0}"#, Some("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"), Some("max_tokens")),
    (C, r#"{"prompt":"x","max_tokens":-5,"echo":true}"#, Some("max_tokens must be at least 1, got -5. (parameter=max_tokens, value=-5)"), Some("max_tokens")),
    (H, r#"{"messages":[],"max_completion_tokens":0,"max_tokens":10}"#, Some("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"), Some("max_tokens")),
    (H, r#"{"messages":[],"max_tokens":0}"#, Some("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"), Some("max_tokens")),
    (C, r#"{"prompt":"x","max_tokens":1.5}"#, Some("max_tokens: Input should be a valid integer, got a number with a fractional part"), Some("max_tokens")),
    (C, r#"{"prompt":"x","max_tokens":"many"}"#, Some("max_tokens: Input should be a valid integer"), Some("max_tokens")),
    (C, r#"{"prompt":"x","max_tokens":"0"}"#, Some("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"), Some("max_tokens")),
    (C, r#"{"prompt":"x","max_tokens":0.0}"#, Some("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"), Some("max_tokens")),

    // min_tokens.
    (C, r#"{"prompt":"x","min_tokens":-1}"#, Some("min_tokens must be greater than or equal to 0, got -1."), None),
    (C, r#"{"prompt":"x","max_tokens":2,"min_tokens":3}"#, Some("min_tokens must be less than or equal to max_tokens=2, got 3."), None),
    (C, r#"{"prompt":"x","min_tokens":17}"#, Some("min_tokens must be less than or equal to max_tokens=16, got 17."), None),
    (C, r#"{"prompt":"x","min_tokens":17,"max_completion_tokens":32}"#, Some("min_tokens must be less than or equal to max_tokens=16, got 17."), None),
    (H, r#"{"messages":[],"max_tokens":32,"max_completion_tokens":4,"min_tokens":5}"#, Some("min_tokens must be less than or equal to max_tokens=4, got 5."), None),
    (H, r#"{"messages":[],"max_tokens":4,"max_completion_tokens":null,"min_tokens":5}"#, Some("min_tokens must be less than or equal to max_tokens=4, got 5."), None),
    (C, r#"{"prompt":"x","min_tokens":9223372036854775808}"#, Some("min_tokens must be less than or equal to max_tokens=16, got 9223372036854775808."), None),

    // n.
    (C, r#"{"prompt":"x","n":0}"#, Some("n must be at least 1, got 0."), None),
    (H, r#"{"messages":[],"n":-3}"#, Some("n must be at least 1, got -3."), None),
    (H, r#"{"messages":[],"n":16385}"#, Some("n must be at most 16384, got 16385. To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable."), None),
    (H, r#"{"messages":[],"n":1.5}"#, Some("n: Input should be a valid integer, got a number with a fractional part"), Some("n")),
    (C, r#"{"prompt":"x","n":2,"temperature":0}"#, Some("n must be 1 when using greedy sampling, got 2."), None),

    // Sampling bounds.
    (C, r#"{"prompt":"x","temperature":-1}"#, Some("temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)"), Some("temperature")),
    (C, r#"{"prompt":"x","top_p":0}"#, Some("top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)"), Some("top_p")),
    (H, r#"{"messages":[],"top_p":1.01}"#, Some("top_p must be in (0, 1], got 1.01. (parameter=top_p, value=1.01)"), Some("top_p")),
    (C, r#"{"prompt":"x","top_k":-2.0}"#, Some("top_k must be 0 (disable), or at least 1, got -2."), None),
    (C, r#"{"prompt":"x","top_k":2.5}"#, Some("top_k: Input should be a valid integer, got a number with a fractional part"), Some("top_k")),
    (C, r#"{"prompt":"x","min_p":1.5}"#, Some("min_p must be in [0, 1], got 1.5."), None),
    (C, r#"{"prompt":"x","presence_penalty":2.1}"#, Some("presence_penalty must be in [-2, 2], got 2.1."), None),
    (H, r#"{"messages":[],"frequency_penalty":-3}"#, Some("frequency_penalty must be in [-2, 2], got -3.0."), None),
    (C, r#"{"prompt":"x","repetition_penalty":0}"#, Some("repetition_penalty must be greater than zero, got 0.0."), None),
    (C, r#"{"prompt":"x","temperature":{}}"#, Some("temperature: Input should be a valid number"), Some("temperature")),
    (C, r#"{"prompt":"x","stop":["a",""]}"#, Some("stop cannot contain an empty string."), None),
    (H, r#"{"messages":[],"stop":""}"#, Some("stop cannot contain an empty string."), None),

    // response_format, tools, generation prompt.
    (C, r#"{"prompt":"x","response_format":{"type":"json_schema"}}"#, Some("When response_format type is 'json_schema', the 'json_schema' field must be provided. (parameter=response_format)"), Some("response_format")),
    (H, r#"{"messages":[],"response_format":{"type":"json_schema","json_schema":{"name":"o","schema":{}}}}"#, None, None),
    (H, r#"{"messages":[],"response_format":{"type":"json_object"}}"#, None, None),
    (H, r#"{"messages":[],"tools":[]}"#, Some("`tools` must not be an empty array. Either provide at least one tool or omit the field entirely. (parameter=tools)"), Some("tools")),
    (C, r#"{"prompt":"x","tools":[]}"#, None, None),
    (H, r#"{"messages":[],"tool_choice":"auto"}"#, Some("When using `tool_choice`, `tools` must be set. (parameter=tool_choice)"), Some("tool_choice")),
    (H, r#"{"messages":[],"tool_choice":"none"}"#, None, None),
    (H, r#"{"messages":[],"tool_choice":null}"#, None, None),
    (H, r#"{"messages":[],"tool_choice":"auto","tools":[{"type":"function","function":{"name":"f"}}]}"#, None, None),
    (H, r#"{"messages":[],"continue_final_message":true,"add_generation_prompt":true}"#, Some("Cannot set both `continue_final_message` and `add_generation_prompt` to True."), None),
    (H, r#"{"messages":[],"continue_final_message":true}"#, None, None),

    // Logprobs.
    (C, r#"{"prompt":"x","logprobs":21}"#, Some("Requested sample logprobs of 21, which is greater than max allowed: 20 (parameter=logprobs, value=21)"), Some("logprobs")),
    (C, r#"{"prompt":"x","logprobs":-2}"#, Some("`logprobs` must be a positive value or -1. (parameter=logprobs, value=-2)"), Some("logprobs")),
    (C, r#"{"prompt":"x","logprobs":"3"}"#, Some("`logprobs` must be an integer. (parameter=logprobs, value=3)"), Some("logprobs")),
    (H, r#"{"messages":[],"top_logprobs":-2}"#, Some("`top_logprobs` must be a positive value or -1. (parameter=top_logprobs, value=-2)"), Some("top_logprobs")),
    (H, r#"{"messages":[],"top_logprobs":2,"logprobs":false}"#, Some("when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)"), Some("top_logprobs")),
    (H, r#"{"messages":[],"top_logprobs":21,"logprobs":true}"#, Some("Requested sample logprobs of 21, which is greater than max allowed: 20 (parameter=logprobs, value=21)"), Some("logprobs")),
    (C, r#"{"prompt":"x","prompt_logprobs":1,"stream":true}"#, Some("`prompt_logprobs` are not available when `stream=True`. (parameter=prompt_logprobs)"), Some("prompt_logprobs")),
    (H, r#"{"messages":[],"prompt_logprobs":-1,"stream":true}"#, Some("`prompt_logprobs` are not available when `stream=True`. (parameter=prompt_logprobs)"), Some("prompt_logprobs")),
    (C, r#"{"prompt":"x","prompt_logprobs":-2}"#, Some("`prompt_logprobs` must be a positive value or -1. (parameter=prompt_logprobs, value=-2)"), Some("prompt_logprobs")),
    (C, r#"{"prompt":"x","prompt_logprobs":25}"#, Some("Requested prompt logprobs of 25, which is greater than max allowed: 20 (parameter=prompt_logprobs, value=25)"), Some("prompt_logprobs")),
    (C, r#"{"prompt":"x","echo":true,"logprobs":21}"#, Some("Requested sample logprobs of 21, which is greater than max allowed: 20 (parameter=logprobs, value=21)"), Some("logprobs")),
];

#[test]
fn table() {
    let mut failures = Vec::new();
    for (i, (endpoint, body, message, param)) in CASES.iter().enumerate() {
        let got = check(*endpoint, body);
        let ok = match (&got, message) {
            (Ok(()), None) => true,
            (Err(e), Some(m)) => e.message == *m && e.param == *param && e.status == 400,
            _ => false,
        };
        if !ok {
            failures.push(format!(
                "case {i} {endpoint:?} {body}: got {got:?}, want {message:?} {param:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn limits_are_configurable() {
    let body =
        JsonBody::parse(Bytes::from_static(br#"{"prompt":"x","logprobs":50,"n":5}"#)).unwrap();
    assert!(check_request(&body, C, &Limits::default()).is_err());
    let none = Limits {
        max_logprobs: None,
        ..Limits::default()
    };
    assert!(check_request(&body, C, &none).is_ok());
    let small_n = Limits {
        max_logprobs: None,
        max_n: 4,
    };
    let e = check_request(&body, C, &small_n).unwrap_err();
    assert!(e.message.starts_with("n must be at most 4, got 5."), "{e}");
}

#[test]
fn rejects_render_as_openai_errors() {
    let e = check(C, r#"{"prompt":"x","max_tokens":0}"#).unwrap_err();
    let v: serde_json::Value = serde_json::from_slice(&e.to_json()).unwrap();
    assert_eq!(v["error"]["type"], "BadRequestError");
    assert_eq!(v["error"]["code"], 400);
    assert_eq!(v["error"]["param"], "max_tokens");
    assert_eq!(e.stage, Stage::Sampling);
    let e = check_model(Some("other"), &["m"]).unwrap_err();
    let v: serde_json::Value = serde_json::from_slice(&e.to_json()).unwrap();
    assert_eq!(e.status, 404);
    assert_eq!(v["error"]["type"], "NotFoundError");
    assert_eq!(v["error"]["message"], "The model `other` does not exist.");
    assert!(check_model(Some("m"), &["m"]).is_ok());
    assert!(check_model(None, &["m"]).is_ok());
    let v: serde_json::Value =
        serde_json::from_slice(&check(C, "{}").unwrap_err().to_json()).unwrap();
    assert_eq!(v["error"]["param"], "prompt");
}

#[test]
fn body_errors_are_400() {
    for raw in ["[1]", "\"s\"", "not json", r#"{"a":1,"a":2}"#] {
        let err = JsonBody::parse(Bytes::copy_from_slice(raw.as_bytes())).unwrap_err();
        let e = reject_body_error(&err);
        let stage = if raw.starts_with('{') {
            Stage::Gateway
        } else {
            Stage::Body
        };
        assert_eq!((e.status, e.stage), (400, stage), "{raw}");
    }
    let err = JsonBody::parse(Bytes::from_static(b"[1]")).unwrap_err();
    assert_eq!(
        reject_body_error(&err).message,
        "Input should be a valid dictionary or object to extract fields from"
    );
}

#[test]
fn batches_are_found() {
    let read = |s: &'static str| JsonBody::parse(Bytes::from_static(s.as_bytes())).unwrap();
    assert_eq!(batch_param(&read(r#"{"prompt":"x"}"#), C).unwrap(), None);
    assert_eq!(
        batch_param(&read(r#"{"prompt":[1,2,3]}"#), C).unwrap(),
        None
    );
    assert_eq!(batch_param(&read(r#"{"prompt":["a"]}"#), C).unwrap(), None);
    assert_eq!(
        batch_param(&read(r#"{"prompt":["a","b"]}"#), C).unwrap(),
        Some("prompt")
    );
    assert_eq!(
        batch_param(&read(r#"{"prompt":[[1],[2]]}"#), C).unwrap(),
        Some("prompt")
    );
    assert_eq!(
        batch_param(&read(r#"{"messages":[],"n":2}"#), H).unwrap(),
        Some("n")
    );
    assert_eq!(
        batch_param(&read(r#"{"messages":[],"n":1}"#), H).unwrap(),
        None
    );
    assert!(batch_param(&read(r#"{"n":"x"}"#), H).is_err());
    let e = check_single_sequence(&read(r#"{"prompt":["a","b"]}"#), C, "shfs").unwrap_err();
    assert_eq!(e.param, Some("prompt"));
    assert!(
        e.message.starts_with("connector shfs serves one prompt"),
        "{e}"
    );
    assert!(check_single_sequence(&read(r#"{"prompt":"a","n":1}"#), C, "shfs").is_ok());
}

/// The deepest bodies the one-scan path takes, at the limits around it: an empty container
/// innermost is a level `check_depth` counts and the scanner reads as a plain value (the case
/// a proptest found: 65 levels passed at a limit of 64).
#[test]
fn parse_bounded_counts_an_innermost_empty_container() {
    use kvtransfer::checks::{SCANNED_DEPTH, check_depth};
    for pairs in 30..34 {
        for innermost in ["[]", "{}", "[1]", "0"] {
            let text = format!(
                "{}{innermost}{}",
                r#"{"a":["#.repeat(pairs),
                "]}".repeat(pairs)
            );
            for limit in SCANNED_DEPTH - 2..SCANNED_DEPTH + 2 {
                let raw = Bytes::from(text.clone());
                let two_steps = check_depth(&raw, limit).is_ok();
                let one = kvtransfer::parse_bounded(raw, limit).is_ok();
                assert_eq!(
                    one, two_steps,
                    "{pairs} pairs around {innermost}, limit {limit}"
                );
            }
        }
    }
}

mod properties {
    use super::*;
    use kvtransfer::check_depth;
    use proptest::prelude::*;
    use serde_json::Value;

    fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            // Quotes, backslashes and brackets inside strings, at every offset of a word.
            "[a-z\"\\\\\\[\\]{} ]{0,20}".prop_map(Value::String),
            any::<String>().prop_map(Value::String),
        ];
        leaf.prop_recursive(8, 64, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map("[a-z_\"]{0,6}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn depth(v: &Value) -> usize {
        match v {
            Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
            Value::Object(m) => 1 + m.values().map(depth).max().unwrap_or(0),
            _ => 0,
        }
    }

    const FIELDS: &[&str] = &[
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "n",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "echo",
        "stop",
        "use_beam_search",
        "tools",
        "tool_choice",
        "response_format",
        "prompt_embeds",
        "continue_final_message",
        "add_generation_prompt",
    ];

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn depth_agrees_with_the_parsed_value(v in json(), pretty in any::<bool>(), limit in 0usize..10) {
            let text = if pretty { serde_json::to_string_pretty(&v) } else { serde_json::to_string(&v) }.unwrap();
            prop_assert_eq!(check_depth(text.as_bytes(), limit).is_ok(), depth(&v) <= limit, "{}", text);
        }

        /// The one-scan path refuses and accepts exactly as `check_depth` then `JsonBody::parse`,
        /// at every nesting depth around the scanner's own bound and at limits on both sides of it.
        #[test]
        fn parse_bounded_is_check_depth_then_parse(
            v in json(),
            wrap in 0usize..70,
            limit in prop_oneof![0usize..8, 60usize..70, Just(kvtransfer::checks::MAX_JSON_DEPTH)],
            cut in any::<prop::sample::Index>(),
            truncate in any::<bool>(),
        ) {
            let inner = serde_json::to_string(&v).unwrap();
            let mut text = format!("{}{inner}{}", r#"{"a":["#.repeat(wrap), "]}".repeat(wrap));
            // (The wrapped value is an array inside an object per level: two levels each.)
            if wrap == 0 {
                text = format!(r#"{{"v":{inner}}}"#);
            }
            let mut bytes = text.clone().into_bytes();
            if truncate {
                bytes.truncate(cut.index(bytes.len()));
            }
            let raw = Bytes::from(bytes);
            let two_steps = check_depth(&raw, limit)
                .map_err(|e| e.message)
                .and_then(|()| JsonBody::parse(raw.clone()).map_err(|e| e.to_string()));
            let one = kvtransfer::parse_bounded(raw, limit).map_err(|r| match r {
                kvtransfer::Refused::TooDeep(e) => e.message,
                kvtransfer::Refused::Body(e) => e.to_string(),
            });
            match (one, two_steps) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a.to_bytes(), b.to_bytes()),
                (Err(a), Err(b)) => prop_assert_eq!(a, b),
                (a, b) => prop_assert!(false, "one scan {:?}, two steps {:?}: {}", a.map(|_| ()), b.map(|_| ()), text),
            }
        }

        #[test]
        fn checks_never_panic_and_answer_400(
            fields in prop::collection::btree_map(prop::sample::select(FIELDS), json(), 0..8),
            chat in any::<bool>(),
        ) {
            let body: serde_json::Map<String, Value> =
                fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
            let text = serde_json::to_vec(&body).unwrap();
            let parsed = JsonBody::parse(Bytes::from(text)).unwrap();
            let endpoint = if chat { Endpoint::ChatCompletions } else { Endpoint::Completions };
            if let Err(e) = check_request(&parsed, endpoint, &Limits::default()) {
                prop_assert_eq!(e.status, 400);
                prop_assert!(!e.message.is_empty());
                prop_assert!(serde_json::from_slice::<Value>(&e.to_json()).is_ok());
            }
            let _ = batch_param(&parsed, endpoint);
        }
    }
}
