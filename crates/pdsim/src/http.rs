//! The OpenAI-compatible HTTP surface and the `/sim/*` control endpoints.

use std::io;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::stream;

use crate::config::{Faults, Role};

/// Pause before an injected connection drop so earlier bytes are flushed first.
const DROP_FLUSH: Duration = Duration::from_millis(20);
use crate::engine::Engine;
use crate::error::ApiError;
use crate::job::{InFlight, Job};
use crate::plan::plan;
use crate::request::{Endpoint, parse_with};
use crate::respond::{self, ChoiceOut, Head, Usage};
use crate::respond_api;
use crate::stats::Recorded;

/// The engine's main router.
pub(crate) fn router(engine: Arc<Engine>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses))
        .route("/v1/messages", post(messages))
        .route("/v1/models", get(models))
        .route("/v1/load_lora_adapter", post(load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(unload_lora_adapter))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/abort_request", post(abort_request))
        .route("/sim/faults", get(get_faults).post(set_faults))
        .route("/sim/stats", get(stats))
        .route("/sim/restart", post(restart))
        .route("/tokenize", post(tokenize))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .fallback(not_found)
        .with_state(engine)
}

async fn completions(State(e): State<Arc<Engine>>, headers: HeaderMap, body: Bytes) -> Response {
    generate(e, Endpoint::Completions, headers, body).await
}

async fn chat_completions(
    State(e): State<Arc<Engine>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(e, Endpoint::Chat, headers, body).await
}

async fn responses(State(e): State<Arc<Engine>>, headers: HeaderMap, body: Bytes) -> Response {
    generate(e, Endpoint::Responses, headers, body).await
}

async fn messages(State(e): State<Arc<Engine>>, headers: HeaderMap, body: Bytes) -> Response {
    generate(e, Endpoint::Messages, headers, body).await
}

/// vLLM 0.32's id when no `X-Request-Id` is sent: 16 hex digits.
fn random_id() -> String {
    format!("{:016x}", rand::random::<u64>())
}

fn count(c: &AtomicU64) {
    c.fetch_add(1, Relaxed);
}

async fn generate(
    engine: Arc<Engine>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let c = &engine.counters;
    count(match endpoint {
        Endpoint::Completions => &c.completions,
        Endpoint::Chat => &c.chat_completions,
        Endpoint::Responses => &c.responses,
        Endpoint::Messages => &c.messages,
    });
    if engine.is_dead() {
        count(&c.responses_error);
        return ApiError::EngineDead.into_response();
    }
    let rid_header = headers.get("x-request-id");
    let dp_rank = headers
        .get("x-data-parallel-rank")
        .and_then(|v| v.to_str().ok());
    engine.recent.push(Recorded {
        path: endpoint.path(),
        request_id: rid_header.cloned(),
        data_parallel_rank: headers.get("x-data-parallel-rank").cloned(),
        traceparent: headers.get("traceparent").cloned(),
        body: body.clone(),
    });
    let base_id = rid_header
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
        .map_or_else(random_id, str::to_owned);
    let mut guard = InFlight::new(engine.clone());
    // Only take a reference to the fault set when a request-path fault is active.
    let active = {
        let f = engine.faults.load();
        f.affects_requests().then(|| Arc::clone(&f))
    };
    let resp = if let Some(faults) = active {
        match inject(&engine, &faults).await {
            Some(r) => {
                guard.finish();
                r
            }
            None => {
                run(
                    engine.clone(),
                    endpoint,
                    &body,
                    &base_id,
                    dp_rank,
                    guard,
                    faults.drop_after_chunks,
                )
                .await
            }
        }
    } else {
        run(
            engine.clone(),
            endpoint,
            &body,
            &base_id,
            dp_rank,
            guard,
            None,
        )
        .await
    };
    count(if resp.status().is_success() {
        &c.responses_ok
    } else {
        &c.responses_error
    });
    // vLLM sends no `x-request-id` response header; the id is only in the body.
    resp
}

