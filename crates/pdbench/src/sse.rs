//! A small incremental reader for OpenAI-style server-sent events.
//!
//! It does just enough to time a stream without parsing every chunk as JSON: split events on
//! a blank line, classify each `data:` payload as a token, an error, the usage chunk or
//! `[DONE]`, and pull `completion_tokens` out of a usage object. Its buffer is bounded.

/// The largest single event accepted; a longer one is a protocol error.
pub const MAX_EVENT_BYTES: usize = 1 << 20;

/// What one `data:` payload was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A chunk that carries generated text (non-empty `text` or `content`).
    Token,
    /// A chunk without generated text (a role-only delta, the usage chunk, ...).
    Other,
    /// `data: [DONE]`.
    Done,
    /// An error object inside the stream.
    Error,
}

/// Why a stream could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// An event grew past [`MAX_EVENT_BYTES`] without a terminating blank line.
    #[error("server-sent event larger than {MAX_EVENT_BYTES} bytes")]
    Oversized,
}

/// Incremental event splitter; feed it body frames as they arrive.
#[derive(Debug, Default)]
pub struct SseReader {
    buf: Vec<u8>,
    /// How far `buf` has been searched for a separator, so each byte is scanned once.
    scanned: usize,
    /// `usage.completion_tokens` from the last event that had it.
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens` from the last event that had it.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens` from the last event that had it.
    pub cached_tokens: Option<u64>,
    /// When set, the generated text of every chunk is appended here (parsed as JSON).
    pub text: Option<String>,
}

impl SseReader {
    /// Feeds one body frame and calls `on_event` for every complete `data:` payload in order.
    pub fn feed(&mut self, frame: &[u8], mut on_event: impl FnMut(Event)) -> Result<(), SseError> {
        self.buf.extend_from_slice(frame);
        let mut start = 0;
        loop {
            let from = self.scanned.max(start);
            let Some((end, next)) = find_separator(&self.buf, from) else {
                // Keep the tail; the separator may straddle two frames, so rescan one byte back.
                self.scanned = self.buf.len().saturating_sub(1).max(start);
                break;
            };
            let event = &self.buf[start..end];
            for line in event.split(|&b| b == b'\n') {
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                if let Some(payload) = line.strip_prefix(b"data:") {
                    let payload = trim(payload);
                    if let Some(n) = find_u64_field(payload, b"\"completion_tokens\"") {
                        self.completion_tokens = Some(n);
                        self.prompt_tokens = find_u64_field(payload, b"\"prompt_tokens\"");
                        self.cached_tokens = find_u64_field(payload, b"\"cached_tokens\"");
                    }
                    if let Some(text) = self.text.as_mut()
                        && payload.starts_with(b"{")
                        && let Ok(v) = serde_json::from_slice::<serde_json::Value>(payload)
                    {
                        text.push_str(&generated_text(&v, true));
                    }
                    on_event(classify(payload));
                }
            }
            start = next;
            self.scanned = next;
        }
        if start > 0 {
            self.buf.drain(..start);
            self.scanned -= start;
        }
        if self.buf.len() > MAX_EVENT_BYTES {
            return Err(SseError::Oversized);
        }
        Ok(())
    }
}

/// The generated text of a response (`choices[0].message.content` or `.text`) or, for a
/// stream chunk (`delta`), of `choices[0].delta.content` or `.text`.
pub fn generated_text(v: &serde_json::Value, delta: bool) -> String {
    let c = &v["choices"][0];
    let inner = if delta { &c["delta"] } else { &c["message"] };
    inner["content"]
        .as_str()
        .or_else(|| c["text"].as_str())
        .unwrap_or_default()
        .to_owned()
}

/// Finds the first blank line (`\n\n` or `\r\n\r\n`) at or after `from`: (event end, next start).
fn find_separator(buf: &[u8], from: usize) -> Option<(usize, usize)> {
    let mut i = from;
    while i + 1 < buf.len() {
        if buf[i] == b'\n' {
            if buf[i + 1] == b'\n' {
                return Some((i, i + 2));
            }
            if buf[i + 1] == b'\r' && buf.get(i + 2) == Some(&b'\n') {
                return Some((i, i + 3));
            }
        }
        i += 1;
    }
    None
}

