//! The OpenAI wire format: request bodies parsed into what the worker needs (with errors that
//! name the field), response bodies and stream chunks, and the error body every 4xx/5xx carries.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Map, Value};

/// OpenAI allows at most this many stop strings.
pub const MAX_STOP_STRINGS: usize = 4;
/// `max_tokens` of a completion request that gives none (OpenAI's default).
pub const DEFAULT_COMPLETION_TOKENS: usize = 16;
/// Most tokens a chat request without a limit generates (the rest of the context, up to this:
/// the KV cache is sized for the whole request up front).
pub const DEFAULT_CHAT_TOKENS_CAP: usize = 4096;

/// An error answered with an OpenAI-style body: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 about the request (`param` names the offending field, when one does).
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    pub fn server(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// The prompt of a request, before tokenization.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptInput {
    /// Text tokenized with the bundle's tokenizer; `special_tokens` adds what its post-processor
    /// adds (BOS): yes for completions, no for a rendered chat template (which writes its own).
    Text { text: String, special_tokens: bool },
    /// Token ids as given.
    Ids(Vec<u32>),
}

/// Decoding parameters common to both endpoints, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    pub model: String,
    /// `None`: as many as the context leaves, up to [`DEFAULT_CHAT_TOKENS_CAP`] (chat requests
    /// without a limit).
    pub max_tokens: Option<usize>,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: u64,
    pub stop: Vec<String>,
    pub stream: bool,
    /// Keep generating past end-of-sequence tokens (an extension vLLM also offers; for load
    /// tests that need a fixed length).
    pub ignore_eos: bool,
}

/// A chat message as the template sees it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// Parses a body as a JSON object.
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}"), None))?;
    match value {
        Value::Object(map) => Ok(map),
        other => Err(ApiError::invalid(
            format!(
                "the request body must be a JSON object, not {}",
                type_name(&other)
            ),
            None,
        )),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Field `name` deserialized as `T` (absent or null: `None`); a wrong type names the field.
fn field<T: for<'de> Deserialize<'de>>(
    body: &Map<String, Value>,
    name: &'static str,
    expected: &str,
) -> Result<Option<T>, ApiError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v.clone()).map(Some).map_err(|_| {
            ApiError::invalid(
                format!("'{name}' must be {expected}, not {}", type_name(v)),
                Some(name),
            )
        }),
    }
}

/// The parameters both endpoints share. `default_max_tokens` applies when the body gives none.
pub fn parse_params(
    body: &Map<String, Value>,
    max_token_fields: &[&'static str],
    default_max_tokens: Option<usize>,
) -> Result<Params, ApiError> {
    let model: String = field(body, "model", "a string")?.ok_or_else(|| {
        ApiError::invalid(
            "'model' is required (GET /v1/models lists it)",
            Some("model"),
        )
    })?;
    let mut max_tokens = default_max_tokens;
    for &name in max_token_fields {
        if let Some(n) = field::<i64>(body, name, "an integer")? {
            if n < 1 {
                return Err(ApiError::invalid(
                    format!("'{name}' must be at least 1, not {n}"),
                    Some(name),
                ));
            }
            max_tokens = Some(n as usize);
        }
    }
    let temperature = field::<f32>(body, "temperature", "a number")?.unwrap_or(1.0);
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(ApiError::invalid(
            format!("'temperature' must be a number >= 0, not {temperature}"),
            Some("temperature"),
        ));
    }
    let top_p = field::<f32>(body, "top_p", "a number")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            format!("'top_p' must be in (0, 1], not {top_p}"),
            Some("top_p"),
        ));
    }
    // Without a seed, each request samples differently, as OpenAI's do.
    let seed = match field::<i64>(body, "seed", "an integer")? {
        Some(s) => s as u64,
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    };
    let stop = match body.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| match item {
                Value::String(s) => Ok(s.clone()),
                other => Err(ApiError::invalid(
                    format!("'stop' must hold strings, not {}", type_name(other)),
                    Some("stop"),
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(ApiError::invalid(
                format!(
                    "'stop' must be a string or an array of strings, not {}",
                    type_name(other)
                ),
                Some("stop"),
            ))
        }
    };
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            format!(
                "'stop' holds {} strings; at most {MAX_STOP_STRINGS} are allowed",
                stop.len()
            ),
            Some("stop"),
        ));
    }
    if stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::invalid(
            "'stop' strings must not be empty",
            Some("stop"),
        ));
    }
    if let Some(n) = field::<i64>(body, "n", "an integer")? {
        if n != 1 {
            return Err(ApiError::invalid(
                format!("'n' must be 1 (this server generates one choice per request), not {n}"),
                Some("n"),
            ));
        }
    }
    let stream = field::<bool>(body, "stream", "a boolean")?.unwrap_or(false);
    let ignore_eos = field::<bool>(body, "ignore_eos", "a boolean")?.unwrap_or(false);
    Ok(Params {
        ignore_eos,
        model,
        max_tokens,
        temperature,
        top_p,
        seed,
        stop,
        stream,
    })
}