/// Applies request-path faults; `Some` is the answer instead of a real one.
async fn inject(engine: &Engine, faults: &Faults) -> Option<Response> {
    let c = &engine.counters;
    if faults.first_byte_delay_ms > 0 {
        count(&c.faults_injected);
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(faults.first_byte_delay_ms)) => {}
            () = engine.shutdown.cancelled() => {}
        }
    }
    if faults.hang {
        count(&c.faults_injected);
        // Never answer: the client leaving drops this future (counted as a disconnect).
        engine.shutdown.cancelled().await;
        return Some(
            ApiError::handoff(StatusCode::SERVICE_UNAVAILABLE, "engine is shutting down")
                .into_response(),
        );
    }
    if faults.error_rate > 0.0 && rand::random::<f64>() < faults.error_rate {
        count(&c.faults_injected);
        let status =
            StatusCode::from_u16(faults.error_status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return Some(ApiError::Injected(status).into_response());
    }
    None
}

async fn run(
    engine: Arc<Engine>,
    endpoint: Endpoint,
    body: &[u8],
    base_id: &str,
    dp_rank: Option<&str>,
    mut guard: InFlight,
    drop_after: Option<u32>,
) -> Response {
    if engine.cfg.role == Role::Encode {
        let answer = crate::encoder::answer(&engine, endpoint, body, base_id).await;
        guard.finish();
        return answer;
    }
    let prepared = parse_with(endpoint, body, engine.served(), &engine.tok).and_then(|req| {
        let total = u64::from(req.prompt.count) + u64::from(req.max_tokens);
        let max_model_len = engine.cfg.context_window();
        if total > u64::from(max_model_len) {
            return Err(ApiError::BadRequest {
                message: format!(
                    "This model's maximum context length is {max_model_len} tokens. However, you requested {} output tokens and your prompt contains {} input tokens, for a total of {total} tokens. Please reduce the length of the input prompt or the number of requested output tokens. (parameter=input_tokens, value={})",
                    req.max_tokens, req.prompt.count, req.prompt.count
                ),
                param: Some("input_tokens"),
            });
        }
        // The rank it runs on: the header's, checked like vLLM's, else the balancer's choice.
        let rank = crate::dp::choose(&engine.ranks, dp_rank, &engine.rank_turn)?;
        let p = plan(engine.plan_input(), &req, base_id)?;
        Ok((req, p, rank))
    });
    let (req, plan, rank) = match prepared {
        Ok(x) => x,
        Err(e) => {
            if matches!(e, ApiError::ModelNotFound { .. }) {
                count(&engine.counters.model_not_found);
            }
            guard.finish();
            return e.into_response();
        }
    };
    // An encoder-cache consumer loads its items' encoder output before it computes the prompt.
    if !req.mm.is_empty()
        && engine.cfg.role.loads_encoder_output()
        && let Err(e) = crate::encoder::load(&engine, &req, base_id).await
    {
        guard.finish();
        return e.into_response();
    }
    let stream = req.stream;
    let rank = crate::dp::OnRank::new(&engine.ranks, rank);
    let mut job = Job::new(engine, endpoint, req, base_id, plan, guard, rank);
    if stream {
        return sse_response(job, drop_after);
    }
    let r = run_full(&mut job).await;
    job.guard.finish();
    match r {
        Ok(body) => match drop_after {
            Some(_) => {
                count(&job.engine.counters.faults_injected);
                let half = Bytes::from(body).slice(..);
                let cut = half.len() / 2;
                let first = half.slice(..cut);
                let parts = stream::unfold(0u8, move |step| {
                    let first = first.clone();
                    async move {
                        match step {
                            0 => Some((Ok(first), 1)),
                            1 => {
                                tokio::time::sleep(DROP_FLUSH).await;
                                Some((Err(io::Error::other("injected connection drop")), 2))
                            }
                            _ => None,
                        }
                    }
                });
                json_response(Body::from_stream(parts))
            }
            None => json_response(Body::from(body)),
        },
        Err(e) => e.into_response(),
    }
}

fn json_response(body: Body) -> Response {
    let mut r = Response::new(body);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn head(job: &Job) -> Head<'_> {
    Head {
        endpoint: job.endpoint,
        id: &job.id_json,
        created: job.created,
        model: &job.model_json,
    }
}

