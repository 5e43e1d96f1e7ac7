//! `specter-run serve` on the CPU backend with fixture bundles, over the loopback address: the
//! OpenAI wire format (whole and streamed), agreement with `generate`, chat prompts rendered as
//! transformers renders them, bad input answered with 4xx and an OpenAI-style body, concurrent
//! clients, clients that leave mid-stream, a full queue, and a clean exit on SIGTERM.

#[path = "../../specter-pack/tests/common/cli.rs"]
mod cli;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use specter_convert::pack::{convert, ConvertOptions, Silent};

const BIN: &str = env!("CARGO_BIN_EXE_specter-run");
/// Longest any single wait in these tests may take (a server that hangs fails, not blocks CI).
const PATIENCE: Duration = Duration::from_secs(60);

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name)
}

struct Converted {
    _dir: tempfile::TempDir,
    bundle: PathBuf,
}

fn convert_fixture(name: &str, drop_files: &[&str]) -> Converted {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir(&src).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap().to_str().unwrap().to_string();
        if !drop_files.contains(&file.as_str()) {
            std::fs::copy(&path, src.join(&file)).unwrap();
        }
    }
    let bundle = dir.path().join(format!("{name}.specter"));
    convert(&src, &bundle, &ConvertOptions::default(), &Silent).unwrap();
    Converted { _dir: dir, bundle }
}

/// The qwen2_moe fixture (ChatML template) converted once per test binary.
fn qwen() -> &'static Path {
    static ONCE: OnceLock<Converted> = OnceLock::new();
    &ONCE
        .get_or_init(|| convert_fixture("qwen2_moe", &[]))
        .bundle
}

/// A running server; stopped with SIGTERM when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    fn start(bundle: &Path, extra: &[&str]) -> Server {
        let mut child = Command::new(BIN)
            .arg("serve")
            .arg(bundle)
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the server starts");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        // Reads the address, then keeps draining stderr so the server never blocks on it.
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if !sent {
                    if let Some(rest) = line.split("listening on http://").nth(1) {
                        let addr = rest.split_whitespace().next().unwrap().to_string();
                        let _ = tx.send(Ok(addr));
                        sent = true;
                        continue;
                    }
                }
                if !sent {
                    let _ = tx.send(Err(line));
                }
            }
        });
        let deadline = Instant::now() + PATIENCE;
        let mut early = Vec::new();
        loop {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(Ok(addr)) => {
                    return Server {
                        child,
                        addr: addr.parse().unwrap(),
                    }
                }
                Ok(Err(line)) => early.push(line),
                Err(_) => {
                    let _ = child.kill();
                    panic!("the server did not start listening: {early:?}");
                }
            }
        }
    }

    fn terminate(&mut self) -> Option<i32> {
        // SAFETY: signalling our own child process by its id; it has not been waited for yet,
        // so the id still names it.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("the server did not exit after SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn post(&self, path: &str, body: &Value) -> Reply {
        request(self.addr, "POST", path, &body.to_string())
    }

    fn get(&self, path: &str) -> Reply {
        request(self.addr, "GET", path, "")
    }

    fn health(&self) -> Value {
        let reply = self.get("/health");
        assert_eq!(reply.status, 200, "{reply:?}");
        reply.json()
    }

    /// Waits until `/health` satisfies `done`.
    fn wait_for_health(&self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let health = self.health();
            if done(&health) {
                return health;
            }
            assert!(Instant::now() < deadline, "waited for {what}: {health}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            self.terminate();
        }
    }
}

#[derive(Debug)]
struct Reply {
    status: u16,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {self:?}"))
    }

    /// The `data:` payloads of a server-sent event stream.
    fn events(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .flat_map(|event| event.lines())
            .filter_map(|line| line.strip_prefix("data: ").or(line.strip_prefix("data:")))
            .map(str::to_string)
            .collect()
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect_timeout(&addr, PATIENCE).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    stream
}

fn send_request(stream: &mut TcpStream, addr: SocketAddr, method: &str, path: &str, body: &str) {
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    stream.flush().unwrap();
}

/// One HTTP/1.1 exchange on a fresh connection (a test client; the server side is hyper's).
fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> Reply {
    let mut stream = connect(addr);
    send_request(&mut stream, addr, method, path, body);
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    parse_reply(&raw)
}

fn parse_reply(raw: &[u8]) -> Reply {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a header block");
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut body = raw[split + 4..].to_vec();
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    Reply {
        status,
        body: String::from_utf8(body).unwrap(),
    }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = data.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size_text = String::from_utf8_lossy(&data[..eol]).to_string();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
        if size == 0 || data.len() < eol + 2 + size {
            return out;
        }
        out.extend_from_slice(&data[eol + 2..eol + 2 + size]);
        data = &data[(eol + 4 + size).min(data.len())..];
    }
}

