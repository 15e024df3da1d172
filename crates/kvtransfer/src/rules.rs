//! Body rules shared by every connector: stripping client-supplied transfer
//! fields and shaping the prefill leg (contracts §2).

use crate::body::{JsonBody, json_type_name};

/// Top-level key carrying connector parameters (vLLM `kv_transfer_params`).
pub const KV_TRANSFER_PARAMS: &str = "kv_transfer_params";

/// Client request headers the gateway must drop: engines trust them to pick a
/// data-parallel rank. Lower-case, compare case-insensitively.
pub const CLIENT_FORBIDDEN_HEADERS: &[&str] = &["x-data-parallel-rank"];

/// Top-level keys a client may not supply, compared case-insensitively (see
/// [`strip_client_transfer_fields`]). `ec_transfer_params` is vLLM's
/// encoder-cache twin of `kv_transfer_params`: an engine trusts it the same way, and
/// TensorRT-LLM's `disaggregated_params` carry the opaque state its generation servers dial.
pub const CLIENT_FORBIDDEN_KEYS: &[&str] = &[
    KV_TRANSFER_PARAMS,
    "ec_transfer_params",
    "transfer_id",
    "disaggregated_params",
];

/// Key prefixes a client may not supply, compared case-insensitively: bootstrap
/// servers (SGLang, Mooncake), the `remote_*` and `do_remote_*` fields of the
/// vLLM connectors when sent at the top level, and `disagg_*`
/// (`disagg_prefill_resp` of the Neuron connector).
pub const CLIENT_FORBIDDEN_KEY_PREFIXES: &[&str] =
    &["bootstrap_", "remote_", "do_remote_", "disagg_"];

/// vLLM's free-form extra arguments: the object is merged into the sampling
/// parameters' `extra_args`, where connectors look for `kv_transfer_params`.
pub const VLLM_XARGS: &str = "vllm_xargs";

fn forbidden_ascii(key: &[u8]) -> bool {
    CLIENT_FORBIDDEN_KEYS
        .iter()
        .any(|k| key.eq_ignore_ascii_case(k.as_bytes()))
        || CLIENT_FORBIDDEN_KEY_PREFIXES
            .iter()
            .any(|p| key.len() >= p.len() && key[..p.len()].eq_ignore_ascii_case(p.as_bytes()))
}

/// Whether `key` equals `name` ignoring case, including the non-ASCII
/// spellings that fold to it (see [`is_client_transfer_field`]).
fn folds_to(key: &str, name: &str) -> bool {
    key.eq_ignore_ascii_case(name)
        || (!key.is_ascii()
            && (key.to_lowercase() == name || key.to_uppercase().to_lowercase() == name))
}

/// Whether `key` (unescaped) is a client-supplied transfer field that must be
/// stripped: one of [`CLIENT_FORBIDDEN_KEYS`] or starting with one of
/// [`CLIENT_FORBIDDEN_KEY_PREFIXES`], ignoring case.
///
/// Case is ignored because an engine or a proxy in front of it may normalise
/// keys; for a key that is not ASCII, the Unicode lower case and the lower
/// case of the upper case are compared too, since characters such as the
/// Kelvin sign (`K`, U+212A) or the long s (`ſ`) fold to ASCII letters the way
/// Python's `str.lower()`/`str.upper()` fold them.
pub fn is_client_transfer_field(key: &str) -> bool {
    if key.is_ascii() {
        return forbidden_ascii(key.as_bytes());
    }
    forbidden_ascii(key.to_lowercase().as_bytes())
        || forbidden_ascii(key.to_uppercase().to_lowercase().as_bytes())
}

/// Removes the client-supplied fields an engine would dial or trust
/// (contracts §2, issue "edge security"): every top-level key for which
/// [`is_client_transfer_field`] holds, and the same keys inside every
/// top-level `vllm_xargs` object (key matched ignoring case too). Keys are
/// compared unescaped, so `"\u006bv_transfer_params"` is found.
///
/// Returns the removed names in body order: top-level keys as spelled after
/// unescaping, entries of `vllm_xargs` as `vllm_xargs.<key>`. A `vllm_xargs`
/// object whose own keys cannot be read (a repeated key) is removed whole and
/// reported by its name, since what the engine would make of it is unknown.
/// Idempotent; a body without such keys is left unedited (zero copy), and
/// every byte of the members that stay is kept.
pub fn strip_client_transfer_fields(body: &mut JsonBody) -> Vec<String> {
    let mut removed = if body.keys().any(is_client_transfer_field) {
        body.remove_where(is_client_transfer_field)
    } else {
        Vec::new()
    };
    let xargs: Vec<String> = body
        .keys()
        .filter(|k| folds_to(k, VLLM_XARGS))
        .map(str::to_owned)
        .collect();
    for key in xargs {
        strip_nested(body, &key, &mut removed);
    }
    removed
}

