//! The slice of MessagePack that KV events use: a bounds-checked reader that borrows from the
//! payload and never trusts a length prefix, and a writer that picks the smallest encoding for
//! every value, as msgspec (vLLM's encoder) does, so encoded payloads equal vLLM's byte for byte.
//!
//! Hand-written rather than `rmpv`: decoding into `rmpv::Value` allocates a tree per event (one
//! node per token id), and ingest has to reach millions of blocks per second; the reader here
//! walks the bytes once and allocates only the vectors the caller keeps.

/// Why a payload or frame could not be decoded (re-exported as `events::DecodeError`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The bytes end inside a value (or a length prefix points past the end).
    #[error("payload truncated")]
    Truncated,
    /// `0xc1`, the one byte MessagePack never uses.
    #[error("invalid MessagePack marker 0x{0:02x}")]
    BadMarker(u8),
    /// A value of the wrong type where the format expects another.
    #[error("{field}: expected {expected}, found {found}")]
    Type {
        /// Which field (or structural position) held it.
        field: &'static str,
        /// What the format allows there.
        expected: &'static str,
        /// What the payload held.
        found: &'static str,
    },
    /// A field the event cannot do without is absent.
    #[error("{event}: missing field {field}")]
    Missing {
        /// The event type.
        event: &'static str,
        /// The absent field.
        field: &'static str,
    },
    /// A number outside the range the field allows (a token id above `u32::MAX`, say).
    #[error("{0}: number out of range")]
    Range(&'static str),
    /// A string that is not UTF-8.
    #[error("{0}: string is not UTF-8")]
    Utf8(&'static str),
    /// Bytes after the payload's one value.
    #[error("{0} trailing bytes after the payload")]
    Trailing(usize),
    /// A sequence frame that is not 8 bytes.
    #[error("sequence frame of {0} bytes, expected 8")]
    SeqLen(usize),
}

/// One MessagePack value's head; strings, binaries and extensions carry their bytes, arrays and
/// maps their element count (the elements follow in the stream).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Head<'a> {
    Nil,
    Bool(bool),
    Uint(u64),
    /// Only negative values: MessagePack writes non-negative ones as unsigned.
    Int(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Ext(&'a [u8]),
    Array(u32),
    Map(u32),
}

impl Head<'_> {
    /// What the value is, for error messages.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Head::Nil => "nil",
            Head::Bool(_) => "bool",
            Head::Uint(_) | Head::Int(_) => "int",
            Head::Float(_) => "float",
            Head::Str(_) => "str",
            Head::Bin(_) => "bin",
            Head::Ext(_) => "ext",
            Head::Array(_) => "array",
            Head::Map(_) => "map",
        }
    }
}

