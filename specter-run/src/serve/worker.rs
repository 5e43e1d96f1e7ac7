//! The thread that owns the model: it opens the session, then serves jobs from a bounded FIFO
//! queue one at a time, sending each job's events (started, text, done or failed) back to the
//! connection that asked. A job whose client has gone is dropped from the queue or stopped
//! within one decode round.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use axum::http::StatusCode;
use serde_json::{json, Value};
use specter::decode::{GenerateOptions, GenerateOutput, Mode, Sampling};
use specter::session::{Session, SessionModel, SessionOptions};
use specter::strategy::{decode_on_session, AutoDepthStart, DecodePlan};
use tokio::sync::mpsc::UnboundedSender;

use super::text::TextTracker;
use super::wire::{ApiError, Params, PromptInput, Usage, DEFAULT_CHAT_TOKENS_CAP};

/// How every request is decoded (the server's command line).
#[derive(Clone, Debug)]
pub struct DecodeConfig {
    pub mode: Mode,
    pub depth: usize,
    pub auto_depth: bool,
    /// CPU backend: routed experts per layer the residency simulation keeps.
    pub simulated_experts: Option<usize>,
    /// CPU: bandwidth of the simulated copies; CUDA: the prefetch schedule's first estimate.
    pub bandwidth_gbps: f64,
}

/// One request waiting for, or being served by, the worker.
pub struct Job {
    pub prompt: PromptInput,
    pub params: Params,
    pub events: UnboundedSender<Event>,
    pub enqueued: Instant,
}

/// What the worker tells the connection that submitted a job.
#[derive(Debug)]
pub enum Event {
    /// The prompt was accepted; tokens follow.
    Started,
    /// Newly released text.
    Text(String),
    Done {
        text: String,
        finish_reason: &'static str,
        usage: Usage,
        stats: Value,
    },
    Failed(ApiError),
}

/// What the connections need to know about the loaded model.
pub struct ModelMeta {
    pub max_context: usize,
    pub tokenizer_config: Option<Vec<u8>>,
    pub chat_template_file: Option<Vec<u8>>,
    pub backend: &'static str,
}

/// Figures `/health` reports.
#[derive(Default)]
pub struct Counters {
    pub queued: AtomicUsize,
    pub busy: AtomicBool,
    pub completed: AtomicU64,
    pub cancelled: AtomicU64,
    pub failed: AtomicU64,
    /// Tokens generated over all requests (cancelled ones included).
    pub generated_tokens: AtomicU64,
}

/// The worker thread and the sending end of its queue.
pub struct Worker {
    pub queue: SyncSender<Job>,
    pub thread: JoinHandle<()>,
    pub meta: ModelMeta,
}

