//! Response bodies of `/v1/responses` and `/v1/messages` in vLLM 0.32's shapes (the fields a
//! client and the gateway read; vLLM sends more). Both carry a top-level `kv_transfer_params`
//! on a prefill's answer, as chat does. Streams are named SSE events (`event:` and `data:`),
//! without `[DONE]`.

use std::fmt::Write;

use crate::request::Endpoint;
use crate::respond::{ChoiceOut, Head, Usage};

fn text_json(words: &[&str]) -> String {
    let mut s = String::new();
    for w in words {
        s.push(' ');
        s.push_str(w);
    }
    crate::respond::json_str(&s)
}

fn responses_usage(u: Usage) -> String {
    format!(
        "{{\"input_tokens\":{},\"input_tokens_details\":{{\"cached_tokens\":{}}},\"output_tokens\":{},\"output_tokens_details\":{{\"reasoning_tokens\":0}},\"total_tokens\":{}}}",
        u.prompt,
        u.cached.unwrap_or(0),
        u.completion,
        u64::from(u.prompt) + u64::from(u.completion)
    )
}

/// Anthropic's split: `input_tokens` are the uncached ones, `cache_read_input_tokens` the rest.
fn messages_usage(u: Usage) -> String {
    let cached = u.cached.unwrap_or(0).min(u.prompt);
    format!(
        "{{\"input_tokens\":{},\"output_tokens\":{},\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":{cached}}}",
        u.prompt - cached,
        u.completion
    )
}

fn stop_reason(c: &ChoiceOut) -> &'static str {
    match (c.finish, &c.stop_reason) {
        ("length", _) => "max_tokens",
        (_, Some(_)) => "stop_sequence",
        _ => "end_turn",
    }
}

/// The Responses API's `response` object; `choice` `None`: in progress, nothing yet.
fn response_object(
    head: &Head<'_>,
    choice: Option<&ChoiceOut>,
    usage: Option<Usage>,
    kv: &str,
) -> String {
    let mut out = String::with_capacity(512);
    let (status, incomplete) = match choice {
        None => ("in_progress", "null"),
        Some(c) if c.finish == "length" => ("incomplete", "{\"reason\":\"max_output_tokens\"}"),
        Some(_) => ("completed", "null"),
    };
    let _ = write!(
        out,
        "{{\"id\":{},\"created_at\":{},\"incomplete_details\":{incomplete},\"model\":{},\"object\":\"response\",\"output\":[",
        head.id, head.created, head.model
    );
    if let Some(c) = choice {
        let _ = write!(
            out,
            "{{\"id\":\"msg_{}\",\"content\":[{{\"annotations\":[],\"text\":{},\"type\":\"output_text\",\"logprobs\":null}}],\"role\":\"assistant\",\"status\":\"completed\",\"type\":\"message\"}}",
            head.created,
            text_json(&c.words)
        );
    }
    let usage = usage.map_or_else(|| "null".to_owned(), responses_usage);
    let _ = write!(
        out,
        "],\"status\":\"{status}\",\"usage\":{usage},\"kv_transfer_params\":{kv}}}"
    );
    out
}

/// A complete non-streaming body.
pub(crate) fn full_body(head: &Head<'_>, choice: &ChoiceOut, usage: Usage, kv: &str) -> String {
    match head.endpoint {
        Endpoint::Messages => format!(
            "{{\"id\":{},\"type\":\"message\",\"role\":\"assistant\",\"content\":[{{\"type\":\"text\",\"text\":{}}}],\"model\":{},\"stop_reason\":\"{}\",\"stop_sequence\":{},\"usage\":{},\"kv_transfer_params\":{kv}}}",
            head.id,
            text_json(&choice.words),
            head.model,
            stop_reason(choice),
            choice
                .stop_reason
                .as_deref()
                .map_or_else(|| "null".to_owned(), crate::respond::json_str),
            messages_usage(usage)
        ),
        _ => response_object(head, Some(choice), Some(usage), kv),
    }
}

fn event(out: &mut String, name: &str, data: &str) {
    let _ = write!(out, "event: {name}\ndata: {data}\n\n");
}