fn usage(job: &Job, choices: &[ChoiceOut]) -> Usage {
    Usage {
        prompt: job.req.prompt.count,
        completion: choices.iter().map(|c| c.words.len() as u32).sum(),
        cached: job
            .engine
            .cfg
            .cache
            .enable_prompt_tokens_details
            .then_some(job.cached),
    }
}

async fn run_full(job: &mut Job) -> Result<String, ApiError> {
    job.prepare().await?;
    let choices = job.choices();
    let steps = choices.iter().map(|c| c.words.len()).max().unwrap_or(0) as u32;
    if steps > 1 {
        job.tokens(steps - 1).await?;
    }
    let kv = job.finish(&choices);
    let (head, usage) = (head(job), usage(job, &choices));
    if let (Endpoint::Responses | Endpoint::Messages, Some(c)) = (head.endpoint, choices.first()) {
        return Ok(respond_api::full_body(
            &head,
            c,
            usage,
            kv.as_deref().unwrap_or("null"),
        ));
    }
    let body = respond::full_body(&head, &choices, usage, kv.as_deref());
    Ok(match &job.trtllm_context {
        Some(params) => crate::addressed::trtllm_context_body(&body, params, &job.req.prompt.ids),
        None => body,
    })
}

enum Phase {
    Start,
    Tokens,
    End,
}

struct SseState {
    job: Job,
    phase: Phase,
    choices: Vec<ChoiceOut>,
    step: usize,
    last_step: usize,
    sent: u32,
    drop_after: Option<u32>,
}

impl SseState {
    fn fail(&mut self, e: &ApiError) -> Bytes {
        count(&self.job.engine.counters.responses_error);
        let mut out = String::with_capacity(512);
        // vLLM's chat stream sends the role chunk with the engine's first output,
        // which for a failed KV load or a dead engine core is the error itself.
        if self.job.endpoint == Endpoint::Chat
            && self.step == 0
            && matches!(e, ApiError::KvLoad(_) | ApiError::EngineDead)
        {
            respond::role_event(&mut out, &head(&self.job), 0);
        }
        respond::error_event(&mut out, &e.to_event_json());
        out.push_str(respond::DONE);
        self.phase = Phase::End;
        self.job.guard.finish();
        Bytes::from(out)
    }

    async fn next(&mut self) -> Option<Result<Bytes, io::Error>> {
        if let Some(n) = self.drop_after
            && self.sent >= n
            && !matches!(self.phase, Phase::End)
        {
            count(&self.job.engine.counters.faults_injected);
            self.phase = Phase::End;
            self.job.guard.finish();
            // Let the chunks already produced reach the socket before the cut.
            tokio::time::sleep(DROP_FLUSH).await;
            return Some(Err(io::Error::other("injected connection drop")));
        }
        self.sent += 1;
        match self.phase {
            Phase::End => None,
            Phase::Start => {
                if let Err(e) = self.job.prepare().await {
                    return Some(Ok(self.fail(&e)));
                }
                self.choices = self.job.choices();
                self.last_step = self
                    .choices
                    .iter()
                    .map(|c| c.words.len().saturating_sub(1))
                    .max()
                    .unwrap_or(0);
                self.phase = Phase::Tokens;
                Some(Ok(self.step_chunk()))
            }
            Phase::Tokens => {
                if let Err(e) = self.job.next_token().await {
                    return Some(Ok(self.fail(&e)));
                }
                Some(Ok(self.step_chunk()))
            }
        }
    }

