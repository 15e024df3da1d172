//! A Hugging Face tokenizer and chat template, so token ids equal vLLM's `/tokenize`.
//!
//! Loads `tokenizer.json` with the `tokenizers` crate and, when a
//! `tokenizer_config.json` (or `chat_template.jinja`) sits beside it, renders its
//! chat template with minijinja plus the Python string methods templates use
//! (`minijinja-contrib` pycompat). Like vLLM: a plain prompt is encoded with the
//! tokenizer's special tokens (BOS); a rendered chat prompt is encoded without
//! them, since the template writes its own.

use std::path::{Path, PathBuf};

use minijinja::{Environment, Error as JinjaError, ErrorKind, context};
use serde_json::Value;

/// Why a tokenizer could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// `tokenizer.json` could not be read or parsed.
    #[error("cannot load tokenizer {path}: {reason}")]
    Load {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// `tokenizer_config.json` is not valid JSON.
    #[error("cannot read {path}: {reason}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The chat template did not compile or failed while rendering.
    #[error("chat template: {0}")]
    Template(String),
    /// Chat messages were given but the model has no chat template.
    #[error("the tokenizer has no chat template")]
    NoTemplate,
    /// Encoding or decoding failed.
    #[error("tokenizer: {0}")]
    Encode(String),
}

/// A loaded tokenizer with its optional chat template.
pub struct HfTokenizer {
    tokenizer: tokenizers::Tokenizer,
    template: Option<Environment<'static>>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("chat_template", &self.template.is_some())
            .field("bos_token", &self.bos_token)
            .finish_non_exhaustive()
    }
}

/// A special token in `tokenizer_config.json`: a string or `{"content": ...}`.
fn special(config: &Value, key: &str) -> String {
    match config.get(key) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

/// The default chat template: a string, or the entry named "default" of a list.
fn template_source(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_owned),
        _ => None,
    }
}

fn raise_exception(message: String) -> Result<String, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

fn template_env(source: String) -> Result<Environment<'static>, TokenizerError> {
    let mut env = Environment::new();
    // Templates are written for Jinja2 under Python: `.strip()`, `.startswith()`, ...
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    minijinja_contrib::add_to_environment(&mut env);
    env.add_function("raise_exception", raise_exception);
    // transformers renders chat templates with trim_blocks and lstrip_blocks.
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| TokenizerError::Template(e.to_string()))?;
    env.set_syntax(syntax);
    env.add_template_owned("chat", source)
        .map_err(|e| TokenizerError::Template(e.to_string()))?;
    Ok(env)
}

impl HfTokenizer {
    /// Loads `tokenizer.json` at `path` and the chat template beside it, if any.
    pub fn load(path: &Path) -> Result<Self, TokenizerError> {
        let tokenizer =
            tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError::Load {
                path: path.to_owned(),
                reason: e.to_string(),
            })?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let config_path = dir.join("tokenizer_config.json");
        let config = match std::fs::read(&config_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| TokenizerError::Config {
                path: config_path.clone(),
                reason: e.to_string(),
            })?,
            Err(_) => Value::Null,
        };
        let source = template_source(&config)
            .or_else(|| std::fs::read_to_string(dir.join("chat_template.jinja")).ok());
        let template = source.map(template_env).transpose()?;
        Ok(HfTokenizer {
            tokenizer,
            template,
            bos_token: special(&config, "bos_token"),
            eos_token: special(&config, "eos_token"),
        })
    }

    /// Whether chat messages can be rendered.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Token ids of a plain prompt, with the tokenizer's special tokens (vLLM's default).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode(text, true)
    }

    fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, TokenizerError> {
        self.tokenizer
            .encode_fast(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    /// The chat prompt the template renders for `messages` (an OpenAI messages array).
    pub fn render_chat(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let env = self.template.as_ref().ok_or(TokenizerError::NoTemplate)?;
        let tmpl = env
            .get_template("chat")
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        tmpl.render(context! {
            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| TokenizerError::Template(e.to_string()))
    }

    /// Token ids of a chat request, as vLLM's chat route and `/tokenize` with `messages`.
    pub fn encode_chat(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let text = self.render_chat(messages, add_generation_prompt)?;
        self.encode(&text, false)
    }

    /// Token ids of generated text (no special tokens).
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode(text, false)
    }

    /// The text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A word-level tokenizer small enough to write inline.
    const TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,
      "added_tokens":[{"id":0,"content":"<s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true},
                      {"id":1,"content":"<unk>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],
      "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},
      "post_processor":{"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"<s>","type_id":0}},{"Sequence":{"id":"A","type_id":0}}],
        "pair":[{"Sequence":{"id":"A","type_id":0}},{"Sequence":{"id":"B","type_id":1}}],
        "special_tokens":{"<s>":{"id":"<s>","ids":[0],"tokens":["<s>"]}}},
      "decoder":null,
      "model":{"type":"WordLevel","vocab":{"<s>":0,"<unk>":1,"hello":2,"world":3,"user":4,"assistant":5,":":6,"|":7},"unk_token":"<unk>"}}"#;

    fn dir_with(config: Option<&str>) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("pdcache-tok-{}", rand_suffix()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), TOKENIZER).unwrap();
        if let Some(c) = config {
            std::fs::write(dir.join("tokenizer_config.json"), c).unwrap();
        }
        dir
    }

    fn rand_suffix() -> String {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        format!(
            "{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        )
    }

    #[test]
    fn prompt_gets_bos_and_chat_renders_the_template() {
        let dir = dir_with(Some(
            r#"{"bos_token":{"content":"<s>"},"eos_token":"</s>","chat_template":"{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'].strip() }} | {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"}"#,
        ));
        let t = HfTokenizer::load(&dir.join("tokenizer.json")).unwrap();
        assert_eq!(t.encode_prompt("hello world").unwrap(), [0, 2, 3]);
        let msgs = serde_json::json!([{"role":"user","content":"  hello  "}]);
        assert_eq!(
            t.render_chat(&msgs, true).unwrap(),
            "<s>user : hello | assistant :"
        );
        // The template wrote the BOS itself: no second one.
        assert_eq!(t.encode_chat(&msgs, true).unwrap(), [0, 4, 6, 2, 7, 5, 6]);
        assert_eq!(t.encode_chat(&msgs, false).unwrap(), [0, 4, 6, 2, 7]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn missing_template_and_bad_files_are_errors() {
        let dir = dir_with(None);
        let t = HfTokenizer::load(&dir.join("tokenizer.json")).unwrap();
        assert!(!t.has_chat_template());
        assert!(matches!(
            t.encode_chat(&serde_json::json!([]), true),
            Err(TokenizerError::NoTemplate)
        ));
        assert!(HfTokenizer::load(&dir.join("absent.json")).is_err());
        std::fs::write(dir.join("tokenizer_config.json"), "{not json").unwrap();
        assert!(matches!(
            HfTokenizer::load(&dir.join("tokenizer.json")),
            Err(TokenizerError::Config { .. })
        ));
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"chat_template":"{{ raise_exception('no system role') }}"}"#,
        )
        .unwrap();
        let t = HfTokenizer::load(&dir.join("tokenizer.json")).unwrap();
        let e = t.render_chat(&serde_json::json!([]), true).unwrap_err();
        assert!(e.to_string().contains("no system role"), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
