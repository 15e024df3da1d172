//! Byte-preserving editing of JSON request bodies.
//!
//! [`JsonBody`] parses a client body once, records where every top-level member
//! sits in the input, and lets callers replace, add or remove top-level keys.
//! Serialising splices the untouched members back byte for byte, so key order,
//! number spelling (`1.0`, `1e3`, integers above 2^53), whitespace inside values
//! and escaped keys survive. Engines' prefix caches and big-integer fields depend
//! on that; a round trip through `serde_json::Value` would break both.

use std::collections::HashSet;
use std::fmt;
use std::ops::Range;

use bytes::{BufMut, Bytes, BytesMut};
use serde::de::{self, MapAccess, Visitor};
use serde_json::value::RawValue;

use crate::scan;

/// Errors from parsing or editing a [`JsonBody`].
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// The body is valid JSON but its top level is not an object.
    #[error("request body must be a JSON object")]
    NotObject,
    /// The same (unescaped) top-level key appears more than once.
    #[error("duplicate top-level key {0:?} in JSON body")]
    DuplicateKey(String),
    /// The body is not valid JSON (syntax, encoding or trailing data).
    #[error("invalid JSON body: {0}")]
    Invalid(#[source] serde_json::Error),
    /// A top-level value could not be read as the requested type.
    #[error("top-level key {key:?} has an unexpected value: {source}")]
    Value {
        /// The key that was read.
        key: String,
        /// What serde_json reported.
        #[source]
        source: serde_json::Error,
    },
    /// A value could not be serialised to JSON.
    #[error("cannot serialise value for key {key:?}: {source}")]
    Serialize {
        /// The key that was written.
        key: String,
        /// What serde_json reported.
        #[source]
        source: serde_json::Error,
    },
}

/// Where a piece of output text comes from: a span of the input, or new bytes.
#[derive(Clone, Debug)]
enum Piece {
    Span(Range<usize>),
    Owned(Bytes),
}

/// One top-level member: `pre` is the whitespace before the key, `head` the
/// key text up to the value (`"key" :`), `value` the value text and `post` the
/// whitespace after it. `pre` and `post` are empty for added members.
#[derive(Clone, Debug)]
struct Member {
    key: Box<str>,
    pre: Range<usize>,
    head: Piece,
    value: Piece,
    post: Range<usize>,
}

/// A parsed JSON object body that supports top-level edits with byte-preserving
/// output.
///
/// Parse once with [`JsonBody::parse`], edit with [`set`](JsonBody::set),
/// [`set_raw`](JsonBody::set_raw) and [`remove`](JsonBody::remove), then emit
/// with [`to_bytes`](JsonBody::to_bytes). Every byte not covered by an edit
/// is emitted exactly as it appeared in the input: the spelling of keys,
/// whitespace around and inside members, and the text outside the braces. A
/// replaced value takes the old value's place, an added member goes last, a
/// removed member leaves with its surrounding whitespace and one comma. An
/// unedited body is returned as the original [`Bytes`] (zero copy).
///
/// Cloning is cheap: members point into the shared input buffer.
///
/// ```
/// use kvtransfer::JsonBody;
///
/// let raw = br#"{"model":"m", "max_tokens": 500, "id":9007199254740993}"#;
/// let mut body = JsonBody::parse(bytes::Bytes::from_static(raw)).unwrap();
/// body.set("max_tokens", &1).unwrap();
/// body.set_raw("stream", "false");
/// assert_eq!(
///     &body.to_bytes()[..],
///     br#"{"model":"m", "max_tokens": 1, "id":9007199254740993,"stream":false}"#
/// );
/// ```
#[derive(Clone, Debug)]
pub struct JsonBody {
    raw: Bytes,
    members: Vec<Member>,
    /// `raw[..open]` is everything up to and including `{`.
    open: usize,
    /// `raw[close..]` is `}` and everything after it.
    close: usize,
    edited: bool,
}

/// Above this many members duplicate detection switches from pairwise
/// comparison to a hash set.
const SMALL_OBJECT: usize = 16;

fn is_json_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\n' | b'\r' | b'\t')
}

fn skip_ws(input: &[u8], mut pos: usize) -> usize {
    while pos < input.len() && is_json_ws(input[pos]) {
        pos += 1;
    }
    pos
}

/// Trims JSON whitespace (space, tab, CR, LF) from both ends of `input`.
pub(crate) fn trim_json_ws(input: &[u8]) -> &[u8] {
    let start = skip_ws(input, 0);
    let mut end = input.len();
    while end > start && is_json_ws(input[end - 1]) {
        end -= 1;
    }
    &input[start..end]
}

