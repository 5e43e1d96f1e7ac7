//! The HTTP endpoints: request parsing and validation, the hand-off to the worker's queue, and
//! the answer as one JSON body or as server-sent events.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use super::chat::ChatTemplate;
use super::wire::{
    self, ApiError, Endpoint, Params, PromptInput, ResponseHead, DEFAULT_COMPLETION_TOKENS,
};
use super::worker::{Counters, Event, Job};

/// What every handler shares.
pub struct AppState {
    pub model_name: String,
    pub created: u64,
    pub queue: SyncSender<Job>,
    pub queue_depth: usize,
    pub chat_template: Option<ChatTemplate>,
    /// Why chat requests are refused, when the bundle has no usable template.
    pub chat_unavailable: String,
    pub counters: Arc<Counters>,
    pub serial: AtomicU64,
    pub max_context: usize,
    pub backend: &'static str,
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .fallback(unknown_endpoint)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

async fn unknown_endpoint(uri: axum::http::Uri) -> ApiError {
    ApiError::invalid(
        format!(
            "no endpoint {}: this server offers POST /v1/completions, POST /v1/chat/completions, GET /v1/models and GET /health",
            uri.path()
        ),
        None,
    )
    .with_status(StatusCode::NOT_FOUND)
    .with_code("unknown_url")
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::invalid(
        format!("{} does not take {method} requests", uri.path()),
        None,
    )
    .with_status(StatusCode::METHOD_NOT_ALLOWED)
}

async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "specter",
            "max_model_len": state.max_context,
        }],
    }))
}

async fn health(State(state): State<Arc<AppState>>) -> Json<Value> {
    let c = &state.counters;
    Json(json!({
        "status": "ok",
        "model": state.model_name,
        "backend": state.backend,
        "busy": c.busy.load(Ordering::SeqCst),
        "queued": c.queued.load(Ordering::SeqCst),
        "queue_depth": state.queue_depth,
        "completed": c.completed.load(Ordering::SeqCst),
        "cancelled": c.cancelled.load(Ordering::SeqCst),
        "failed": c.failed.load(Ordering::SeqCst),
        "generated_tokens": c.generated_tokens.load(Ordering::SeqCst),
        "chat_template": state.chat_template.is_some(),
    }))
}

async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let parsed = (|| {
        let body = wire::parse_object(&read_body(body)?)?;
        let params = wire::parse_params(&body, &["max_tokens"], Some(DEFAULT_COMPLETION_TOKENS))?;
        check_model(&state, &params)?;
        let prompt = wire::parse_prompt(&body)?;
        Ok::<_, ApiError>((prompt, params))
    })();
    match parsed {
        Ok((prompt, params)) => submit(&state, Endpoint::Completions, prompt, params).await,
        Err(e) => e.into_response(),
    }
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let parsed = (|| {
        let body = wire::parse_object(&read_body(body)?)?;
        // A chat without a limit may use the rest of the context.
        let params = wire::parse_params(&body, &["max_tokens", "max_completion_tokens"], None)?;
        check_model(&state, &params)?;
        let messages = wire::parse_messages(&body)?;
        let template = state.chat_template.as_ref().ok_or_else(|| {
            ApiError::invalid(state.chat_unavailable.clone(), Some("messages"))
                .with_code("chat_template_missing")
        })?;
        let text = template.render(&messages).map_err(|e| {
            ApiError::invalid(
                format!("the model's chat template refused these messages: {e:#}"),
                Some("messages"),
            )
        })?;
        Ok::<_, ApiError>((
            PromptInput::Text {
                text,
                special_tokens: false,
            },
            params,
        ))
    })();
    match parsed {
        Ok((prompt, params)) => submit(&state, Endpoint::Chat, prompt, params).await,
        Err(e) => e.into_response(),
    }
}

fn read_body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        ApiError::invalid(format!("cannot read the request body: {e}"), None)
            .with_status(e.status())
    })
}

