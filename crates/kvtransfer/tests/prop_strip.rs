//! Property tests for `strip_client_transfer_fields`: whatever the spelling
//! (case, `\u` escapes, inside `vllm_xargs`), no transfer field survives, and
//! every byte of the members that stay is the client's own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use kvtransfer::{JsonBody, is_client_transfer_field, strip_client_transfer_fields};
use proptest::prelude::*;

/// JSON text of `key`, each character written plainly or as `\uXXXX` as
/// `escape` picks.
fn spell(key: &str, escape: &[bool]) -> String {
    let mut out = String::from("\"");
    for (i, c) in key.chars().enumerate() {
        let plain = c != '"' && c != '\\' && (c as u32) >= 0x20;
        if plain
            && !escape
                .get(i % escape.len().max(1))
                .copied()
                .unwrap_or(false)
        {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    out.push('"');
    out
}

/// `name` with the case of each ASCII letter flipped where `flip` says.
fn recase(name: &str, flip: &[bool]) -> String {
    name.chars()
        .enumerate()
        .map(|(i, c)| {
            if flip.get(i % flip.len().max(1)).copied().unwrap_or(false) {
                c.to_ascii_uppercase()
            } else {
                c
            }
        })
        .collect()
}

fn forbidden_key() -> impl Strategy<Value = String> {
    let base = prop_oneof![
        Just("kv_transfer_params".to_owned()),
        Just("ec_transfer_params".to_owned()),
        Just("transfer_id".to_owned()),
        Just("disagg_prefill_resp".to_owned()),
        "bootstrap_[a-z]{0,6}",
        "remote_[a-z_]{0,8}",
        "do_remote_[a-z]{0,8}",
        "disagg_[a-z]{0,6}",
    ];
    (base, prop::collection::vec(any::<bool>(), 1..6)).prop_map(|(k, f)| recase(&k, &f))
}

fn safe_key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("model".to_owned()),
        Just("prompt".to_owned()),
        Just("transfer".to_owned()),
        Just("remote".to_owned()),
        Just("bootstrap".to_owned()),
        Just("xkv_transfer_params".to_owned()),
        "[a-z_]{0,10}",
        "[\u{e0}-\u{ff}\u{1F600}]{1,3}",
    ]
    .prop_filter("not a transfer field", |k| {
        !is_client_transfer_field(k) && !k.eq_ignore_ascii_case("vllm_xargs")
    })
}

fn ws() -> impl Strategy<Value = String> {
    "[ \t\n\r]{0,2}"
}

fn scalar() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("null".to_owned()),
        Just("true".to_owned()),
        "-?[1-9][0-9]{0,20}",
        "-?[0-9]\\.[0-9]{1,4}(e[+-]?[0-9])?",
        "\"[a-z /]{0,6}\"",
        Just("{\"kv_transfer_params\" : {\"remote_host\":\"10.0.0.1\"}}".to_owned()),
        Just("[1, {\"remote_port\":1}]".to_owned()),
    ]
}

/// One generated member: unescaped key, text around it, and whether it must go.
#[derive(Clone, Debug)]
struct Member {
    key: String,
    pre: String,
    head: String,
    value: String,
    post: String,
    forbidden: bool,
}

impl Member {
    fn text(&self, value: &str) -> String {
        format!("{}{}{}{}", self.pre, self.head, value, self.post)
    }
}

fn member(value: BoxedStrategy<String>) -> impl Strategy<Value = Member> {
    (
        prop_oneof![
            1 => forbidden_key().prop_map(|k| (k, true)),
            2 => safe_key().prop_map(|k| (k, false)),
        ],
        prop::collection::vec(any::<bool>(), 1..5),
        ws(),
        ws(),
        ws(),
        value,
        ws(),
    )
        .prop_map(|((key, forbidden), esc, pre, a, b, value, post)| {
            // Escape a little: most real keys are plain.
            let esc: Vec<bool> = esc.iter().map(|e| *e && esc.len() > 3).collect();
            Member {
                head: format!("{}{a}:{b}", spell(&key, &esc)),
                key,
                pre,
                value,
                post,
                forbidden,
            }
        })
}

fn unique(members: Vec<Member>) -> Vec<Member> {
    let mut seen = std::collections::HashSet::new();
    members
        .into_iter()
        .filter(|m| seen.insert(m.key.clone()))
        .collect()
}

fn object(members: &[Member], inner_ws: &str) -> String {
    if members.is_empty() {
        return format!("{{{inner_ws}}}");
    }
    let parts: Vec<String> = members.iter().map(|m| m.text(&m.value)).collect();
    format!("{{{}}}", parts.join(","))
}