    fn step_chunk(&mut self) -> Bytes {
        if matches!(self.job.endpoint, Endpoint::Responses | Endpoint::Messages) {
            return self.api_step_chunk();
        }
        let (step, last, kv) = self.begin_step();
        let job = &self.job;
        let h = head(job);
        let mut out = String::with_capacity(256 * self.choices.len());
        for (i, c) in self.choices.iter().enumerate() {
            let finish_at = c.words.len().saturating_sub(1);
            if step > finish_at {
                continue;
            }
            if step == 0 && job.endpoint == Endpoint::Chat {
                respond::role_event(&mut out, &h, i);
            }
            let fin = (step == finish_at).then_some((c.finish, &c.stop_reason));
            let kv_here = if step == finish_at {
                kv.as_deref()
            } else {
                None
            };
            respond::token_event(&mut out, &h, i, c.words.get(step).copied(), fin, kv_here);
        }
        if last {
            if job.req.include_usage {
                respond::usage_event(&mut out, &h, usage(job, &self.choices));
            }
            out.push_str(respond::DONE);
            self.phase = Phase::End;
            self.job.guard.finish();
        }
        self.step += 1;
        Bytes::from(out)
    }
}

impl SseState {
    /// The step about to be sent, whether it is the last, and on the last the job's finish
    /// (its transfer params as JSON, `null` without any).
    fn begin_step(&mut self) -> (usize, bool, Option<String>) {
        let step = self.step;
        let last = step == self.last_step;
        let kv = last.then(|| {
            let choices = std::mem::take(&mut self.choices);
            let kv = self.job.finish(&choices);
            self.choices = choices;
            kv.unwrap_or_else(|| "null".to_owned())
        });
        (step, last, kv)
    }

    /// One step of a `/v1/responses` or `/v1/messages` stream (one choice: neither has `n`).
    fn api_step_chunk(&mut self) -> Bytes {
        let (step, last, kv) = self.begin_step();
        let job = &self.job;
        let h = head(job);
        let mut out = String::with_capacity(512);
        if step == 0 {
            respond_api::stream_open(&mut out, &h, usage(job, &[]));
        }
        if let Some(c) = self.choices.first() {
            if let Some(word) = c.words.get(step) {
                respond_api::stream_token(&mut out, &h, word, step);
            }
            if let Some(kv) = &kv {
                respond_api::stream_close(&mut out, &h, c, usage(job, &self.choices), kv, step + 1);
            }
        }
        if last {
            self.phase = Phase::End;
            self.job.guard.finish();
        }
        self.step += 1;
        Bytes::from(out)
    }
}