fn trim(mut s: &[u8]) -> &[u8] {
    while let [first, rest @ ..] = s {
        if first.is_ascii_whitespace() {
            s = rest;
        } else {
            break;
        }
    }
    while let [rest @ .., last] = s {
        if last.is_ascii_whitespace() {
            s = rest;
        } else {
            break;
        }
    }
    s
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Position just after `"key"` `:` and any whitespace, for the first occurrence of `key`.
fn value_after(hay: &[u8], key: &[u8]) -> Option<usize> {
    let mut at = find(hay, key)? + key.len();
    while hay.get(at).is_some_and(u8::is_ascii_whitespace) {
        at += 1;
    }
    if hay.get(at) != Some(&b':') {
        return None;
    }
    at += 1;
    while hay.get(at).is_some_and(u8::is_ascii_whitespace) {
        at += 1;
    }
    Some(at)
}

/// Reads an unsigned integer value of `key` (a quoted JSON key) anywhere in `hay`.
pub fn find_u64_field(hay: &[u8], key: &[u8]) -> Option<u64> {
    let at = value_after(hay, key)?;
    let digits = hay[at..].iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        return None;
    }
    std::str::from_utf8(&hay[at..at + digits])
        .ok()?
        .parse()
        .ok()
}

/// True when `key` has a non-empty string value.
fn has_nonempty_string(hay: &[u8], key: &[u8]) -> bool {
    let mut rest = hay;
    // A chunk may mention the key more than once (e.g. `"content"` in a role delta and later).
    while let Some(at) = value_after(rest, key) {
        if rest.get(at) == Some(&b'"') && rest.get(at + 1).is_some_and(|&b| b != b'"') {
            return true;
        }
        rest = &rest[at..];
    }
    false
}

/// Classifies one trimmed `data:` payload.
pub fn classify(payload: &[u8]) -> Event {
    if payload == b"[DONE]" {
        return Event::Done;
    }
    let inner = trim(payload.strip_prefix(b"{").unwrap_or(payload));
    if inner.starts_with(b"\"error\"")
        || find(payload, b"\"object\":\"error\"").is_some()
        || find(payload, b"\"object\": \"error\"").is_some()
    {
        return Event::Error;
    }
    if has_nonempty_string(payload, b"\"text\"") || has_nonempty_string(payload, b"\"content\"") {
        Event::Token
    } else {
        Event::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(frames: &[&[u8]]) -> (Vec<Event>, Option<u64>) {
        let mut r = SseReader::default();
        let mut out = Vec::new();
        for f in frames {
            r.feed(f, |e| out.push(e)).expect("feed");
        }
        (out, r.completion_tokens)
    }

    #[test]
    fn completions_stream_with_usage() {
        let body: &[u8] = b"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"text\":\" a\",\"finish_reason\":null}]}\n\n\
data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"text\":\" b\",\"finish_reason\":\"length\"}]}\n\n\
data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"total_tokens\":7}}\n\n\
data: [DONE]\n\n";
        let (ev, n) = events(&[body]);
        assert_eq!(
            ev,
            vec![Event::Token, Event::Token, Event::Other, Event::Done]
        );
        assert_eq!(n, Some(2));
    }

    #[test]
    fn split_across_frames_at_every_byte() {
        let body: &[u8] =
            b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\r\n\r\n\
data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n";
        for cut in 1..body.len() {
            let (ev, _) = events(&[&body[..cut], &body[cut..]]);
            assert_eq!(
                ev,
                vec![Event::Other, Event::Token, Event::Done],
                "cut {cut}"
            );
        }
        let one_by_one: Vec<&[u8]> = body.chunks(1).collect();
        let (ev, _) = events(&one_by_one);
        assert_eq!(ev, vec![Event::Other, Event::Token, Event::Done]);
    }

    #[test]
    fn error_events_are_recognised() {
        assert_eq!(
            classify(br#"{"error":{"message":"kv load failed","code":500}}"#),
            Event::Error
        );
        assert_eq!(
            classify(br#"{"object": "error", "message": "x", "code": 500}"#),
            Event::Error
        );
        assert_eq!(classify(br#"{"choices":[{"text":"error"}]}"#), Event::Token);
        assert_eq!(classify(br#"{"choices":[{"text":""}]}"#), Event::Other);
        assert_eq!(classify(b"[DONE]"), Event::Done);
    }

    #[test]
    fn spaced_json_and_numbers() {
        assert_eq!(
            classify(br#"{"choices": [{"delta": {"content": "x"}}]}"#),
            Event::Token
        );
        assert_eq!(
            find_u64_field(
                br#"{"usage": {"completion_tokens": 17}}"#,
                b"\"completion_tokens\""
            ),
            Some(17)
        );
        assert_eq!(
            find_u64_field(br#"{"completion_tokens":null}"#, b"\"completion_tokens\""),
            None
        );
    }

    #[test]
    fn oversized_event_is_an_error_and_buffer_stays_bounded() {
        let mut r = SseReader::default();
        let chunk = vec![b'x'; 64 * 1024];
        let mut failed = false;
        for _ in 0..40 {
            if r.feed(&chunk, |_| {}).is_err() {
                failed = true;
                break;
            }
        }
        assert!(failed);
        assert!(r.buf.len() <= MAX_EVENT_BYTES + chunk.len());
    }
}
