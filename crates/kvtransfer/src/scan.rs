//! A validating JSON scanner for the request path: where the members of an object and their
//! values start and end, and nothing else (no keys unescaped, no values decoded).
//!
//! Written by hand because measurement asked for it: serde_json skips a value it is not asked to
//! decode (`IgnoredAny`, `RawValue`) at 15-20 instructions per byte when the value is many small
//! members, which a prefill answer's `kv_transfer_params` and usage are. Finding
//! `kv_transfer_params` in a prefill answer and setting its `remote_host` cost 18.5 k
//! instructions per PD request through serde_json, 13% of all the gateway's instructions
//! (`bench/profile.sh callgrind 2000`); see docs/benchmarks.md.
//!
//! The scanner only ever *accepts*: a caller that gets `None` re-reads the text with
//! serde_json, whose answer (an error, or a value the scanner was too cautious for, such as a key
//! with escapes) is the one that counts. So it must never accept what serde_json refuses, and
//! must find the same values; the property tests in `tests/prop_body.rs` hold it to that. The
//! grammar is serde_json's: RFC 8259 with no trailing commas, strings without control
//! characters and with valid escapes (`\u` takes four hex digits; surrogates are not paired, as
//! serde_json does not pair them in a value it skips), nesting below [`MAX_NESTING`]. The input
//! is `str`: UTF-8 was checked once by the caller.

/// Containers nested deeper than this are left to serde_json (whose own recursion limit is 128):
/// one bit per level in a `u64`.
pub(crate) const MAX_NESTING: u32 = 63;

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGHS: u64 = 0x8080_8080_8080_8080;

/// The high bit of the bytes of `w` that equal `b`: exact for the lowest such byte (a borrow may
/// mark bytes above it too).
#[inline(always)]
fn equal(w: u64, b: u8) -> u64 {
    let x = w ^ (ONES * u64::from(b));
    x.wrapping_sub(ONES) & !x & HIGHS
}

/// Where in `w` the first byte is that ends a string's fast run (a control character below
/// 0x20, `"` or `\\`), as a byte offset; 8 when none does. Every test is exact for its lowest
/// byte, so the lowest of them all is the first such byte.
#[inline(always)]
pub(crate) fn string_stop(w: u64) -> usize {
    let stops = (w.wrapping_sub(ONES * 0x20) & !w & HIGHS) | equal(w, b'"') | equal(w, b'\\');
    (stops.trailing_zeros() / 8) as usize
}

#[inline(always)]
fn ws(s: &[u8], mut i: usize) -> usize {
    while let Some(b' ' | b'\n' | b'\r' | b'\t') = s.get(i) {
        i += 1;
    }
    i
}

/// The end (one past the closing quote) of the string whose opening quote is at `i`, and whether
/// it holds an escape.
#[inline(always)]
fn string(s: &[u8], mut i: usize) -> Option<(usize, bool)> {
    i += 1;
    let mut escaped = false;
    loop {
        // Eight bytes at a time up to the first that can end the run (prompts are most of a
        // body); the last few bytes of the input one by one.
        while let Some(chunk) = s.get(i..i + 8) {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            let stop = string_stop(u64::from_le_bytes(word));
            i += stop;
            if stop < 8 {
                break;
            }
        }
        match *s.get(i)? {
            b'"' => return Some((i + 1, escaped)),
            b'\\' => {
                escaped = true;
                match *s.get(i + 1)? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => i += 2,
                    b'u' => {
                        let hex = s.get(i + 2..i + 6)?;
                        if !hex.iter().all(u8::is_ascii_hexdigit) {
                            return None;
                        }
                        i += 6;
                    }
                    _ => return None,
                }
            }
            0..=0x1f => return None,
            _ => i += 1,
        }
    }
}

#[inline(always)]
fn digits(s: &[u8], mut i: usize) -> usize {
    while let Some(b'0'..=b'9') = s.get(i) {
        i += 1;
    }
    i
}