fn tokens_of(response: &Value) -> Vec<u32> {
    response["specter"]["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("no specter.tokens in {response}"))
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// The text and final chunk of a streamed completion.
fn streamed(reply: &Reply, chat: bool) -> (String, Value) {
    assert_eq!(reply.status, 200, "{reply:?}");
    let events = reply.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{reply:?}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .map(|c| {
            let choice = &c["choices"][0];
            let piece = if chat {
                &choice["delta"]["content"]
            } else {
                &choice["text"]
            };
            piece.as_str().unwrap_or("").to_string()
        })
        .collect();
    let last = chunks.last().expect("at least the final chunk").clone();
    assert!(last["choices"][0]["finish_reason"].is_string(), "{last}");
    (text, last)
}

fn completion(prompt: Value, max_tokens: i64) -> Value {
    json!({"model": "qwen2_moe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

#[test]
fn greedy_completions_equal_generate_and_streaming_equals_the_whole() {
    let server = Server::start(qwen(), &[]);
    let models = server.get("/v1/models").json();
    assert_eq!(models["data"][0]["id"], "qwen2_moe", "{models}");

    let prompt = "The quick brown fox";
    let whole = server.post("/v1/completions", &completion(json!(prompt), 10));
    assert_eq!(whole.status, 200, "{whole:?}");
    let whole = whole.json();
    let generate = cli::run(
        BIN,
        &[
            "generate",
            qwen().to_str().unwrap(),
            "--prompt",
            prompt,
            "--max-new-tokens",
            "10",
            "--json",
        ],
    );
    assert!(generate.ok(), "{generate:?}");
    let generate: Value = serde_json::from_str(&generate.stdout).unwrap();
    assert_eq!(whole["choices"][0]["text"], generate["text"], "{whole}");
    assert_eq!(
        tokens_of(&whole),
        generate["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect::<Vec<_>>()
    );
    let usage = &whole["usage"];
    assert_eq!(
        usage["prompt_tokens"],
        json!(generate["prompt_tokens"].as_array().unwrap().len())
    );
    assert_eq!(usage["completion_tokens"], json!(tokens_of(&whole).len()));
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );
    let finish = whole["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(finish == "length" || finish == "stop", "{whole}");
    assert!(whole["specter"]["acceptance_rate"].is_number(), "{whole}");

    let mut body = completion(json!(prompt), 10);
    body["stream"] = json!(true);
    let (text, last) = streamed(&server.post("/v1/completions", &body), false);
    assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap());
    assert_eq!(
        last["choices"][0]["finish_reason"],
        whole["choices"][0]["finish_reason"]
    );
    assert_eq!(last["usage"], whole["usage"]);

    // Token ids in, the same tokens as generate --prompt-ids out.
    let ids = [1u32, 40, 41, 42, 43, 44];
    let by_ids = server
        .post("/v1/completions", &completion(json!(ids), 8))
        .json();
    let generate = cli::run(
        BIN,
        &[
            "generate",
            qwen().to_str().unwrap(),
            "--prompt-ids",
            "1,40,41,42,43,44",
            "--max-new-tokens",
            "8",
            "--json",
        ],
    );
    let generate: Value = serde_json::from_str(&generate.stdout).unwrap();
    assert_eq!(json!(tokens_of(&by_ids)), generate["tokens"]);
}

#[test]
fn stop_strings_and_seeds_are_honoured() {
    let server = Server::start(qwen(), &[]);
    let base = server
        .post("/v1/completions", &completion(json!("Once upon"), 16))
        .json();
    let text = base["choices"][0]["text"].as_str().unwrap().to_string();
    // A stop string taken from the middle of the greedy text cuts it there.
    let chars: Vec<char> = text.chars().collect();
    if chars.len() >= 4 {
        let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
        let cut = &text[..text.find(&stop).unwrap()];
        let mut body = completion(json!("Once upon"), 16);
        body["stop"] = json!([stop]);
        let stopped = server.post("/v1/completions", &body).json();
        assert_eq!(stopped["choices"][0]["text"], json!(cut), "{stopped}");
        assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
        body["stream"] = json!(true);
        let (streamed_text, _) = streamed(&server.post("/v1/completions", &body), false);
        assert_eq!(streamed_text, cut);
    }
    // Sampling: the same seed gives the same text.
    let sampled = |seed: u64| {
        let body = json!({"model": "qwen2_moe", "prompt": "Once upon", "max_tokens": 12,
                          "temperature": 0.9, "top_p": 0.95, "seed": seed});
        tokens_of(&server.post("/v1/completions", &body).json())
    };
    assert_eq!(sampled(7), sampled(7));
}

/// The rendering transformers' apply_chat_template(..., add_generation_prompt=True) made.
fn chat_goldens(fixture_name: &str) -> Vec<(Value, String)> {
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("chat_golden.json")).unwrap())
            .unwrap();
    golden["fixtures"][fixture_name]
        .as_array()
        .unwrap()
        .iter()
        .map(|case| {
            (
                case["messages"].clone(),
                case["rendered"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// A chat request decodes exactly the tokens of transformers' rendering of its messages (the
/// same greedy output as a completion from those tokens), whole and streamed.
fn check_chat_against_goldens(bundle: &Path, fixture_name: &str) {
    let server = Server::start(bundle, &[]);
    let tokenizer =
        tokenizers::Tokenizer::from_file(fixture(fixture_name).join("tokenizer.json")).unwrap();
    for (messages, rendered) in chat_goldens(fixture_name) {
        let ids = tokenizer
            .encode(rendered.as_str(), false)
            .unwrap()
            .get_ids()
            .to_vec();
        let body =
            json!({"model": fixture_name, "messages": messages, "max_tokens": 6, "temperature": 0});
        let chat = server.post("/v1/chat/completions", &body);
        assert_eq!(chat.status, 200, "{chat:?}");
        let chat = chat.json();
        assert_eq!(chat["object"], "chat.completion");
        assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
        assert_eq!(
            chat["usage"]["prompt_tokens"],
            json!(ids.len()),
            "{fixture_name}: {rendered:?}"
        );
        let reference = server
            .post(
                "/v1/completions",
                &json!({"model": fixture_name, "prompt": ids, "max_tokens": 6, "temperature": 0}),
            )
            .json();
        assert_eq!(
            tokens_of(&chat),
            tokens_of(&reference),
            "{fixture_name}: {rendered:?}"
        );
        let mut body = body;
        body["stream"] = json!(true);
        let (text, _) = streamed(&server.post("/v1/chat/completions", &body), true);
        assert_eq!(json!(text), chat["choices"][0]["message"]["content"]);
    }
}

#[test]
fn chat_prompts_are_rendered_as_transformers_renders_them() {
    check_chat_against_goldens(qwen(), "qwen2_moe");
    let deepseek = convert_fixture("deepseek_v2", &[]);
    check_chat_against_goldens(&deepseek.bundle, "deepseek_v2");
}

#[test]
fn generation_config_end_tokens_end_the_answer() {
    let prompt = json!([1, 11, 12, 13, 14]);
    let greedy = {
        let server = Server::start(qwen(), &[]);
        tokens_of(
            &server
                .post("/v1/completions", &completion(prompt.clone(), 12))
                .json(),
        )
    };
    // The first token that did not occur before it (so the answer ends exactly there).
    let end = (2..greedy.len())
        .find(|&i| !greedy[..i].contains(&greedy[i]))
        .expect("a fresh token in the greedy output");
    let converted = {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir(&src).unwrap();
        for entry in std::fs::read_dir(fixture("qwen2_moe")).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, src.join(path.file_name().unwrap())).unwrap();
        }
        let config = json!({"bos_token_id": 1, "eos_token_id": [2, greedy[end]]});
        std::fs::write(src.join("generation_config.json"), config.to_string()).unwrap();
        let bundle = dir.path().join("qwen2_moe.specter");
        convert(&src, &bundle, &ConvertOptions::default(), &Silent).unwrap();
        Converted { _dir: dir, bundle }
    };
    let server = Server::start(&converted.bundle, &[]);
    let ended = server
        .post("/v1/completions", &completion(prompt.clone(), 12))
        .json();
    assert_eq!(tokens_of(&ended), greedy[..=end], "{ended}");
    assert_eq!(ended["choices"][0]["finish_reason"], "stop", "{ended}");
    assert_eq!(ended["usage"]["completion_tokens"], json!(end + 1));
    // The text is the answer before the end token, streamed or not.
    let before = server
        .post("/v1/completions", &completion(prompt.clone(), end as i64))
        .json();
    assert_eq!(ended["choices"][0]["text"], before["choices"][0]["text"]);
    let mut body = completion(prompt, 12);
    body["stream"] = json!(true);
    let (text, _) = streamed(&server.post("/v1/completions", &body), false);
    assert_eq!(json!(text), before["choices"][0]["text"]);
}

#[test]
fn a_bundle_without_a_chat_template_refuses_chat_and_still_completes() {
    let bare = convert_fixture("qwen2_moe", &["tokenizer_config.json"]);
    let server = Server::start(&bare.bundle, &["--model-name", "bare"]);
    let chat = server.post(
        "/v1/chat/completions",
        &json!({"model": "bare", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(chat.status, 400, "{chat:?}");
    let message = chat.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.contains("no chat template") && message.contains("tokenizer_config.json"),
        "{message}"
    );
    let done = server.post(
        "/v1/completions",
        &json!({"model": "bare", "prompt": "hi", "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(done.status, 200, "{done:?}");
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let server = Server::start(qwen(), &[]);
    let raw = |method: &str, path: &str, body: &str| request(server.addr, method, path, body);
    let cases: Vec<(&str, Reply, u16)> = vec![
        (
            "malformed JSON",
            raw(
                "POST",
                "/v1/completions",
                "{\"model\": \"qwen2_moe\", \"prompt\": ",
            ),
            400,
        ),
        (
            "not an object",
            raw("POST", "/v1/completions", "[1, 2]"),
            400,
        ),
        (
            "missing prompt",
            server.post("/v1/completions", &json!({"model": "qwen2_moe"})),
            400,
        ),
        (
            "missing model",
            server.post("/v1/completions", &json!({"prompt": "hi"})),
            400,
        ),
        (
            "wrong-typed max_tokens",
            server.post(
                "/v1/completions",
                &json!({"model": "qwen2_moe", "prompt": "hi", "max_tokens": "5"}),
            ),
            400,
        ),
        (
            "wrong-typed prompt",
            server.post(
                "/v1/completions",
                &json!({"model": "qwen2_moe", "prompt": {"text": "hi"}}),
            ),
            400,
        ),
        (
            "missing messages",
            server.post("/v1/chat/completions", &json!({"model": "qwen2_moe"})),
            400,
        ),
        (
            "unknown model",
            server.post(
                "/v1/completions",
                &json!({"model": "gpt-4", "prompt": "hi"}),
            ),
            404,
        ),
        (
            "max_tokens 0",
            server.post("/v1/completions", &completion(json!("hi"), 0)),
            400,
        ),
        (
            "max_tokens negative",
            server.post("/v1/completions", &completion(json!("hi"), -4)),
            400,
        ),
        (
            "prompt plus max_tokens past the context",
            server.post("/v1/completions", &completion(json!("hi"), 100_000)),
            400,
        ),
        (
            "prompt longer than the context",
            server.post("/v1/completions", &completion(json!(vec![5u32; 5000]), 1)),
            400,
        ),
        (
            "token outside the vocabulary",
            server.post("/v1/completions", &completion(json!([1, 99_999]), 2)),
            400,
        ),
        (
            "streaming past the context",
            server.post("/v1/completions", &{
                let mut b = completion(json!("hi"), 100_000);
                b["stream"] = json!(true);
                b
            }),
            400,
        ),
        ("unknown endpoint", server.get("/v1/engines"), 404),
        ("wrong method", server.get("/v1/completions"), 405),
    ];
    for (what, reply, status) in cases {
        assert_eq!(reply.status, status, "{what}: {reply:?}");
        let body = reply.json();
        let error = &body["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{what}: {body}"
        );
        assert!(error["type"].is_string(), "{what}: {body}");
    }
    let context = server
        .post("/v1/completions", &completion(json!("hi"), 100_000))
        .json();
    assert_eq!(
        context["error"]["code"], "context_length_exceeded",
        "{context}"
    );
    let health = server.health();
    assert_eq!(health["status"], "ok");
    let ok = server.post("/v1/completions", &completion(json!("hi"), 4));
    assert_eq!(ok.status, 200, "{ok:?}");
}

#[test]
fn eight_concurrent_clients_get_complete_answers() {
    let server = Server::start(qwen(), &[]);
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|i| vec![1, 30 + i, 60 + 2 * i, 90 + 3 * i])
        .collect();
    let expected: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            tokens_of(
                &server
                    .post("/v1/completions", &completion(json!(p), 8))
                    .json(),
            )
        })
        .collect();
    let addr = server.addr;
    let handles: Vec<_> = prompts
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, p)| {
            std::thread::spawn(move || {
                let mut body = completion(json!(p), 8);
                // Half stream, half wait for the whole answer.
                body["stream"] = json!(i % 2 == 0);
                let reply = request(addr, "POST", "/v1/completions", &body.to_string());
                if i % 2 == 0 {
                    let (_, last) = streamed(&reply, false);
                    tokens_of(&last)
                } else {
                    assert_eq!(reply.status, 200, "{reply:?}");
                    tokens_of(&reply.json())
                }
            })
        })
        .collect();
    for (i, handle) in handles.into_iter().enumerate() {
        assert_eq!(handle.join().unwrap(), expected[i], "client {i}");
    }
    let health = server.health();
    assert_eq!(health["completed"], json!(16), "{health}");
    assert_eq!(health["failed"], json!(0), "{health}");
}

/// Starts a long streamed generation and returns the open connection once its first chunk came.
fn start_long_stream(server: &Server) -> TcpStream {
    let mut body = completion(json!([1, 20, 21, 22]), 4000);
    body["stream"] = json!(true);
    body["ignore_eos"] = json!(true);
    let mut stream = connect(server.addr);
    send_request(
        &mut stream,
        server.addr,
        "POST",
        "/v1/completions",
        &body.to_string(),
    );
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    let deadline = Instant::now() + PATIENCE;
    while !line.contains("data:") {
        assert!(Instant::now() < deadline, "no chunk arrived");
        line.clear();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "the stream ended early"
        );
    }
    stream
}

#[test]
fn a_client_that_leaves_mid_stream_cancels_its_generation_only() {
    let server = Server::start(qwen(), &[]);
    let expected = tokens_of(
        &server
            .post("/v1/completions", &completion(json!([1, 7, 8, 9]), 8))
            .json(),
    );
    let stream = start_long_stream(&server);
    drop(stream);
    let health = server.wait_for_health("the cancellation", |h| {
        h["cancelled"] == json!(1) && h["busy"] == json!(false)
    });
    assert_eq!(health["completed"], json!(1), "{health}");
    // Stopped within a few rounds of the disconnect, far from the 4000 tokens it asked for.
    let generated = health["generated_tokens"].as_u64().unwrap();
    assert!(generated < 8 + 1000, "{health}");
    let after = server.post("/v1/completions", &completion(json!([1, 7, 8, 9]), 8));
    assert_eq!(after.status, 200, "{after:?}");
    assert_eq!(tokens_of(&after.json()), expected);
}

#[test]
fn a_full_queue_answers_429_and_recovers() {
    let server = Server::start(qwen(), &["--queue-depth", "1"]);
    let running = start_long_stream(&server);
    // One request waits in the queue ...
    let addr = server.addr;
    let waiting = std::thread::spawn(move || {
        request(
            addr,
            "POST",
            "/v1/completions",
            &completion(json!([1, 5, 6]), 4).to_string(),
        )
    });
    server.wait_for_health("a queued request", |h| h["queued"] == json!(1));
    // ... so the next one is refused.
    let refused = server.post("/v1/completions", &completion(json!([1, 5, 6]), 4));
    assert_eq!(refused.status, 429, "{refused:?}");
    assert_eq!(refused.json()["error"]["code"], "queue_full");
    drop(running);
    let waited = waiting.join().unwrap();
    assert_eq!(waited.status, 200, "{waited:?}");
}

#[test]
fn sigterm_ends_a_running_stream_and_exits_zero() {
    let mut server = Server::start(qwen(), &[]);
    let stream = start_long_stream(&server);
    let mut reader = BufReader::new(stream);
    assert_eq!(server.terminate(), Some(0));
    // The stream was ended, not left hanging: it finishes with [DONE].
    let mut rest = String::new();
    reader.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("[DONE]"), "{rest}");
    // Ended at a round boundary soon after the signal, not after all 4000 tokens.
    let completion_tokens: u64 = rest
        .split("\"completion_tokens\":")
        .nth(1)
        .and_then(|tail| tail.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no usage in the final chunk: {rest}"));
    assert!(completion_tokens < 1000, "{completion_tokens}");
}

#[test]
fn the_openai_python_client_works_against_the_server() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve_openai.py");
    let requirements = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/requirements-serve.txt");
    let probe = Command::new("python3")
        .args(["-c", "import openai"])
        .output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        let how = format!(
            "the openai Python package is missing: python3 -m pip install -r {}",
            requirements.display()
        );
        if std::env::var_os("CI").is_some() {
            panic!("{how}");
        }
        eprintln!("skipped: {how}");
        return;
    }
    let server = Server::start(qwen(), &[]);
    let out = Command::new("python3")
        .arg(&script)
        .arg(format!("http://{}/v1", server.addr))
        .arg("qwen2_moe")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