/// Collects `(unescaped key, raw value)` pairs of a top-level object, borrowing
/// the values from the input.
struct TopLevel;

impl<'de> Visitor<'de> for TopLevel {
    type Value = Vec<(String, &'de RawValue)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::with_capacity(map.size_hint().unwrap_or(8));
        while let Some(key) = map.next_key::<String>()? {
            let value: &'de RawValue = map.next_value()?;
            out.push((key, value));
        }
        Ok(out)
    }
}

/// Finds one top-level member and skips the others without allocating; a repeated `key` is an
/// error, other repeated keys are not looked at.
struct FindMember<'k>(&'k str);

impl<'de> Visitor<'de> for FindMember<'_> {
    type Value = Option<&'de RawValue>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found = None;
        while let Some(wanted) = map.next_key_seed(KeyIs(self.0))? {
            if !wanted {
                map.next_value::<de::IgnoredAny>()?;
            } else if found.is_some() {
                return Err(de::Error::custom(format_args!(
                    "duplicate key {:?}",
                    self.0
                )));
            } else {
                found = Some(map.next_value()?);
            }
        }
        Ok(found)
    }
}

/// Reads an object key as "is it this one?", borrowing it from the input.
struct KeyIs<'k>(&'k str);

impl<'de> de::DeserializeSeed<'de> for KeyIs<'_> {
    type Value = bool;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeyIs<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<bool, E> {
        Ok(key == self.0)
    }
}

/// The position of the opening `{`, or the error for input that is not a JSON object.
fn object_start(input: &[u8]) -> Result<usize, BodyError> {
    let open = skip_ws(input, 0);
    match input.get(open) {
        Some(b'{') => Ok(open),
        // Distinguish "valid JSON but not an object" from garbage.
        Some(_) => match serde_json::from_slice::<de::IgnoredAny>(input) {
            Ok(_) => Err(BodyError::NotObject),
            Err(e) => Err(BodyError::Invalid(e)),
        },
        None => Err(BodyError::Invalid(
            serde_json::from_slice::<de::IgnoredAny>(input)
                .err()
                .unwrap_or_else(|| de::Error::custom("empty body")),
        )),
    }
}

/// The raw text of the top-level member `key` of the JSON object `input`, borrowed from it, or
/// `None` without such a member. Cheaper than [`JsonBody::parse`] when one member is all that
/// is wanted (a prefill response's `kv_transfer_params`): the rest of the object is validated
/// but no key or member is stored.
///
/// # Errors
/// [`BodyError::NotObject`] for any other JSON value, [`BodyError::Invalid`] for malformed
/// JSON or a repeated `key`.
pub fn top_level_member<'a>(input: &'a [u8], key: &str) -> Result<Option<&'a str>, BodyError> {
    let open = object_start(input)?;
    let text = std::str::from_utf8(input);
    if let Ok(text) = text
        && let Some(found) = scan_member(text, open, key)
    {
        return Ok(found);
    }
    // What the scanner did not accept: serde_json decides, and names the error.
    let found = match text {
        Ok(text) => visit_object(serde_json::Deserializer::from_str(text), FindMember(key)),
        // Skipped values are not decoded, so the byte reader would let invalid UTF-8 in them
        // pass; reading the whole input as one raw value reports where it is.
        Err(_) => Err(serde_json::from_slice::<&RawValue>(input)
            .err()
            .unwrap_or_else(|| de::Error::custom("invalid UTF-8"))),
    };
    found
        .map(|v| v.map(RawValue::get))
        .map_err(BodyError::Invalid)
}

/// [`top_level_member`] by the scanner: `None` for anything it leaves to serde_json (invalid
/// text, a repeated `key`, a key with escapes, which could spell `key`).
fn scan_member<'a>(text: &'a str, open: usize, key: &str) -> Option<Option<&'a str>> {
    let s = text.as_bytes();
    let mut found = None;
    scan::object_members(s, open, |k| {
        if k.escaped {
            return None;
        }
        let end = scan::value_end(s, k.value)?;
        if s.get(k.key) == Some(key.as_bytes()) && found.replace(k.value..end).is_some() {
            return None;
        }
        Some(end)
    })?;
    match found {
        None => Some(None),
        Some(r) => text.get(r).map(Some),
    }
}

