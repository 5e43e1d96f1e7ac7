//! `specter-run serve`: an OpenAI-compatible HTTP server for one bundle.
//!
//! One model in memory, one generation at a time on the thread that owns it ([`worker`]);
//! requests wait in a bounded FIFO queue (429 when it is full). Completions and chat completions
//! ([`routes`], [`wire`]), chat messages rendered with the checkpoint's own template ([`chat`]),
//! streaming as server-sent events with stop strings ([`text`]), and generations stopped at the
//! next committed token when their client leaves or the server shuts down ([`worker`]).

mod chat;
mod routes;
mod text;
mod wire;
mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use specter::backend::cuda::HostPath;
use specter::decode::{self, Mode};
use specter::session::{BackendKind, SessionOptions};

use crate::args::{
    cuda_options_from_env, resolve_backend, slot_policy, BackendArg, HybridArgs, ModeArg,
    PolicyArg, VerifyArg,
};

use chat::ChatTemplate;
use routes::AppState;
use worker::{Counters, DecodeConfig};

#[derive(clap::Args)]
pub struct ServeArgs {
    /// The bundle written by `specter-pack convert`.
    bundle: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the address is printed once listening).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// The model id clients name in requests (default: the bundle's file stem).
    #[arg(long)]
    model_name: Option<String>,
    /// Requests that may wait for the model; more are answered 429.
    #[arg(long, default_value_t = 64)]
    queue_depth: usize,
    /// specter: the INT4 draft proposes, the FP16 target verifies (output equals target's);
    /// target: the FP16 model alone; draft: the INT4 draft alone (not lossless); specmoeoff: the
    /// SpecMoEOff-style baseline.
    #[arg(long, value_enum, default_value_t = ModeArg::Specter)]
    mode: ModeArg,
    /// Draft tokens per verify pass (with --auto-depth, the most it may use). Default: 8, or 3
    /// with --mode specmoeoff.
    #[arg(long)]
    depth: Option<usize>,
    /// Choose each round's depth from measured cost per committed token (Specter mode).
    #[arg(long)]
    auto_depth: bool,
    /// auto (the GPU when one is usable, else the CPU; says which on stderr), cpu or cuda.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// Routed experts kept resident per MoE layer; the rest are copied in when needed (CUDA:
    /// real copies into VRAM slots under --policy; CPU: simulated at --bandwidth-gbps).
    #[arg(long)]
    resident_experts: Option<usize>,
    /// CUDA: how expert slots are reused.
    #[arg(long, value_enum, default_value_t = PolicyArg::Lru)]
    policy: PolicyArg,
    /// CUDA: copy offloaded experts through pinned staging buffers.
    #[arg(long)]
    pinned_staging: bool,
    /// Host-to-device bandwidth the CPU simulation assumes (GB/s); on CUDA, the first estimate
    /// the prefetch schedule uses.
    #[arg(long, default_value_t = 55.0)]
    bandwidth_gbps: f64,
    /// How much of the bundle to check before serving: full, manifest or none.
    #[arg(long, value_enum, default_value_t = VerifyArg::Manifest)]
    verify: VerifyArg,
    #[command(flatten)]
    hybrid: HybridArgs,
}