/// A cursor over a MessagePack payload.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    /// Bytes not read yet: an upper bound for any element count that follows, since every
    /// element takes at least one byte (used to cap pre-allocation on hostile lengths).
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).ok_or(DecodeError::Truncated)?;
        let bytes = self.buf.get(self.pos..end).ok_or(DecodeError::Truncated)?;
        self.pos = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    fn sized(&mut self, len: usize) -> Result<&'a [u8], DecodeError> {
        self.take(len)
    }

    /// Reads the next value's head (and, for str/bin/ext, its bytes).
    pub(crate) fn head(&mut self) -> Result<Head<'a>, DecodeError> {
        let marker = self.u8()?;
        Ok(match marker {
            0x00..=0x7f => Head::Uint(u64::from(marker)),
            0x80..=0x8f => Head::Map(u32::from(marker & 0x0f)),
            0x90..=0x9f => Head::Array(u32::from(marker & 0x0f)),
            0xa0..=0xbf => Head::Str(self.sized(usize::from(marker & 0x1f))?),
            0xc0 => Head::Nil,
            0xc1 => return Err(DecodeError::BadMarker(marker)),
            0xc2 => Head::Bool(false),
            0xc3 => Head::Bool(true),
            0xc4 => {
                let n = self.u8()?;
                Head::Bin(self.sized(usize::from(n))?)
            }
            0xc5 => {
                let n = self.u16()?;
                Head::Bin(self.sized(usize::from(n))?)
            }
            0xc6 => {
                let n = self.u32()?;
                Head::Bin(self.sized(n as usize)?)
            }
            0xc7 => {
                let n = self.u8()?;
                Head::Ext(self.sized(usize::from(n) + 1)?)
            }
            0xc8 => {
                let n = self.u16()?;
                Head::Ext(self.sized(usize::from(n) + 1)?)
            }
            0xc9 => {
                let n = self.u32()?;
                Head::Ext(self.sized((n as usize).saturating_add(1))?)
            }
            0xca => Head::Float(f64::from(f32::from_be_bytes(self.array()?))),
            0xcb => Head::Float(f64::from_be_bytes(self.array()?)),
            0xcc => Head::Uint(u64::from(self.u8()?)),
            0xcd => Head::Uint(u64::from(self.u16()?)),
            0xce => Head::Uint(u64::from(self.u32()?)),
            0xcf => Head::Uint(self.u64()?),
            0xd0 => int(i64::from(i8::from_be_bytes(self.array()?))),
            0xd1 => int(i64::from(i16::from_be_bytes(self.array()?))),
            0xd2 => int(i64::from(i32::from_be_bytes(self.array()?))),
            0xd3 => int(i64::from_be_bytes(self.array()?)),
            0xd4 => Head::Ext(self.sized(2)?),
            0xd5 => Head::Ext(self.sized(3)?),
            0xd6 => Head::Ext(self.sized(5)?),
            0xd7 => Head::Ext(self.sized(9)?),
            0xd8 => Head::Ext(self.sized(17)?),
            0xd9 => {
                let n = self.u8()?;
                Head::Str(self.sized(usize::from(n))?)
            }
            0xda => {
                let n = self.u16()?;
                Head::Str(self.sized(usize::from(n))?)
            }
            0xdb => {
                let n = self.u32()?;
                Head::Str(self.sized(n as usize)?)
            }
            0xdc => Head::Array(u32::from(self.u16()?)),
            0xdd => Head::Array(self.u32()?),
            0xde => Head::Map(u32::from(self.u16()?)),
            0xdf => Head::Map(self.u32()?),
            0xe0..=0xff => Head::Int(i64::from(marker as i8)),
        })
    }

    /// Skips one whole value. Iterative (a count of values still to skip), so hostile nesting
    /// cannot overflow the stack, and every step consumes a byte, so it ends within the buffer.
    pub(crate) fn skip(&mut self) -> Result<(), DecodeError> {
        let mut pending: u64 = 1;
        while pending > 0 {
            pending -= 1;
            match self.head()? {
                Head::Array(n) => pending += u64::from(n),
                Head::Map(n) => pending += 2 * u64::from(n),
                _ => {}
            }
        }
        Ok(())
    }

    /// Skips one value and returns its encoded bytes.
    pub(crate) fn raw(&mut self) -> Result<&'a [u8], DecodeError> {
        let start = self.pos;
        self.skip()?;
        Ok(&self.buf[start..self.pos])
    }
}

/// Signed values that are non-negative are normalised to `Uint`, so callers see one form per
/// number whichever width the writer chose.
fn int(v: i64) -> Head<'static> {
    if v >= 0 {
        Head::Uint(v as u64)
    } else {
        Head::Int(v)
    }
}

/// Smallest-encoding MessagePack writers (msgspec's choices).
pub(crate) mod write {
    pub(crate) fn nil(out: &mut Vec<u8>) {
        out.push(0xc0);
    }

