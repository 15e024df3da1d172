//! Load drivers: closed loop (N clients back to back) and open loop (fixed arrival rate).
//!
//! Every run is bounded: by a request count, a duration, or both (whichever comes first), and
//! every request by its own timeout. Tasks live in a `JoinSet` owned by the run; cancelling the
//! run's token (Ctrl-C) stops new requests and aborts the ones in flight.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::SmallRng;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::BenchError;
use crate::client::{Endpoint, Requester, Route, Scratch, http_client};
use crate::dist::Dist;
use crate::report::{Report, TargetInfo};
use crate::stats::{ErrorClass, Recorder};
use crate::trace::{Oracle, Prompt, TraceQueue, oracle};
use crate::workload::Bodies;

pub use crate::config::{Config, Load, Target};

/// Where the run's requests go, and how the report names it.
fn route(cfg: &Config) -> Result<(Route, TargetInfo), BenchError> {
    let path = cfg.effective_api().path();
    Ok(match &cfg.target {
        Target::Url(url) => (
            Route::Single(Endpoint::new(url, path)?),
            TargetInfo::Url { url: url.clone() },
        ),
        Target::Direct {
            prefill,
            decode,
            connector,
        } => (
            Route::Direct {
                prefill: Endpoint::new(prefill, path)?,
                decode: Endpoint::new(decode, path)?,
                connector: *connector,
            },
            TargetInfo::Direct {
                prefill: prefill.clone(),
                decode: decode.clone(),
                connector: *connector,
            },
        ),
    })
}

/// Shared state of one phase (warm-up or measured).
struct Phase {
    req: Arc<Requester>,
    recorder: Recorder,
    next_id: AtomicU64,
    id_base: u64,
    limit: Option<u64>,
    deadline: Option<Instant>,
    timeout: Duration,
    prompt_len: Dist,
    output_len: Dist,
    cancel: CancellationToken,
    trace: Option<Arc<TraceQueue>>,
    done: AtomicU64,
    failed: AtomicU64,
}

impl Phase {
    /// Claims the next request number, or `None` when the phase is over.
    fn claim(&self) -> Option<u64> {
        if self.cancel.is_cancelled() || self.deadline.is_some_and(|d| Instant::now() >= d) {
            return None;
        }
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        if self.limit.is_some_and(|l| n >= l) {
            return None;
        }
        Some(n)
    }

    /// Runs one request and records its outcome; returns the generated text when asked for
    /// (`None` on failure, or if cancelled: not recorded).
    async fn one(
        &self,
        n: u64,
        words: u32,
        prompt: Option<&Prompt>,
        max_tokens: u32,
        started: Instant,
        scratch: &mut Scratch,
    ) -> Option<String> {
        let id = self.id_base + n;
        let fut = tokio::time::timeout(
            self.timeout,
            self.req
                .execute(id, words, prompt, max_tokens, started, scratch),
        );
        let outcome = tokio::select! {
            r = fut => r,
            () = self.cancel.cancelled() => return None,
        };
        let ok = matches!(outcome, Ok(Ok(_)));
        if ok {
            self.done.fetch_add(1, Ordering::Relaxed);
        } else {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        self.recorder.with_shard(n, |s| match outcome {
            Ok(Ok(mut sample)) => {
                s.record_ok(&sample);
                let answer = sample.answer.take();
                scratch.recycle(sample);
                answer
            }
            Ok(Err(class)) => {
                s.record_err(class);
                None
            }
            Err(_) => {
                s.record_err(ErrorClass::Timeout);
                None
            }
        })
    }

    /// Claims a request number and, for a trace, its request (waiting for a ready turn).
    async fn next(&self) -> Option<(u64, Option<crate::trace::TraceItem>)> {
        let n = self.claim()?;
        match &self.trace {
            None => Some((n, None)),
            Some(t) => t.next().await.map(|item| (n, Some(item))),
        }
    }

    /// Finishes a trace request (releases the session's next turn) or, past the bound, stops.
    fn finish(&self, item: Option<&crate::trace::TraceItem>, answer: Option<String>) {
        if let (Some(t), Some(item)) = (&self.trace, item) {
            t.done(item, answer);
            if self.cancel.is_cancelled() {
                t.close();
            }
        }
    }
}

fn shard_count() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get()) * 4
}

