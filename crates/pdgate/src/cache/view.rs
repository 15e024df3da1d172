//! The prefix view of a request: its block keys, computed once from the parsed body.
//!
//! Token keys when the prompt is token ids or a tokenizer is configured for the model (the same
//! keys the engines' KV events produce, so precise matching works); approximate text keys
//! otherwise (blocks of the prompt's bytes, or of the chat messages serialized in order: the
//! whole conversation, so a follow-up turn shares the earlier turns' blocks).

use std::borrow::Cow;

use kvtransfer::JsonBody;
use pdcache::keys::{BYTES_PER_TOKEN, BlockKey, TextKeys, token_keys};
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

    fn text(keys: TextKeys, bytes: usize, block_size: usize) -> Self {
        PrefixView {
            keys: keys.finish(),
            kind: KeyKind::Text,
            prompt_tokens: saturate(bytes.div_ceil(BYTES_PER_TOKEN)),
            block_size: saturate(block_size),
        }
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
        }
        .unwrap_or_else(|| Self::empty(block_size))
    }

    fn completion(
        body: &JsonBody,
        block_size: usize,
        tokenizer: Option<&HfTokenizer>,
    ) -> Option<Self> {
        let raw = body.get_raw("prompt")?;
        let trimmed = raw.trim_start();
        if trimmed.starts_with('[') {
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
        Self::text(keys, text.len(), block_size)
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
        Some(Self::text(keys, bytes, block_size))
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