/// `object` with its top-level `key` set to `raw_value`, which must be valid JSON: the same bytes
/// as [`JsonBody::parse`], [`JsonBody::set_raw`] and [`JsonBody::to_bytes`] would give (the value
/// replaced in place, or the member added last), from one scan and without building a
/// [`JsonBody`].
///
/// # Errors
/// As [`top_level_member`].
pub fn with_member(object: &[u8], key: &str, raw_value: &[u8]) -> Result<Bytes, BodyError> {
    let at = match top_level_member(object, key)? {
        Some(text) => {
            let start = offset_in(object, text)
                .ok_or_else(|| BodyError::Invalid(de::Error::custom("raw value outside input")))?;
            Some(start..start + text.len())
        }
        None => None,
    };
    Ok(splice_member(object, at, key, raw_value))
}

/// The valid JSON object `object` with the value at `at` (its member `key`'s) replaced by
/// `raw_value`, or without `at`, the member `key` added last.
fn splice_member(object: &[u8], at: Option<Range<usize>>, key: &str, raw_value: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(object.len() + key.len() + raw_value.len() + 4);
    if let Some(at) = at {
        out.put_slice(&object[..at.start]);
        out.put_slice(raw_value);
        out.put_slice(&object[at.end..]);
        return out.freeze();
    }
    // A valid object: its `}` is the last byte that is not whitespace.
    let open = skip_ws(object, 0);
    let close = trim_json_ws(object).len() + open - 1;
    let empty = skip_ws(object, open + 1) == close;
    // An empty object loses the whitespace between its braces, as in `JsonBody::to_bytes`.
    out.put_slice(&object[..if empty { open + 1 } else { close }]);
    if !empty {
        out.put_u8(b',');
    }
    out.put_slice(&member_head(key));
    out.put_slice(raw_value);
    out.put_slice(&object[close..]);
    out.freeze()
}

/// What [`member_with_member`] found under its key.
#[derive(Debug, PartialEq, Eq)]
pub enum Nested<'a> {
    /// No such member.
    Absent,
    /// The member's value, which is not an object, as raw JSON text.
    Other(&'a str),
    /// The member's value, an object, with its own member set (see [`member_with_member`]).
    Object(Bytes),
}

/// The top-level member `key` of the JSON object `input` and, when its value is an object, that
/// object with its top-level `inner` set to `raw_value` (valid JSON) as [`with_member`] sets it:
/// [`top_level_member`] and then [`with_member`], from one scan of `input` (a prefill answer's
/// `kv_transfer_params` with its `remote_host` set: the value would be scanned twice otherwise).
///
/// # Errors
/// As [`top_level_member`]; a fault inside the object (a repeated `inner`) is a
/// [`BodyError::Value`] naming `key`.
pub fn member_with_member<'a>(
    input: &'a [u8],
    key: &str,
    inner: &str,
    raw_value: &[u8],
) -> Result<Nested<'a>, BodyError> {
    let open = object_start(input)?;
    if let Ok(text) = std::str::from_utf8(input)
        && let Some(found) = scan_nested(text, open, key, inner)
    {
        return Ok(match found {
            None => Nested::Absent,
            Some((value, None)) if !value.starts_with('{') => Nested::Other(value),
            Some((value, at)) => {
                Nested::Object(splice_member(value.as_bytes(), at, inner, raw_value))
            }
        });
    }
    // What the scanner did not accept: the two steps, whose errors name the fault.
    match top_level_member(input, key)? {
        None => Ok(Nested::Absent),
        Some(value) if value.starts_with('{') => with_member(value.as_bytes(), inner, raw_value)
            .map(Nested::Object)
            .map_err(|e| match e {
                BodyError::Invalid(source) => BodyError::Value {
                    key: key.to_owned(),
                    source,
                },
                other => other,
            }),
        Some(value) => Ok(Nested::Other(value)),
    }
}

/// [`member_with_member`]'s scan: the value of `key` and, when it is an object, where its member
/// `inner` lies within it. `None` for what it leaves to serde_json, as [`scan_member`].
#[allow(clippy::type_complexity)]
fn scan_nested<'a>(
    text: &'a str,
    open: usize,
    key: &str,
    inner: &str,
) -> Option<Option<(&'a str, Option<Range<usize>>)>> {
    let s = text.as_bytes();
    let mut found: Option<(Range<usize>, Option<Range<usize>>)> = None;
    scan::object_members(s, open, |k| {
        if k.escaped {
            return None;
        }
        let wanted = s.get(k.key) == Some(key.as_bytes());
        if wanted && found.is_some() {
            return None;
        }
        if !wanted || s.get(k.value) != Some(&b'{') {
            let end = scan::value_end(s, k.value)?;
            if wanted {
                found = Some((k.value..end, None));
            }
            return Some(end);
        }
        // The object itself is read here, member by member, so it is scanned once.
        let base = k.value;
        let mut at = None;
        let end = scan::members(s, base, |m| {
            if m.escaped {
                return None;
            }
            let end = scan::value_end(s, m.value)?;
            if s.get(m.key) == Some(inner.as_bytes())
                && at.replace(m.value - base..end - base).is_some()
            {
                return None;
            }
            Some(end)
        })?;
        found = Some((base..end, at));
        Some(end)
    })?;
    match found {
        None => Some(None),
        Some((value, at)) => Some(Some((text.get(value)?, at))),
    }
}

