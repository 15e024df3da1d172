//! Response bodies in vLLM 0.33's shapes, written by hand so the hot path is
//! one buffer and no intermediate JSON tree.

use std::fmt::Write;

use crate::request::Endpoint;

/// One generated choice.
#[derive(Debug, Clone)]
pub(crate) struct ChoiceOut {
    pub words: Vec<&'static str>,
    pub finish: &'static str,
    pub stop_reason: Option<String>,
}

/// Identity shared by every chunk of one response.
pub(crate) struct Head<'a> {
    pub endpoint: Endpoint,
    /// JSON-escaped id, with quotes.
    pub id: &'a str,
    pub created: u64,
    /// JSON-escaped model name, with quotes.
    pub model: &'a str,
}

/// Token accounting for `usage`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Usage {
    pub prompt: u32,
    pub completion: u32,
    /// `None`: `prompt_tokens_details` is null (vLLM without `--enable-prompt-tokens-details`).
    pub cached: Option<u32>,
}

pub(crate) fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_owned())
}

fn stop_reason_json(s: &Option<String>) -> String {
    s.as_deref().map_or_else(|| "null".to_owned(), json_str)
}

fn push_usage(out: &mut String, u: Usage) {
    let _ = write!(
        out,
        "{{\"prompt_tokens\":{},\"total_tokens\":{},\"completion_tokens\":{},\"prompt_tokens_details\":",
        u.prompt,
        u64::from(u.prompt) + u64::from(u.completion),
        u.completion,
    );
    match u.cached {
        Some(c) => {
            let _ = write!(out, "{{\"cached_tokens\":{c}}}}}");
        }
        None => out.push_str("null}"),
    }
}

fn push_text(out: &mut String, words: &[&str]) {
    // Generated words are plain ASCII: no escaping needed.
    for w in words {
        out.push(' ');
        out.push_str(w);
    }
}

/// A complete non-streaming body of completions or chat (`respond_api` writes the Responses
/// and Messages ones).
pub(crate) fn full_body(
    head: &Head<'_>,
    choices: &[ChoiceOut],
    usage: Usage,
    kv: Option<&str>,
) -> String {
    let mut out = String::with_capacity(512 + choices.len() * 128);
    let object = match head.endpoint {
        Endpoint::Completions => "text_completion",
        _ => "chat.completion",
    };
    let _ = write!(
        out,
        "{{\"id\":{},\"object\":\"{object}\",\"created\":{},\"model\":{},\"choices\":[",
        head.id, head.created, head.model
    );
    for (i, c) in choices.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        match head.endpoint {
            Endpoint::Completions => {
                let _ = write!(out, "{{\"index\":{i},\"text\":\"");
                push_text(&mut out, &c.words);
                let _ = write!(
                    out,
                    "\",\"logprobs\":null,\"finish_reason\":\"{}\",\"stop_reason\":{},\"prompt_logprobs\":null}}",
                    c.finish,
                    stop_reason_json(&c.stop_reason)
                );
            }
            _ => {
                let _ = write!(
                    out,
                    "{{\"index\":{i},\"message\":{{\"role\":\"assistant\",\"content\":\""
                );
                push_text(&mut out, &c.words);
                let _ = write!(
                    out,
                    "\",\"refusal\":null,\"annotations\":null,\"audio\":null,\"function_call\":null,\"tool_calls\":[],\"reasoning_content\":null}},\"logprobs\":null,\"finish_reason\":\"{}\",\"stop_reason\":{}}}",
                    c.finish,
                    stop_reason_json(&c.stop_reason)
                );
            }
        }
    }
    out.push_str("],\"service_tier\":null,\"system_fingerprint\":null,\"usage\":");
    push_usage(&mut out, usage);
    if head.endpoint == Endpoint::Chat {
        out.push_str(",\"prompt_logprobs\":null");
    }
    out.push_str(",\"kv_transfer_params\":");
    out.push_str(kv.unwrap_or("null"));
    out.push('}');
    out
}