/// Strips the forbidden keys of the object under top-level `key`.
fn strip_nested(body: &mut JsonBody, key: &str, removed: &mut Vec<String>) {
    let Some(raw) = body.get_raw_bytes(key) else {
        return;
    };
    // Anything but an object carries no keys (and vLLM rejects it with a 400).
    if json_type_name(&raw) != "object" {
        return;
    }
    match JsonBody::parse(raw) {
        Ok(mut inner) => {
            if !inner.keys().any(is_client_transfer_field) {
                return;
            }
            for k in inner.remove_where(is_client_transfer_field) {
                removed.push(format!("{key}.{k}"));
            }
            body.set_raw(key, inner.to_bytes());
        }
        Err(_) => {
            body.remove(key);
            removed.push(key.to_owned());
        }
    }
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
    fn strip_ignores_case_and_escapes() {
        let mut b = body(
            r#"{"KV_TRANSFER_PARAMS":{"remote_host":"x"},"Kv_Transfer_Params":1,"\u006bv_transfer_params":2,"Remote_Host":"h","REMOTE_PORT":1,"Bootstrap_Room":3,"TRANSFER_ID":"t","Disagg_Prefill_Resp":{},"do_remote_prefill":true,"DO_REMOTE_DECODE":false,"EC_Transfer_Params":{},"model":"m"}"#,
        );
        let removed = strip_client_transfer_fields(&mut b);
        assert_eq!(removed.len(), 11, "{removed:?}");
        assert_eq!(removed[2], "kv_transfer_params");
        assert_eq!(&b.to_bytes()[..], br#"{"model":"m"}"#);
    }

    #[test]
    fn strip_folds_non_ascii_spellings() {
        // U+212A KELVIN SIGN lower-cases to `k`; U+017F LONG S upper-cases to `S`.
        for key in [
            "\u{212A}v_transfer_params",
            "tran\u{17F}fer_id",
            "boot\u{17F}trap_x",
        ] {
            assert!(is_client_transfer_field(key), "{key}");
        }
        for key in [
            "kv_transfer",
            "remote",
            "bootstrap",
            "disagg",
            "do_remotely",
            "é_remote_x",
        ] {
            assert!(!is_client_transfer_field(key), "{key}");
        }
    }

    #[test]
    fn strip_cleans_vllm_xargs() {
        let mut b = body(
            r#"{"model":"m", "vllm_xargs" : { "kv_transfer_params" : "x", "keep":1 ,"Remote_Host":"h","\u0074ransfer_id":"t"}, "n":1}"#,
        );
        let removed = strip_client_transfer_fields(&mut b);
        assert_eq!(
            removed,
            [
                "vllm_xargs.kv_transfer_params",
                "vllm_xargs.Remote_Host",
                "vllm_xargs.transfer_id"
            ]
        );
        assert_eq!(
            &b.to_bytes()[..],
            br#"{"model":"m", "vllm_xargs" : { "keep":1 }, "n":1}"#
        );
        assert!(strip_client_transfer_fields(&mut b).is_empty());
        // Matched ignoring case; non-objects are left alone.
        let mut b = body(r#"{"VLLM_XARGS":{"kv_transfer_params":1},"vllm_xargs2":{"remote_x":1}}"#);
        assert_eq!(
            strip_client_transfer_fields(&mut b),
            ["VLLM_XARGS.kv_transfer_params"]
        );
        assert_eq!(
            &b.to_bytes()[..],
            br#"{"VLLM_XARGS":{},"vllm_xargs2":{"remote_x":1}}"#
        );
        let mut b = body(r#"{"vllm_xargs":"kv_transfer_params"}"#);
        assert!(strip_client_transfer_fields(&mut b).is_empty());
        assert!(!b.is_edited());
    }

    #[test]
    fn strip_drops_unreadable_vllm_xargs() {
        let mut b = body(r#"{"vllm_xargs":{"a":1,"\u0061":2},"model":"m"}"#);
        assert_eq!(strip_client_transfer_fields(&mut b), ["vllm_xargs"]);
        assert_eq!(&b.to_bytes()[..], br#"{"model":"m"}"#);
        // Clean xargs stay byte for byte, without a copy.
        let mut b = body(r#"{"vllm_xargs":{ "a" : 1.0 }}"#);
        assert!(strip_client_transfer_fields(&mut b).is_empty());
        assert!(!b.is_edited());
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
