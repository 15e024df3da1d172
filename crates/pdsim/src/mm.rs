//! The multimodal items of a chat request as an encoder and an encoder-cache consumer both see
//! them: which content parts are items, and the hash each is known by (vLLM's `mm_hash`, the
//! `identifier` of a multimodal feature). A leaf: nothing of the engine is read here.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// Content-part types that are multimodal items (vLLM's chat parser; the EPD proxy's `MM_TYPES`).
pub(crate) const PART_TYPES: [&str; 4] = ["image_url", "audio_url", "input_audio", "video_url"];

/// One multimodal item of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MmItem {
    /// The content part's `type`.
    pub kind: &'static str,
    /// The item's hash: the part's own `uuid` when it has one (vLLM's multimodal UUIDs), else
    /// a digest of its media reference.
    pub hash: String,
    /// Encoder output tokens (placeholder tokens in the prompt), derived from the hash.
    pub tokens: u32,
}

/// The media a part points to: the URL (or data URL) of `image_url`/`audio_url`/`video_url`,
/// the data and format of `input_audio`.
fn media(kind: &str, part: &Value) -> Option<String> {
    let inner = part.get(kind)?;
    if kind == "input_audio" {
        let data = inner.get("data")?.as_str()?;
        let format = inner.get("format").and_then(Value::as_str).unwrap_or("");
        return Some(format!("{format}:{data}"));
    }
    // `"image_url": "http://..."` is accepted by vLLM's parser too.
    inner
        .as_str()
        .or_else(|| inner.get("url").and_then(Value::as_str))
        .map(str::to_owned)
}

/// The hash a part is known by (see [`MmItem::hash`]).
fn hash_of(kind: &str, part: &Value) -> Result<String, String> {
    if let Some(uuid) = part
        .get("uuid")
        .and_then(Value::as_str)
        .filter(|u| !u.is_empty())
    {
        return Ok(uuid.to_owned());
    }
    let media = media(kind, part).ok_or_else(|| format!("a {kind} content part names no media"))?;
    let mut h = Sha256::new();
    h.update(kind.as_bytes());
    h.update([0]);
    h.update(media.as_bytes());
    Ok(h.finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>())
}

/// Encoder tokens of an item: 64 to 319, fixed per hash.
fn tokens_of(hash: &str) -> u32 {
    64 + hash
        .bytes()
        .fold(0u32, |a, b| a.wrapping_mul(31).wrapping_add(u32::from(b)))
        % 256
}

/// The multimodal items of `messages` (the chat request's list), in order.
///
/// # Errors
/// A message that names a multimodal part without its media (vLLM refuses it with a 400).
pub(crate) fn items(messages: &Value) -> Result<Vec<MmItem>, String> {
    let mut out = Vec::new();
    for message in messages.as_array().into_iter().flatten() {
        let Some(parts) = message.get("content").and_then(Value::as_array) else {
            continue;
        };
        for part in parts {
            let Some(kind) = part
                .get("type")
                .and_then(Value::as_str)
                .and_then(|t| PART_TYPES.iter().copied().find(|k| *k == t))
            else {
                continue;
            };
            let hash = hash_of(kind, part)?;
            out.push(MmItem {
                kind,
                tokens: tokens_of(&hash),
                hash,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_are_found_and_hashed_by_their_media() {
        let m: Value = serde_json::json!([
            {"role":"system","content":"s"},
            {"role":"user","content":[
                {"type":"image_url","image_url":{"url":"http://h/a.png"}},
                {"type":"text","text":"x"},
                {"type":"image_url","image_url":{"url":"http://h/a.png"},"uuid":"mine"},
                {"type":"input_audio","input_audio":{"data":"UklG","format":"wav"}},
                {"type":"image_url","image_url":"http://h/a.png"}
            ]}
        ]);
        let found = items(&m).unwrap();
        assert_eq!(found.len(), 4);
        assert_eq!(found[0].hash.len(), 64);
        assert_eq!(found[1].hash, "mine");
        assert_eq!(found[3].hash, found[0].hash, "same media, same hash");
        assert_ne!(found[2].hash, found[0].hash);
        assert!(found.iter().all(|i| (64..320).contains(&i.tokens)));
        let bad = serde_json::json!([{"content":[{"type":"video_url","video_url":{}}]}]);
        assert!(items(&bad).unwrap_err().contains("video_url"));
        assert!(items(&serde_json::json!("x")).unwrap().is_empty());
    }
}
