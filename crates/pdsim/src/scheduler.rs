//! The step loop's scheduler task, one per engine (the model is described in [`crate::step_loop`],
//! whose types it schedules).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use pdcache::events::KvEvent;
use tokio::sync::mpsc;

use crate::dp::DpRank;
use crate::engine::Engine;
use crate::prefix_cache::PrefixCache;
use crate::profile::Work;
use crate::step_loop::{Held, Seq, Tick};

/// How soon a scheduler with nothing runnable looks at the KV blocks again.
const BLOCKED_RETRY: Duration = Duration::from_millis(1);

/// How far behind the wall clock the step deadlines may fall before the lag is written off
/// (an overloaded host slows the simulation rather than bursting steps without end).
const MAX_LAG: Duration = Duration::from_millis(50);

/// KV capacity when prefix caching is off (nothing is cached, blocks are only reserved).
struct Plain {
    capacity: usize,
    reserved: usize,
}

struct Running {
    seq: Seq,
    /// Tokens scheduled in the current step.
    now: u32,
    /// Blocks reserved without a prefix cache.
    plain_blocks: usize,
}

/// The scheduler of data-parallel rank `rank`: runs until the engine shuts down.
pub(crate) async fn run(engine: Arc<Engine>, rank: usize, mut rx: mpsc::UnboundedReceiver<Seq>) {
    let Some(model) = engine.cfg.step.clone() else {
        return;
    };
    let Some(dp) = engine.ranks.get(rank) else {
        return;
    };
    let clock = engine.clock;
    let mut plain = Plain {
        capacity: engine.cfg.cache.kv_cache_blocks,
        reserved: 0,
    };
    let mut waiting: VecDeque<Seq> = VecDeque::new();
    let mut running: Vec<Running> = Vec::new();
    let mut batch: Vec<Work> = Vec::new();
    let c = &engine.counters;
    // This rank's share of the engine's running gauge.
    let running_here = AtomicU64::new(0);
    // When the current step ends, in wall time. Steps are laid end to end from it, so a step
    // shorter than the timer's resolution (large --time-scale) or a late wake-up is made up
    // by the next ones instead of stretching simulated time.
    let mut deadline = tokio::time::Instant::now();
    loop {
        if running.is_empty() && waiting.is_empty() {
            tokio::select! {
                () = engine.shutdown.cancelled() => return,
                s = rx.recv() => match s {
                    Some(s) => waiting.push_back(s),
                    None => return,
                },
            }
            deadline = tokio::time::Instant::now();
        }
        while let Ok(s) = rx.try_recv() {
            waiting.push_back(s);
        }
        // Running requests first: decodes and unfinished prefills, in arrival order.
        let mut budget = model.max_num_batched_tokens.max(1);
        batch.clear();
        for r in &mut running {
            let n = if r.seq.prefill_left > 0 {
                r.seq.prefill_left.min(budget)
            } else {
                budget.min(1)
            };
            r.now = n;
            budget -= n;
        }
        // Then admissions, FCFS, while there is room.
        while running.len() < model.max_num_seqs && budget > 0 {
            let Some(front) = waiting.front_mut() else {
                break;
            };
            if front.ticks.is_closed() {
                if let Some(s) = waiting.pop_front() {
                    release(dp, s.held);
                }
                continue;
            }
            let admitted = match &dp.cache {
                Some(cache) => {
                    let mut events = Vec::new();
                    let ok = cache
                        .lock()
                        .map(|mut c| admit(&mut c, front, engine.block_size, &mut events))
                        .unwrap_or(false);
                    dp.publish(events);
                    ok.then_some(0)
                }
                None => (plain.reserved + front.total_blocks <= plain.capacity).then(|| {
                    plain.reserved += front.total_blocks;
                    front.total_blocks
                }),
            };
            let Some(plain_blocks) = admitted else {
                break;
            };
            let Some(seq) = waiting.pop_front() else {
                break;
            };
            let n = seq.prefill_left.min(budget);
            budget -= n;
            running.push(Running {
                seq,
                now: n,
                plain_blocks,
            });
        }
        gauge(&c.waiting, &dp.counters.waiting, waiting.len());
        gauge(&c.running, &running_here, running.len());
        for r in &running {
            if r.now > 0 {
                batch.push(Work {
                    new_tokens: r.now,
                    context: r.seq.context,
                });
            }
        }
        if batch.is_empty() {
            // The head of the queue waits for blocks that requests finishing right now are
            // handing back (the job's own finish): look again shortly, or on a new arrival.
            tokio::select! {
                () = engine.shutdown.cancelled() => return,
                () = tokio::time::sleep(BLOCKED_RETRY) => {}
                s = rx.recv() => if let Some(s) = s { waiting.push_back(s) },
            }
            continue;
        }
        let step = Duration::from_secs_f64(model.profile.step_seconds(&batch));
        let now = tokio::time::Instant::now();
        deadline = deadline.max(now.checked_sub(MAX_LAG).unwrap_or(now)) + clock.wall(step);
        tokio::select! {
            () = engine.shutdown.cancelled() => return,
            () = tokio::time::sleep_until(deadline) => {}
        }
        c.steps.fetch_add(1, Relaxed);
        c.busy_micros
            .fetch_add(step.as_micros().try_into().unwrap_or(u64::MAX), Relaxed);
        running.retain_mut(|r| advance(&engine, dp, r, &mut plain));
        gauge(&c.running, &running_here, running.len());
    }
}