fn sse_response(job: Job, drop_after: Option<u32>) -> Response {
    let state = SseState {
        job,
        phase: Phase::Start,
        choices: Vec::new(),
        step: 0,
        last_step: 0,
        sent: 0,
        drop_after,
    };
    let body = stream::unfold(state, |mut st| async move {
        let item = st.next().await?;
        Some((item, st))
    });
    let mut r = Response::new(Body::from_stream(body));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

async fn models(State(engine): State<Arc<Engine>>) -> Response {
    count(&engine.counters.models);
    let created = engine.clock.now_unix() as u64;
    let m = &engine.cfg.model;
    let mut data = vec![serde_json::json!({
        "id": m, "object": "model", "created": created, "owned_by": "vllm",
        "root": m, "parent": null, "max_model_len": engine.cfg.context_window(),
    })];
    // vLLM lists each adapter after the base model, without `max_model_len`.
    data.extend(engine.adapters.list().iter().map(|l| {
        serde_json::json!({
            "id": l.name, "object": "model", "created": created, "owned_by": "vllm",
            "root": l.path, "parent": m, "max_model_len": null,
        })
    }));
    let body = serde_json::json!({ "object": "list", "data": data });
    axum::Json(body).into_response()
}

async fn health(State(engine): State<Arc<Engine>>) -> StatusCode {
    count(&engine.counters.health);
    if engine.faults.load().dead || engine.is_dead() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

async fn metrics(State(engine): State<Arc<Engine>>) -> Response {
    count(&engine.counters.metrics);
    let mut text = engine.counters.render_prometheus(
        &engine.cfg.model,
        engine.cfg.role.as_str(),
        engine.cfg.connector.as_str(),
    );
    // vLLM's info gauge of its cache configuration: the KV blocks it holds (what a gateway
    // models the engine's cache size from) and their size.
    let cache = &engine.cfg.cache;
    text.push_str(&format!(
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"{}\",num_gpu_blocks=\"{}\"}} 1.0\n",
        cache.block_size,
        if cache.enable_prefix_caching { "True" } else { "False" },
        cache.kv_cache_blocks,
    ));
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

#[derive(serde::Deserialize)]
struct AbortBody {
    rid: String,
}

async fn abort_request(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    count(&engine.counters.abort_requests);
    match serde_json::from_slice::<AbortBody>(&body) {
        Ok(a) => {
            engine.abort(&a.rid);
            StatusCode::OK.into_response()
        }
        Err(e) => ApiError::bad(format!("JSON decode error: {e}")).into_response(),
    }
}

async fn get_faults(State(engine): State<Arc<Engine>>) -> Response {
    axum::Json(engine.faults.load_full().as_ref().clone()).into_response()
}

async fn set_faults(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    match serde_json::from_slice::<Faults>(&body) {
        Ok(f) => {
            engine.faults.store(Arc::new(f.clone()));
            axum::Json(f).into_response()
        }
        Err(e) => ApiError::bad(format!("invalid faults: {e}")).into_response(),
    }
}

async fn stats(State(engine): State<Arc<Engine>>) -> Response {
    axum::Json(engine.snapshot()).into_response()
}

async fn restart(State(engine): State<Arc<Engine>>) -> StatusCode {
    engine.restart();
    StatusCode::OK
}

async fn reset_prefix_cache(State(engine): State<Arc<Engine>>) -> StatusCode {
    engine.reset_prefix_cache();
    StatusCode::OK
}

#[derive(serde::Deserialize)]
struct TokenizeBody<'a> {
    #[serde(borrow, default)]
    prompt: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a serde_json::value::RawValue>,
}

/// vLLM's `POST /tokenize`: `prompt` or `messages` (chat template applied) to token ids.
async fn tokenize(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    let parsed = serde_json::from_slice::<TokenizeBody<'_>>(&body)
        .map_err(|e| ApiError::bad(format!("JSON decode error: {e}")))
        .and_then(|b| match b.messages {
            Some(m) => crate::request::tokenize_messages(Some(m), &engine.tok),
            None => crate::request::tokenize_prompt(b.prompt, &engine.tok),
        });
    match parsed {
        Ok(p) => axum::Json(serde_json::json!({
            "count": p.count,
            "max_model_len": engine.cfg.context_window(),
            "tokens": p.ids,
            "token_strs": null,
        }))
        .into_response(),
        Err(e) => e.into_response(),
    }
}

#[derive(serde::Deserialize)]
struct LoadBody {
    #[serde(default)]
    lora_name: String,
    #[serde(default)]
    lora_path: String,
}

#[derive(serde::Deserialize)]
struct UnloadBody {
    #[serde(default)]
    lora_name: String,
}

/// `POST /v1/load_lora_adapter`.
async fn load_lora_adapter(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    change_adapter(&body, "added", |b: LoadBody| {
        engine.adapters.load(&b.lora_name, &b.lora_path)?;
        Ok(b.lora_name)
    })
}

/// `POST /v1/unload_lora_adapter`.
async fn unload_lora_adapter(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    change_adapter(&body, "removed", |b: UnloadBody| {
        engine.adapters.unload(&b.lora_name)?;
        Ok(b.lora_name)
    })
}

/// Parses a load/unload body and applies it; vLLM answers 200 with a plain-text success line
/// naming the adapter and what was `done` to it.
fn change_adapter<B: serde::de::DeserializeOwned>(
    body: &[u8],
    done: &str,
    apply: impl FnOnce(B) -> Result<String, ApiError>,
) -> Response {
    let changed = serde_json::from_slice::<B>(body)
        .map_err(|e| ApiError::bad(format!("JSON decode error: {e}")))
        .and_then(apply);
    match changed {
        Ok(name) => {
            tracing::info!(lora_name = %name, done, "LoRA adapter changed");
            format!("Success: LoRA adapter '{name}' {done} successfully.").into_response()
        }
        Err(e) => e.into_response(),
    }
}

async fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        [(header::CONTENT_TYPE, "application/json")],
        "{\"detail\":\"Not Found\"}",
    )
        .into_response()
}