fn chunk_open(out: &mut String, head: &Head<'_>) {
    let object = match head.endpoint {
        Endpoint::Completions => "text_completion",
        _ => "chat.completion.chunk",
    };
    let _ = write!(
        out,
        "data: {{\"id\":{},\"object\":\"{object}\",\"created\":{},\"model\":{},\"choices\":[",
        head.id, head.created, head.model
    );
}

/// The chat role chunk sent before the first token of choice `index`.
pub(crate) fn role_event(out: &mut String, head: &Head<'_>, index: usize) {
    chunk_open(out, head);
    let _ = write!(
        out,
        "{{\"index\":{index},\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
    );
}

/// One token event for choice `index`; `finish` set on its last token.
pub(crate) fn token_event(
    out: &mut String,
    head: &Head<'_>,
    index: usize,
    word: Option<&str>,
    finish: Option<(&str, &Option<String>)>,
    kv: Option<&str>,
) {
    chunk_open(out, head);
    let text = word.unwrap_or("");
    let sep = if word.is_some() { " " } else { "" };
    let (fr, sr) = match finish {
        Some((f, s)) => (format!("\"{f}\""), stop_reason_json(s)),
        None => ("null".to_owned(), "null".to_owned()),
    };
    match head.endpoint {
        Endpoint::Completions => {
            let _ = write!(
                out,
                "{{\"index\":{index},\"text\":\"{sep}{text}\",\"logprobs\":null,\"finish_reason\":{fr},\"stop_reason\":{sr}}}]"
            );
        }
        _ => {
            let _ = write!(
                out,
                "{{\"index\":{index},\"delta\":{{\"content\":\"{sep}{text}\"}},\"logprobs\":null,\"finish_reason\":{fr},\"stop_reason\":{sr}}}]"
            );
        }
    }
    if let Some(kv) = kv {
        out.push_str(",\"kv_transfer_params\":");
        out.push_str(kv);
    }
    out.push_str("}\n\n");
}

/// The final usage chunk (`stream_options.include_usage`).
pub(crate) fn usage_event(out: &mut String, head: &Head<'_>, usage: Usage) {
    chunk_open(out, head);
    out.push_str("],\"usage\":");
    push_usage(out, usage);
    out.push_str("}\n\n");
}

/// `data: {"error": ...}` for a failure after the 200 head.
pub(crate) fn error_event(out: &mut String, error_json: &str) {
    out.push_str("data: ");
    out.push_str(error_json);
    out.push_str("\n\n");
}

/// The stream terminator.
pub(crate) const DONE: &str = "data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    fn head(endpoint: Endpoint) -> Head<'static> {
        Head {
            endpoint,
            id: "\"cmpl-1\"",
            created: 7,
            model: "\"m\"",
        }
    }

    #[test]
    fn bodies_are_valid_json() {
        let c = ChoiceOut {
            words: vec!["a", "b"],
            finish: "stop",
            stop_reason: Some("x\"y".into()),
        };
        let u = Usage {
            prompt: 3,
            completion: 2,
            cached: Some(0),
        };
        for ep in [Endpoint::Completions, Endpoint::Chat] {
            let body = full_body(&head(ep), std::slice::from_ref(&c), u, Some("{\"k\":1}"));
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["usage"]["total_tokens"], 5);
            assert_eq!(v["kv_transfer_params"]["k"], 1);
            assert_eq!(v["choices"][0]["stop_reason"], "x\"y");
            let mut s = String::new();
            role_event(&mut s, &head(ep), 0);
            token_event(
                &mut s,
                &head(ep),
                0,
                Some("a"),
                Some(("length", &None)),
                Some("null"),
            );
            usage_event(&mut s, &head(ep), u);
            for ev in s.split("\n\n").filter(|e| !e.is_empty()) {
                let json = ev.strip_prefix("data: ").unwrap();
                serde_json::from_str::<serde_json::Value>(json).unwrap();
            }
        }
    }
}
