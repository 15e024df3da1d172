//! Token keys without a local tokenizer: the engine's own `POST /tokenize` (vLLM), asked once
//! per distinct prompt and remembered in a bounded LRU keyed by the prompt's hash. Bounded by a
//! timeout; on any failure the request keeps its approximate (byte-block) keys. Off by default
//! (`cache.engine_tokenize`): a prompt seen for the first time waits for one engine round trip
//! before it is routed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::Method;
use kvtransfer::JsonBody;
use serde::Deserialize;
use tracing::debug;

use crate::endpoints::Snapshot;
use crate::endpoints::health::Health;
use crate::engine::EnginePool;
use crate::engine::client::{self, LegRequest};
use crate::error::Leg;
use crate::route::Route;

/// Remembered token ids by prompt hash, least recently used evicted first.
#[derive(Debug)]
pub(crate) struct EngineTokens {
    capacity: usize,
    timeout: Duration,
    entries: Mutex<Lru>,
}

#[derive(Debug, Default)]
struct Lru {
    map: HashMap<u64, (Arc<[u32]>, u64)>,
    tick: u64,
}

#[derive(Deserialize)]
struct Tokenized {
    tokens: Vec<u32>,
}

/// What `/tokenize` is asked for a request (`None`: not a text prompt it can tokenize).
fn tokenize_body(body: &JsonBody, route: Route, model: Option<&str>) -> Option<(u64, Bytes)> {
    let (field, raw) = match route {
        Route::Completions => ("prompt", body.get_raw("prompt")?),
        Route::Chat => ("messages", body.get_raw("messages")?),
        Route::Responses | Route::Messages => return None,
    };
    // Token ids need no engine; a batch is not one prompt.
    if route == Route::Completions && !raw.trim_start().starts_with('"') {
        return None;
    }
    let mut req = serde_json::Map::new();
    if let Some(m) = model {
        req.insert("model".into(), m.into());
    }
    let value: serde_json::Value = serde_json::from_str(raw).ok()?;
    req.insert(field.into(), value);
    if route == Route::Chat {
        let generation = body
            .get::<bool>("add_generation_prompt")
            .and_then(Result::ok)
            .unwrap_or(true);
        req.insert("add_generation_prompt".into(), generation.into());
    }
    let bytes = serde_json::to_vec(&req).ok()?;
    let mut h = std::hash::DefaultHasher::new();
    std::hash::Hasher::write(&mut h, &bytes);
    Some((std::hash::Hasher::finish(&h), Bytes::from(bytes)))
}

impl EngineTokens {
    pub(crate) fn new(capacity: usize, timeout: Duration) -> Self {
        EngineTokens {
            capacity: capacity.max(1),
            timeout,
            entries: Mutex::new(Lru::default()),
        }
    }

    fn get(&self, hash: u64) -> Option<Arc<[u32]>> {
        let mut lru = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        lru.tick += 1;
        let tick = lru.tick;
        let (ids, used) = lru.map.get_mut(&hash)?;
        *used = tick;
        Some(ids.clone())
    }

    fn put(&self, hash: u64, ids: Arc<[u32]>) {
        let mut lru = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        lru.tick += 1;
        let tick = lru.tick;
        if lru.map.len() >= self.capacity && !lru.map.contains_key(&hash) {
            // A scan on insert only: inserts follow an engine round trip, which costs far more.
            if let Some(oldest) = lru.map.iter().min_by_key(|(_, (_, t))| *t).map(|(k, _)| *k) {
                lru.map.remove(&oldest);
            }
        }
        lru.map.insert(hash, (ids, tick));
    }

    /// Entries remembered.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map
            .len()
    }

    /// The prompt's token ids as an engine serving `model` tokenizes them, from memory or from
    /// its `/tokenize` within the timeout; `None` on any failure.
    pub(crate) async fn tokens(
        &self,
        client: &EnginePool,
        health: &Health,
        snap: &Snapshot,
        body: &JsonBody,
        route: Route,
        model: Option<&str>,
    ) -> Option<Arc<[u32]>> {
        let (hash, request) = tokenize_body(body, route, model)?;
        if let Some(ids) = self.get(hash) {
            return Some(ids);
        }
        let mut serving = snap
            .prefill
            .iter()
            .chain(snap.decode.iter())
            .filter(|e| e.serves(model));
        let engine = serving
            .clone()
            .find(|e| health.verified(&e.name))
            .or_else(|| serving.next())?;
        let headers = http::HeaderMap::new();
        let leg = LegRequest {
            leg: Leg::Prefill,
            endpoint: engine.target(),
            path: "/tokenize",
            method: Method::POST,
            body: request,
            request_id: "tokenize",
            headers: &headers,
            extra: &[],
        };
        let work = async {
            let head = client::send(client, leg).await.ok()?;
            let got = client::collect(Leg::Prefill, engine.target(), head)
                .await
                .ok()?;
            if !got.status.is_success() {
                return None;
            }
            serde_json::from_slice::<Tokenized>(&got.body).ok()
        };
        let Ok(Some(t)) = tokio::time::timeout(self.timeout, work).await else {
            debug!(engine = %engine.name, "engine /tokenize failed or timed out; approximate keys");
            return None;
        };
        let ids: Arc<[u32]> = t.tokens.into();
        self.put(hash, ids.clone());
        Some(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_used_prompt_goes_first() {
        let t = EngineTokens::new(2, Duration::from_millis(10));
        t.put(1, Arc::from([1u32]));
        t.put(2, Arc::from([2u32]));
        assert!(t.get(1).is_some());
        t.put(3, Arc::from([3u32]));
        assert!(t.get(2).is_none(), "2 was the least recently used");
        assert!(t.get(1).is_some() && t.get(3).is_some());
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn only_text_prompts_are_asked() {
        let body = |s: &str| JsonBody::parse(Bytes::from(s.to_string())).unwrap();
        let a = tokenize_body(&body(r#"{"prompt":"hi"}"#), Route::Completions, Some("m"));
        let b = tokenize_body(&body(r#"{"prompt": "hi" }"#), Route::Completions, Some("m"));
        assert_eq!(a.as_ref().map(|x| x.0), b.as_ref().map(|x| x.0));
        assert_eq!(&a.unwrap().1[..], br#"{"model":"m","prompt":"hi"}"#);
        assert!(tokenize_body(&body(r#"{"prompt":[1,2]}"#), Route::Completions, None).is_none());
        let chat = tokenize_body(
            &body(r#"{"messages":[{"role":"user","content":"hi"}]}"#),
            Route::Chat,
            None,
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&chat.1).unwrap();
        assert_eq!(v["add_generation_prompt"], true);
        assert!(tokenize_body(&body(r#"{"input":"hi"}"#), Route::Responses, None).is_none());
    }
}
