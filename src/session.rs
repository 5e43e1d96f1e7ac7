//! A loaded bundle ready to decode: the mapping, the model on its backend, and the tokenizer.
//!
//! This is what the `specter-run` subcommands share, so that they stay thin.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use specter_format::Bundle;
use tokenizers::Tokenizer;

use crate::arch::{ArchConfig, MoeModel};
use crate::backend::cpu::Cpu;
use crate::backend::cuda::{CudaBackend, CudaDevice, CudaOptions, OffloadConfig};
use crate::model::LanguageModel;
use crate::offload::Policy;
use crate::startup::{since_start_ms, StartupTimes};
use crate::verify_mode::{self, VerifyMode};
use crate::{Error, Result};

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Cuda,
}

/// How to load a session.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    pub backend: BackendKind,
    /// Load the draft's INT4 experts (needed by `--mode specter|draft`).
    pub with_draft: bool,
    /// CUDA only: keep this many routed experts per MoE layer in VRAM, copying the rest in from
    /// the bundle's mapping under this policy. `None`: every expert resident.
    pub offload: Option<(usize, Policy)>,
    /// How much of the bundle is checked before the model runs.
    pub verify: VerifyMode,
    /// CUDA only: how the backend runs (recorded passes, load threads and I/O, copy path).
    pub cuda: CudaOptions,
    /// Measurement only: launches every pass leaves out or starts late (examples/bench_step.rs).
    #[cfg(feature = "measure")]
    pub measure: crate::backend::cuda::MeasureOptions,
}

impl SessionOptions {
    pub fn new(backend: BackendKind) -> Self {
        SessionOptions {
            backend,
            with_draft: true,
            offload: None,
            verify: VerifyMode::Manifest,
            cuda: CudaOptions::default(),
            #[cfg(feature = "measure")]
            measure: Default::default(),
        }
    }
}

/// The model on the backend it was loaded on.
pub enum SessionModel {
    Cpu(Box<MoeModel<Cpu>>),
    Cuda(Box<MoeModel<CudaBackend>>),
}

/// Runs `$body` with `$m` bound to the session's model, whatever its backend.
#[macro_export]
macro_rules! with_session_model {
    ($session:expr, |$m:ident| $body:expr) => {
        match &$session.model {
            $crate::session::SessionModel::Cpu(boxed) => {
                let $m = boxed.as_ref();
                $body
            }
            $crate::session::SessionModel::Cuda(boxed) => {
                let $m = boxed.as_ref();
                $body
            }
        }
    };
}

/// An opened bundle with its model loaded.
pub struct Session {
    pub path: PathBuf,
    pub bundle: Arc<Bundle>,
    pub config: ArchConfig,
    pub model: SessionModel,
    pub tokenizer: Option<Tokenizer>,
    /// When each stage of opening finished.
    pub startup: StartupTimes,
}

impl Session {
    /// Opens `path` (header and manifest checked, no tensor bytes read), then loads the model
    /// with its draft.
    pub fn open(path: &Path, backend: BackendKind) -> Result<Session> {
        Self::open_with(path, &SessionOptions::new(backend))
    }