/// Where `text`, a slice serde_json borrowed from `input`, starts in it. Checked rather than
/// trusted: `None` if it does not lie within `input`.
fn offset_in(input: &[u8], text: &str) -> Option<usize> {
    (text.as_ptr() as usize)
        .checked_sub(input.as_ptr() as usize)
        .filter(|start| start + text.len() <= input.len())
}

/// The text of an added member before its value: the key as a JSON string, then `:`.
fn member_head(key: &str) -> Vec<u8> {
    // A key that needs no escape (every key the gateway adds) is written as it is.
    if key.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        let mut head = Vec::with_capacity(key.len() + 3);
        head.push(b'"');
        head.extend_from_slice(key.as_bytes());
        head.extend_from_slice(b"\":");
        return head;
    }
    // Serialising a str cannot fail; fall back to a plain quote if it ever did.
    let mut head = serde_json::to_vec(key).unwrap_or_else(|_| format!("\"{key}\"").into_bytes());
    head.push(b':');
    head
}

/// The top-level members of the object `input` (its `{` at `open`), unescaped keys and where
/// their values lie, in order, when the scanner reads them alone: valid JSON, no key with an
/// escape, at most `scan::MAX_NESTING` levels below the object.
fn scanned_members(input: &[u8], open: usize) -> Option<Vec<(String, Range<usize>)>> {
    let text = std::str::from_utf8(input).ok()?;
    let mut members = Vec::with_capacity(8);
    scan::object_members(input, open, |k| {
        let key = text.get(k.key).filter(|_| !k.escaped)?;
        let end = scan::value_end(input, k.value)?;
        members.push((key.to_owned(), k.value..end));
        Some(end)
    })?;
    Some(members)
}

/// The top-level members as serde_json reads them (see [`scanned_members`]).
fn serde_members(input: &[u8]) -> Result<Vec<(String, Range<usize>)>, BodyError> {
    let parsed = read_object(input, TopLevel).map_err(BodyError::Invalid)?;
    parsed
        .into_iter()
        .map(|(key, value)| {
            let text = value.get();
            let start = offset_in(input, text)
                .ok_or_else(|| BodyError::Invalid(de::Error::custom("raw value outside input")))?;
            Ok((key, start..start + text.len()))
        })
        .collect()
}

/// Runs `visitor` over the object `input`, which must hold nothing after it but whitespace.
fn read_object<'de, V: Visitor<'de>>(
    input: &'de [u8],
    visitor: V,
) -> Result<V::Value, serde_json::Error> {
    // One UTF-8 check of the whole input lets serde_json read it as `str`, which skips the
    // per-string and per-raw-value re-validation of the byte reader (about a third of the parse
    // cost for prompt-sized strings). Invalid UTF-8 takes the byte reader, for its error position.
    match std::str::from_utf8(input) {
        Ok(text) => visit_object(serde_json::Deserializer::from_str(text), visitor),
        Err(_) => visit_object(serde_json::Deserializer::from_slice(input), visitor),
    }
}

fn visit_object<'de, R: serde_json::de::Read<'de>, V: Visitor<'de>>(
    mut de: serde_json::Deserializer<R>,
    visitor: V,
) -> Result<V::Value, serde_json::Error> {
    let value = de::Deserializer::deserialize_map(&mut de, visitor)?;
    de.end()?;
    Ok(value)
}

impl JsonBody {
    /// Parses `raw`, which must be a single JSON object with unique top-level
    /// keys (keys are compared after unescaping, so `"a"` and `"\u0061"` clash).
    ///
    /// # Errors
    /// [`BodyError::NotObject`] for any other JSON value, [`BodyError::DuplicateKey`]
    /// for repeated keys, [`BodyError::Invalid`] for malformed JSON.
    pub fn parse(raw: Bytes) -> Result<JsonBody, BodyError> {
        match Self::scanned(raw) {
            Ok(parsed) => parsed,
            // What the scanner did not accept: serde_json decides, and names the error.
            Err(raw) => {
                let open = object_start(&raw)?;
                let members = serde_members(&raw)?;
                Self::laid_out(raw, open, members)
            }
        }
    }