/// The end of the number starting at `i`: `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`.
#[inline(always)]
fn number(s: &[u8], mut i: usize) -> Option<usize> {
    if s.get(i) == Some(&b'-') {
        i += 1;
    }
    match *s.get(i)? {
        b'0' => i += 1,
        b'1'..=b'9' => i = digits(s, i + 1),
        _ => return None,
    }
    if s.get(i) == Some(&b'.') {
        let end = digits(s, i + 1);
        if end == i + 1 {
            return None;
        }
        i = end;
    }
    if let Some(b'e' | b'E') = s.get(i) {
        i += 1;
        if let Some(b'+' | b'-') = s.get(i) {
            i += 1;
        }
        let end = digits(s, i);
        if end == i {
            return None;
        }
        i = end;
    }
    // What follows a number is the container's to check, except a digit ("01" is not a number).
    if let Some(b'0'..=b'9') = s.get(i) {
        return None;
    }
    Some(i)
}

#[inline(always)]
fn literal(s: &[u8], i: usize, word: &[u8]) -> Option<usize> {
    (s.get(i..i + word.len())? == word).then_some(i + word.len())
}

/// After a key's opening quote at `i`: the key's end and the value's start (past `:` and
/// whitespace).
#[inline(always)]
fn key_and_colon(s: &[u8], i: usize) -> Option<(usize, bool, usize)> {
    if s.get(i) != Some(&b'"') {
        return None;
    }
    let (end, escaped) = string(s, i)?;
    let colon = ws(s, end);
    if s.get(colon) != Some(&b':') {
        return None;
    }
    Some((end, escaped, ws(s, colon + 1)))
}

/// The end of the JSON value that starts at `i` (no whitespace before it), or `None` if the text
/// there is not one serde_json would accept.
pub(crate) fn value_end(s: &[u8], mut i: usize) -> Option<usize> {
    // Bit `d` of `objects`: the container at depth `d` (1-based) is an object.
    let mut objects: u64 = 0;
    let mut depth = 0u32;
    loop {
        // A value starts at `i`.
        match *s.get(i)? {
            open @ (b'{' | b'[') => {
                let inner = ws(s, i + 1);
                let close = if open == b'{' { b'}' } else { b']' };
                if s.get(inner) == Some(&close) {
                    i = inner + 1;
                } else {
                    depth += 1;
                    if depth > MAX_NESTING {
                        return None;
                    }
                    if open == b'{' {
                        objects |= 1 << depth;
                        i = key_and_colon(s, inner)?.2;
                    } else {
                        objects &= !(1 << depth);
                        i = inner;
                    }
                    continue;
                }
            }
            b'"' => i = string(s, i)?.0,
            b't' => i = literal(s, i, b"true")?,
            b'f' => i = literal(s, i, b"false")?,
            b'n' => i = literal(s, i, b"null")?,
            _ => i = number(s, i)?,
        }
        // A value ended at `i`: close what it ends, or go on to the next member or element.
        loop {
            if depth == 0 {
                return Some(i);
            }
            i = ws(s, i);
            let object = objects & (1 << depth) != 0;
            match *s.get(i)? {
                b',' => {
                    let next = ws(s, i + 1);
                    i = if object {
                        key_and_colon(s, next)?.2
                    } else {
                        next
                    };
                    break;
                }
                b'}' if object => {
                    i += 1;
                    depth -= 1;
                }
                b']' if !object => {
                    i += 1;
                    depth -= 1;
                }
                _ => return None,
            }
        }
    }
}

/// A member's key as the scanner meets it: its text between the quotes (still escaped; `escaped`
/// says whether it holds an escape) and where its value starts.
pub(crate) struct Key {
    pub(crate) key: std::ops::Range<usize>,
    pub(crate) escaped: bool,
    pub(crate) value: usize,
}

/// Reads the members of the object whose `{` is at `open`: `each` gets every key, in order, and
/// returns where that member's value ends, having checked it ([`value_end`], unless it reads the
/// value its own way), or `None` to give up. Returns the position just past the object's `}`.
pub(crate) fn members(
    s: &[u8],
    open: usize,
    mut each: impl FnMut(Key) -> Option<usize>,
) -> Option<usize> {
    let mut i = ws(s, open + 1);
    if s.get(i) == Some(&b'}') {
        return Some(i + 1);
    }
    loop {
        let (key_end, escaped, value) = key_and_colon(s, i)?;
        let end = each(Key {
            key: i + 1..key_end - 1,
            escaped,
            value,
        })?;
        i = ws(s, end);
        match *s.get(i)? {
            b',' => i = ws(s, i + 1),
            b'}' => return Some(i + 1),
            _ => return None,
        }
    }
}

