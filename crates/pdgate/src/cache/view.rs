//! The prefix view of a request: its block keys, computed once from the parsed body.
//!
//! Token keys when the prompt is token ids or a tokenizer is configured for the model (the same
//! keys the engines' KV events produce, so precise matching works); approximate text keys
//! otherwise (blocks of the prompt's bytes, or of the chat messages serialized in order: the
//! whole conversation, so a follow-up turn shares the earlier turns' blocks).

use std::borrow::Cow;

use kvtransfer::JsonBody;
use pdcache::keys::{BYTES_PER_TOKEN, BlockKey, TextKeys, text_keys, token_keys};
use pdcache::tokenizer::HfTokenizer;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::route::Route;

/// Which kind of keys a view holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KeyKind {
    /// Chained keys over token blocks (as the engines' events).
    Tokens,
    /// Chained keys over byte blocks of the text (approximate).
    Text,
}

/// A request's prefix: its full blocks' keys and its (estimated) prompt length.
#[derive(Clone, Debug)]
pub(crate) struct PrefixView {
    pub(crate) keys: Vec<BlockKey>,
    pub(crate) kind: KeyKind,
    /// Prompt tokens: exact for token keys, estimated (bytes / 4) for text keys.
    pub(crate) prompt_tokens: u32,
    pub(crate) block_size: u32,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

fn saturate(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl PrefixView {
    fn tokens(tokens: &[u32], block_size: usize) -> Self {
        PrefixView {
            keys: token_keys(tokens, block_size),
            kind: KeyKind::Tokens,
            prompt_tokens: saturate(tokens.len()),
            block_size: saturate(block_size),
        }
    }

    fn text(keys: Vec<BlockKey>, bytes: usize, block_size: usize) -> Self {
        PrefixView {
            keys,
            kind: KeyKind::Text,
            prompt_tokens: saturate(bytes.div_ceil(BYTES_PER_TOKEN)),
            block_size: saturate(block_size),
        }
    }

    /// The view of a prompt's token ids (from an engine's `/tokenize`).
    pub(crate) fn from_tokens(tokens: &[u32], block_size: usize) -> Self {
        Self::tokens(tokens, block_size)
    }

    /// An empty view (nothing to match: the request is scored by load alone).
    pub(crate) fn empty(block_size: usize) -> Self {
        PrefixView {
            keys: Vec::new(),
            kind: KeyKind::Text,
            prompt_tokens: 0,
            block_size: saturate(block_size),
        }
    }

    /// Reads the view of `body`. Never fails: a prompt it cannot read yields an empty view (the
    /// engine will judge the request).
    pub(crate) fn read(
        body: &JsonBody,
        route: Route,
        block_size: usize,
        tokenizer: Option<&HfTokenizer>,
    ) -> Self {
        match route {
            Route::Completions => Self::completion(body, block_size, tokenizer),
            Route::Chat => Self::chat(body, block_size, tokenizer),
            Route::Responses => Self::responses(body, block_size, tokenizer),
            Route::Messages => Self::messages(body, block_size, tokenizer),
        }
        .unwrap_or_else(|| Self::empty(block_size))
    }

    fn completion(
        body: &JsonBody,
        block_size: usize,
        tokenizer: Option<&HfTokenizer>,
    ) -> Option<Self> {
        let raw = body.get_raw_slice("prompt")?.trim_ascii();
        // A string prompt's keys without a tokenizer: its bytes as received, escapes included
        // (as chat contents are keyed), so no unescaped copy and no UTF-8 pass (a measurable
        // share of the cache's cost per request: docs/benchmarks.md). Deterministic, which is all approximate keys need.
        let as_received =
            |text: &[u8]| Self::text(text_keys(text, block_size), text.len(), block_size);
        if tokenizer.is_none()
            && let Some(text) = raw.strip_prefix(b"\"").and_then(|r| r.strip_suffix(b"\""))
        {
            return Some(as_received(text));
        }
        let raw = std::str::from_utf8(raw).ok()?;
        if raw.starts_with('[') {
            // A one-element batch of a string is keyed as that string is.
            if tokenizer.is_none()
                && let Ok([item]) = serde_json::from_str::<[&RawValue; 1]>(raw)
                && let Some(text) = item
                    .get()
                    .strip_prefix('"')
                    .and_then(|r| r.strip_suffix('"'))
            {
                return Some(as_received(text.as_bytes()));
            }
            // Token ids (or a one-element batch of a string or of token ids).
            if let Ok(ids) = serde_json::from_str::<Vec<u32>>(raw) {
                return Some(Self::tokens(&ids, block_size));
            }
            if let Ok([ids]) = serde_json::from_str::<[Vec<u32>; 1]>(raw) {
                return Some(Self::tokens(&ids, block_size));
            }
            let [text] = serde_json::from_str::<[Cow<'_, str>; 1]>(raw).ok()?;
            return Some(Self::prompt_text(&text, block_size, tokenizer));
        }
        let text: Cow<'_, str> = serde_json::from_str(raw).ok()?;
        Some(Self::prompt_text(&text, block_size, tokenizer))
    }

    fn prompt_text(text: &str, block_size: usize, tokenizer: Option<&HfTokenizer>) -> Self {
        if let Some(ids) = tokenizer.and_then(|t| t.encode_prompt(text).ok()) {
            return Self::tokens(&ids, block_size);
        }
        let mut keys = TextKeys::new(block_size);
        keys.push(text.as_bytes());
        Self::text(keys.finish(), text.len(), block_size)
    }

    fn chat(body: &JsonBody, block_size: usize, tokenizer: Option<&HfTokenizer>) -> Option<Self> {
        let raw = body.get_raw("messages")?;
        if let Some(t) = tokenizer.filter(|t| t.has_chat_template()) {
            let add_generation_prompt = body
                .get::<bool>("add_generation_prompt")
                .and_then(Result::ok)
                .unwrap_or(true);
            let tokens = serde_json::from_str::<serde_json::Value>(raw)
                .ok()
                .and_then(|messages| t.encode_chat(&messages, add_generation_prompt).ok());
            if let Some(ids) = tokens {
                return Some(Self::tokens(&ids, block_size));
            }
        }
        let messages: Vec<Message<'_>> = serde_json::from_str(raw).ok()?;
        let mut keys = TextKeys::new(block_size);
        let mut bytes = 0;
        for m in &messages {
            let role = m.role.as_deref().unwrap_or_default();
            // The content as received (a JSON string with its quotes and escapes, or structured
            // parts): deterministic, which is all approximate keys need.
            let content = m.content.map_or("", RawValue::get);
            keys.push_message(role, content.as_bytes());
            bytes += role.len() + content.len() + 2;
        }
        Some(Self::text(keys.finish(), bytes, block_size))
    }

    /// The Responses API's conversation: `instructions` as the system message, then `input` (a
    /// string is one user message; items with a role are messages, other items count by their
    /// type and JSON).
    fn responses(
        body: &JsonBody,
        block_size: usize,
        tokenizer: Option<&HfTokenizer>,
    ) -> Option<Self> {
        let raw = body.get_raw("input")?;
        let mut turns: Vec<(Cow<'_, str>, &RawValue)> = Vec::new();
        let instructions: Option<&RawValue> = body
            .get_raw("instructions")
            .and_then(|r| serde_json::from_str(r).ok())
            .filter(|r: &&RawValue| r.get() != "null");
        if let Some(i) = instructions {
            turns.push((Cow::Borrowed("system"), i));
        }
        let input: &RawValue = serde_json::from_str(raw).ok()?;
        if input.get().starts_with('"') {
            turns.push((Cow::Borrowed("user"), input));
        } else {
            #[derive(Deserialize)]
            struct Item<'a> {
                #[serde(borrow, default)]
                role: Option<Cow<'a, str>>,
                #[serde(borrow, default, rename = "type")]
                kind: Option<Cow<'a, str>>,
                #[serde(borrow, default)]
                content: Option<&'a RawValue>,
            }
            let items: Vec<&RawValue> = serde_json::from_str(input.get()).ok()?;
            for item in items {
                let it: Item<'_> = serde_json::from_str(item.get()).ok()?;
                match (it.role, it.content) {
                    (Some(role), Some(content)) => turns.push((role, content)),
                    (_, _) => turns.push((it.kind.unwrap_or_default(), item)),
                }
            }
        }
        Some(Self::turns(&turns, block_size, tokenizer))
    }

    /// The Messages API's conversation: `system` first, then `messages` (as chat's).
    fn messages(
        body: &JsonBody,
        block_size: usize,
        tokenizer: Option<&HfTokenizer>,
    ) -> Option<Self> {
        let raw = body.get_raw("messages")?;
        let mut turns: Vec<(Cow<'_, str>, &RawValue)> = Vec::new();
        if let Some(system) = body
            .get_raw("system")
            .and_then(|r| serde_json::from_str::<&RawValue>(r).ok())
            .filter(|r| r.get() != "null")
        {
            turns.push((Cow::Borrowed("system"), system));
        }
        let messages: Vec<Message<'_>> = serde_json::from_str(raw).ok()?;
        for m in messages {
            let content = m.content?;
            turns.push((m.role.unwrap_or_default(), content));
        }
        Some(Self::turns(&turns, block_size, tokenizer))
    }

    /// A conversation's view: token keys through the chat template when every content is a
    /// string, else text keys serialized as chat's (so the same conversation on chat, responses
    /// and messages shares its blocks).
    fn turns(
        turns: &[(Cow<'_, str>, &RawValue)],
        block_size: usize,
        tokenizer: Option<&HfTokenizer>,
    ) -> Self {
        if let Some(t) = tokenizer.filter(|t| t.has_chat_template()) {
            let messages: Option<Vec<serde_json::Value>> = turns
                .iter()
                .map(|(role, content)| {
                    let text: String = serde_json::from_str(content.get()).ok()?;
                    Some(serde_json::json!({"role": role, "content": text}))
                })
                .collect();
            if let Some(ids) =
                messages.and_then(|m| t.encode_chat(&serde_json::Value::Array(m), true).ok())
            {
                return Self::tokens(&ids, block_size);
            }
        }
        let mut keys = TextKeys::new(block_size);
        let mut bytes = 0;
        for (role, content) in turns {
            keys.push_message(role, content.get().as_bytes());
            bytes += role.len() + content.get().len() + 2;
        }
        Self::text(keys.finish(), bytes, block_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn view(body: &str, route: Route, bs: usize) -> PrefixView {
        let body = JsonBody::parse(Bytes::from(body.to_string())).unwrap();
        PrefixView::read(&body, route, bs, None)
    }

    #[test]
    fn token_prompts_get_token_keys() {
        let ids: Vec<u32> = (0..40).collect();
        let body = format!(r#"{{"prompt":{}}}"#, serde_json::to_string(&ids).unwrap());
        let v = view(&body, Route::Completions, 16);
        assert_eq!(v.kind, KeyKind::Tokens);
        assert_eq!(v.keys, token_keys(&ids, 16));
        assert_eq!(v.keys.len(), 2);
        assert_eq!(v.prompt_tokens, 40);
        let nested = format!(r#"{{"prompt":[{}]}}"#, serde_json::to_string(&ids).unwrap());
        assert_eq!(view(&nested, Route::Completions, 16).keys, v.keys);
    }

    #[test]
    fn text_prompts_share_prefix_keys() {
        let shared = "s".repeat(200);
        let a = view(
            &format!(
                r#"{{"prompt":"{shared}aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"}}"#
            ),
            Route::Completions,
            16,
        );
        let b = view(
            &format!(
                r#"{{"prompt":"{shared}bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"}}"#
            ),
            Route::Completions,
            16,
        );
        assert_eq!(a.kind, KeyKind::Text);
        assert_eq!(a.keys.len(), 4);
        assert_eq!(a.keys[..3], b.keys[..3]);
        assert_ne!(a.keys[3], b.keys[3]);
        assert_eq!(a.prompt_tokens, 66);
    }

    #[test]
    fn string_prompts_are_keyed_as_received() {
        // Escapes included: two prompts sharing an escaped prefix share its blocks, whatever
        // the whitespace around the value.
        let shared = r"line\n\u00e9\t".repeat(20);
        let a = view(
            &format!(r#"{{"prompt":"{shared}{}"}}"#, "a".repeat(64)),
            Route::Completions,
            16,
        );
        let b = view(
            &format!("{{\"prompt\" :\n \"{shared}{}\" }}", "b".repeat(64)),
            Route::Completions,
            16,
        );
        let bytes = format!("{shared}{}", "a".repeat(64));
        assert_eq!(a.keys, text_keys(bytes.as_bytes(), 16));
        assert_eq!(
            a.prompt_tokens as usize,
            bytes.len().div_ceil(BYTES_PER_TOKEN)
        );
        let common = shared.len() / (16 * BYTES_PER_TOKEN);
        assert!(common >= 4);
        assert_eq!(a.keys[..common], b.keys[..common]);
        assert_ne!(a.keys.last(), b.keys.last());
        // The same prompt as a one-element batch has the same keys; a two-element one is no
        // single prompt.
        let batch = view(
            &format!(r#"{{"prompt":[ "{shared}{}" ]}}"#, "a".repeat(64)),
            Route::Completions,
            16,
        );
        assert_eq!(batch.keys, a.keys);
        assert_eq!(batch.prompt_tokens, a.prompt_tokens);
        let two = view(
            &format!(r#"{{"prompt":["{shared}", "{}"]}}"#, "a".repeat(64)),
            Route::Completions,
            16,
        );
        assert!(two.keys.is_empty());
    }

    #[test]
    fn chat_keys_cover_the_whole_conversation() {
        let sys = "x".repeat(300);
        let one = format!(r#"{{"messages":[{{"role":"system","content":"{sys}"}}]}}"#);
        let two = format!(
            r#"{{"messages":[{{"role":"system","content":"{sys}"}},{{"role":"user","content":"{}"}}]}}"#,
            "q".repeat(300)
        );
        let a = view(&one, Route::Chat, 16);
        let b = view(&two, Route::Chat, 16);
        assert!(!a.keys.is_empty());
        assert!(b.keys.len() > a.keys.len());
        assert_eq!(b.keys[..a.keys.len()], a.keys[..]);
    }

    #[test]
    fn one_conversation_has_one_prefix_on_chat_responses_and_messages() {
        let sys = "x".repeat(300);
        let q = "q".repeat(300);
        let chat = view(
            &format!(
                r#"{{"messages":[{{"role":"system","content":"{sys}"}},{{"role":"user","content":"{q}"}}]}}"#
            ),
            Route::Chat,
            16,
        );
        let responses = view(
            &format!(r#"{{"instructions":"{sys}","input":"{q}"}}"#),
            Route::Responses,
            16,
        );
        let items = view(
            &format!(r#"{{"instructions":"{sys}","input":[{{"role":"user","content":"{q}"}}]}}"#),
            Route::Responses,
            16,
        );
        let messages = view(
            &format!(r#"{{"system":"{sys}","messages":[{{"role":"user","content":"{q}"}}]}}"#),
            Route::Messages,
            16,
        );
        assert!(chat.keys.len() > 5);
        assert_eq!(responses.keys, chat.keys);
        assert_eq!(items.keys, chat.keys);
        assert_eq!(messages.keys, chat.keys);
        // A tool result item counts by its JSON.
        let tool = view(
            &format!(
                r#"{{"input":[{{"role":"user","content":"{q}"}},{{"type":"function_call_output","call_id":"c","output":"{sys}"}}]}}"#
            ),
            Route::Responses,
            16,
        );
        assert!(tool.keys.len() > chat.keys.len() / 2);
        assert!(view(r#"{"input":7}"#, Route::Responses, 16).keys.is_empty());
        assert!(
            view(r#"{"system":"s"}"#, Route::Messages, 16)
                .keys
                .is_empty()
        );
    }

    #[test]
    fn unreadable_prompts_give_an_empty_view() {
        for body in [
            r#"{"prompt":7}"#,
            r#"{"prompt":["a","b"]}"#,
            r#"{}"#,
            r#"{"messages":"hi"}"#,
        ] {
            let route = if body.contains("messages") {
                Route::Chat
            } else {
                Route::Completions
            };
            let v = view(body, route, 16);
            assert!(v.keys.is_empty(), "{body}");
            assert_eq!(v.prompt_tokens, 0);
        }
        assert!(
            view(r#"{"prompt":"short"}"#, Route::Completions, 16)
                .keys
                .is_empty()
        );
    }
}