    /// [`JsonBody::parse`] when the scanner reads `raw` alone (an object of valid JSON nesting at
    /// most `scan::MAX_NESTING` levels below it, no key with an escape): the parse's result
    /// (which may still be a repeated key). Otherwise `raw` back, untouched.
    pub(crate) fn scanned(raw: Bytes) -> Result<Result<JsonBody, BodyError>, Bytes> {
        let open = skip_ws(&raw, 0);
        if raw.get(open) != Some(&b'{') {
            return Err(raw);
        }
        match scanned_members(&raw, open) {
            Some(members) => Ok(Self::laid_out(raw, open, members)),
            None => Err(raw),
        }
    }

    /// The body of the valid object `raw` (its `{` at `open`) with these members.
    fn laid_out(
        raw: Bytes,
        open: usize,
        parsed: Vec<(String, Range<usize>)>,
    ) -> Result<JsonBody, BodyError> {
        let input: &[u8] = &raw;
        let mut members: Vec<Member> = Vec::with_capacity(parsed.len());
        // The text is valid, so between members there is only whitespace and one comma, and
        // after the last one `}`.
        let mut pos = open + 1;
        for (key, value) in parsed {
            let (start, end) = (value.start, value.end);
            if start < pos {
                return Err(BodyError::Invalid(de::Error::custom(
                    "raw value outside input",
                )));
            }
            if let Some(prev) = members.last_mut() {
                let comma = skip_ws(input, pos);
                prev.post = pos..comma;
                pos = comma + 1;
            }
            let key_start = skip_ws(input, pos);
            if key_start > start {
                return Err(BodyError::Invalid(de::Error::custom(
                    "member layout not understood",
                )));
            }
            members.push(Member {
                key: key.into_boxed_str(),
                pre: pos..key_start,
                head: Piece::Span(key_start..start),
                value: Piece::Span(start..end),
                post: end..end,
            });
            pos = end;
        }
        let close = skip_ws(input, pos);
        if let Some(last) = members.last_mut() {
            last.post = pos..close;
        }
        check_duplicates(&members)?;
        Ok(JsonBody {
            raw,
            members,
            open: open + 1,
            close,
            edited: false,
        })
    }

    /// The original input, unchanged by any edit.
    pub fn raw(&self) -> &Bytes {
        &self.raw
    }

    fn piece<'a>(&'a self, piece: &'a Piece) -> &'a [u8] {
        match piece {
            Piece::Span(r) => &self.raw[r.clone()],
            Piece::Owned(b) => b,
        }
    }

    fn find(&self, key: &str) -> Option<usize> {
        self.members.iter().position(|m| &*m.key == key)
    }

    /// The current raw JSON text of top-level `key` (after edits), if present.
    pub fn get_raw(&self, key: &str) -> Option<&str> {
        let i = self.find(key)?;
        std::str::from_utf8(self.piece(&self.members[i].value)).ok()
    }

    /// The current raw JSON bytes of top-level `key` (after edits), if present, borrowed:
    /// [`JsonBody::get_raw`] without its UTF-8 pass, for readers that take bytes.
    pub fn get_raw_slice(&self, key: &str) -> Option<&[u8]> {
        let i = self.find(key)?;
        Some(self.piece(&self.members[i].value))
    }

    /// The current raw JSON bytes of top-level `key` as a zero-copy slice of
    /// the input (or of the bytes that were set).
    pub fn get_raw_bytes(&self, key: &str) -> Option<Bytes> {
        let i = self.find(key)?;
        Some(match &self.members[i].value {
            Piece::Span(r) => self.raw.slice(r.clone()),
            Piece::Owned(b) => b.clone(),
        })
    }

    /// Deserialises the current value of top-level `key`.
    ///
    /// Returns `None` when the key is absent, `Some(Err(BodyError::Value))` when
    /// the value does not have the requested type.
    pub fn get<'a, T: serde::Deserialize<'a>>(&'a self, key: &str) -> Option<Result<T, BodyError>> {
        let i = self.find(key)?;
        let text = self.piece(&self.members[i].value);
        Some(
            serde_json::from_slice(text).map_err(|source| BodyError::Value {
                key: key.to_owned(),
                source,
            }),
        )
    }

    /// Whether top-level `key` is present.
    pub fn contains_key(&self, key: &str) -> bool {
        self.find(key).is_some()
    }

