//! Encoder disaggregation (EPD, contracts §14): vLLM's encoder-cache (EC) connector.
//!
//! A multimodal chat request goes encoder -> prefill -> decode. The gateway splits the request's
//! multimodal content parts into one encoder request each ([`encoder_requests`]), checks each
//! encoder's answer ([`check_encoder_answer`]), merges the answers' `ec_transfer_params` into one
//! object keyed by the encoders' multimodal hashes ([`merge_ec_params`]) and sets it on the
//! prefill body ([`with_ec_params`]). The prefill's EC connector finds each of its items' hash in
//! that object and loads the encoder's output from where the entry says.
//!
//! Pure, like the agents: bytes in, bytes out. Which encoder serves an item, timeouts and
//! retries are the gateway's.
//!
//! ```
//! use bytes::Bytes;
//! use kvtransfer::JsonBody;
//! use kvtransfer::encoder::{check_encoder_answer, encoder_requests, merge_ec_params, with_ec_params};
//!
//! let client = JsonBody::parse(Bytes::from_static(br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x/cat.jpg"}},{"type":"text","text":"What is this?"}]}]}"#)).unwrap();
//! let requests = encoder_requests(&client);
//! assert_eq!(
//!     &requests[0][..],
//!     br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x/cat.jpg"}}]}],"max_tokens":1,"stream":false}"#
//! );
//! // ... the gateway sends it to an encoder, which answers:
//! let answer = br#"{"id":"chatcmpl-1","choices":[],"ec_transfer_params":{"9f2c":{"do_remote_encode":true,"remote_host":"10.0.0.5","remote_port":9198}}}"#;
//! let item = check_encoder_answer(answer).unwrap().expect("a handle");
//! let params = merge_ec_params(&[item]).expect("one item");
//! let prefill = with_ec_params(br#"{"model":"m","max_tokens":1}"#, &params).unwrap();
//! assert_eq!(
//!     &prefill[..],
//!     br#"{"model":"m","max_tokens":1,"ec_transfer_params":{"9f2c":{"do_remote_encode":true,"remote_host":"10.0.0.5","remote_port":9198}}}"#
//! );
//! ```

use std::borrow::Cow;

use bytes::{BufMut, Bytes, BytesMut};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::body::{BodyError, JsonBody, json_type_name, with_member};

/// Top-level key carrying encoder-cache transfer parameters (vLLM's `ec_transfer_params`, on
/// chat requests and on their answers).
pub const EC_TRANSFER_PARAMS: &str = "ec_transfer_params";

/// Content-part types the upstream proxy sends to encoders (`MM_TYPES` of vLLM's
/// `disagg_epd_proxy.py`).
pub const MULTIMODAL_PART_TYPES: [&str; 4] = ["image_url", "audio_url", "input_audio", "video_url"];

/// Client body keys copied onto each encoder request, as the upstream proxy copies them: they
/// change how an item is processed (and so what it hashes to).
pub const ENCODER_CARRIED_KEYS: [&str; 4] = [
    "mm_processor_kwargs",
    "media_io_kwargs",
    "priority",
    "session_id",
];

/// A key of an encoder's `ec_transfer_params` that is not an item's hash: the push-mode
/// connectors' list of transfers (`[{"mm_hash":..,"transfer_id":..}]`).
pub const EC_ITEMS: &str = "ec_items";

/// One multimodal content part of a chat request, as the client wrote it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MultimodalPart<'a> {
    /// Index of the message holding it.
    pub message: usize,
    /// Its `type` (one of [`MULTIMODAL_PART_TYPES`]).
    pub kind: &'static str,
    /// The part's JSON text, byte for byte.
    pub raw: &'a str,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
}

