//! Durations as the configuration file and the flags spell them (`30s`, `250ms`, `2m`, or a bare
//! number of seconds): one parser and one writer for every section.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer};

/// Parses durations such as `30s`, `250ms`, `2m` or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if let Ok(secs) = text.parse::<f64>() {
        if secs.is_finite() && secs >= 0.0 {
            return Ok(Duration::from_secs_f64(secs));
        }
        return Err(format!("{text:?} is not a valid duration"));
    }
    humantime::parse_duration(text).map_err(|e| format!("{text:?} is not a valid duration: {e}"))
}

/// Writes a duration the way the docs and flags spell it: `250ms`, `30s`.
pub fn format_duration(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d.subsec_nanos().is_multiple_of(1_000_000) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}s", d.as_secs_f64())
    }
}

pub fn ser_duration<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format_duration(*d))
}

pub fn de_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Secs(f64),
        Text(String),
    }
    match Raw::deserialize(d)? {
        Raw::Secs(s) if s.is_finite() && s >= 0.0 => Ok(Duration::from_secs_f64(s)),
        Raw::Secs(s) => Err(serde::de::Error::custom(format!(
            "{s} is not a valid duration"
        ))),
        Raw::Text(t) => parse_duration(&t).map_err(serde::de::Error::custom),
    }
}

/// `#[serde(with = "crate::durations::text")]`: a duration field read by [`de_duration`] and
/// written by [`ser_duration`].
pub mod text {
    pub use super::de_duration as deserialize;
    pub use super::ser_duration as serialize;
}