/// Pins the request's cached prefix and reserves the rest of its blocks; false (nothing held)
/// when they do not fit. Waiting requests hold no blocks, so they never keep the head of the
/// queue out.
fn admit(c: &mut PrefixCache, s: &mut Seq, block_size: u32, events: &mut Vec<KvEvent>) -> bool {
    let hit = c.lookup(&s.held.chain.values, s.lookup_max, &mut s.held.pins);
    if !c.reserve(s.total_blocks.saturating_sub(hit), &mut s.held.pins, events) {
        c.release(&mut s.held.pins);
        return false;
    }
    if s.local && hit < s.hit_blocks {
        // Blocks cached on arrival were evicted while it waited: they are computed again.
        let lost = (s.hit_blocks - hit) as u32 * block_size;
        let lost = lost.min(s.context);
        s.prefill_left += lost;
        s.context -= lost;
    }
    s.cache_from = hit;
    true
}

/// Sets this rank's share of an engine-wide gauge: `total` moves by the change of `mine`.
fn gauge(total: &AtomicU64, mine: &AtomicU64, now: usize) {
    let now = now as u64;
    let before = mine.swap(now, Relaxed);
    total.fetch_add(now, Relaxed);
    total.fetch_sub(before, Relaxed);
}

/// Applies a finished step to one request; false when it leaves the running set.
fn advance(engine: &Engine, dp: &DpRank, r: &mut Running, plain: &mut Plain) -> bool {
    let n = std::mem::take(&mut r.now);
    if n == 0 {
        return !r.seq.ticks.is_closed() || leave(dp, r, plain);
    }
    let seq = &mut r.seq;
    seq.context += n;
    let token = if seq.prefill_left > 0 {
        seq.prefill_left -= n;
        if seq.prefill_left == 0 {
            crate::job::store(
                dp,
                engine.block_size,
                &mut seq.held.chain,
                &mut seq.held.pins,
                &seq.prompt,
                seq.cache_from,
            );
        }
        seq.prefill_left == 0
    } else {
        seq.decode_left -= 1;
        true
    };
    if !token {
        return !seq.ticks.is_closed() || leave(dp, r, plain);
    }
    if seq.decode_left == 0 && seq.prefill_left == 0 {
        let held = std::mem::take(&mut seq.held);
        plain.reserved -= r.plain_blocks.min(plain.reserved);
        if let Err(mpsc::error::SendError(Tick::Last(held))) =
            seq.ticks.send(Tick::Last(Box::new(held)))
        {
            release(dp, *held);
        }
        return false;
    }
    seq.ticks.send(Tick::Token).is_ok() || leave(dp, r, plain)
}

/// A request whose client went away: its blocks go back. Always false (it leaves).
fn leave(dp: &DpRank, r: &mut Running, plain: &mut Plain) -> bool {
    plain.reserved -= r.plain_blocks.min(plain.reserved);
    release(dp, std::mem::take(&mut r.seq.held));
    false
}

fn release(dp: &DpRank, mut held: Held) {
    if let Some(cache) = &dp.cache
        && let Ok(mut c) = cache.lock()
    {
        c.release(&mut held.pins);
    }
}