    pub fn open_with(path: &Path, opts: &SessionOptions) -> Result<Session> {
        if opts.offload.is_some() && opts.backend != BackendKind::Cuda {
            return Err(Error::Request(
                "expert offloading to VRAM needs --backend cuda (the CPU backend simulates it)"
                    .into(),
            ));
        }
        let bundle = Arc::new(verify_mode::open_bundle(path, opts.verify)?);
        let bundle_opened_ms = since_start_ms();
        let config = ArchConfig::from_config_json(bundle.hyperparameters_json())
            .map_err(|e| Error::Model(format!("{}: hyper-parameters: {e}", path.display())))?;
        let in_file = |e: Error| Error::Model(format!("{}: {e}", path.display()));
        // The GPU's context, kernel modules and expert slots are set up on another thread while
        // this one parses the tokenizer.
        let device_setup = match opts.backend {
            BackendKind::Cpu => None,
            BackendKind::Cuda => {
                // As many slots as experts is plain all-resident.
                let offload = opts
                    .offload
                    .filter(|&(slots, _)| slots != config.moe.num_experts)
                    .map(|(slots, policy)| OffloadConfig {
                        bundle: bundle.clone(),
                        config: config.clone(),
                        slots_per_layer: slots,
                        policy,
                        host_path: opts.cuda.host_path,
                        host_experts: opts
                            .cuda
                            .host_experts
                            .map(|threads| opts.cuda.host_experts_config(threads)),
                        link_pace_bytes_per_s: opts.cuda.link_pace_bytes_per_s,
                    });
                let cuda = opts.cuda.clone();
                #[cfg(feature = "measure")]
                let measure = opts.measure.clone();
                Some(
                    std::thread::Builder::new()
                        .name("specter-device".into())
                        .spawn(move || -> Result<(CudaBackend, f64)> {
                            let device = Arc::new(CudaDevice::open(0)?);
                            let backend = CudaBackend::with_device(device, offload, &cuda)?;
                            #[cfg(feature = "measure")]
                            let backend = backend.measuring(measure);
                            Ok((backend, since_start_ms()))
                        })
                        .map_err(|e| {
                            Error::Backend(format!("cannot start the device thread: {e}"))
                        })?,
                )
            }
        };
        let tokenizer = match bundle.tokenizer_bytes() {
            Some(bytes) => Some(Tokenizer::from_bytes(bytes).map_err(|e| {
                Error::Model(format!(
                    "{}: the bundle's tokenizer.json does not load: {e}",
                    path.display()
                ))
            })?),
            None => None,
        };
        let mut device_ready_ms = None;
        // With --verify full, every section is hashed on another thread while the model loads.
        let model = verify_mode::while_verifying(&bundle, path, opts.verify, || {
            Ok(match device_setup {
                None => SessionModel::Cpu(Box::new(
                    MoeModel::load_with(config.clone(), bundle.as_ref(), Cpu, opts.with_draft)
                        .map_err(in_file)?,
                )),
                Some(handle) => {
                    let (backend, ready) = handle.join().map_err(|_| {
                        Error::Backend("the device set-up thread panicked".into())
                    })??;
                    device_ready_ms = Some(ready);
                    SessionModel::Cuda(Box::new(
                        MoeModel::load_with(
                            config.clone(),
                            bundle.as_ref(),
                            backend,
                            opts.with_draft,
                        )
                        .map_err(in_file)?,
                    ))
                }
            })
        })?;
        let startup = StartupTimes {
            bundle_opened_ms,
            device_ready_ms,
            weights_resident_ms: since_start_ms(),
        };
        Ok(Session {
            path: path.to_path_buf(),
            bundle,
            config,
            model,
            tokenizer,
            startup,
        })
    }

    /// The model on the CPU reference backend (tools that only run there, such as `probe`).
    pub fn cpu_model(&self) -> Result<&MoeModel<Cpu>> {
        match &self.model {
            SessionModel::Cpu(m) => Ok(m),
            SessionModel::Cuda(_) => Err(Error::Request(
                "this command runs on the CPU reference backend only".into(),
            )),
        }
    }

    /// The CUDA backend, when the session runs on the GPU.
    pub fn cuda(&self) -> Option<&CudaBackend> {
        match &self.model {
            SessionModel::Cpu(_) => None,
            SessionModel::Cuda(m) => Some(m.backend()),
        }
    }

    pub fn info(&self) -> &crate::model::ModelInfo {
        with_session_model!(self, |m| m.info())
    }

    fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().ok_or_else(|| {
            Error::Request(format!(
                "{} holds no tokenizer.json: pass token ids with --prompt-ids instead of text",
                self.path.display()
            ))
        })
    }

    /// Text to token ids with the bundle's tokenizer (special tokens such as BOS added as the
    /// tokenizer's post-processor says).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer()?
            .encode(text, true)
            .map_err(|e| Error::Request(format!("cannot tokenize the prompt: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids to text (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer()?
            .decode(ids, true)
            .map_err(|e| Error::Request(format!("cannot detokenize: {e}")))
    }

    pub fn has_tokenizer(&self) -> bool {
        self.tokenizer.is_some()
    }
}