/// Loads the bundle, listens, and serves until SIGINT or SIGTERM.
pub fn serve(args: ServeArgs) -> Result<()> {
    let mode = Mode::from(args.mode);
    let mut cuda = cuda_options_from_env()?;
    args.hybrid.apply(&mut cuda)?;
    if args.auto_depth && mode != Mode::Specter {
        bail!("--auto-depth needs --mode specter");
    }
    let depth = args.depth.unwrap_or(if mode == Mode::SpecMoeOff {
        decode::SPECMOEOFF_DEPTH
    } else {
        8
    });
    if depth == 0 {
        bail!("--depth must be at least 1");
    }
    if args.queue_depth == 0 {
        bail!("--queue-depth must be at least 1");
    }
    if !(args.bandwidth_gbps.is_finite() && args.bandwidth_gbps > 0.0) {
        bail!("--bandwidth-gbps must be a positive number");
    }
    let model_name = match &args.model_name {
        Some(name) if name.is_empty() => bail!("--model-name must not be empty"),
        Some(name) => name.clone(),
        None => args
            .bundle
            .file_stem()
            .and_then(|s| s.to_str())
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .with_context(|| {
                format!(
                    "{} has no file stem to name the model by: pass --model-name",
                    args.bundle.display()
                )
            })?,
    };
    let backend = resolve_backend(args.backend);
    let mut session_opts = SessionOptions::new(backend);
    session_opts.cuda = cuda;
    session_opts.with_draft = mode != Mode::Target;
    session_opts.verify = args.verify.into();
    let mut simulated_experts = None;
    match backend {
        BackendKind::Cuda => {
            session_opts.offload = args.resident_experts.map(|n| (n, slot_policy(args.policy)));
            if args.pinned_staging {
                session_opts.cuda.host_path = HostPath::PinnedStaging;
            }
        }
        BackendKind::Cpu => {
            if args.pinned_staging {
                bail!("--pinned-staging needs --backend cuda");
            }
            simulated_experts = args.resident_experts;
            for line in specter::generate::cpu_backend_notes(&session_opts.cuda) {
                eprintln!("{line}");
            }
        }
    }
    let decode = DecodeConfig {
        mode,
        depth,
        auto_depth: args.auto_depth,
        simulated_experts,
        bandwidth_gbps: args.bandwidth_gbps,
    };

    let shutdown = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(Counters::default());
    let worker = worker::spawn(
        args.bundle.clone(),
        session_opts,
        decode,
        args.queue_depth,
        shutdown.clone(),
        counters.clone(),
    )?;
    let template = ChatTemplate::from_files(
        worker.meta.tokenizer_config.as_deref(),
        worker.meta.chat_template_file.as_deref(),
    );
    let (chat_template, chat_unavailable) = match template {
        Ok(Some(t)) => (Some(t), String::new()),
        Ok(None) => (
            None,
            format!(
                "{} holds no chat template: convert the checkpoint again with specter-pack \
                 convert from a directory holding its tokenizer_config.json (with a \
                 chat_template) or chat_template.jinja, or use /v1/completions with a prompt \
                 you format yourself",
                args.bundle.display()
            ),
        ),
        Err(e) => {
            eprintln!("warning: chat requests will be refused: {e}");
            (
                None,
                format!("the bundle's chat template cannot be used ({e}); use /v1/completions"),
            )
        }
    };
    let state = Arc::new(AppState {
        model_name: model_name.clone(),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        queue: worker.queue.clone(),
        queue_depth: args.queue_depth,
        chat_template,
        chat_unavailable,
        counters,
        serial: AtomicU64::new(0),
        max_context: worker.meta.max_context,
        backend: worker.meta.backend,
    });
    let queue = worker.queue;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("specter-serve-http")
        .build()
        .context("cannot start the HTTP runtime")?;
    let served = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
        let addr: SocketAddr = listener.local_addr()?;
        eprintln!("specter-run serve: listening on http://{addr} (model {model_name})");
        let app = routes::router(state);
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown_signal(shutdown.clone()))
            .await
            .context("the HTTP server failed")
    });
    // Every connection is closed: no one can queue any more. The worker ends when its queue's
    // last sender goes.
    drop(queue);
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    if worker.thread.join().is_err() {
        bail!("the model thread panicked");
    }
    served?;
    eprintln!("specter-run serve: stopped");
    Ok(())
}

/// Resolves on SIGINT or SIGTERM, after telling the worker to stop what it runs (a running
/// generation ends at its next round; queued requests are answered 503).
async fn shutdown_signal(shutdown: Arc<AtomicBool>) {
    let interrupt = tokio::signal::ctrl_c();
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut stream) => {
                stream.recv().await;
            }
            // Without a SIGTERM handler, SIGINT still stops the server.
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = interrupt => {},
        _ = terminate => {},
    }
    eprintln!("specter-run serve: shutting down");
    shutdown.store(true, Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct Serve {
        #[command(flatten)]
        args: ServeArgs,
    }

    #[test]
    fn serve_copies_every_miss_unpaced_by_default() {
        use clap::Parser;
        let serve = Serve::try_parse_from(["serve", "m.specter"]).unwrap();
        let mut cuda = specter::backend::cuda::CudaOptions::default();
        serve.args.hybrid.apply(&mut cuda).unwrap();
        assert_eq!(cuda.host_experts, None);
        assert_eq!(cuda.link_pace_bytes_per_s, None);
        let paced = Serve::try_parse_from(["serve", "m.specter", "--link-gbps", "25"]).unwrap();
        paced.args.hybrid.apply(&mut cuda).unwrap();
        assert_eq!(cuda.link_pace_bytes_per_s, Some(25e9));
    }
}