    /// Top-level keys (unescaped) in output order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.members.iter().map(|m| &*m.key)
    }

    /// Number of top-level members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the object has no members.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Whether any edit has been made since parsing.
    pub fn is_edited(&self) -> bool {
        self.edited
    }

    /// Sets top-level `key` to the JSON text `raw_json`: replaces the value in
    /// place when the key exists, otherwise appends the member at the end.
    ///
    /// `raw_json` is not validated in release builds; it must be one valid JSON
    /// value. Use [`set`](JsonBody::set) to serialise a Rust value instead.
    pub fn set_raw(&mut self, key: &str, raw_json: impl Into<Bytes>) {
        let value: Bytes = raw_json.into();
        debug_assert!(
            serde_json::from_slice::<de::IgnoredAny>(&value).is_ok(),
            "set_raw({key:?}) given invalid JSON"
        );
        self.edited = true;
        if let Some(i) = self.find(key) {
            self.members[i].value = Piece::Owned(value);
            return;
        }
        self.members.push(Member {
            key: key.into(),
            pre: 0..0,
            head: Piece::Owned(Bytes::from(member_head(key))),
            value: Piece::Owned(value),
            post: 0..0,
        });
    }

    /// Serialises `value` and sets it under top-level `key` (see
    /// [`set_raw`](JsonBody::set_raw) for placement).
    ///
    /// # Errors
    /// [`BodyError::Serialize`] when `value` cannot be represented as JSON.
    pub fn set<T: serde::Serialize + ?Sized>(
        &mut self,
        key: &str,
        value: &T,
    ) -> Result<(), BodyError> {
        let text = serde_json::to_vec(value).map_err(|source| BodyError::Serialize {
            key: key.to_owned(),
            source,
        })?;
        self.set_raw(key, text);
        Ok(())
    }

    /// Removes top-level `key`; returns whether it was present.
    pub fn remove(&mut self, key: &str) -> bool {
        match self.find(key) {
            Some(i) => {
                self.members.remove(i);
                self.edited = true;
                true
            }
            None => false,
        }
    }

    /// Removes every top-level key for which `drop` returns true; returns the
    /// removed keys in their original order.
    pub fn remove_where(&mut self, mut drop: impl FnMut(&str) -> bool) -> Vec<String> {
        let mut removed = Vec::new();
        self.members.retain(|m| {
            if drop(&m.key) {
                removed.push(m.key.to_string());
                false
            } else {
                true
            }
        });
        if !removed.is_empty() {
            self.edited = true;
        }
        removed
    }

    /// Emits the body. Without edits this is the input [`Bytes`] itself (zero
    /// copy); otherwise one buffer of the exact size is allocated.
    pub fn to_bytes(&self) -> Bytes {
        if !self.edited {
            return self.raw.clone();
        }
        let raw = &self.raw[..];
        let mut len = self.open + (raw.len() - self.close) + self.members.len().saturating_sub(1);
        for m in &self.members {
            len +=
                m.pre.len() + self.piece(&m.head).len() + self.piece(&m.value).len() + m.post.len();
        }
        let mut out = BytesMut::with_capacity(len);
        out.put_slice(&raw[..self.open]);
        for (i, m) in self.members.iter().enumerate() {
            if i > 0 {
                out.put_u8(b',');
            }
            out.put_slice(&raw[m.pre.clone()]);
            out.put_slice(self.piece(&m.head));
            out.put_slice(self.piece(&m.value));
            out.put_slice(&raw[m.post.clone()]);
        }
        out.put_slice(&raw[self.close..]);
        debug_assert_eq!(out.len(), len);
        out.freeze()
    }
}

fn check_duplicates(members: &[Member]) -> Result<(), BodyError> {
    if members.len() <= SMALL_OBJECT {
        for (i, m) in members.iter().enumerate() {
            if members[..i].iter().any(|o| o.key == m.key) {
                return Err(BodyError::DuplicateKey(m.key.to_string()));
            }
        }
        return Ok(());
    }
    let mut seen = HashSet::with_capacity(members.len());
    for m in members {
        if !seen.insert(&*m.key) {
            return Err(BodyError::DuplicateKey(m.key.to_string()));
        }
    }
    Ok(())
}

