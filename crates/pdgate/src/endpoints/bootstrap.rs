//! Re-queries of a prefill's bootstrap facts (Mooncake's `/query`: its engine id per rank).
//!
//! The reconciler caches the facts and refreshes them every `discovery.bootstrap_refresh`. A
//! prefill that restarts comes back with a new engine id, and every decode handed the old one
//! fails its KV pull. So the facts are also looked up again at once when the prefill comes back
//! from being down (ejected or failing its checks), and when the request path asks: after a
//! decode failure on that prefill's KV. A request can wait (bounded) for the round that did the
//! lookup and retry on the fresh facts.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::{Notify, watch};

/// Prefills whose bootstrap facts must be looked up again, and the rounds that did it.
#[derive(Debug)]
pub struct Requery {
    asked: Mutex<Asked>,
    wake: Notify,
    /// The last ticket whose names a finished round looked up (and published).
    done: watch::Sender<u64>,
}

#[derive(Debug, Default)]
struct Asked {
    names: BTreeSet<String>,
    ticket: u64,
}

impl Default for Requery {
    fn default() -> Self {
        Requery {
            asked: Mutex::new(Asked::default()),
            wake: Notify::new(),
            done: watch::Sender::new(0),
        }
    }
}

impl Requery {
    fn lock(&self) -> std::sync::MutexGuard<'_, Asked> {
        self.asked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Asks for `name`'s facts to be looked up again; the ticket to [`Requery::wait`] on.
    pub fn ask(&self, name: &str) -> u64 {
        let ticket = {
            let mut asked = self.lock();
            asked.names.insert(name.to_string());
            asked.ticket = asked.ticket.wrapping_add(1);
            asked.ticket
        };
        self.wake.notify_one();
        ticket
    }

    /// The names asked for since the last call, and the ticket they cover (the reconciler's).
    pub fn take(&self) -> (BTreeSet<String>, u64) {
        let mut asked = self.lock();
        (std::mem::take(&mut asked.names), asked.ticket)
    }

    /// A round looked up (and published) everything asked up to `ticket`.
    pub fn finished(&self, ticket: u64) {
        self.done.send_if_modified(|d| {
            let newer = *d < ticket;
            if newer {
                *d = ticket;
            }
            newer
        });
    }

    /// Resolves when something was asked (no lost wake-ups).
    pub async fn asked(&self) {
        self.wake.notified().await;
    }

    /// Waits at most `limit` for the round that covers `ticket`; whether it finished.
    pub async fn wait(&self, ticket: u64, limit: Duration) -> bool {
        let mut done = self.done.subscribe();
        matches!(
            tokio::time::timeout(limit, done.wait_for(|d| *d >= ticket)).await,
            Ok(Ok(_))
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_wait_ends_with_the_round_that_covers_its_ticket() {
        let r = Requery::default();
        let first = r.ask("p1");
        let second = r.ask("p2");
        let (names, covered) = r.take();
        assert_eq!(names, BTreeSet::from(["p1".to_string(), "p2".to_string()]));
        assert_eq!(covered, second);
        assert!(!r.wait(first, Duration::from_millis(10)).await, "not yet");
        r.finished(covered);
        assert!(r.wait(first, Duration::from_millis(10)).await);
        assert!(r.wait(second, Duration::from_millis(10)).await);
        let third = r.ask("p1");
        assert!(!r.wait(third, Duration::from_secs(1)).await, "bounded");
        assert!(r.take().0.contains("p1"));
    }
}
