//! The memory held by request bodies while they are read, bounded in total
//! (`security.max_buffered_body_bytes`): without it, every client that starts an upload and stalls
//! holds up to `max_body_bytes`, and the gateway's memory grows with the number of clients.
//!
//! A body with a `Content-Length` reserves its whole length before the first byte is read; a
//! chunked body reserves as its chunks arrive. A reservation that does not fit waits up to
//! `security.body_budget_wait`, then the request gets 503 with `Retry-After`. Reservations are
//! counted in KiB (a semaphore's permits are `u32`).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::GatewayError;

const UNIT: usize = 1024;

/// The shared total. `None`: unbounded.
#[derive(Debug)]
pub(crate) struct BodyBudget {
    permits: Option<Arc<Semaphore>>,
    total_units: u32,
    wait: Duration,
}

/// What one body holds of the total; released when dropped.
#[derive(Debug, Default)]
pub(crate) struct Reservation {
    held: Option<OwnedSemaphorePermit>,
    units: u32,
}

fn units(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(UNIT)).unwrap_or(u32::MAX)
}

impl BodyBudget {
    /// A budget of `total` bytes (0: unbounded); a reservation waits up to `wait`.
    pub(crate) fn new(total: usize, wait: Duration) -> Self {
        let total_units =
            units(total).min(u32::try_from(Semaphore::MAX_PERMITS).unwrap_or(u32::MAX));
        BodyBudget {
            permits: (total > 0).then(|| Arc::new(Semaphore::new(total_units as usize))),
            total_units,
            wait,
        }
    }

    /// Grows `reservation` so that it covers `bytes` in all.
    pub(crate) async fn grow(
        &self,
        reservation: &mut Reservation,
        bytes: usize,
    ) -> Result<(), GatewayError> {
        let Some(permits) = &self.permits else {
            return Ok(());
        };
        let want = units(bytes);
        if want <= reservation.units {
            return Ok(());
        }
        let more = want - reservation.units;
        if want > self.total_units {
            return Err(GatewayError::Busy {
                retry_after_secs: 1,
            });
        }
        let acquired = match permits.clone().try_acquire_many_owned(more) {
            Ok(p) => Some(p),
            Err(_) => tokio::time::timeout(self.wait, permits.clone().acquire_many_owned(more))
                .await
                .ok()
                .and_then(Result::ok),
        };
        let Some(permit) = acquired else {
            return Err(GatewayError::Busy {
                retry_after_secs: 1,
            });
        };
        match &mut reservation.held {
            Some(held) => held.merge(permit),
            None => reservation.held = Some(permit),
        }
        reservation.units = want;
        Ok(())
    }

    /// Bytes reserved now (for tests and metrics).
    #[cfg(test)]
    pub(crate) fn reserved(&self) -> usize {
        self.permits.as_ref().map_or(0, |p| {
            (self.total_units as usize - p.available_permits()) * UNIT
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn reservations_beyond_the_total_wait_then_get_503() {
        let budget = BodyBudget::new(10 * UNIT, Duration::from_secs(1));
        let mut a = Reservation::default();
        budget.grow(&mut a, 6 * UNIT).await.unwrap();
        budget.grow(&mut a, 3 * UNIT).await.unwrap(); // already covered
        assert_eq!(budget.reserved(), 6 * UNIT);
        let mut b = Reservation::default();
        let err = budget.grow(&mut b, 5 * UNIT).await.unwrap_err();
        assert_eq!(err.status(), http::StatusCode::SERVICE_UNAVAILABLE);
        budget.grow(&mut b, 4 * UNIT).await.unwrap();
        drop(a);
        assert_eq!(budget.reserved(), 4 * UNIT);
        let mut c = Reservation::default();
        assert!(budget.grow(&mut c, 11 * UNIT).await.is_err(), "never fits");
        // A waiting reservation gets the room freed meanwhile.
        let waiter = async {
            let mut d = Reservation::default();
            budget.grow(&mut d, 6 * UNIT).await.map(|()| d)
        };
        let (got, ()) = tokio::join!(waiter, async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            drop(b);
        });
        assert!(got.is_ok());
    }

    #[tokio::test]
    async fn zero_is_unbounded() {
        let budget = BodyBudget::new(0, Duration::ZERO);
        let mut r = Reservation::default();
        budget.grow(&mut r, usize::MAX).await.unwrap();
    }
}
