//! LoRA adapters: which endpoints serve which adapter.
//!
//! vLLM serves each adapter under its own model name and lists it in `/v1/models` as a card
//! whose `parent` is the base model (`--lora-modules` at start, `/v1/load_lora_adapter` at run
//! time). The active health check reads that list on every round ([`Cards::parse`]); the
//! snapshot gives each endpoint the adapters it serves and the fleet's union
//! ([`EndpointAdapters`]), so a request for an adapter goes only to endpoints that hold it. A
//! request for a name that is no adapter keeps the model rules it had.
//!
//! Adapters change at run time. A load is learned on the next round; an engine answering 404
//! for an adapter it was thought to hold (unloaded since) asks for an early round
//! ([`Refresh`]), at most one a second, so the fleet's view catches up within about a second
//! without an engine that keeps refusing turning into a probe storm.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// Adapter name -> its base model (the card's `parent`).
pub type AdapterParents = BTreeMap<String, String>;

/// What one `/v1/models` answer names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cards {
    /// Base models (cards without a parent).
    pub models: Vec<String>,
    /// Adapters, with their base model.
    pub adapters: AdapterParents,
}

impl Cards {
    /// Reads an OpenAI `/v1/models` body; `None` when it is not one.
    pub fn parse(body: &[u8]) -> Option<Cards> {
        #[derive(serde::Deserialize)]
        struct Card {
            id: String,
            #[serde(default)]
            parent: Option<String>,
        }
        #[derive(serde::Deserialize)]
        struct List {
            data: Vec<Card>,
        }
        let list: List = serde_json::from_slice(body).ok()?;
        let mut cards = Cards::default();
        for card in list.data {
            match card.parent {
                Some(parent) => {
                    cards.adapters.insert(card.id, parent);
                }
                None => cards.models.push(card.id),
            }
        }
        Some(cards)
    }
}

/// The adapters one endpoint serves, beside those of the whole routable fleet.
#[derive(Clone, Debug, Default)]
pub struct EndpointAdapters {
    /// This endpoint's adapters (sorted).
    pub own: Vec<String>,
    /// Every adapter some routable endpoint serves, with its base model (one map per snapshot,
    /// shared by its endpoints).
    pub fleet: Arc<AdapterParents>,
}

impl EndpointAdapters {
    /// `Some(serves)` when `model` is an adapter of the fleet: whether this endpoint holds it;
    /// `None` when it is no adapter (the endpoint's models decide).
    pub fn serves(&self, model: &str) -> Option<bool> {
        self.fleet
            .contains_key(model)
            .then(|| self.own.iter().any(|a| a == model))
    }
}

/// Requests for an early health round, at most one per [`Refresh::MIN_GAP`].
#[derive(Debug, Default)]
pub struct Refresh {
    last: Mutex<Option<Instant>>,
    wanted: Notify,
}

impl Refresh {
    /// The least time between two early rounds.
    pub const MIN_GAP: Duration = Duration::from_secs(1);

    /// Asks for an early round unless one was asked for within [`Refresh::MIN_GAP`]; true if
    /// this call asked.
    pub fn ask(&self, now: Instant) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_some_and(|t| now.saturating_duration_since(t) < Self::MIN_GAP) {
            return false;
        }
        *last = Some(now);
        // A stored permit: a checker busy with a round starts the next one when it is done.
        self.wanted.notify_one();
        true
    }

    /// Resolves when an early round was asked for.
    pub async fn asked(&self) {
        self.wanted.notified().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cards_split_base_models_from_adapters() {
        let body = br#"{"object":"list","data":[
            {"id":"m","root":"m","parent":null},
            {"id":"sql","root":"/a/sql","parent":"m"},
            {"id":"chat","root":"/a/chat","parent":"m"}]}"#;
        let cards = Cards::parse(body).unwrap();
        assert_eq!(cards.models, ["m"]);
        assert_eq!(
            cards.adapters.into_iter().collect::<Vec<_>>(),
            [("chat".into(), "m".into()), ("sql".into(), "m".into())]
        );
        assert!(Cards::parse(b"{\"detail\":\"Not Found\"}").is_none());
        assert!(Cards::parse(b"not json").is_none());
    }

    #[test]
    fn adapters_of_the_fleet_go_only_where_they_are_held() {
        let fleet: AdapterParents = [("sql".to_string(), "m".to_string())].into();
        let holder = EndpointAdapters {
            own: vec!["sql".into()],
            fleet: Arc::new(fleet.clone()),
        };
        let other = EndpointAdapters {
            own: vec![],
            fleet: Arc::new(fleet),
        };
        assert_eq!(holder.serves("sql"), Some(true));
        assert_eq!(other.serves("sql"), Some(false));
        assert_eq!(other.serves("m"), None, "not an adapter: models decide");
    }

    #[test]
    fn early_rounds_are_asked_at_most_once_a_second() {
        let r = Refresh::default();
        let t0 = Instant::now();
        assert!(r.ask(t0));
        assert!(!r.ask(t0 + Duration::from_millis(999)));
        assert!(r.ask(t0 + Duration::from_secs(1)));
    }
}