/// The `prompt` of a completion request: text, or an array of token ids (one prompt only: this
/// server generates one sequence at a time).
pub fn parse_prompt(body: &Map<String, Value>) -> Result<PromptInput, ApiError> {
    let wrong = |what: &str| {
        ApiError::invalid(
            format!("'prompt' must be a string or an array of token ids, not {what}"),
            Some("prompt"),
        )
    };
    match body.get("prompt") {
        None | Some(Value::Null) => Err(ApiError::invalid("'prompt' is required", Some("prompt"))),
        Some(Value::String(text)) => Ok(PromptInput::Text {
            text: text.clone(),
            special_tokens: true,
        }),
        Some(Value::Array(items)) => {
            // A one-element batch is the same request as its element.
            if let [Value::String(text)] = items.as_slice() {
                return Ok(PromptInput::Text {
                    text: text.clone(),
                    special_tokens: true,
                });
            }
            if let [Value::Array(inner)] = items.as_slice() {
                return token_ids(inner)
                    .map(PromptInput::Ids)
                    .ok_or_else(|| wrong("an array holding something other than token ids"));
            }
            if items.iter().all(|v| v.is_string() || v.is_array()) && items.len() > 1 {
                return Err(ApiError::invalid(
                    format!(
                        "'prompt' holds {} prompts; this server takes one per request",
                        items.len()
                    ),
                    Some("prompt"),
                ));
            }
            token_ids(items)
                .map(PromptInput::Ids)
                .ok_or_else(|| wrong("an array holding something other than token ids"))
        }
        Some(other) => Err(wrong(type_name(other))),
    }
}

fn token_ids(items: &[Value]) -> Option<Vec<u32>> {
    items
        .iter()
        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

/// The `messages` of a chat request. Content may be a string or an array of text parts.
pub fn parse_messages(body: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match body.get("messages") {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                "'messages' is required",
                Some("messages"),
            ))
        }
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(ApiError::invalid(
                format!("'messages' must be an array, not {}", type_name(other)),
                Some("messages"),
            ))
        }
    };
    if items.is_empty() {
        return Err(ApiError::invalid(
            "'messages' must hold at least one message",
            Some("messages"),
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let bad = |what: String| ApiError::invalid(format!("messages[{i}]: {what}"), Some("messages"));
            let Value::Object(m) = item else {
                return Err(bad(format!("must be an object, not {}", type_name(item))));
            };
            let role = match m.get("role") {
                Some(Value::String(r)) => r.clone(),
                Some(other) => return Err(bad(format!("'role' must be a string, not {}", type_name(other)))),
                None => return Err(bad("'role' is required".into())),
            };
            let content = match m.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for part in parts {
                        match (part.get("type").and_then(Value::as_str), part.get("text")) {
                            (Some("text"), Some(Value::String(t))) => text.push_str(t),
                            _ => {
                                return Err(bad(
                                    "content parts must be {\"type\": \"text\", \"text\": ...} (this model reads text only)".into(),
                                ))
                            }
                        }
                    }
                    text
                }
                Some(other) => {
                    return Err(bad(format!(
                        "'content' must be a string or an array of text parts, not {}",
                        type_name(other)
                    )))
                }
            };
            let name = m.get("name").and_then(Value::as_str).map(str::to_string);
            Ok(ChatMessage { role, content, name })
        })
        .collect()
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

impl Usage {
    pub fn to_json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        })
    }
}

/// Which endpoint a response is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// What identifies one response across its chunks.
#[derive(Clone, Debug)]
pub struct ResponseHead {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
}