/// The events before the first token.
pub(crate) fn stream_open(out: &mut String, head: &Head<'_>, usage: Usage) {
    match head.endpoint {
        Endpoint::Messages => {
            let start = format!(
                "{{\"type\":\"message_start\",\"message\":{{\"id\":{},\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":{},\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{{\"input_tokens\":{},\"output_tokens\":0}}}}}}",
                head.id, head.model, usage.prompt
            );
            event(out, "message_start", &start);
            event(
                out,
                "content_block_start",
                "{\"type\":\"content_block_start\",\"content_block\":{\"type\":\"text\",\"text\":\"\"},\"index\":0}",
            );
        }
        _ => {
            let created = format!(
                "{{\"response\":{},\"sequence_number\":0,\"type\":\"response.created\"}}",
                response_object(head, None, None, "null")
            );
            event(out, "response.created", &created);
        }
    }
}

/// One token.
pub(crate) fn stream_token(out: &mut String, head: &Head<'_>, word: &str, seq: usize) {
    let text = crate::respond::json_str(&format!(" {word}"));
    match head.endpoint {
        Endpoint::Messages => {
            let data = format!(
                "{{\"type\":\"content_block_delta\",\"delta\":{{\"type\":\"text_delta\",\"text\":{text}}},\"index\":0}}"
            );
            event(out, "content_block_delta", &data);
        }
        _ => {
            let data = format!(
                "{{\"content_index\":0,\"delta\":{text},\"item_id\":\"msg_{}\",\"output_index\":0,\"sequence_number\":{},\"type\":\"response.output_text.delta\"}}",
                head.created,
                seq + 1
            );
            event(out, "response.output_text.delta", &data);
        }
    }
}

/// The events after the last token (the final usage and, for a prefill, the transfer
/// parameters).
pub(crate) fn stream_close(
    out: &mut String,
    head: &Head<'_>,
    choice: &ChoiceOut,
    usage: Usage,
    kv: &str,
    seq: usize,
) {
    match head.endpoint {
        Endpoint::Messages => {
            event(
                out,
                "content_block_stop",
                "{\"type\":\"content_block_stop\",\"index\":0}",
            );
            let delta = format!(
                "{{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":\"{}\",\"stop_sequence\":null}},\"usage\":{}}}",
                stop_reason(choice),
                messages_usage(usage)
            );
            event(out, "message_delta", &delta);
            event(out, "message_stop", "{\"type\":\"message_stop\"}");
        }
        _ => {
            let done = format!(
                "{{\"response\":{},\"sequence_number\":{},\"type\":\"response.completed\"}}",
                response_object(head, Some(choice), Some(usage), kv),
                seq + 1
            );
            event(out, "response.completed", &done);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_and_events_are_valid_json() {
        let c = ChoiceOut {
            words: vec!["a", "b"],
            finish: "length",
            stop_reason: None,
        };
        let u = Usage {
            prompt: 10,
            completion: 2,
            cached: Some(4),
        };
        for ep in [Endpoint::Responses, Endpoint::Messages] {
            let head = Head {
                endpoint: ep,
                id: "\"x\"",
                created: 7,
                model: "\"m\"",
            };
            let v: serde_json::Value =
                serde_json::from_str(&full_body(&head, &c, u, "{\"k\":1}")).unwrap();
            assert_eq!(v["kv_transfer_params"]["k"], 1);
            let mut s = String::new();
            stream_open(&mut s, &head, u);
            stream_token(&mut s, &head, "a", 0);
            stream_close(&mut s, &head, &c, u, "null", 1);
            for ev in s.split("\n\n").filter(|e| !e.is_empty()) {
                let (name, data) = ev.split_once('\n').unwrap();
                assert!(name.starts_with("event: "), "{ev}");
                let json = data.strip_prefix("data: ").unwrap();
                serde_json::from_str::<serde_json::Value>(json).unwrap();
            }
        }
        let head = Head {
            endpoint: Endpoint::Messages,
            id: "\"x\"",
            created: 7,
            model: "\"m\"",
        };
        let v: serde_json::Value = serde_json::from_str(&full_body(&head, &c, u, "null")).unwrap();
        assert_eq!(v["usage"]["input_tokens"], 6);
        assert_eq!(v["usage"]["cache_read_input_tokens"], 4);
        assert_eq!(v["content"][0]["text"], " a b");
    }
}