/// A short name for the JSON type of `raw` (for error messages).
pub(crate) fn json_type_name(raw: &[u8]) -> &'static str {
    match trim_json_ws(raw).first() {
        Some(b'{') => "object",
        Some(b'[') => "array",
        Some(b'"') => "string",
        Some(b't' | b'f') => "boolean",
        Some(b'n') => "null",
        Some(_) => "number",
        None => "empty",
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<JsonBody, BodyError> {
        JsonBody::parse(Bytes::copy_from_slice(s.as_bytes()))
    }

    #[test]
    fn member_with_member_sets_the_inner_member_in_one_scan() {
        let raw = br#"{"id":"x","kv_transfer_params":{"remote_host":"localhost","port":1},"n":2}"#;
        assert_eq!(
            member_with_member(raw, "kv_transfer_params", "remote_host", br#""10.0.0.7""#).unwrap(),
            Nested::Object(Bytes::from_static(
                br#"{"remote_host":"10.0.0.7","port":1}"#
            ))
        );
        assert_eq!(
            member_with_member(raw, "kv_transfer_params", "other", b"3").unwrap(),
            Nested::Object(Bytes::from_static(
                br#"{"remote_host":"localhost","port":1,"other":3}"#
            ))
        );
        assert_eq!(
            member_with_member(raw, "n", "x", b"1").unwrap(),
            Nested::Other("2")
        );
        assert_eq!(
            member_with_member(raw, "absent", "x", b"1").unwrap(),
            Nested::Absent
        );
        // Escaped keys and faults inside the object take serde_json's path, with its errors.
        let escaped = br#"{"kv_transfer_params":{"remote\u005fhost":"a"}}"#;
        assert_eq!(
            member_with_member(escaped, "kv_transfer_params", "remote_host", b"1").unwrap(),
            Nested::Object(Bytes::from_static(br#"{"remote\u005fhost":1}"#))
        );
        let twice = br#"{"kv_transfer_params":{"remote_host":"a","remote_host":"b"}}"#;
        assert!(matches!(
            member_with_member(twice, "kv_transfer_params", "remote_host", b"1"),
            Err(BodyError::Value { key, .. }) if key == "kv_transfer_params"
        ));
        assert!(matches!(
            member_with_member(
                br#"{"kv_transfer_params":{"a":tru}}"#,
                "kv_transfer_params",
                "a",
                b"1"
            ),
            Err(BodyError::Invalid(_))
        ));
    }

    #[test]
    fn top_level_member_reads_one_member() {
        let raw = br#" {"id":"x","kv\u005ftransfer_params" : {"a":[1,{"kv_transfer_params":2}]} ,"n":null} "#;
        let found = top_level_member(raw, "kv_transfer_params")
            .unwrap()
            .unwrap();
        assert_eq!(found, r#"{"a":[1,{"kv_transfer_params":2}]}"#);
        assert_eq!(top_level_member(raw, "n").unwrap().unwrap(), "null");
        // The same without escapes, which the scanner reads alone.
        let plain =
            br#" {"id":"x","kv_transfer_params" : {"a":[1,{"kv_transfer_params":2}]} ,"n":null} "#;
        assert_eq!(
            top_level_member(plain, "kv_transfer_params").unwrap(),
            Some(r#"{"a":[1,{"kv_transfer_params":2}]}"#)
        );
        assert!(matches!(
            top_level_member(br#"{"a":1,"a":2}"#, "a"),
            Err(BodyError::Invalid(e)) if e.to_string().contains("duplicate key \"a\"")
        ));
        assert!(top_level_member(raw, "a").unwrap().is_none());
        assert!(
            top_level_member(br#"{"a":1,"a":2}"#, "b")
                .unwrap()
                .is_none()
        );
        assert!(matches!(
            top_level_member(br#"{"a":1,"\u0061":2}"#, "a"),
            Err(BodyError::Invalid(e)) if e.to_string().contains("duplicate key \"a\"")
        ));
        assert!(matches!(
            top_level_member(b"[1]", "a"),
            Err(BodyError::NotObject)
        ));
        assert!(matches!(
            top_level_member(b"{\"a\":1} x", "a"),
            Err(BodyError::Invalid(_))
        ));
        assert!(matches!(
            top_level_member(b"", "a"),
            Err(BodyError::Invalid(_))
        ));
        assert!(matches!(
            top_level_member(b"{\"a\":tru}", "b"),
            Err(BodyError::Invalid(_))
        ));
    }

    #[test]
    fn unedited_body_is_the_same_buffer() {
        let raw = Bytes::from_static(b"  {\"a\" : 1 }\n");
        let body = JsonBody::parse(raw.clone()).unwrap();
        let out = body.to_bytes();
        assert_eq!(out, raw);
        assert_eq!(out.as_ptr(), raw.as_ptr());
    }

    #[test]
    fn edit_keeps_key_spacing_and_values() {
        let mut b = parse("{ \"a\" : 1.0e3 , \"b\":[1, 2] ,\"c\":\"x\" }").unwrap();
        b.set("b", &false).unwrap();
        assert_eq!(
            &b.to_bytes()[..],
            b"{ \"a\" : 1.0e3 , \"b\":false ,\"c\":\"x\" }"
        );
        assert!(b.remove("a"));
        assert_eq!(&b.to_bytes()[..], b"{ \"b\":false ,\"c\":\"x\" }");
    }

    #[test]
    fn rejects_non_objects_and_garbage() {
        assert!(matches!(parse("[1]"), Err(BodyError::NotObject)));
        assert!(matches!(parse("\"s\""), Err(BodyError::NotObject)));
        assert!(matches!(parse("null"), Err(BodyError::NotObject)));
        assert!(matches!(parse(""), Err(BodyError::Invalid(_))));
        assert!(matches!(parse("   "), Err(BodyError::Invalid(_))));
        assert!(matches!(parse("invalid json"), Err(BodyError::Invalid(_))));
        assert!(matches!(parse("{\"a\":1} x"), Err(BodyError::Invalid(_))));
        assert!(matches!(parse("{\"a\":1"), Err(BodyError::Invalid(_))));
        assert!(matches!(parse("{\"a\":1,}"), Err(BodyError::Invalid(_))));
    }

    #[test]
    fn escaped_and_plain_keys_are_found_by_their_unescaped_names() {
        let body = parse(r#"{"mo\u0064el":"m", "stream" :true,"\u00e9t\u00e9":1}"#).unwrap();
        let clone = body.clone();
        for b in [&body, &clone] {
            assert_eq!(b.get_raw("model"), Some("\"m\""));
            assert_eq!(b.get_raw("stream"), Some("true"));
            assert_eq!(b.get_raw("été"), Some("1"));
            assert_eq!(b.keys().collect::<Vec<_>>(), ["model", "stream", "été"]);
        }
        let mut edited = clone;
        assert_eq!(edited.remove_where(|k| k == "stream"), ["stream"]);
        edited.set_raw("model", "\"n\"");
        assert_eq!(
            &edited.to_bytes()[..],
            r#"{"mo\u0064el":"n","\u00e9t\u00e9":1}"#.as_bytes()
        );
    }

    #[test]
    fn duplicate_keys_compare_unescaped() {
        match parse(r#"{"a":1,"\u0061":2}"#) {
            Err(BodyError::DuplicateKey(k)) => assert_eq!(k, "a"),
            other => panic!("expected duplicate, got {other:?}"),
        }
        let many: Vec<String> = (0..40).map(|i| format!("\"k{i}\":{i}")).collect();
        let text = format!("{{{},\"k7\":0}}", many.join(","));
        assert!(matches!(parse(&text), Err(BodyError::DuplicateKey(k)) if k == "k7"));
    }

    #[test]
    fn remove_and_append() {
        let mut b = parse(r#"{"a":1,"b":2}"#).unwrap();
        assert!(b.remove("a"));
        assert!(!b.remove("zz"));
        b.set_raw("a", "3");
        assert_eq!(&b.to_bytes()[..], br#"{"b":2,"a":3}"#);
        assert!(b.remove("b"));
        assert!(b.remove("a"));
        assert_eq!(&b.to_bytes()[..], b"{}");
    }

    #[test]
    fn empty_object_accepts_additions() {
        let mut b = parse(" { } ").unwrap();
        assert!(b.is_empty());
        b.set("k\"q", "v").unwrap();
        assert_eq!(&b.to_bytes()[..], br#" {"k\"q":"v"} "#);
        assert_eq!(b.get::<String>("k\"q").unwrap().unwrap(), "v");
    }

    #[test]
    fn get_reports_type_errors() {
        let b = parse(r#"{"n":"two"}"#).unwrap();
        assert!(matches!(
            b.get::<u32>("n"),
            Some(Err(BodyError::Value { .. }))
        ));
        assert!(b.get::<u32>("missing").is_none());
        assert_eq!(b.get::<&str>("n").unwrap().unwrap(), "two");
    }

    #[test]
    fn type_names() {
        assert_eq!(json_type_name(b" \"s\""), "string");
        assert_eq!(json_type_name(b"-1"), "number");
        assert_eq!(json_type_name(b""), "empty");
        assert_eq!(trim_json_ws(b" \n{}\r\t"), b"{}");
    }
}