fn check_model(state: &AppState, params: &Params) -> Result<(), ApiError> {
    if params.model == state.model_name {
        Ok(())
    } else {
        Err(ApiError::invalid(
            format!(
                "the model '{}' does not exist; this server serves '{}'",
                params.model, state.model_name
            ),
            Some("model"),
        )
        .with_status(StatusCode::NOT_FOUND)
        .with_code("model_not_found"))
    }
}

/// Queues the job and answers once the worker has taken it up (or refused it), so that a
/// refused prompt gets a 4xx even on a streaming request.
async fn submit(
    state: &AppState,
    endpoint: Endpoint,
    prompt: PromptInput,
    params: Params,
) -> Response {
    let (events, mut rx) = unbounded_channel();
    let stream = params.stream;
    let head = ResponseHead::new(
        endpoint,
        &state.model_name,
        state.serial.fetch_add(1, Ordering::SeqCst),
    );
    let job = Job {
        prompt,
        params,
        events,
        enqueued: Instant::now(),
    };
    state.counters.queued.fetch_add(1, Ordering::SeqCst);
    if let Err(refused) = state.queue.try_send(job) {
        state.counters.queued.fetch_sub(1, Ordering::SeqCst);
        return match refused {
            TrySendError::Full(_) => ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                message: format!(
                    "the queue is full ({} requests wait); retry later",
                    state.queue_depth
                ),
                kind: "rate_limit_error",
                param: None,
                code: Some("queue_full"),
            },
            TrySendError::Disconnected(_) => ApiError::server("the model thread has stopped")
                .with_status(StatusCode::SERVICE_UNAVAILABLE),
        }
        .into_response();
    }
    match rx.recv().await {
        Some(Event::Started) => {}
        Some(Event::Failed(e)) => return e.into_response(),
        Some(other) => {
            return ApiError::server(format!("the model thread answered {other:?} first"))
                .into_response()
        }
        None => return ApiError::server("the model thread dropped the request").into_response(),
    }
    if stream {
        stream_events(head, rx).into_response()
    } else {
        collect(head, rx).await
    }
}

/// Waits for the end of the generation and answers with one body.
async fn collect(head: ResponseHead, mut rx: UnboundedReceiver<Event>) -> Response {
    while let Some(event) = rx.recv().await {
        match event {
            Event::Started | Event::Text(_) => {}
            Event::Done {
                text,
                finish_reason,
                usage,
                stats,
            } => return Json(head.complete(&text, finish_reason, usage, stats)).into_response(),
            Event::Failed(e) => return e.into_response(),
        }
    }
    ApiError::server("the model thread dropped the request").into_response()
}

/// Streams the generation as server-sent events: `data: {chunk}` per released piece of text,
/// the final chunk (finish reason, usage, statistics), then `data: [DONE]`. Dropping the stream
/// (the client went away) drops the receiver, which the worker notices within one round.
fn stream_events(
    head: ResponseHead,
    rx: UnboundedReceiver<Event>,
) -> Sse<impl tokio_stream::Stream<Item = Result<SseEvent, Infallible>>> {
    let mut first = true;
    let events = UnboundedReceiverStream::new(rx)
        .map(move |event| {
            let data = match event {
                Event::Started => return None,
                Event::Text(text) => {
                    let chunk = head.chunk(&text, first);
                    first = false;
                    chunk
                }
                Event::Done {
                    finish_reason,
                    usage,
                    stats,
                    ..
                } => head.final_chunk(finish_reason, usage, stats),
                // Headers are sent: the error travels in the stream, as OpenAI's do.
                Event::Failed(e) => e.body(),
            };
            Some(data.to_string())
        })
        .filter_map(|data| data)
        .chain(tokio_stream::once("[DONE]".to_string()))
        .map(|data| Ok(SseEvent::default().data(data)));
    Sse::new(events).keep_alive(KeepAlive::default())
}
