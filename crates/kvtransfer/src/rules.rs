//! Body rules shared by every connector: stripping client-supplied transfer
//! fields and shaping the prefill leg (contracts §2).

use crate::body::JsonBody;

/// Top-level key carrying connector parameters (vLLM `kv_transfer_params`).
pub const KV_TRANSFER_PARAMS: &str = "kv_transfer_params";

/// Client request headers the gateway must drop: engines trust them to pick a
/// data-parallel rank. Lower-case, compare case-insensitively.
pub const CLIENT_FORBIDDEN_HEADERS: &[&str] = &["x-data-parallel-rank"];

/// Exact top-level keys a client may not supply (see
/// [`strip_client_transfer_fields`]); `bootstrap_*` is matched by prefix.
pub const CLIENT_FORBIDDEN_KEYS: &[&str] =
    &[KV_TRANSFER_PARAMS, "transfer_id", "disagg_prefill_resp"];

/// Prefix of client keys that name a bootstrap server (SGLang, Mooncake).
pub const CLIENT_FORBIDDEN_KEY_PREFIX: &str = "bootstrap_";

/// Whether `key` is a client-supplied transfer field that must be stripped.
pub fn is_client_transfer_field(key: &str) -> bool {
    CLIENT_FORBIDDEN_KEYS.contains(&key) || key.starts_with(CLIENT_FORBIDDEN_KEY_PREFIX)
}

/// Removes the client-supplied keys an engine would dial or trust
/// (contracts §2): `kv_transfer_params`, `transfer_id`, `disagg_prefill_resp`
/// and every key starting with `bootstrap_`. Returns the removed key names in
/// body order. Idempotent; a body without such keys is left unedited.
pub fn strip_client_transfer_fields(body: &mut JsonBody) -> Vec<String> {
    if !body.keys().any(is_client_transfer_field) {
        return Vec::new();
    }
    body.remove_where(is_client_transfer_field)
}

/// Applies the prefill-leg rules of contracts §2: `max_tokens=1`,
/// `max_completion_tokens=1`, `min_tokens`/`min_completion_tokens` removed,
/// `stream=false`, `stream_options` removed, `ignore_eos=true`,
/// `stop`/`stop_token_ids` removed. Existing keys are replaced in place, new
/// ones appended; every other member is untouched.
pub fn apply_prefill_leg_rules(body: &mut JsonBody) {
    body.set_raw("max_tokens", "1");
    body.set_raw("max_completion_tokens", "1");
    body.remove("min_tokens");
    body.remove("min_completion_tokens");
    body.set_raw("stream", "false");
    body.remove("stream_options");
    // A prefill that stops on EOS or a stop string before its single token may
    // not hand KV over (Mooncake ships only length-finished requests).
    body.set_raw("ignore_eos", "true");
    body.remove("stop");
    body.remove("stop_token_ids");
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn body(s: &'static str) -> JsonBody {
        JsonBody::parse(Bytes::from_static(s.as_bytes())).unwrap()
    }

    #[test]
    fn strip_removes_only_forbidden_keys() {
        let mut b = body(
            r#"{"model":"m","kv_transfer_params":{"remote_host":"169.254.169.254"},"bootstrap_host":"x","bootstrap_room":1,"transfer_id":"t","disagg_prefill_resp":{},"bootstrap":1,"transfer":2}"#,
        );
        let removed = strip_client_transfer_fields(&mut b);
        assert_eq!(
            removed,
            [
                "kv_transfer_params",
                "bootstrap_host",
                "bootstrap_room",
                "transfer_id",
                "disagg_prefill_resp"
            ]
        );
        assert_eq!(
            &b.to_bytes()[..],
            br#"{"model":"m","bootstrap":1,"transfer":2}"#
        );
        assert!(strip_client_transfer_fields(&mut b).is_empty());
    }

    #[test]
    fn strip_without_matches_keeps_buffer() {
        let mut b = body(r#"{ "model" : "m" }"#);
        assert!(strip_client_transfer_fields(&mut b).is_empty());
        assert!(!b.is_edited());
    }

    #[test]
    fn prefill_rules_replace_in_place_and_append() {
        let mut b = body(
            r#"{"model":"m","max_tokens":100,"min_tokens":5,"stream":true,"stream_options":{"include_usage":true},"stop":["x"],"temperature":0.70}"#,
        );
        apply_prefill_leg_rules(&mut b);
        assert_eq!(
            &b.to_bytes()[..],
            br#"{"model":"m","max_tokens":1,"stream":false,"temperature":0.70,"max_completion_tokens":1,"ignore_eos":true}"#
        );
    }
}