/// Runs the benchmark described by `cfg` until it is bounded or `cancel` fires.
pub async fn run(cfg: &Config, cancel: CancellationToken) -> Result<Report, BenchError> {
    cfg.validate()?;
    let (route, target_info) = route(cfg)?;
    let client = http_client(cfg.peak_connections().max(16));
    let mut warnings = Vec::new();
    let model = match &cfg.model {
        Some(m) => m.clone(),
        None => match crate::client::served_model(&client, cfg.models_base()).await {
            Ok(m) => m,
            Err(why) => {
                warnings.push(format!(
                    "no model from {}/v1/models ({why}); using \"pdsim\" (set --model)",
                    cfg.models_base().trim_end_matches('/')
                ));
                "pdsim".to_owned()
            }
        },
    };
    let trace = cfg
        .is_trace()
        .then(|| Arc::new(TraceQueue::new(&cfg.trace, cfg.effective_api())));
    let requester = Arc::new(Requester {
        client: client.clone(),
        bodies: Bodies::new(
            cfg.effective_api(),
            &model,
            cfg.stream,
            cfg.prompt_len.max(),
        ),
        route,
        stream: cfg.stream,
        run_id: format!("pdbench-{}", uuid::Uuid::new_v4().simple()),
        answers: trace.as_ref().is_some_and(|t| t.needs_answers()),
        first_error: std::sync::OnceLock::new(),
    });

    if cfg.warmup > 0 {
        let concurrency = match cfg.load {
            Load::Closed { concurrency } => concurrency,
            Load::Open { max_in_flight, .. } => max_in_flight.min(64),
        };
        let warm = Arc::new(Phase {
            req: requester.clone(),
            recorder: Recorder::new(1)?,
            next_id: AtomicU64::new(0),
            id_base: 1 << 40,
            limit: Some(cfg.warmup),
            deadline: None,
            timeout: cfg.timeout,
            prompt_len: cfg.prompt_len,
            output_len: cfg.output_len,
            cancel: cancel.child_token(),
            trace: None,
            done: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        });
        closed_loop(&warm, concurrency, cfg.seed ^ 0x5eed, Duration::ZERO).await;
    }

    let before = crate::metrics::scrape_all(&client, &cfg.engine_metrics).await;
    let start = Instant::now();
    let phase = Arc::new(Phase {
        req: requester.clone(),
        recorder: Recorder::new(shard_count())?,
        next_id: AtomicU64::new(0),
        id_base: 0,
        limit: cfg.requests,
        deadline: cfg.duration.map(|d| start + d),
        timeout: cfg.timeout,
        prompt_len: cfg.prompt_len,
        output_len: cfg.output_len,
        cancel: cancel.child_token(),
        trace: trace.clone(),
        done: AtomicU64::new(0),
        failed: AtomicU64::new(0),
    });
    let progress = cfg
        .progress
        .then(|| tokio::spawn(progress_line(phase.clone(), start)));
    match cfg.load {
        Load::Closed { concurrency } => {
            closed_loop(&phase, concurrency, cfg.seed, cfg.ramp).await;
        }
        Load::Open {
            rate,
            max_in_flight,
        } => open_loop(&phase, rate, max_in_flight, cfg.seed).await,
    }
    let elapsed = start.elapsed();
    if let Some(p) = progress {
        p.abort();
        // Clear the progress line so the report starts on a clean line.
        eprint!("\r\x1b[K");
    }
    let after = crate::metrics::scrape_all(&client, &cfg.engine_metrics).await;
    let total = phase.recorder.total()?;
    let oracle: Option<Oracle> = trace
        .as_ref()
        .map(|t| oracle(&t.sent(), cfg.oracle_block_size, cfg.oracle_limit));
    let mut report = Report::new(cfg, target_info, &total, elapsed, cancel.is_cancelled());
    report.model = model;
    report.oracle = oracle;
    report.engines = crate::metrics::deltas(&cfg.engine_metrics, &before, &after, &mut warnings);
    report.sample_error = requester.first_error.get().cloned();
    report.warnings = warnings;
    Ok(report)
}

