//! A loaded bundle ready to decode: the mapping, the model on its backend, and the tokenizer.
//!
//! This is what the `specter-run` subcommands share, so that they stay thin.

use std::path::{Path, PathBuf};

use specter_format::Bundle;
use tokenizers::Tokenizer;

use crate::verify_mode::{self, VerifyMode};

use crate::arch::{ArchConfig, MoeModel};
use crate::backend::cpu::Cpu;
use crate::model::LanguageModel;
use crate::{Error, Result};

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Cuda,
}

/// An opened bundle with its model loaded on the CPU reference backend.
pub struct Session {
    pub path: PathBuf,
    pub bundle: Bundle,
    pub config: ArchConfig,
    pub model: MoeModel<Cpu>,
    pub tokenizer: Option<Tokenizer>,
}

impl Session {
    /// Opens `path` (header and manifest checked, no tensor bytes read), then loads the model.
    pub fn open(path: &Path, backend: BackendKind) -> Result<Session> {
        Session::open_with(path, backend, VerifyMode::Manifest)
    }

    /// As [`Session::open`], checking as much of the bundle as `verify` says.
    pub fn open_with(path: &Path, backend: BackendKind, verify: VerifyMode) -> Result<Session> {
        if backend == BackendKind::Cuda {
            return Err(Error::Backend(
                "--backend cuda: model execution on the GPU is not part of this build yet; \
                 use --backend cpu (the exact reference)"
                    .into(),
            ));
        }
        let bundle = verify_mode::open_bundle(path, verify)?;
        let (config, model, tokenizer) =
            verify_mode::while_verifying(&bundle, path, verify, || {
                let config =
                    ArchConfig::from_config_json(bundle.hyperparameters_json()).map_err(|e| {
                        Error::Model(format!("{}: hyper-parameters: {e}", path.display()))
                    })?;
                let model = MoeModel::load(config.clone(), &bundle, Cpu)
                    .map_err(|e| Error::Model(format!("{}: {e}", path.display())))?;
                let tokenizer = match bundle.tokenizer_bytes() {
                    Some(bytes) => Some(Tokenizer::from_bytes(bytes).map_err(|e| {
                        Error::Model(format!(
                            "{}: the bundle's tokenizer.json does not load: {e}",
                            path.display()
                        ))
                    })?),
                    None => None,
                };
                Ok((config, model, tokenizer))
            })?;
        Ok(Session {
            path: path.to_path_buf(),
            bundle,
            config,
            model,
            tokenizer,
        })
    }

    pub fn info(&self) -> &crate::model::ModelInfo {
        self.model.info()
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
