//! The client's `usage.prompt_tokens_details.cached_tokens`: what the engine that computed the
//! prompt found in its prefix cache. In a PD flow that is the prefill; the decode reports its
//! own cache (or nothing useful), so the prefill's figure replaces the decode's in the relayed
//! body, on the JSON answer and on SSE chunks that carry usage. A decode serving alone reports
//! its own, which is left as it is. Engines that do not report details (vLLM without
//! `--enable-prompt-tokens-details`: `"prompt_tokens_details": null`) are left alone.
//!
//! A byte search, not a parse: the key can only appear unescaped as a JSON key, and the relayed
//! bytes stay untouched but for the number. A JSON answer keeps the length its head announced:
//! the new number is padded with spaces, and when it needs more digits than the decode's the
//! decode's figure stays (SSE chunks have no announced length and always get the new figure).

use std::sync::LazyLock;

use bytes::{BufMut, Bytes, BytesMut};
use memchr::memmem::Finder;

const KEY: &[u8] = b"\"cached_tokens\"";

static FINDER: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(KEY));

/// Where the last `"cached_tokens": N` of `body` has its number, and the number.
fn find(body: &[u8]) -> Option<(usize, usize, u32)> {
    // Forward (vectorised) search for every match, keeping the last: reverse search is not
    // vectorised and costs more on a body with the key near its end.
    let at = FINDER.find_iter(body).last()?;
    let mut i = at + KEY.len();
    let skip_ws = |i: &mut usize| {
        while body.get(*i).is_some_and(u8::is_ascii_whitespace) {
            *i += 1;
        }
    };
    skip_ws(&mut i);
    if body.get(i) != Some(&b':') {
        return None;
    }
    i += 1;
    skip_ws(&mut i);
    let start = i;
    while body.get(i).is_some_and(u8::is_ascii_digit) {
        i += 1;
    }
    let value = std::str::from_utf8(&body[start..i]).ok()?.parse().ok()?;
    Some((start, i, value))
}

/// The cached tokens an engine's JSON response reports, if it does.
pub(crate) fn reported(body: &[u8]) -> Option<u32> {
    find(body).map(|(_, _, v)| v)
}

/// `chunk` with its (last) reported cached tokens set to `value`; `None` when it reports none
/// or already says `value`. `keep_len` (a body whose length the client was told): the number is
/// padded with spaces to its old width, and left alone when `value` needs more digits.
pub(crate) fn patch(chunk: &[u8], value: u32, keep_len: bool) -> Option<Bytes> {
    let (start, end, old) = find(chunk)?;
    if old == value {
        return None;
    }
    let digits = value.to_string();
    let width = end - start;
    if keep_len && digits.len() > width {
        return None;
    }
    let mut out = BytesMut::with_capacity(chunk.len() + digits.len());
    out.put_slice(&chunk[..start]);
    out.put_slice(digits.as_bytes());
    if keep_len {
        out.put_bytes(b' ', width - digits.len());
    }
    out.put_slice(&chunk[end..]);
    Some(out.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_and_replaces_only_the_number() {
        let body = br#"{"id":"x","usage":{"prompt_tokens":300,"prompt_tokens_details":{"cached_tokens":256}}}"#;
        assert_eq!(reported(body), Some(256));
        let patched = patch(body, 0, false).unwrap();
        assert_eq!(
            &patched[..],
            br#"{"id":"x","usage":{"prompt_tokens":300,"prompt_tokens_details":{"cached_tokens":0}}}"#
        );
        // Same length: padded (whitespace after a number is valid JSON).
        let padded = patch(body, 7, true).unwrap();
        assert_eq!(padded.len(), body.len());
        assert!(padded.ends_with(br#""cached_tokens":7  }}}"#));
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&padded).unwrap()["usage"]["prompt_tokens_details"]
                ["cached_tokens"],
            7
        );
        assert_eq!(patch(body, 1000, true), None, "no room for more digits");
        assert_eq!(patch(body, 256, false), None, "already right");
        let sse = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens_details\": { \"cached_tokens\" : 7 }}}\n\n";
        let patched = patch(sse, 1024, false).unwrap();
        assert!(patched.ends_with(b"\"cached_tokens\" : 1024 }}}\n\n"));
        assert_eq!(patched.len(), sse.len() + 3);
    }

    #[test]
    fn absent_null_or_quoted_figures_are_left_alone() {
        for body in [
            &br#"{"usage":{"prompt_tokens":3,"prompt_tokens_details":null}}"#[..],
            br#"{"usage":{"prompt_tokens_details":{"cached_tokens":null}}}"#,
            br#"{"choices":[{"text":"say \"cached_tokens\": 5"}]}"#,
            br#"{"usage":{"prompt_tokens_details":{"cached_tokens""#,
            b"",
        ] {
            assert_eq!(reported(body), None, "{}", String::from_utf8_lossy(body));
            assert_eq!(patch(body, 1, false), None);
        }
    }
}