    pub(crate) fn uint(out: &mut Vec<u8>, v: u64) {
        if v < 0x80 {
            out.push(v as u8);
        } else if v <= u64::from(u8::MAX) {
            out.extend_from_slice(&[0xcc, v as u8]);
        } else if v <= u64::from(u16::MAX) {
            out.push(0xcd);
            out.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= u64::from(u32::MAX) {
            out.push(0xce);
            out.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            out.push(0xcf);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub(crate) fn int(out: &mut Vec<u8>, v: i64) {
        if v >= 0 {
            uint(out, v as u64);
        } else if v >= -32 {
            out.push(v as i8 as u8);
        } else if v >= i64::from(i8::MIN) {
            out.extend_from_slice(&[0xd0, v as i8 as u8]);
        } else if v >= i64::from(i16::MIN) {
            out.push(0xd1);
            out.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= i64::from(i32::MIN) {
            out.push(0xd2);
            out.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            out.push(0xd3);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub(crate) fn f64(out: &mut Vec<u8>, v: f64) {
        out.push(0xcb);
        out.extend_from_slice(&v.to_be_bytes());
    }

    pub(crate) fn str(out: &mut Vec<u8>, s: &str) {
        let n = s.len();
        if n < 32 {
            out.push(0xa0 | n as u8);
        } else if n <= usize::from(u8::MAX) {
            out.extend_from_slice(&[0xd9, n as u8]);
        } else if n <= usize::from(u16::MAX) {
            out.push(0xda);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            out.push(0xdb);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
        out.extend_from_slice(s.as_bytes());
    }

    pub(crate) fn bin(out: &mut Vec<u8>, b: &[u8]) {
        let n = b.len();
        if n <= usize::from(u8::MAX) {
            out.extend_from_slice(&[0xc4, n as u8]);
        } else if n <= usize::from(u16::MAX) {
            out.push(0xc5);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            out.push(0xc6);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
        out.extend_from_slice(b);
    }

    pub(crate) fn array_len(out: &mut Vec<u8>, n: usize) {
        if n < 16 {
            out.push(0x90 | n as u8);
        } else if n <= usize::from(u16::MAX) {
            out.push(0xdc);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            out.push(0xdd);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }

    pub(crate) fn map_len(out: &mut Vec<u8>, n: usize) {
        if n < 16 {
            out.push(0x80 | n as u8);
        } else if n <= usize::from(u16::MAX) {
            out.push(0xde);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            out.push(0xdf);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip_uint(v: u64) -> Head<'static> {
        let mut out = Vec::new();
        write::uint(&mut out, v);
        let leaked: &'static [u8] = Box::leak(out.into_boxed_slice());
        let mut r = Reader::new(leaked);
        let h = r.head().expect("valid");
        assert_eq!(r.remaining(), 0);
        h
    }

    #[test]
    fn ints_take_the_smallest_form_and_read_back() {
        for v in [
            0,
            1,
            127,
            128,
            255,
            256,
            65535,
            65536,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            assert_eq!(roundtrip_uint(v), Head::Uint(v));
        }
        let mut out = Vec::new();
        write::uint(&mut out, 300);
        assert_eq!(out, [0xcd, 0x01, 0x2c]);
        for v in [-1i64, -32, -33, -128, -129, -32768, -32769, i64::MIN] {
            let mut out = Vec::new();
            write::int(&mut out, v);
            assert_eq!(Reader::new(&out).head().expect("valid"), Head::Int(v));
        }
    }

    #[test]
    fn positive_signed_encodings_read_as_uint() {
        assert_eq!(
            Reader::new(&[0xd3, 0, 0, 0, 0, 0, 0, 0, 5]).head(),
            Ok(Head::Uint(5))
        );
    }

    #[test]
    fn a_lying_length_is_truncated_not_a_panic() {
        assert_eq!(
            Reader::new(&[0xdb, 0xff, 0xff, 0xff, 0xff, b'a']).head(),
            Err(DecodeError::Truncated)
        );
        assert_eq!(
            Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff, 0x01]).skip(),
            Err(DecodeError::Truncated)
        );
        assert_eq!(
            Reader::new(&[0xc9, 0xff, 0xff, 0xff, 0xff]).head(),
            Err(DecodeError::Truncated)
        );
    }

    #[test]
    fn skip_handles_deep_nesting_without_recursion() {
        let mut deep = vec![0x91u8; 1_000_000];
        deep.push(0xc0);
        let mut r = Reader::new(&deep);
        assert_eq!(r.raw().map(<[u8]>::len), Ok(deep.len()));
    }
}