impl ResponseHead {
    pub fn new(endpoint: Endpoint, model: &str, serial: u64) -> Self {
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let prefix = match endpoint {
            Endpoint::Completions => "cmpl",
            Endpoint::Chat => "chatcmpl",
        };
        ResponseHead {
            id: format!("{prefix}-{created:x}{serial:08x}"),
            created,
            model: model.to_string(),
            endpoint,
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    /// The whole response of a non-streaming request.
    pub fn complete(&self, text: &str, finish: &str, usage: Usage, stats: Value) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completions => json!({
                "index": 0, "text": text, "logprobs": null, "finish_reason": finish,
            }),
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": finish,
            }),
        };
        json!({
            "id": self.id, "object": self.object(false), "created": self.created,
            "model": self.model, "choices": [choice], "usage": usage.to_json(),
            "specter": stats,
        })
    }

    /// A stream chunk carrying `text` (and, in the chat stream's first chunk, the role).
    pub fn chunk(&self, text: &str, first: bool) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completions => json!({
                "index": 0, "text": text, "logprobs": null, "finish_reason": null,
            }),
            Endpoint::Chat if first => json!({
                "index": 0, "delta": {"role": "assistant", "content": text},
                "logprobs": null, "finish_reason": null,
            }),
            Endpoint::Chat => json!({
                "index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": null,
            }),
        };
        self.wrap_chunk(choice)
    }

    /// The stream's last chunk: the finish reason, the usage and our statistics.
    pub fn final_chunk(&self, finish: &str, usage: Usage, stats: Value) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completions => json!({
                "index": 0, "text": "", "logprobs": null, "finish_reason": finish,
            }),
            Endpoint::Chat => json!({
                "index": 0, "delta": {}, "logprobs": null, "finish_reason": finish,
            }),
        };
        let mut chunk = self.wrap_chunk(choice);
        chunk["usage"] = usage.to_json();
        chunk["specter"] = stats;
        chunk
    }

    fn wrap_chunk(&self, choice: Value) -> Value {
        json!({
            "id": self.id, "object": self.object(true), "created": self.created,
            "model": self.model, "choices": [choice],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(text: &str) -> Map<String, Value> {
        parse_object(text.as_bytes()).unwrap()
    }

    #[test]
    fn prompts_are_text_or_one_array_of_ids() {
        assert_eq!(
            parse_prompt(&body(r#"{"prompt": [1, 2, 3]}"#)).unwrap(),
            PromptInput::Ids(vec![1, 2, 3])
        );
        assert_eq!(
            parse_prompt(&body(r#"{"prompt": [[4, 5]]}"#)).unwrap(),
            PromptInput::Ids(vec![4, 5])
        );
        assert!(matches!(
            parse_prompt(&body(r#"{"prompt": "hi"}"#)).unwrap(),
            PromptInput::Text {
                special_tokens: true,
                ..
            }
        ));
        for bad in [
            r#"{"prompt": 3}"#,
            r#"{"prompt": [1, -2]}"#,
            r#"{"prompt": ["a", "b"]}"#,
            r#"{"prompt": [1.5]}"#,
            r#"{}"#,
        ] {
            let err = parse_prompt(&body(bad)).unwrap_err();
            assert_eq!(err.param, Some("prompt"), "{bad}: {}", err.message);
        }
    }

    #[test]
    fn parameters_are_checked_and_name_the_field() {
        let ok = parse_params(
            &body(r#"{"model": "m", "max_tokens": 5, "temperature": 0, "stop": "x", "seed": 7}"#),
            &["max_tokens"],
            Some(16),
        )
        .unwrap();
        assert_eq!(ok.max_tokens, Some(5));
        assert_eq!(ok.temperature, 0.0);
        assert_eq!(ok.stop, vec!["x".to_string()]);
        assert_eq!(ok.seed, 7);
        let cases = [
            (r#"{"max_tokens": 5}"#, "model"),
            (r#"{"model": 1}"#, "model"),
            (r#"{"model": "m", "max_tokens": 0}"#, "max_tokens"),
            (r#"{"model": "m", "max_tokens": -3}"#, "max_tokens"),
            (r#"{"model": "m", "max_tokens": "8"}"#, "max_tokens"),
            (r#"{"model": "m", "temperature": -1}"#, "temperature"),
            (r#"{"model": "m", "top_p": 0}"#, "top_p"),
            (
                r#"{"model": "m", "stop": ["a", "b", "c", "d", "e"]}"#,
                "stop",
            ),
            (r#"{"model": "m", "stop": [1]}"#, "stop"),
            (r#"{"model": "m", "n": 2}"#, "n"),
            (r#"{"model": "m", "stream": "yes"}"#, "stream"),
        ];
        for (text, param) in cases {
            let err = parse_params(&body(text), &["max_tokens"], Some(16)).unwrap_err();
            assert_eq!(err.param, Some(param), "{text}: {}", err.message);
            assert_eq!(err.status, StatusCode::BAD_REQUEST);
        }
    }

    #[test]
    fn messages_take_strings_or_text_parts() {
        let m = parse_messages(&body(
            r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}"#,
        ))
        .unwrap();
        assert_eq!(m[0].content, "ab");
        for bad in [
            r#"{"messages": []}"#,
            r#"{"messages": "hi"}"#,
            r#"{"messages": [{"content": "x"}]}"#,
            r#"{"messages": [{"role": "user", "content": 5}]}"#,
        ] {
            assert!(parse_messages(&body(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn malformed_bodies_are_refused() {
        assert!(parse_object(b"{not json").is_err());
        assert!(parse_object(b"[1, 2]").is_err());
    }
}