/// Starts the worker: it opens the bundle (this returns once the model is loaded, or with the
/// reason it could not be) and then serves the queue until every sender is dropped.
pub fn spawn(
    bundle: std::path::PathBuf,
    session_opts: SessionOptions,
    decode: DecodeConfig,
    queue_depth: usize,
    shutdown: Arc<AtomicBool>,
    counters: Arc<Counters>,
) -> Result<Worker> {
    let (queue, jobs) = sync_channel::<Job>(queue_depth);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<ModelMeta>>();
    let thread = std::thread::Builder::new()
        .name("specter-serve-model".into())
        .spawn(move || {
            let session = match open(&bundle, &session_opts, &decode) {
                Ok(session) => session,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let meta = ModelMeta {
                max_context: session.info().max_context,
                tokenizer_config: specter_convert::pack::chat_file(
                    &session.bundle,
                    specter_convert::pack::TOKENIZER_CONFIG,
                )
                .map(<[u8]>::to_vec),
                chat_template_file: specter_convert::pack::chat_file(
                    &session.bundle,
                    specter_convert::pack::CHAT_TEMPLATE,
                )
                .map(<[u8]>::to_vec),
                backend: if session.cuda().is_some() {
                    "cuda"
                } else {
                    "cpu"
                },
            };
            let end_tokens = match end_tokens(&session) {
                Ok(ids) => ids,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            if ready_tx.send(Ok(meta)).is_err() {
                return;
            }
            let model = Model {
                session: &session,
                decode: &decode,
                end_tokens: &end_tokens,
            };
            serve_queue(&model, jobs, &shutdown, &counters);
        })
        .context("cannot start the model thread")?;
    let meta = match ready_rx.recv() {
        Ok(result) => result?,
        Err(_) => {
            let _ = thread.join();
            return Err(anyhow!("the model thread ended while loading the bundle"));
        }
    };
    Ok(Worker {
        queue,
        thread,
        meta,
    })
}

fn open(bundle: &std::path::Path, opts: &SessionOptions, decode: &DecodeConfig) -> Result<Session> {
    let session = Session::open_with(bundle, opts)?;
    let info = session.info();
    if let Some(slots) = decode.simulated_experts {
        if slots == 0 || slots > info.num_experts {
            anyhow::bail!(
                "--resident-experts must be between 1 and {} (experts per layer)",
                info.num_experts
            );
        }
    }
    if let Some(gpu) = session.cuda() {
        eprintln!("cuda: {}", gpu.residency_description()?);
    }
    Ok(session)
}

/// The end-of-sequence tokens of the model's config.json and of its generation_config.json (chat
/// models often end turns with a token only the latter names, such as ChatML's `<|im_end|>`).
fn end_tokens(session: &Session) -> Result<Vec<u32>> {
    let mut ids = session.info().eos_token_ids.clone();
    let Some(bytes) =
        specter_convert::pack::chat_file(&session.bundle, specter_convert::pack::GENERATION_CONFIG)
    else {
        return Ok(ids);
    };
    let config: Value = serde_json::from_slice(bytes)
        .context("the bundle's generation_config.json is not valid JSON")?;
    let listed = match config.get("eos_token_id") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(Value::as_u64)
            .collect::<Option<Vec<_>>>()
            .context("generation_config.json: eos_token_id must hold token ids")?,
        Some(v) => vec![v.as_u64().context(
            "generation_config.json: eos_token_id must be a token id or a list of them",
        )?],
    };
    for id in listed {
        let id = u32::try_from(id).context("generation_config.json: eos_token_id out of range")?;
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    Ok(ids)
}

/// What every job is served with.
struct Model<'a> {
    session: &'a Session,
    decode: &'a DecodeConfig,
    /// Tokens that end a generation (see [`end_tokens`]).
    end_tokens: &'a [u32],
}

fn serve_queue(model: &Model<'_>, jobs: Receiver<Job>, shutdown: &AtomicBool, counters: &Counters) {
    while let Ok(job) = jobs.recv() {
        counters.queued.fetch_sub(1, Ordering::SeqCst);
        if job.events.is_closed() {
            // Its client left while it waited.
            counters.cancelled.fetch_add(1, Ordering::SeqCst);
            continue;
        }
        if shutdown.load(Ordering::SeqCst) {
            let _ = job.events.send(Event::Failed(
                ApiError::server("the server is shutting down")
                    .with_status(StatusCode::SERVICE_UNAVAILABLE),
            ));
            continue;
        }
        counters.busy.store(true, Ordering::SeqCst);
        let outcome = serve_job(model, &job, shutdown, counters);
        counters.busy.store(false, Ordering::SeqCst);
        // Counted before the client hears the end, so /health never lags an answer it has.
        let (counter, last) = match outcome {
            Outcome::Completed(done) => (&counters.completed, Some(done)),
            Outcome::Cancelled => (&counters.cancelled, None),
            Outcome::Failed(error) => (&counters.failed, Some(Event::Failed(error))),
        };
        counter.fetch_add(1, Ordering::SeqCst);
        if let Some(event) = last {
            let _ = job.events.send(event);
        }
    }
}

enum Outcome {
    /// The answer's last event, for the worker to send once it has counted the job.
    Completed(Event),
    Cancelled,
    Failed(ApiError),
}

fn serve_job(model: &Model<'_>, job: &Job, shutdown: &AtomicBool, counters: &Counters) -> Outcome {
    let (session, decode) = (model.session, model.decode);
    let prompt = match tokenize(session, &job.prompt) {
        Ok(prompt) => prompt,
        Err(e) => return Outcome::Failed(e),
    };
    let info = session.info();
    if prompt.is_empty() {
        return Outcome::Failed(ApiError::invalid("the prompt is empty", Some("prompt")));
    }
    if let Some((position, &id)) = prompt
        .iter()
        .enumerate()
        .find(|(_, &id)| id as usize >= info.vocab_size)
    {
        return Outcome::Failed(ApiError::invalid(
            format!(
                "prompt token {id} at position {position} is outside the vocabulary (size {})",
                info.vocab_size
            ),
            Some("prompt"),
        ));
    }
    let room = info.max_context.saturating_sub(prompt.len());
    let max_tokens = job
        .params
        .max_tokens
        .unwrap_or(room.min(DEFAULT_CHAT_TOKENS_CAP));
    if max_tokens == 0 || max_tokens > room {
        return Outcome::Failed(
            ApiError::invalid(
                format!(
                    "this model's context is {} tokens; the prompt takes {} and {} were asked for",
                    info.max_context,
                    prompt.len(),
                    max_tokens.max(1)
                ),
                Some("max_tokens"),
            )
            .with_code("context_length_exceeded"),
        );
    }
    let opts = GenerateOptions {
        mode: decode.mode,
        max_new_tokens: max_tokens,
        depth: decode.depth,
        sampling: Sampling {
            temperature: job.params.temperature,
            top_p: job.params.top_p,
            seed: job.params.seed,
        },
        stop_at_eos: !job.params.ignore_eos,
    };
    if job.events.send(Event::Started).is_err() {
        return Outcome::Cancelled;
    }
    let queue_ms = job.enqueued.elapsed().as_secs_f64() * 1e3;

    let mut tracker = TextTracker::new(job.params.stop.clone());
    let mut tokens: Vec<u32> = Vec::with_capacity(max_tokens);
    let stop_string_seen = Cell::new(false);
    let client_gone = Cell::new(false);
    let end_token_seen = Cell::new(false);
    let mut on_token = |token: u32| {
        // A round may commit tokens past an end token the library does not stop at (one only
        // generation_config.json names): they are not part of the answer.
        if end_token_seen.get() || !job.params.ignore_eos && model.end_tokens.contains(&token) {
            end_token_seen.set(true);
            return;
        }
        tokens.push(token);
        if !session.has_tokenizer() {
            return;
        }
        if let Ok(text) = session.decode(&tokens) {
            if let Some(piece) = tracker.update(&text) {
                if job.events.send(Event::Text(piece)).is_err() {
                    client_gone.set(true);
                }
            }
            stop_string_seen.set(tracker.stopped());
        }
    };
    let stop = || {
        stop_string_seen.get()
            || end_token_seen.get()
            || client_gone.get()
            || job.events.is_closed()
            || shutdown.load(Ordering::SeqCst)
    };
    let result = run_generation(session, decode, &prompt, &opts, &stop, &mut on_token);
    let (mut output, experts) = match result {
        Ok(done) => done,
        Err(e) => {
            let request = matches!(
                e.downcast_ref::<specter::Error>(),
                Some(specter::Error::Request(_))
            );
            return Outcome::Failed(if request {
                ApiError::invalid(format!("{e:#}"), None)
            } else {
                ApiError::server(format!("generation failed: {e:#}"))
            });
        }
    };
    // The answer ends at its first end token (kept, as the library keeps its own).
    if !job.params.ignore_eos {
        if let Some(end) = output
            .tokens
            .iter()
            .position(|t| model.end_tokens.contains(t))
        {
            output.tokens.truncate(end + 1);
        }
    }
    counters
        .generated_tokens
        .fetch_add(output.tokens.len() as u64, Ordering::SeqCst);
    if job.events.is_closed() {
        return Outcome::Cancelled;
    }
    let ended_on_eos = !job.params.ignore_eos
        && output
            .tokens
            .last()
            .is_some_and(|t| model.end_tokens.contains(t));
    // The end token is not part of the text (as it was not streamed).
    let answer = &output.tokens[..output.tokens.len() - usize::from(ended_on_eos)];
    let decoded = if session.has_tokenizer() {
        match session.decode(answer) {
            Ok(text) => text,
            Err(e) => return Outcome::Failed(ApiError::server(format!("{e:#}"))),
        }
    } else {
        String::new()
    };
    let (text, rest) = tracker.finish(&decoded);
    if let Some(rest) = rest {
        let _ = job.events.send(Event::Text(rest));
    }
    let finish_reason = if output.tokens.len() >= max_tokens && !ended_on_eos && !tracker.stopped()
    {
        "length"
    } else {
        "stop"
    };
    let s = &output.stats;
    let stats = json!({
        "backend": if session.cuda().is_some() { "cuda" } else { "cpu" },
        "mode": format!("{:?}", decode.mode).to_lowercase(),
        "depth": decode.depth,
        "auto_depth": decode.auto_depth,
        "tokens": output.tokens,
        "rounds": s.rounds,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "acceptance_rate": s.acceptance_rate,
        "mean_accepted_per_round": s.mean_accepted_per_round,
        "queue_ms": queue_ms,
        "ttft_ms": s.ttft_ms,
        "tpot_ms": s.tpot_ms,
        "total_ms": s.total_ms,
        "experts": experts,
    });
    Outcome::Completed(Event::Done {
        text,
        finish_reason,
        usage: Usage {
            prompt_tokens: prompt.len(),
            completion_tokens: output.tokens.len(),
        },
        stats,
    })
}

fn tokenize(session: &Session, prompt: &PromptInput) -> Result<Vec<u32>, ApiError> {
    match prompt {
        PromptInput::Ids(ids) => Ok(ids.clone()),
        PromptInput::Text {
            text,
            special_tokens,
        } => {
            let tokenizer = session.tokenizer.as_ref().ok_or_else(|| {
                ApiError::invalid(
                    "this bundle holds no tokenizer.json: send the prompt as an array of token ids",
                    Some("prompt"),
                )
            })?;
            tokenizer
                .encode(text.as_str(), *special_tokens)
                .map(|enc| enc.get_ids().to_vec())
                .map_err(|e| {
                    ApiError::invalid(format!("cannot tokenize the prompt: {e}"), Some("prompt"))
                })
        }
    }
}

/// Decodes one request with the server's configuration: the backend, residency, mode and depth
/// chosen on the command line, through the library's one decode entry point
/// ([`decode_on_session`]), stopping after the token at which `stop` says so. Returns the output
/// and the request's expert-residency figures (hits, misses, bytes copied) where experts are
/// offloaded or their offloading simulated.
fn run_generation(
    session: &Session,
    cfg: &DecodeConfig,
    prompt: &[u32],
    opts: &GenerateOptions,
    stop: &dyn Fn() -> bool,
    on_token: &mut dyn FnMut(u32),
) -> Result<(GenerateOutput, Option<Value>)> {
    let simulated_slots = match &session.model {
        SessionModel::Cpu(_) => cfg.simulated_experts,
        SessionModel::Cuda(_) => None,
    };
    let plan = DecodePlan {
        auto_depth: cfg.auto_depth.then(|| AutoDepthStart {
            start: opts.depth,
            seed: Vec::new(),
        }),
        simulated_slots,
        copy_bandwidth: cfg.bandwidth_gbps * 1e9,
    };
    let gpu_before = match session.cuda() {
        Some(gpu) => gpu.offload_stats()?,
        None => None,
    };
    let output = decode_on_session(session, prompt, opts, &plan, &mut |t| {
        on_token(t);
        !stop()
    })?
    .output;
    let experts = if let Some(o) = &output.stats.offload {
        Some(json!({
            "simulated": true,
            "resident_experts": cfg.simulated_experts,
            "hits": o.hits,
            "misses": o.misses,
            "hit_rate": if o.lookups > 0 { o.hits as f64 / o.lookups as f64 } else { 0.0 },
            "bytes_copied": o.bytes_copied,
        }))
    } else {
        match (session.cuda(), gpu_before) {
            (Some(gpu), Some(before)) => gpu.offload_stats()?.map(|after| {
                let hits = after.hits.saturating_sub(before.hits);
                let misses = after.misses.saturating_sub(before.misses);
                json!({
                    "simulated": false,
                    "slots_per_layer": after.slots_per_layer,
                    "hits": hits,
                    "misses": misses,
                    "hit_rate": if hits + misses > 0 { hits as f64 / (hits + misses) as f64 } else { 0.0 },
                    "bytes_copied": after.bytes_copied.saturating_sub(before.bytes_copied),
                    "prefetched": after.prefetched.saturating_sub(before.prefetched),
                    "prefetch_used": after.prefetch_used.saturating_sub(before.prefetch_used),
                })
            }),
            _ => None,
        }
    };
    Ok((output, experts))
}