/// The multimodal content parts of `body`'s `messages`, in order (every part whose `type` is one
/// of [`MULTIMODAL_PART_TYPES`], in every message whose `content` is a list). A body the gateway
/// cannot read this way (no `messages`, not a list, a part that is not an object) has none here:
/// the engines refuse what is invalid, with their own message.
pub fn multimodal_parts(body: &JsonBody) -> Vec<MultimodalPart<'_>> {
    let Some(raw) = body.get_raw("messages") else {
        return Vec::new();
    };
    let Ok(messages) = serde_json::from_str::<Vec<&RawValue>>(raw) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        let Ok(Message {
            content: Some(content),
        }) = serde_json::from_str::<Message<'_>>(message.get())
        else {
            continue;
        };
        let Ok(parts) = serde_json::from_str::<Vec<&RawValue>>(content.get()) else {
            // A string (or anything else): no parts.
            continue;
        };
        for part in parts {
            let Ok(Part { kind: Some(kind) }) = serde_json::from_str::<Part<'_>>(part.get()) else {
                continue;
            };
            if let Some(known) = MULTIMODAL_PART_TYPES.iter().find(|t| **t == kind.as_ref()) {
                out.push(MultimodalPart {
                    message: i,
                    kind: known,
                    raw: part.get(),
                });
            }
        }
    }
    out
}

/// The encoder request for `part` of the client's chat `body`: the part alone in one user
/// message, the client's `model` and [`ENCODER_CARRIED_KEYS`], `max_tokens: 1`, not streamed.
/// Nothing else of the client's body goes to an encoder (no text, no transfer fields).
pub fn encoder_request(body: &JsonBody, part: &MultimodalPart<'_>) -> Bytes {
    let mut out = BytesMut::with_capacity(part.raw.len() + 128);
    out.put_slice(b"{");
    if let Some(model) = body.get_raw("model") {
        out.put_slice(b"\"model\":");
        out.put_slice(model.trim().as_bytes());
        out.put_slice(b",");
    }
    out.put_slice(br#""messages":[{"role":"user","content":["#);
    out.put_slice(part.raw.as_bytes());
    out.put_slice(br#"]}],"max_tokens":1,"stream":false"#);
    for key in ENCODER_CARRIED_KEYS {
        if let Some(value) = body.get_raw(key) {
            out.put_slice(b",\"");
            out.put_slice(key.as_bytes());
            out.put_slice(b"\":");
            out.put_slice(value.trim().as_bytes());
        }
    }
    out.put_slice(b"}");
    out.freeze()
}

/// One encoder request per multimodal part of `body` ([`encoder_request`]), in order; empty for
/// a text-only request.
pub fn encoder_requests(body: &JsonBody) -> Vec<Bytes> {
    multimodal_parts(body)
        .iter()
        .map(|p| encoder_request(body, p))
        .collect()
}

/// Why an encoder's answer cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum EncoderAnswerError {
    /// Not a JSON object (or a repeated `ec_transfer_params`).
    #[error("encoder answer is not a JSON object: {0}")]
    NotObject(String),
    /// `ec_transfer_params` is neither an object nor null.
    #[error("encoder answer's ec_transfer_params has unexpected type {0} (want object)")]
    UnexpectedType(&'static str),
    /// `ec_transfer_params` is not readable as an object with unique keys.
    #[error("encoder answer's ec_transfer_params: {0}")]
    Params(#[source] BodyError),
    /// An item's entry is not an object.
    #[error(
        "encoder answer's ec_transfer_params[{hash:?}] has unexpected type {found} (want object)"
    )]
    EntryNotObject {
        /// The item's hash.
        hash: String,
        /// JSON type found.
        found: &'static str,
    },
    /// An entry under an empty hash.
    #[error("encoder answer's ec_transfer_params has an entry under an empty hash")]
    EmptyHash,
    /// More than one item for a request that carried one.
    #[error("encoder answered {0} items for a request with one")]
    TooMany(usize),
}

/// What one encoder answered about the item it encoded: the item's multimodal hash and the
/// connector's handle on it (opaque JSON object text, kept byte for byte).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodedItem {
    /// The item's hash as the encoder computed it (the key the prefill looks up).
    pub mm_hash: String,
    /// The entry: for vLLM's Mooncake EC connector
    /// `{"do_remote_encode":true,"remote_host":..,"remote_port":..}`.
    pub params: Bytes,
}

