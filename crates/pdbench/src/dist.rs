//! Length distributions for prompts and outputs.
//!
//! A distribution is written on the command line as one of:
//! - `128`: always 128;
//! - `64..256`: uniform over 64 to 256 inclusive;
//! - `normal:128,32`: normal with mean 128 and standard deviation 32, rounded and clamped to
//!   `[1, mean + 6 * stddev]` so that every draw is a usable, bounded length.

use std::fmt;
use std::str::FromStr;

use rand::Rng;

/// The most tokens a single length may ask for; keeps prompt buffers bounded.
pub const MAX_LEN: u32 = 1 << 20;

/// A distribution of positive lengths (tokens or words).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Dist {
    /// Always the same length.
    Fixed(u32),
    /// Uniform over `lo..=hi`.
    Uniform {
        /// Smallest length.
        lo: u32,
        /// Largest length.
        hi: u32,
    },
    /// Normal, rounded, clamped to `[1, max()]`.
    Normal {
        /// Mean length.
        mean: f64,
        /// Standard deviation.
        stddev: f64,
    },
}

/// Why a distribution could not be parsed.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DistError {
    /// Not one of the three accepted forms.
    #[error("invalid length distribution {0:?}: expected N, A..B or normal:MEAN,STDDEV")]
    Syntax(String),
    /// A length outside `1..=MAX_LEN`, or `lo > hi`, or a non-finite/negative parameter.
    #[error("invalid length distribution {0:?}: lengths must be 1..={MAX_LEN} and ordered")]
    Range(String),
}

impl Dist {
    /// Draws one length.
    pub fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> u32 {
        match *self {
            Dist::Fixed(n) => n,
            Dist::Uniform { lo, hi } => rng.random_range(lo..=hi),
            Dist::Normal { mean, stddev } => {
                // Box-Muller: two uniforms in (0,1] give one standard normal draw.
                let u1: f64 = 1.0 - rng.random::<f64>();
                let u2: f64 = rng.random::<f64>();
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                let v = (mean + stddev * z).round();
                clamp_len(v, self.max())
            }
        }
    }

    /// The largest length this distribution can produce.
    pub fn max(&self) -> u32 {
        match *self {
            Dist::Fixed(n) => n,
            Dist::Uniform { hi, .. } => hi,
            Dist::Normal { mean, stddev } => clamp_len((mean + 6.0 * stddev).ceil(), MAX_LEN),
        }
    }
}

fn clamp_len(v: f64, max: u32) -> u32 {
    if v.is_nan() || v < 1.0 {
        1
    } else if v >= f64::from(max) {
        max
    } else {
        // In range 1..max, so the cast is exact after rounding.
        v as u32
    }
}

fn parse_len(s: &str, whole: &str) -> Result<u32, DistError> {
    let n: u32 = s
        .trim()
        .parse()
        .map_err(|_| DistError::Syntax(whole.to_owned()))?;
    if n == 0 || n > MAX_LEN {
        return Err(DistError::Range(whole.to_owned()));
    }
    Ok(n)
}

impl FromStr for Dist {
    type Err = DistError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if let Some(rest) = t.strip_prefix("normal:") {
            let (m, d) = rest
                .split_once(',')
                .ok_or_else(|| DistError::Syntax(s.to_owned()))?;
            let mean: f64 = m
                .trim()
                .parse()
                .map_err(|_| DistError::Syntax(s.to_owned()))?;
            let stddev: f64 = d
                .trim()
                .parse()
                .map_err(|_| DistError::Syntax(s.to_owned()))?;
            if !mean.is_finite()
                || !stddev.is_finite()
                || mean < 1.0
                || stddev < 0.0
                || mean > f64::from(MAX_LEN)
            {
                return Err(DistError::Range(s.to_owned()));
            }
            return Ok(Dist::Normal { mean, stddev });
        }
        if let Some((a, b)) = t.split_once("..") {
            let b = b.strip_prefix('=').unwrap_or(b);
            let lo = parse_len(a, s)?;
            let hi = parse_len(b, s)?;
            if lo > hi {
                return Err(DistError::Range(s.to_owned()));
            }
            return Ok(if lo == hi {
                Dist::Fixed(lo)
            } else {
                Dist::Uniform { lo, hi }
            });
        }
        Ok(Dist::Fixed(parse_len(t, s)?))
    }
}

impl fmt::Display for Dist {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dist::Fixed(n) => write!(f, "{n}"),
            Dist::Uniform { lo, hi } => write!(f, "{lo}..{hi}"),
            Dist::Normal { mean, stddev } => write!(f, "normal:{mean},{stddev}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::SmallRng;

    #[test]
    fn parses_the_three_forms() {
        assert_eq!("128".parse::<Dist>(), Ok(Dist::Fixed(128)));
        assert_eq!(
            "64..256".parse::<Dist>(),
            Ok(Dist::Uniform { lo: 64, hi: 256 })
        );
        assert_eq!(
            "64..=256".parse::<Dist>(),
            Ok(Dist::Uniform { lo: 64, hi: 256 })
        );
        assert_eq!("7..7".parse::<Dist>(), Ok(Dist::Fixed(7)));
        assert_eq!(
            "normal:100,10".parse::<Dist>(),
            Ok(Dist::Normal {
                mean: 100.0,
                stddev: 10.0
            })
        );
    }

    #[test]
    fn rejects_bad_input() {
        for bad in [
            "",
            "x",
            "0",
            "-1",
            "5..2",
            "1..",
            "normal:5",
            "normal:0,1",
            "normal:5,-1",
        ] {
            assert!(bad.parse::<Dist>().is_err(), "{bad} should not parse");
        }
        assert!(format!("{}", (MAX_LEN + 1)).parse::<Dist>().is_err());
    }

    #[test]
    fn samples_stay_in_range() {
        let mut rng = SmallRng::seed_from_u64(7);
        let u = Dist::Uniform { lo: 3, hi: 9 };
        let mut seen = [false; 10];
        for _ in 0..2000 {
            let v = u.sample(&mut rng);
            assert!((3..=9).contains(&v));
            seen[v as usize] = true;
        }
        assert!(seen[3] && seen[9], "both ends of the range are drawn");

        let n = Dist::Normal {
            mean: 4.0,
            stddev: 50.0,
        };
        let mut sum = 0u64;
        for _ in 0..5000 {
            let v = n.sample(&mut rng);
            assert!(v >= 1 && v <= n.max());
            sum += u64::from(v);
        }
        assert!(
            sum > 5000,
            "clamping at 1 pushes the mean up, never below 1"
        );

        let tight = Dist::Normal {
            mean: 100.0,
            stddev: 5.0,
        };
        let mean = (0..4000)
            .map(|_| f64::from(tight.sample(&mut rng)))
            .sum::<f64>()
            / 4000.0;
        assert!((mean - 100.0).abs() < 1.0, "sample mean {mean}");
    }

    #[test]
    fn display_round_trips() {
        for s in ["12", "3..9", "normal:100,5"] {
            let d: Dist = s.parse().expect("parse");
            assert_eq!(d.to_string().parse::<Dist>().expect("reparse"), d);
        }
    }
}
