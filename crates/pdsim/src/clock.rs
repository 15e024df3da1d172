//! Simulated time: wall time since the engine started, scaled by `--time-scale`.
//!
//! Every time an engine reports (`created`, KV-event timestamps, step durations on `/metrics`)
//! is simulated time, and every delay it sleeps is simulated time divided by the scale, so a
//! client that multiplies its wall-clock measurements by the scale sees what the engine models.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The engine's clock. `scale` simulated seconds pass per wall second.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SimClock {
    wall0: Instant,
    unix0: f64,
    scale: f64,
}

impl SimClock {
    /// A clock that reads the Unix time now and runs `scale` times faster than the wall.
    pub fn new(scale: f64) -> Self {
        let unix0 = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        SimClock {
            wall0: Instant::now(),
            unix0,
            scale: if scale.is_finite() && scale > 0.0 {
                scale
            } else {
                1.0
            },
        }
    }

    /// Simulated Unix time, seconds.
    pub fn now_unix(&self) -> f64 {
        self.unix0 + self.wall0.elapsed().as_secs_f64() * self.scale
    }

    /// The wall time a simulated duration takes.
    pub fn wall(&self, simulated: Duration) -> Duration {
        if self.scale == 1.0 {
            simulated
        } else {
            simulated.div_f64(self.scale)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_delays_and_runs_ahead_of_the_wall() {
        let c = SimClock::new(10.0);
        assert_eq!(c.wall(Duration::from_secs(10)), Duration::from_secs(1));
        assert_eq!(
            SimClock::new(0.0).wall(Duration::from_secs(3)),
            Duration::from_secs(3)
        );
        let before = c.now_unix();
        std::thread::sleep(Duration::from_millis(20));
        // 20 ms of wall time is at least 200 ms of simulated time.
        assert!(c.now_unix() - before >= 0.2);
    }
}