/// Seconds before the progress line appears: short runs stay quiet.
const PROGRESS_AFTER: Duration = Duration::from_secs(3);

async fn progress_line(phase: Arc<Phase>, start: Instant) {
    tokio::time::sleep(PROGRESS_AFTER).await;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let (mut last_n, mut last_t) = (0u64, Instant::now());
    loop {
        tick.tick().await;
        let ok = phase.done.load(Ordering::Relaxed);
        let err = phase.failed.load(Ordering::Relaxed);
        let now = Instant::now();
        let rate = (ok + err - last_n) as f64 / now.duration_since(last_t).as_secs_f64().max(1e-3);
        (last_n, last_t) = (ok + err, now);
        eprint!(
            "\r\x1b[K{:>6.1} s  {} requests  {} errors  {:.0} req/s",
            start.elapsed().as_secs_f64(),
            ok + err,
            err,
            rate
        );
    }
}

async fn closed_loop(phase: &Arc<Phase>, concurrency: usize, seed: u64, ramp: Duration) {
    let mut set = JoinSet::new();
    let start = Instant::now();
    for w in 0..concurrency {
        let phase = phase.clone();
        let delay = ramp.mul_f64(w as f64 / concurrency as f64);
        set.spawn(async move {
            if !delay.is_zero() {
                tokio::select! {
                    () = tokio::time::sleep_until(start + delay) => {}
                    () = phase.cancel.cancelled() => return,
                }
            }
            let mut rng = SmallRng::seed_from_u64(seed.wrapping_add(w as u64));
            let mut scratch = Scratch::default();
            while let Some((n, item)) = phase.next().await {
                let words = phase.prompt_len.sample(&mut rng);
                let max_tokens = phase.output_len.sample(&mut rng);
                let answer = phase
                    .one(
                        n,
                        words,
                        item.as_ref().map(|i| &i.prompt),
                        max_tokens,
                        Instant::now(),
                        &mut scratch,
                    )
                    .await;
                phase.finish(item.as_ref(), answer);
            }
            // Past the bound: nothing more is handed out, so waiting workers stop.
            if let Some(t) = &phase.trace {
                t.close();
            }
        });
    }
    while set.join_next().await.is_some() {}
}

async fn open_loop(phase: &Arc<Phase>, rate: f64, max_in_flight: usize, seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut set = JoinSet::new();
    let start = Instant::now();
    let period = Duration::from_secs_f64(1.0 / rate);
    let mut i: u32 = 0;
    loop {
        let due = start + period.saturating_mul(i);
        i = i.saturating_add(1);
        tokio::select! {
            () = tokio::time::sleep_until(due) => {}
            () = phase.cancel.cancelled() => break,
        }
        // A multi-turn tick with no ready turn waits for one (the session must answer first).
        let next = tokio::select! {
            n = phase.next() => n,
            () = phase.cancel.cancelled() => None,
        };
        let Some((n, item)) = next else { break };
        while set.try_join_next().is_some() {}
        if set.len() >= max_in_flight {
            phase
                .recorder
                .with_shard(n, |s| s.record_err(ErrorClass::Overflow));
            phase.finish(item.as_ref(), None);
            continue;
        }
        let words = phase.prompt_len.sample(&mut rng);
        let max_tokens = phase.output_len.sample(&mut rng);
        let phase = phase.clone();
        set.spawn(async move {
            let mut scratch = Scratch::default();
            let prompt = item.as_ref().map(|i| &i.prompt);
            let answer = phase
                .one(n, words, prompt, max_tokens, due, &mut scratch)
                .await;
            phase.finish(item.as_ref(), answer);
        });
    }
    if let Some(t) = &phase.trace {
        t.close();
    }
    while set.join_next().await.is_some() {}
}