#[derive(Deserialize)]
struct Answer<'a> {
    #[serde(borrow, default)]
    ec_transfer_params: Option<&'a RawValue>,
}

/// Checks the answer of an encoder to one [`encoder_request`]. `Ok(None)`: no handle (no
/// `ec_transfer_params`, `null`, or an object without item entries), as connectors that publish
/// by hash alone (vLLM's ExampleConnector, shared storage) answer; the prefill then finds the
/// item by its hash.
///
/// # Errors
/// [`EncoderAnswerError`] for an answer that is not a JSON object, `ec_transfer_params` of
/// another type or with repeated keys, an entry that is not an object or has an empty hash, or
/// more than one entry.
pub fn check_encoder_answer(answer: &[u8]) -> Result<Option<EncodedItem>, EncoderAnswerError> {
    // (A derived struct would also read a JSON array.)
    let found = json_type_name(answer);
    if found != "object" {
        return Err(EncoderAnswerError::NotObject(format!("found {found}")));
    }
    let parsed: Answer<'_> =
        serde_json::from_slice(answer).map_err(|e| EncoderAnswerError::NotObject(e.to_string()))?;
    let Some(raw) = parsed.ec_transfer_params else {
        return Ok(None);
    };
    match json_type_name(raw.get().as_bytes()) {
        "null" => return Ok(None),
        "object" => {}
        other => return Err(EncoderAnswerError::UnexpectedType(other)),
    }
    let params = JsonBody::parse(Bytes::copy_from_slice(raw.get().as_bytes()))
        .map_err(EncoderAnswerError::Params)?;
    let hashes: Vec<&str> = params.keys().filter(|k| *k != EC_ITEMS).collect();
    let hash = match hashes.as_slice() {
        [] => return Ok(None),
        [one] => *one,
        many => return Err(EncoderAnswerError::TooMany(many.len())),
    };
    if hash.is_empty() {
        return Err(EncoderAnswerError::EmptyHash);
    }
    let entry = params.get_raw_bytes(hash).unwrap_or_default();
    match json_type_name(&entry) {
        "object" => Ok(Some(EncodedItem {
            mm_hash: hash.to_owned(),
            params: Bytes::copy_from_slice(crate::body::trim_json_ws(&entry)),
        })),
        found => Err(EncoderAnswerError::EntryNotObject {
            hash: hash.to_owned(),
            found,
        }),
    }
}

/// The prefill's `ec_transfer_params`: one object keyed by the items' hashes, each entry as its
/// encoder answered it. An item encoded twice (the same image twice in one request) keeps the
/// last answer, as the upstream proxy's dict update does. `None` without items.
pub fn merge_ec_params(items: &[EncodedItem]) -> Option<Bytes> {
    if items.is_empty() {
        return None;
    }
    let mut out = BytesMut::with_capacity(items.iter().map(|i| i.params.len() + 72).sum());
    out.put_u8(b'{');
    let mut first = true;
    for (i, item) in items.iter().enumerate() {
        if items[i + 1..]
            .iter()
            .any(|later| later.mm_hash == item.mm_hash)
        {
            continue;
        }
        if !first {
            out.put_u8(b',');
        }
        first = false;
        // A string always serialises.
        let key = serde_json::to_string(&item.mm_hash).unwrap_or_default();
        out.put_slice(key.as_bytes());
        out.put_u8(b':');
        out.put_slice(&item.params);
    }
    out.put_u8(b'}');
    Some(out.freeze())
}

