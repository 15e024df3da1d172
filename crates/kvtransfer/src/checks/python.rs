//! How Python reads the JSON values vLLM validates: truthiness (the
//! request validators run on the raw `dict`), pydantic's lax integers, and
//! `repr()` of floats (vLLM's messages print values the Python way).

use std::fmt::Write as _;

/// An integer field as pydantic reads it: `value` saturates beyond `i128`,
/// `text` is Python's `str()` of it (exact digits at any size).
#[derive(Clone, Debug)]
pub(super) struct Int {
    pub(super) value: i128,
    /// Python's `str()` of the value.
    pub(super) text: String,
}

/// Python's truthiness of a JSON value (`bool(json.loads(raw))`).
pub(super) fn truthy(raw: Option<&str>) -> bool {
    let Some(raw) = raw else { return false };
    match raw.as_bytes().first() {
        None | Some(b'n' | b'f') => false,
        Some(b't') => true,
        Some(b'"') => raw != "\"\"",
        Some(b'[' | b'{') => !empty_container(raw.as_bytes()),
        Some(_) => number_text(raw).is_some_and(|f| f != 0.0),
    }
}

/// Whether the array or object `raw` has nothing but whitespace between its brackets.
pub(super) fn empty_container(raw: &[u8]) -> bool {
    raw.get(1..raw.len().saturating_sub(1))
        .is_some_and(|inner| inner.iter().all(|b| b" \t\n\r".contains(b)))
}

pub(super) fn number_text(raw: &str) -> Option<f64> {
    raw.parse::<f64>().ok()
}

pub(super) fn is_integer_text(raw: &str) -> bool {
    !raw.contains(['.', 'e', 'E'])
}

/// Python's `repr()` of a float: shortest round-trip digits, positional for
/// exponents -4..16, else `1e-05` / `1e+16` style.
pub(super) fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "nan".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.to_owned();
    }
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let mut out = String::from(sign);
    if (-4..16).contains(&exp) {
        let point = exp + 1;
        if point <= 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', point.unsigned_abs() as usize));
            out.push_str(&digits);
        } else {
            let point = point as usize;
            if digits.len() <= point {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', point - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..point]);
                out.push('.');
                out.push_str(&digits[point..]);
            }
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(
            out,
            "e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.unsigned_abs()
        );
    }
    out
}

/// Python's `str()` of the JSON value `raw` as a `VLLMValidationError` value.
pub(super) fn py_value(raw: &str) -> String {
    match raw.as_bytes().first() {
        Some(b'"') => serde_json::from_str::<String>(raw).unwrap_or_else(|_| raw.to_owned()),
        Some(b't') => "True".to_owned(),
        Some(b'f') => "False".to_owned(),
        Some(b'n') => "None".to_owned(),
        Some(b'-' | b'0'..=b'9') if !is_integer_text(raw) => {
            number_text(raw).map_or_else(|| raw.to_owned(), py_float)
        }
        _ => raw.to_owned(),
    }
}

/// Parses integer text exactly (saturating beyond `i128`) or a float without
/// a fraction; `None` for anything else.
pub(super) fn parse_int(text: &str) -> Option<Int> {
    if text.is_empty() {
        return None;
    }
    if is_integer_text(text) {
        let digits = text.strip_prefix(['-', '+']).unwrap_or(text);
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let negative = text.starts_with('-');
        let value = text
            .parse::<i128>()
            .unwrap_or(if negative { i128::MIN } else { i128::MAX });
        let trimmed = digits.trim_start_matches('0');
        let magnitude = if trimmed.is_empty() { "0" } else { trimmed };
        let sign = if negative && magnitude != "0" {
            "-"
        } else {
            ""
        };
        return Some(Int {
            value,
            text: format!("{sign}{magnitude}"),
        });
    }
    let f = number_text(text)?;
    if !f.is_finite() || f.fract() != 0.0 {
        return None;
    }
    // Exact for |f| < 2^127; a float integer beyond that saturates.
    let value = f as i128;
    let text = if value == 0 {
        "0".to_owned()
    } else {
        format!("{f:.0}")
    };
    Some(Int { value, text })
}

/// The count as Python prints the int (or float) pydantic made of it.
pub(super) fn py_logprob_count(n: f64) -> String {
    if n.fract() == 0.0 {
        format!("{n:.0}")
    } else {
        py_float(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn py_float_matches_python_repr() {
        for (f, want) in [
            (-1.0, "-1.0"),
            (0.1, "0.1"),
            (2.5, "2.5"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (123456789012345.0, "123456789012345.0"),
            (-0.0, "-0.0"),
            (1.5e300, "1.5e+300"),
        ] {
            assert_eq!(py_float(f), want, "{f}");
        }
        assert_eq!(py_value("\"a\\u0062\""), "ab");
        assert_eq!(py_value("true"), "True");
        assert_eq!(py_value("-2.50"), "-2.5");
        assert_eq!(py_value("-2"), "-2");
    }

    #[test]
    fn truthiness_is_pythons() {
        for (raw, want) in [
            ("true", true),
            ("false", false),
            ("null", false),
            ("0", false),
            ("0.0", false),
            ("-0", false),
            ("2", true),
            ("\"\"", false),
            ("\"false\"", true),
            ("[]", false),
            ("[ ]", false),
            ("{}", false),
            ("{ \n}", false),
            ("{\"a\":1}", true),
        ] {
            assert_eq!(truthy(Some(raw)), want, "{raw}");
        }
        assert!(!truthy(None));
    }
}
