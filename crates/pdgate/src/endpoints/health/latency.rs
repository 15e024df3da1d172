//! Latency outliers: a prefill whose time-to-answer is far above its peers' is ejected like one
//! that fails (`[reliability] latency_outlier_*`).
//!
//! Each prefill keeps its last [`KEEP`] answer times. When one of them answers, its median over
//! `latency_outlier_window` is compared with the median of its serving peers' (pooled) over the
//! same window: it is an outlier when both have at least `latency_outlier_min_requests` samples
//! and its median is above `latency_outlier_ratio` times theirs *and* at least
//! `latency_outlier_min_excess` longer (so that 3 ms against 1 ms is no outlier).

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// Answer times kept per endpoint.
const KEEP: usize = 64;

/// One endpoint's recent answer times.
#[derive(Debug, Default)]
pub(super) struct Samples(VecDeque<(Instant, Duration)>);

impl Samples {
    pub(super) fn push(&mut self, at: Instant, took: Duration) {
        if self.0.len() >= KEEP {
            self.0.pop_front();
        }
        self.0.push_back((at, took));
    }

    pub(super) fn clear(&mut self) {
        self.0.clear();
    }

    fn recent(&self, now: Instant, window: Duration) -> impl Iterator<Item = Duration> + '_ {
        self.0
            .iter()
            .filter(move |(at, _)| now.saturating_duration_since(*at) <= window)
            .map(|(_, took)| *took)
    }
}

/// The outlier rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LatencyRule {
    /// An endpoint's median above this many times its peers' is an outlier (0 disables).
    pub ratio: f64,
    /// How far back answer times count.
    pub window: Duration,
    /// Answers needed within the window, the endpoint's own and its peers' (pooled).
    pub min_requests: u32,
    /// The endpoint's median must also be at least this much above its peers'.
    pub min_excess: Duration,
}

impl LatencyRule {
    /// `Some((own median, peers' median))` when `own` is an outlier against `peers`.
    pub(super) fn outlier<'a>(
        &self,
        own: &Samples,
        peers: impl Iterator<Item = &'a Samples>,
        now: Instant,
    ) -> Option<(Duration, Duration)> {
        if self.ratio <= 0.0 {
            return None;
        }
        let need = self.min_requests.max(1) as usize;
        let mut mine: Vec<Duration> = own.recent(now, self.window).collect();
        if mine.len() < need {
            return None;
        }
        let mut theirs: Vec<Duration> = peers.flat_map(|p| p.recent(now, self.window)).collect();
        if theirs.len() < need {
            return None;
        }
        let (m, p) = (median(&mut mine), median(&mut theirs));
        let slow = m.as_secs_f64() > self.ratio * p.as_secs_f64() && m >= p + self.min_excess;
        slow.then_some((m, p))
    }
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule() -> LatencyRule {
        LatencyRule {
            ratio: 3.0,
            window: Duration::from_secs(10),
            min_requests: 3,
            min_excess: Duration::from_millis(100),
        }
    }

    fn samples(ms: &[u64]) -> Samples {
        let mut s = Samples::default();
        for &m in ms {
            s.push(Instant::now(), Duration::from_millis(m));
        }
        s
    }

    #[tokio::test(start_paused = true)]
    async fn a_prefill_far_above_its_peers_median_is_an_outlier_within_the_window() {
        let r = rule();
        let peers = [samples(&[100, 120, 90]), samples(&[110])];
        let slow = samples(&[2100, 2050, 400]);
        let now = Instant::now();
        assert_eq!(
            r.outlier(&slow, peers.iter(), now),
            Some((Duration::from_millis(2050), Duration::from_millis(110)))
        );
        // Too few answers of its own, or of its peers: no verdict.
        assert_eq!(r.outlier(&samples(&[2100, 2100]), peers.iter(), now), None);
        assert_eq!(r.outlier(&slow, [samples(&[1, 1])].iter(), now), None);
        // Below the ratio, or above it by less than the minimum excess: not an outlier.
        assert_eq!(
            r.outlier(&samples(&[300, 300, 300]), peers.iter(), now),
            None
        );
        let fast = [samples(&[1, 1, 1])];
        assert_eq!(r.outlier(&samples(&[9, 9, 9]), fast.iter(), now), None);
        // Off.
        let off = LatencyRule { ratio: 0.0, ..r };
        assert_eq!(off.outlier(&slow, peers.iter(), now), None);
        // Old answers leave the window.
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_eq!(r.outlier(&slow, peers.iter(), Instant::now()), None);
    }

    #[test]
    fn samples_are_bounded() {
        let s = samples(&[5; 200]);
        assert_eq!(s.0.len(), KEEP);
    }
}
