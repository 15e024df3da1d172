//! LoRA adapters, as vLLM serves them: `--lora-modules name=path` at start,
//! `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` at run time, each adapter a
//! model card in `/v1/models` (`parent` the base model, `root` its path), and a request whose
//! `model` names an adapter served under it.
//!
//! The HTTP handlers are `http`'s; this module is the table they change.
//!
//! pdsim never reads the adapter's files: an adapter changes nothing about the answer, only how
//! its blocks are hashed (`("lora", name, path)` in every block's extra keys, as vLLM 0.32 does:
//! `vllm_hash::lora_key`) and
//! what its KV events carry (`lora_name`, `lora_id`). Statuses, error types and messages follow
//! vLLM's `vllm/entrypoints/openai/models/serving.py` (`OpenAIServingModels`), as of commit
//! 00153c8b7948077ebdfc5bfa14e403da41aaea6d.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;

use crate::error::ApiError;

/// One loaded adapter.
#[derive(Debug)]
pub(crate) struct Lora {
    /// The model name requests use, and what vLLM hashes.
    pub name: String,
    /// Where it was loaded from (`root` in `/v1/models`; hashed, never read).
    pub path: String,
    /// vLLM's `lora_int_id`: 1, 2, ... in load order; the deprecated `lora_id` of KV events.
    pub id: i64,
    /// Generation requests served under it.
    pub requests: AtomicU64,
}

/// The adapters an engine serves now.
#[derive(Debug, Default)]
pub(crate) struct Adapters {
    by_name: Mutex<BTreeMap<String, Arc<Lora>>>,
    last_id: AtomicI64,
}

/// What a request's `model` resolved to: the base model, or one adapter.
pub(crate) type Served = Option<Arc<Lora>>;

impl Adapters {
    /// The adapters of `--lora-modules`, loaded in order.
    pub fn new(modules: &[(String, String)]) -> Self {
        let adapters = Adapters::default();
        for (name, path) in modules {
            // A repeated name keeps its first path, as vLLM refuses the second load.
            let _ = adapters.load(name, path);
        }
        adapters
    }

    /// Loads `name` from `path`; vLLM's 400s for a missing field or a name already loaded.
    pub fn load(&self, name: &str, path: &str) -> Result<(), ApiError> {
        if name.is_empty() || path.is_empty() {
            return Err(invalid(
                "Both 'lora_name' and 'lora_path' must be provided.".to_owned(),
            ));
        }
        let mut map = self.by_name.lock().map_err(|_| poisoned())?;
        if map.contains_key(name) {
            return Err(invalid(format!(
                "The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."
            )));
        }
        let id = self.last_id.fetch_add(1, Relaxed) + 1;
        map.insert(
            name.to_owned(),
            Arc::new(Lora {
                name: name.to_owned(),
                path: path.to_owned(),
                id,
                requests: AtomicU64::new(0),
            }),
        );
        Ok(())
    }

    /// Unloads `name`; vLLM's 400 without a name, 404 for one not loaded.
    pub fn unload(&self, name: &str) -> Result<(), ApiError> {
        if name.is_empty() {
            return Err(invalid(
                "'lora_name' needs to be provided to unload a LoRA adapter.".to_owned(),
            ));
        }
        let mut map = self.by_name.lock().map_err(|_| poisoned())?;
        match map.remove(name) {
            Some(_) => Ok(()),
            None => Err(ApiError::Lora {
                message: format!("The lora adapter '{name}' cannot be found."),
                status: StatusCode::NOT_FOUND,
            }),
        }
    }

    /// The adapters loaded now, in load order (vLLM lists its dict of them in that order).
    pub fn list(&self) -> Vec<Arc<Lora>> {
        let mut list: Vec<Arc<Lora>> = self
            .by_name
            .lock()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default();
        list.sort_by_key(|l| l.id);
        list
    }

    /// What the request's `model` names: nothing or `base` is the base model, a loaded
    /// adapter's name that adapter; anything else vLLM's 404.
    pub fn resolve(&self, base: &str, requested: Option<&str>) -> Result<Served, ApiError> {
        let Some(name) = requested.filter(|m| *m != base) else {
            return Ok(None);
        };
        let found = self.by_name.lock().ok().and_then(|m| m.get(name).cloned());
        match found {
            Some(lora) => Ok(Some(lora)),
            None => Err(ApiError::ModelNotFound {
                requested: name.to_owned(),
                served: base.to_owned(),
            }),
        }
    }
}

fn invalid(message: String) -> ApiError {
    ApiError::Lora {
        message,
        status: StatusCode::BAD_REQUEST,
    }
}

fn poisoned() -> ApiError {
    ApiError::Lora {
        message: "adapter table unavailable".to_owned(),
        status: StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// Parses one `--lora-modules` item, vLLM's `name=path` form.
pub fn parse_module(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => {
            Ok((name.to_owned(), path.to_owned()))
        }
        _ => Err(format!("invalid LoRA module {s:?}: expected name=path")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_in_order_refuses_duplicates_and_resolves_names() {
        let a = Adapters::new(&[("sql".into(), "/a".into()), ("sql".into(), "/b".into())]);
        assert_eq!(a.list().len(), 1);
        assert_eq!(a.list()[0].path, "/a");
        a.load("chat", "/c").unwrap();
        let listed: Vec<(String, i64)> = a.list().iter().map(|l| (l.name.clone(), l.id)).collect();
        assert_eq!(
            listed,
            [("sql".to_owned(), 1), ("chat".to_owned(), 2)],
            "load order"
        );
        let dup = a.load("chat", "/c").unwrap_err();
        assert_eq!(dup.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            a.load("", "/c").unwrap_err().status(),
            StatusCode::BAD_REQUEST
        );
        assert!(a.resolve("base", None).unwrap().is_none());
        assert!(a.resolve("base", Some("base")).unwrap().is_none());
        assert_eq!(a.resolve("base", Some("sql")).unwrap().unwrap().name, "sql");
        assert_eq!(
            a.resolve("base", Some("nope")).unwrap_err().status(),
            StatusCode::NOT_FOUND
        );
        a.unload("sql").unwrap();
        assert_eq!(a.unload("sql").unwrap_err().status(), StatusCode::NOT_FOUND);
        assert_eq!(a.unload("").unwrap_err().status(), StatusCode::BAD_REQUEST);
        assert!(a.resolve("base", Some("sql")).is_err());
        // A reload gets a fresh id, as vLLM's counter only grows.
        a.load("sql", "/a").unwrap();
        assert_eq!(a.resolve("base", Some("sql")).unwrap().unwrap().id, 3);
    }

    #[test]
    fn modules_parse_as_name_equals_path() {
        assert_eq!(
            parse_module("sql=/m/sql").unwrap(),
            ("sql".to_owned(), "/m/sql".to_owned())
        );
        assert!(parse_module("sql").is_err());
        assert!(parse_module("=x").is_err());
        assert!(parse_module("x=").is_err());
    }
}
