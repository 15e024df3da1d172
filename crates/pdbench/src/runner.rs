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
use crate::mooncake::Trace;
use crate::report::{ReplayInfo, Report, SloReport, TargetInfo};
use crate::stats::{ErrorClass, Recorder, Sample};
use crate::trace::{Oracle, Prompt, TraceQueue, oracle};
use crate::workload::Bodies;

pub use crate::config::{Config, Load, Slo, Target};

fn route(cfg: &Config) -> Result<(Route, TargetInfo), BenchError> {
    let path = cfg.effective_api().path();
    Ok(match &cfg.target {
        Target::Url(url) => (
            Route::Single(Endpoint::new(url, path)?),
            TargetInfo::Url { url: url.clone() },
        ),
        Target::Replicas(urls) => (
            Route::Replicas(
                urls.iter()
                    .map(|u| Endpoint::new(u, path))
                    .collect::<Result<_, _>>()?,
            ),
            TargetInfo::Replicas { urls: urls.clone() },
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

/// Base URL asked for `/v1/models`.
fn models_base(cfg: &Config) -> &str {
    match &cfg.target {
        Target::Url(u) => u,
        Target::Replicas(urls) => urls.first().map_or("", String::as_str),
        Target::Direct { prefill, .. } => prefill,
    }
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
    /// Requests the run will send at most (for the progress line).
    total: Option<u64>,
    time_scale: f64,
    slo: Slo,
    /// Requests within the TTFT objective, within the ITL objective, within both.
    slo_met: [AtomicU64; 3],
}

impl Phase {
    fn new(
        cfg: &Config,
        req: Arc<Requester>,
        recorder: Recorder,
        cancel: CancellationToken,
    ) -> Self {
        Phase {
            req,
            recorder,
            next_id: AtomicU64::new(0),
            id_base: 0,
            limit: cfg.requests,
            deadline: None,
            timeout: cfg.timeout,
            prompt_len: cfg.prompt_len,
            output_len: cfg.output_len,
            cancel,
            trace: None,
            done: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            total: None,
            time_scale: cfg.time_scale,
            slo: cfg.slo,
            slo_met: Default::default(),
        }
    }

    /// Wall time to simulated time (every figure is reported in simulated time).
    fn scale(&self, s: &mut Sample) {
        let f = self.time_scale;
        if f == 1.0 {
            return;
        }
        s.latency = s.latency.mul_f64(f);
        s.ttft = s.ttft.map(|t| t.mul_f64(f));
        s.prefill = s.prefill.map(|t| t.mul_f64(f));
        for g in &mut s.gaps_us {
            *g = (*g as f64 * f) as u64;
        }
    }

    /// Counts a successful request against the objectives.
    fn judge(&self, s: &Sample) {
        if !self.slo.is_set() {
            return;
        }
        let ttft = self.slo.ttft.is_none_or(|t| s.ttft.is_some_and(|x| x <= t));
        let itl = self.slo.itl.is_none_or(|t| {
            let n = s.gaps_us.len() as u64;
            n == 0
                || s.gaps_us.iter().sum::<u64>() / n
                    <= u64::try_from(t.as_micros()).unwrap_or(u64::MAX)
        });
        for (met, counter) in [ttft, itl, ttft && itl].into_iter().zip(&self.slo_met) {
            if met {
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

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
        let outcome = match outcome {
            Ok(Ok(mut sample)) => {
                self.scale(&mut sample);
                self.judge(&sample);
                Ok(Ok(sample))
            }
            other => other,
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
        None => match crate::client::served_model(&client, models_base(cfg)).await {
            Ok(m) => m,
            Err(why) => {
                warnings.push(format!(
                    "no model from {}/v1/models ({why}); using \"pdsim\" (set --model)",
                    models_base(cfg).trim_end_matches('/')
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
            Load::Open { max_in_flight, .. } | Load::Replay { max_in_flight, .. } => {
                max_in_flight.min(64)
            }
        };
        let warm = Arc::new(Phase {
            id_base: 1 << 40,
            limit: Some(cfg.warmup),
            slo: Slo::default(),
            ..Phase::new(
                cfg,
                requester.clone(),
                Recorder::new(1)?,
                cancel.child_token(),
            )
        });
        closed_loop(&warm, concurrency, cfg.seed ^ 0x5eed, Duration::ZERO).await;
    }

    let before = crate::metrics::scrape_all(&client, &cfg.engine_metrics).await;
    let start = Instant::now();
    let replay_len = cfg.replay.as_ref().map(|t| t.requests.len() as u64);
    let phase = Arc::new(Phase {
        deadline: cfg.duration.map(|d| start + d),
        trace: trace.clone(),
        total: match (
            cfg.requests,
            replay_len.or(trace.as_ref().map(|t| t.len() as u64)),
        ) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        },
        ..Phase::new(
            cfg,
            requester.clone(),
            Recorder::new(shard_count())?,
            cancel.child_token(),
        )
    });
    let progress = cfg
        .progress
        .then(|| tokio::spawn(progress_line(phase.clone(), start)));
    let mut due = 0;
    match (cfg.load, &cfg.replay) {
        (Load::Closed { concurrency }, _) => {
            closed_loop(&phase, concurrency, cfg.seed, cfg.ramp).await;
        }
        (
            Load::Open {
                rate,
                max_in_flight,
            },
            _,
        ) => open_loop(&phase, rate, max_in_flight, cfg.seed).await,
        (
            Load::Replay {
                rate_factor,
                max_in_flight,
            },
            Some(replay),
        ) => {
            let speed = rate_factor * cfg.time_scale;
            due = replay_loop(&phase, replay, speed, max_in_flight, cfg.seed).await;
        }
        (Load::Replay { .. }, None) => {}
    }
    let wall = start.elapsed();
    let elapsed = wall.mul_f64(cfg.time_scale);
    if let Some(p) = progress {
        p.abort();
        // Clear the progress line so the report starts on a clean line.
        eprint!("\r\x1b[K");
    }
    let after = crate::metrics::scrape_all(&client, &cfg.engine_metrics).await;
    let total = phase.recorder.total()?;
    let oracle: Option<Oracle> = match (&trace, &cfg.replay) {
        (Some(t), _) => Some(oracle(&t.sent(), cfg.oracle_block_size, cfg.oracle_limit)),
        (None, Some(r)) => Some(crate::mooncake::oracle(
            &r.requests[..due.min(r.requests.len())],
            cfg.oracle_block_size,
            cfg.oracle_limit,
        )),
        (None, None) => None,
    };
    let mut report = Report::new(cfg, target_info, &total, elapsed, cancel.is_cancelled());
    report.wall_s = wall.as_secs_f64();
    report.model = model;
    report.oracle = oracle;
    if let Some(r) = &cfg.replay {
        report.replay = Some(ReplayInfo {
            path: r.path.clone(),
            requests_in_file: r.requests.len(),
            requests_due: due,
            span_s: r.span_s(),
        });
    }
    if cfg.slo.is_set() {
        let n = report.requests.max(1) as f64;
        let met = |i: usize| phase.slo_met[i].load(Ordering::Relaxed);
        report.slo = Some(SloReport {
            ttft_ms: cfg.slo.ttft.map(|d| d.as_secs_f64() * 1000.0),
            itl_ms: cfg.slo.itl.map(|d| d.as_secs_f64() * 1000.0),
            ttft_attainment: met(0) as f64 / n,
            itl_attainment: met(1) as f64 / n,
            attainment: met(2) as f64 / n,
            goodput_rps: met(2) as f64 / report.elapsed_s,
        });
    }
    report.engines = crate::metrics::deltas(
        &cfg.engine_metrics,
        &cfg.engine_roles,
        &before,
        &after,
        &mut warnings,
    );
    report.sample_error = requester.first_error.get().cloned();
    report.warnings = warnings;
    Ok(report)
}

/// Seconds before the progress line appears: short runs stay quiet.
const PROGRESS_AFTER: Duration = Duration::from_secs(3);

async fn progress_line(phase: Arc<Phase>, start: Instant) {
    tokio::time::sleep(PROGRESS_AFTER).await;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    // Rates count from the line's start, not from the run's (the first tick fires at once).
    let finished = || phase.done.load(Ordering::Relaxed) + phase.failed.load(Ordering::Relaxed);
    let (mut last_n, mut last_t) = (finished(), Instant::now());
    loop {
        tick.tick().await;
        let ok = phase.done.load(Ordering::Relaxed);
        let err = phase.failed.load(Ordering::Relaxed);
        let now = Instant::now();
        let rate = (ok + err - last_n) as f64 / now.duration_since(last_t).as_secs_f64().max(1e-3);
        (last_n, last_t) = (ok + err, now);
        let of = phase.total.map(|t| format!("/{t}")).unwrap_or_default();
        let open = phase
            .next_id
            .load(Ordering::Relaxed)
            .min(phase.total.unwrap_or(u64::MAX))
            .saturating_sub(ok + err);
        eprint!(
            "\r\x1b[K{:>6.1} s  {}{of} requests  {open} open  {} errors  {:.1} req/s",
            start.elapsed().as_secs_f64() * phase.time_scale,
            ok + err,
            err,
            rate * phase.time_scale
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

/// Sends the requests of `trace` at their recorded times divided by `speed`, each measured from
/// its due time (no coordinated omission); requests due while `max_in_flight` are open are not
/// sent and count as `overflow`. Returns how many requests came due (sent or not).
async fn replay_loop(
    phase: &Arc<Phase>,
    trace: &Arc<Trace>,
    speed: f64,
    max_in_flight: usize,
    seed: u64,
) -> usize {
    let mut set = JoinSet::new();
    let start = Instant::now();
    let t0 = trace.requests.first().map_or(0, |r| r.timestamp);
    let mut due_count = 0;
    for (i, r) in trace.requests.iter().enumerate() {
        let offset = r.timestamp.saturating_sub(t0) as f64 / 1000.0 / speed;
        // Beyond any run's bound; keeps `start + offset` representable.
        let far = Duration::from_secs(10 * 365 * 86_400);
        let due = start + Duration::try_from_secs_f64(offset).map_or(far, |d| d.min(far));
        tokio::select! {
            () = tokio::time::sleep_until(due) => {}
            () = phase.cancel.cancelled() => break,
        }
        let Some(n) = phase.claim() else { break };
        due_count = i + 1;
        while set.try_join_next().is_some() {}
        if set.len() >= max_in_flight {
            phase
                .recorder
                .with_shard(n, |s| s.record_err(ErrorClass::Overflow));
            continue;
        }
        let phase = phase.clone();
        let trace = trace.clone();
        set.spawn(async move {
            let r = &trace.requests[i];
            let prompt = Prompt::Text(r.prompt(seed, i));
            let mut scratch = Scratch::default();
            phase
                .one(
                    n,
                    0,
                    Some(&prompt),
                    r.output_length.max(1),
                    due,
                    &mut scratch,
                )
                .await;
        });
    }
    while set.join_next().await.is_some() {}
    due_count
}