/// `prefill_body` (a JSON object) with its top-level `ec_transfer_params` set to `params` (from
/// [`merge_ec_params`]), every other byte kept.
///
/// # Errors
/// [`BodyError`] when `prefill_body` is not a JSON object.
pub fn with_ec_params(prefill_body: &[u8], params: &[u8]) -> Result<Bytes, BodyError> {
    with_member(prefill_body, EC_TRANSFER_PARAMS, params)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn body(s: &str) -> JsonBody {
        JsonBody::parse(Bytes::from(s.to_owned())).unwrap()
    }

    /// The single request of vLLM's `disagg_1e1p1d_example.sh`.
    const UPSTREAM_EXAMPLE: &str = r#"{
    "model": "Qwen/Qwen3-VL-8B-Instruct",
    "temperature": 0,
    "messages": [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///vllm/tests/v1/ec_connector/integration/hato.jpg"}},
        {"type": "text", "text": "What is in this image?"}
    ]}
    ]
    }"#;

    #[test]
    fn the_upstream_example_makes_one_text_free_encoder_request() {
        let b = body(UPSTREAM_EXAMPLE);
        let parts = multimodal_parts(&b);
        assert_eq!(parts.len(), 1);
        assert_eq!((parts[0].message, parts[0].kind), (1, "image_url"));
        let reqs = encoder_requests(&b);
        assert_eq!(
            std::str::from_utf8(&reqs[0]).unwrap(),
            r#"{"model":"Qwen/Qwen3-VL-8B-Instruct","messages":[{"role":"user","content":[{"type": "image_url", "image_url": {"url": "file:///vllm/tests/v1/ec_connector/integration/hato.jpg"}}]}],"max_tokens":1,"stream":false}"#
        );
        // Valid JSON, without the text or the sampling parameters.
        let v: serde_json::Value = serde_json::from_slice(&reqs[0]).unwrap();
        assert!(v.get("temperature").is_none());
        assert!(!reqs[0].windows(4).any(|w| w == b"text"));
    }

    #[test]
    fn every_multimodal_part_of_every_message_in_order() {
        // vLLM's benchmark sends three images per request (`--random-mm-base-items-per-request 3`).
        let b = body(
            r#"{"model":"m","mm_processor_kwargs":{"max_pixels":1000},"kv_transfer_params":{},"messages":[
            {"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,AAA"}},{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"http://h/b.png"}}]},
            {"role":"assistant","content":"ok"},
            {"role":"user","content":[{"type":"input_audio","input_audio":{"data":"UklG","format":"wav"}},{"type":"video_url","video_url":{"url":"http://h/v.mp4"}},{"type":"audio_url","audio_url":{"url":"http://h/a.wav"}},{"type":"image_embeds"},{"type":"file"}]}]}"#,
        );
        let parts = multimodal_parts(&b);
        let kinds: Vec<_> = parts.iter().map(|p| (p.message, p.kind)).collect();
        assert_eq!(
            kinds,
            [
                (0, "image_url"),
                (0, "image_url"),
                (2, "input_audio"),
                (2, "video_url"),
                (2, "audio_url")
            ]
        );
        let reqs = encoder_requests(&b);
        assert_eq!(reqs.len(), 5);
        assert_eq!(
            std::str::from_utf8(&reqs[1]).unwrap(),
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://h/b.png"}}]}],"max_tokens":1,"stream":false,"mm_processor_kwargs":{"max_pixels":1000}}"#
        );
        // The client's transfer fields never reach an encoder.
        assert!(reqs.iter().all(|r| !r.windows(8).any(|w| w == b"transfer")));
    }

    #[test]
    fn text_only_and_unreadable_bodies_have_no_parts() {
        for s in [
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
            r#"{"model":"m","prompt":"hi"}"#,
            r#"{"messages":"not a list"}"#,
            r#"{"messages":[1,{"content":[7,"x",{"type":3},{"image_url":{}}]}]}"#,
            r#"{"messages":[{"role":"user","content":null}]}"#,
        ] {
            assert!(encoder_requests(&body(s)).is_empty(), "{s}");
        }
        // No model: the encoder request has none either (the engine answers for it).
        let b =
            body(r#"{"messages":[{"content":[{"type":"image_url","image_url":{"url":"u"}}]}]}"#);
        assert!(encoder_requests(&b)[0].starts_with(br#"{"messages":"#));
    }

    #[test]
    fn a_mooncake_answer_gives_its_item() {
        // `MooncakeECConnectorScheduler.request_finished` on the encoder (ec_producer).
        let answer = br#"{"id":"chatcmpl-e1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":""},"finish_reason":"length"}],"kv_transfer_params":null,"ec_transfer_params":{"5d41402abc4b2a76b9719d911017c592":{"do_remote_encode":true,"remote_host":"10.0.0.5","remote_port":9198}}}"#;
        let item = check_encoder_answer(answer).unwrap().unwrap();
        assert_eq!(item.mm_hash, "5d41402abc4b2a76b9719d911017c592");
        assert_eq!(
            &item.params[..],
            br#"{"do_remote_encode":true,"remote_host":"10.0.0.5","remote_port":9198}"#
        );
    }

    #[test]
    fn a_nixl_style_answer_with_metadata_and_ec_items_gives_its_item() {
        let answer = br#"{"ec_transfer_params":{"ec_items":[{"transfer_id":"t"}],"h1":{"metadata":{"image_grid_thw":[1,2,2]},"peer_host":"10.0.0.6","peer_port":5600,"size_bytes":9007199254740993}}}"#;
        let item = check_encoder_answer(answer).unwrap().unwrap();
        assert_eq!(item.mm_hash, "h1");
        assert!(item.params.ends_with(b"\"size_bytes\":9007199254740993}"));
    }

    #[test]
    fn answers_without_a_handle() {
        for a in [
            &br#"{"id":"x","choices":[]}"#[..],
            br#"{"ec_transfer_params":null}"#,
            br#"{"ec_transfer_params":{}}"#,
            br#"{"ec_transfer_params":{"ec_items":[]}}"#,
        ] {
            assert_eq!(check_encoder_answer(a).unwrap(), None);
        }
    }

    #[test]
    fn malformed_answers_are_errors() {
        let err = |a: &[u8]| check_encoder_answer(a).unwrap_err().to_string();
        assert!(err(b"not json").contains("not a JSON object"));
        assert!(err(b"[]").contains("not a JSON object"));
        assert!(err(br#"{"ec_transfer_params":"h"}"#).contains("unexpected type string"));
        assert!(err(br#"{"ec_transfer_params":[]}"#).contains("unexpected type array"));
        assert!(err(br#"{"ec_transfer_params":{"h":1}}"#).contains("unexpected type number"));
        assert!(err(br#"{"ec_transfer_params":{"":{}}}"#).contains("empty hash"));
        assert!(err(br#"{"ec_transfer_params":{"a":{},"b":{}}}"#).contains("2 items"));
        assert!(err(br#"{"ec_transfer_params":{"a":{},"a":{}}}"#).contains("duplicate"));
        assert!(err(br#"{"ec_transfer_params":{},"ec_transfer_params":{}}"#).contains("duplicate"));
    }

    #[test]
    fn merged_params_key_every_item_once_and_set_in_place() {
        let item = |h: &str, p: &'static str| EncodedItem {
            mm_hash: h.into(),
            params: Bytes::from_static(p.as_bytes()),
        };
        assert_eq!(merge_ec_params(&[]), None);
        let merged = merge_ec_params(&[
            item("a", r#"{"remote_port":1}"#),
            item("b\"q", r#"{"remote_port":2}"#),
            item("a", r#"{"remote_port":3}"#),
        ])
        .unwrap();
        assert_eq!(
            &merged[..],
            br#"{"b\"q":{"remote_port":2},"a":{"remote_port":3}}"#
        );
        let prefill = with_ec_params(
            br#"{ "model" : "m", "ec_transfer_params" : {"stale":{}}, "n":9007199254740993 }"#,
            &merged,
        )
        .unwrap();
        assert_eq!(
            &prefill[..],
            br#"{ "model" : "m", "ec_transfer_params" : {"b\"q":{"remote_port":2},"a":{"remote_port":3}}, "n":9007199254740993 }"#
        );
        assert!(with_ec_params(b"[1]", &merged).is_err());
    }
}