/// The expected output of an object after stripping, and whether it changed.
fn stripped(members: &[Member], original: &str) -> (String, bool) {
    if !members.iter().any(|m| m.forbidden) {
        return (original.to_owned(), false);
    }
    let kept: Vec<String> = members
        .iter()
        .filter(|m| !m.forbidden)
        .map(|m| m.text(&m.value))
        .collect();
    (format!("{{{}}}", kept.join(",")), true)
}

#[derive(Clone, Debug)]
struct Doc {
    lead: String,
    members: Vec<Member>,
    /// Position, key spelling and members of a `vllm_xargs` object, if any.
    xargs: Option<(usize, String, Vec<Member>, String)>,
    trail: String,
}

fn doc() -> impl Strategy<Value = Doc> {
    let top = prop::collection::vec(member(scalar().boxed()), 0..8);
    let nested = prop::collection::vec(member(scalar().boxed()), 0..6);
    let xargs_key = prop_oneof![
        Just("vllm_xargs".to_owned()),
        Just("VLLM_XARGS".to_owned()),
        Just("Vllm_Xargs".to_owned()),
    ];
    (
        ws(),
        top,
        prop::option::of((any::<prop::sample::Index>(), xargs_key, nested, ws())),
        ws(),
    )
        .prop_map(|(lead, top, xargs, trail)| Doc {
            lead,
            members: unique(top),
            xargs: xargs.map(|(at, key, nested, inner)| (at.index(8), key, unique(nested), inner)),
            trail,
        })
}

impl Doc {
    /// The input text and the expected output, members in order.
    fn render(&self) -> (String, String, Vec<String>) {
        let mut members = self.members.clone();
        let mut xargs_at = None;
        if let Some((at, key, nested, inner)) = &self.xargs
            && !members.iter().any(|m| m.key.eq_ignore_ascii_case(key))
        {
            let at = (*at).min(members.len());
            members.insert(
                at,
                Member {
                    key: key.clone(),
                    pre: String::new(),
                    head: format!("{}:", spell(key, &[false])),
                    value: object(nested, inner),
                    post: " ".to_owned(),
                    forbidden: false,
                },
            );
            xargs_at = Some(at);
        }
        let input = format!("{}{}{}", self.lead, object(&members, ""), self.trail);
        let mut removed: Vec<String> = members
            .iter()
            .filter(|m| m.forbidden)
            .map(|m| m.key.clone())
            .collect();
        let mut edited = !removed.is_empty();
        let mut kept = Vec::new();
        for (i, m) in members.iter().enumerate() {
            if m.forbidden {
                continue;
            }
            match (&self.xargs, xargs_at) {
                (Some((_, key, nested, _)), Some(at)) if at == i => {
                    let (value, changed) = stripped(nested, &m.value);
                    edited |= changed;
                    removed.extend(
                        nested
                            .iter()
                            .filter(|n| n.forbidden)
                            .map(|n| format!("{key}.{}", n.key)),
                    );
                    kept.push(m.text(&value));
                }
                _ => kept.push(m.text(&m.value)),
            }
        }
        let output = if edited {
            format!("{}{{{}}}{}", self.lead, kept.join(","), self.trail)
        } else {
            input.clone()
        };
        (input, output, removed)
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn strip_removes_every_spelling_and_keeps_every_other_byte(d in doc()) {
        let (input, expected, removed_want) = d.render();
        let input = Bytes::from(input);
        let mut body = JsonBody::parse(input.clone()).unwrap();
        let removed = strip_client_transfer_fields(&mut body);
        // Top-level names first, then the nested ones, each in body order.
        prop_assert_eq!(&removed, &removed_want);
        let out = body.to_bytes();
        prop_assert_eq!(std::str::from_utf8(&out).unwrap(), expected.as_str());
        if removed.is_empty() {
            prop_assert_eq!(out.as_ptr(), input.as_ptr(), "unedited => zero copy");
        }
        // Nothing forbidden is left, at the top or inside vllm_xargs.
        let again = JsonBody::parse(out).unwrap();
        prop_assert!(!again.keys().any(is_client_transfer_field));
        for key in again.keys().filter(|k| k.eq_ignore_ascii_case("vllm_xargs")) {
            let inner = JsonBody::parse(again.get_raw_bytes(key).unwrap()).unwrap();
            prop_assert!(!inner.keys().any(is_client_transfer_field));
        }
        // Idempotent.
        let mut twice = again.clone();
        prop_assert!(strip_client_transfer_fields(&mut twice).is_empty());
    }
}