/// [`members`] of an object that must be the whole input but whitespace: the position of its `}`.
pub(crate) fn object_members(
    s: &[u8],
    open: usize,
    each: impl FnMut(Key) -> Option<usize>,
) -> Option<usize> {
    let end = members(s, open, each)?;
    (ws(s, end) == s.len()).then_some(end - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accepts(text: &str) -> bool {
        value_end(text.as_bytes(), 0) == Some(text.len())
    }

    #[test]
    fn values_serde_json_accepts_are_accepted_whole() {
        for text in [
            "0",
            "-0.5e+10",
            "12E3",
            r#""a\"b\\\u00e9\/""#,
            "true",
            "null",
            "[]",
            "{}",
            r#"{"a":[1,{"b":null}, "c" ],"d":{}}"#,
            "[ [ [ ] ] , { } ]",
            r#""ünïcode and a long run of text past eight bytes""#,
        ] {
            assert!(accepts(text), "{text}");
            assert!(
                serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok(),
                "{text}"
            );
        }
    }

    #[test]
    fn values_serde_json_refuses_are_refused() {
        for text in [
            "01",
            "-",
            "1.",
            "1e",
            ".5",
            "+1",
            "tru",
            "nul",
            r#""a"#,
            "\"a\u{1}b\"",
            r#""\x""#,
            r#""\u12g4""#,
            "[1,]",
            r#"{"a":1,}"#,
            r#"{"a" 1}"#,
            "{1:2}",
            "[1 2]",
            "[",
            r#"{"a":}"#,
            "[}",
            "{]",
        ] {
            assert!(!accepts(text), "{text}");
            assert!(
                serde_json::from_str::<serde::de::IgnoredAny>(text).is_err(),
                "{text}"
            );
        }
    }

    #[test]
    fn a_string_ends_at_its_first_quote_wherever_it_falls_in_a_word() {
        for pad in 0..20 {
            let body = "é".repeat(pad % 3) + &"a".repeat(pad);
            let text = format!("\"{body}\"");
            assert_eq!(
                string(format!("{text}, \"x\"").as_bytes(), 0),
                Some((text.len(), false))
            );
            let escaped = format!("\"{body}\\\"{body}\"");
            assert_eq!(string(escaped.as_bytes(), 0), Some((escaped.len(), true)));
            assert_eq!(
                string(format!("\"{body}\u{1f}{body}\"").as_bytes(), 0),
                None
            );
        }
    }

    #[test]
    fn nesting_beyond_the_limit_is_left_to_serde_json() {
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert!(accepts(&deep(MAX_NESTING as usize)));
        assert!(!accepts(&deep(MAX_NESTING as usize + 2)));
    }

    #[test]
    fn members_come_with_their_spans_and_the_object_must_end_the_input() {
        let text = r#" { "a" : 1 , "b\n":[2] } "#;
        let s = text.as_bytes();
        let mut seen = Vec::new();
        let close = object_members(s, 1, |k| {
            let end = value_end(s, k.value)?;
            seen.push((
                text[k.key.clone()].to_owned(),
                k.escaped,
                text[k.value..end].to_owned(),
            ));
            Some(end)
        });
        assert_eq!(close, Some(text.len() - 2));
        assert_eq!(
            seen,
            [
                ("a".to_owned(), false, "1".to_owned()),
                ("b\\n".to_owned(), true, "[2]".to_owned())
            ]
        );
        let plain = |s: &[u8]| object_members(s, 0, |k| value_end(s, k.value));
        assert_eq!(plain(br#"{"a":1} x"#), None);
        assert_eq!(plain(br#"{"a":1,}"#), None);
        assert_eq!(plain(b"{ }"), Some(2));
        assert_eq!(object_members(br#"{"a":1}"#, 0, |_| None), None);
    }
}
