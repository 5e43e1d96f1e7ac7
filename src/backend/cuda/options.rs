//! Settings of a CUDA backend that a caller chooses. The library reads no environment variables;
//! the binaries map `SPECTER_CUDA_GRAPHS`, `SPECTER_CUDA_SEGMENTS`, `SPECTER_CUDA_OVERLAP`,
//! `SPECTER_CUDA_CLUSTERS`, `SPECTER_CUDA_FUSE_SHARED`, `SPECTER_CUDA_ONE_LAUNCH_EXPERTS`,
//! `SPECTER_CUDA_INT4_INTERLEAVE`, `SPECTER_CUDA_CHAIN`, `SPECTER_HOST_SPLIT` and
//! `SPECTER_LOAD_THREADS` onto these fields (and `bench_step --skip-launches` onto the
//! measurement-only `skip_launches`, `SPECTER_CUDA_SERIAL` onto the measurement-only
//! `serial_launches`).

use super::{HostExpertsConfig, HostPath, LoadIo, SplitExperts};

/// How a [`CudaBackend`](super::CudaBackend) runs.
#[derive(Clone, Debug, PartialEq)]
pub struct CudaOptions {
    /// Record forward passes as CUDA graphs and replay them (see src/backend/cuda/graphs.rs).
    pub graphs: bool,
    /// Threads that read weights from the bundle at load time; `None`: the cores, at most 8.
    pub load_threads: Option<usize>,
    /// How weights are read from the bundle at load time.
    pub load_io: LoadIo,
    /// Where offloaded experts are copied from.
    pub host_path: HostPath,
    /// With offloaded experts: compute some missing ones on this many host threads instead of
    /// copying them (the hybrid path); `None`: copy every miss.
    pub host_experts: Option<usize>,
    /// The link's rate, bytes per second, that the hybrid split starts from (both paths' rates
    /// are then measured as the run goes). With a pace, the pace is the start instead.
    pub link_bytes_per_s: f64,
    /// With offloaded experts: hold expert copies to this many bytes per second, to emulate a
    /// slower link (25e9: PCIe 4.0 x16) on a faster one; `None`: the link's own rate.
    pub link_pace_bytes_per_s: Option<f64>,
    /// With `graphs`: record the segments of passes that wait for the device midway (an
    /// offloaded layer's routing read back), the ops between the waits, and replay them.
    pub segment_graphs: bool,
    /// Launch each kernel so that it may start while the one before it on the stream finishes
    /// (programmatic dependent launch, Hopper and newer; ignored on older devices). Kernels
    /// wait for their inputs on the device (kernels/common.cuh, `spx_grid_wait`), so the bits
    /// are the same either way; what it saves is the gap between dependent kernels.
    pub overlap_launches: bool,
    /// Launch in thread block clusters where a kernel has a clustered form (Hopper and newer;
    /// ignored on older devices): attention combines a (row, head)'s key chunks in a cluster's
    /// shared memory instead of through global memory and an atomic ticket, and a draft step's
    /// INT4 down launch adds the layer's expert outputs (the combine) in each cluster of its
    /// blocks instead of in a launch of its own. The same bits either way; what it saves is
    /// round trips through L2 and a launch at every layer.
    pub clusters: bool,
    /// Run an MoE layer's ungated shared experts inside its routed experts' launches (their
    /// gate/up beside the routing, their down beside the routed down) instead of as separate
    /// ops. The same bits either way; what it saves is two launches per layer and the routing's
    /// latency.
    pub fuse_shared_experts: bool,
    /// With `fuse_shared_experts`, run a one-row MoE layer's FP16 experts (the shared down, each
    /// routed expert's gate/up and down, the combine) in one launch whose blocks wait only for
    /// the work they read, instead of three launches (kernels/gemv_f16.cu,
    /// `moe_f16_experts_1`). The same bits either way; what it saves is two launch boundaries
    /// per layer of a decode step.
    pub experts_in_one_launch: bool,
    /// In the INT4 draft's gate/up launch with the shared down, alternate routed and shared
    /// down blocks in launch order instead of listing the routed blocks first. The same bits
    /// either way; what it changes is which blocks share a multiprocessor (on the H200 the
    /// draft's chained steps ran 1.3% faster with it).
    pub int4_interleave_roles: bool,
    /// Feed greedy choices to the next recorded pass on the device, so a chain of greedy
    /// one-row passes (decode steps, a draft window) runs without waiting for the host between
    /// passes (`Backend::feed_choice`). The same tokens either way.
    pub chain_greedy: bool,
    /// With the host path: let one miss of a layer be split between the paths (its gate and up
    /// on the host, its down matrix copied) when the measured rates say that finishes sooner.
    /// The same tokens either way.
    pub split_experts: bool,
    /// Measurement only: launches to leave out of every pass. A pass that skips a launch
    /// computes meaningless outputs (and where the skipped kernel feeds the routing, the
    /// experts it then picks are arbitrary); `examples/bench_step.rs` uses this to measure what
    /// a kernel costs inside a recorded pass (the step time saved without it), which timing a
    /// kernel alone does not show. Empty (the default) for every real run.
    pub skip_launches: Vec<LaunchMatch>,
    /// Measurement only: launches that do not start early where `overlap_launches` is on; each
    /// starts once the kernel before it has finished, as without the overlap. What the early
    /// start gains or costs one kernel inside a recorded pass is the step time with and without
    /// it (a clustered launch that starts early behind a kernel filling the multiprocessors
    /// cost a step 8 us a layer: docs/BENCHMARKS-LOG.md, branch `mla-attention`). The bits are
    /// the same either way. Empty (the default) for every real run.
    pub serial_launches: Vec<LaunchMatch>,
}

/// The labels of the kernel launches [`CudaOptions::skip_launches`] and
/// [`CudaOptions::serial_launches`] can name: the names the
/// backend gives its launches in errors, and those of the INT4 expert kernels' launches.
pub const LAUNCH_LABELS: &[&str] = &[
    "add",
    "add_rms_norm",
    "add_rms_norm_linear",
    "add_sigmoid_gated",
    "argmax",
    "attention",
    "attention combine",
    "clamp",
    "count routes",
    "embedding",
    "gate/up silu",
    "layer_norm",
    "linear",
    "linear_pair",
    "mla_expand_append",
    "mla_expand_kv",
    "mla_kv_append",
    "mla_latent",
    "moe combine",
    "moe down",
    "moe experts",
    "moe gate/up",
    "moe int4 down",
    "moe int4 down + combine",
    "moe int4 gate/up",
    "moe plan",
    "rms_norm",
    "rope",
    "route + plan",
    "route + plan + shared gate/up",
    "route sparse mixer",
    "route top-k",
    "split_cols",
    "write_rows",
];

/// One kind of launch, by label and grid: what a measurement pass leaves out
/// ([`CudaOptions::skip_launches`]) or launches without the early start
/// ([`CudaOptions::serial_launches`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchMatch {
    /// A label of [`LAUNCH_LABELS`].
    pub kernel: String,
    /// Only the launches of this many blocks (the grid's x extent: "linear@8" is DeepSeek's
    /// router product, 64 outputs at 8 a block); `None`: every launch of the kernel.
    pub blocks: Option<u32>,
}

impl LaunchMatch {
    /// `LABEL[@BLOCKS]` items separated by commas, each label one of [`LAUNCH_LABELS`].
    pub fn parse_list(list: &str) -> Result<Vec<LaunchMatch>, String> {
        list.split(',')
            .map(str::trim)
            .filter(|item| !item.is_empty())
            .map(|item| {
                let (kernel, blocks) = match item.split_once('@') {
                    Some((k, b)) => {
                        let blocks = b.trim().parse::<u32>().map_err(|_| {
                            format!("{item:?}: the block count after '@' is not a number")
                        })?;
                        (k.trim(), Some(blocks))
                    }
                    None => (item, None),
                };
                if !LAUNCH_LABELS.contains(&kernel) {
                    return Err(format!(
                        "{kernel:?} is not a kernel launch label (one of: {})",
                        LAUNCH_LABELS.join(", ")
                    ));
                }
                Ok(LaunchMatch {
                    kernel: kernel.to_string(),
                    blocks,
                })
            })
            .collect()
    }

    /// Whether this entry names a launch of `kernel` over `blocks` blocks.
    pub fn matches(&self, kernel: &str, blocks: u32) -> bool {
        self.kernel == kernel && self.blocks.is_none_or(|b| b == blocks)
    }

    /// Whether an entry of `list` names a launch of `kernel` over `blocks` blocks.
    fn any(list: &[LaunchMatch], kernel: &str, blocks: u32) -> bool {
        list.iter().any(|m| m.matches(kernel, blocks))
    }
}

/// How a launcher (the backend, the INT4 expert kernels) starts each launch: early where
/// `overlap` holds ([`CudaOptions::overlap_launches`] on a device that has it), but for the
/// launches [`CudaOptions::serial_launches`] names, and not at all for those
/// [`CudaOptions::skip_launches`] names (both measurement only).
#[derive(Clone, Debug, Default)]
pub(super) struct LaunchRule {
    overlap: bool,
    skip: Vec<LaunchMatch>,
    serial: Vec<LaunchMatch>,
}

impl LaunchRule {
    pub(super) fn new(overlap: bool, options: &CudaOptions) -> Self {
        LaunchRule {
            overlap,
            skip: options.skip_launches.clone(),
            serial: options.serial_launches.clone(),
        }
    }

    /// For the launch of `kernel` (a label of [`LAUNCH_LABELS`]) over `blocks` blocks: `None`
    /// when it is left out, else whether it starts early.
    pub(super) fn overlap_for(&self, kernel: &str, blocks: u32) -> Option<bool> {
        (!LaunchMatch::any(&self.skip, kernel, blocks))
            .then(|| self.overlap && !LaunchMatch::any(&self.serial, kernel, blocks))
    }
}

impl CudaOptions {
    /// The host path with `threads` threads, its split starting from the link's rate (the pace,
    /// when set) for both paths: the split corrects the host's after the first layer.
    pub fn host_experts_config(&self, threads: usize) -> HostExpertsConfig {
        let link = self.link_pace_bytes_per_s.unwrap_or(self.link_bytes_per_s);
        HostExpertsConfig {
            threads,
            link_bytes_per_s: link,
            host_bytes_per_s: link,
            split: if self.split_experts {
                SplitExperts::Measured
            } else {
                SplitExperts::Never
            },
        }
    }
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            graphs: true,
            segment_graphs: true,
            load_threads: None,
            load_io: LoadIo::default(),
            host_path: HostPath::Auto,
            host_experts: None,
            link_bytes_per_s: 54e9,
            link_pace_bytes_per_s: None,
            overlap_launches: true,
            clusters: true,
            fuse_shared_experts: true,
            experts_in_one_launch: true,
            int4_interleave_roles: true,
            chain_greedy: true,
            split_experts: true,
            skip_launches: Vec::new(),
            serial_launches: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skip_lists_parse_and_match() {
        let list = LaunchMatch::parse_list("attention, linear@8,moe combine,").unwrap();
        assert_eq!(list.len(), 3);
        assert!(list[0].matches("attention", 16) && list[0].matches("attention", 272));
        assert!(list[1].matches("linear", 8) && !list[1].matches("linear", 256));
        assert!(list[2].matches("moe combine", 1) && !list[2].matches("moe down", 1));
        assert!(LaunchMatch::parse_list("").unwrap().is_empty());
        let err = LaunchMatch::parse_list("atention").unwrap_err();
        assert!(
            err.contains("\"atention\" is not a kernel launch label"),
            "{err}"
        );
        let err = LaunchMatch::parse_list("linear@x").unwrap_err();
        assert!(err.contains("not a number"), "{err}");
    }

    #[test]
    fn launch_rule_leaves_out_or_starts_late_what_the_lists_name() {
        let options = CudaOptions {
            skip_launches: LaunchMatch::parse_list("moe combine").unwrap(),
            serial_launches: LaunchMatch::parse_list("attention@16").unwrap(),
            ..CudaOptions::default()
        };
        let rule = LaunchRule::new(true, &options);
        assert_eq!(rule.overlap_for("moe combine", 8), None);
        assert_eq!(rule.overlap_for("attention", 16), Some(false));
        assert_eq!(rule.overlap_for("attention", 272), Some(true));
        let plain = LaunchRule::new(false, &CudaOptions::default());
        assert_eq!(plain.overlap_for("attention", 16), Some(false));
    }

    /// Every label the backend gives a launch is one a skip list may name, and no other.
    #[test]
    fn launch_labels_are_the_backends() {
        let sources = [
            include_str!("attention.rs"),
            include_str!("backend.rs"),
            include_str!("fused.rs"),
            include_str!("moe.rs"),
            include_str!("moe_device.rs"),
            include_str!("moe_int4.rs"),
            include_str!("ops.rs"),
        ];
        let mut found = std::collections::BTreeSet::new();
        for src in sources {
            // `self.launch(` or `this.launch(` (or `.launch_clustered(`), the kernel, then the
            // label as a string literal; the INT4 kernels' `self.issue(` (or
            // `.issue_clustered(`), the stream, then the label.
            let calls = [
                ".launch(",
                ".launch_clustered(",
                ".issue(",
                ".issue_clustered(",
            ]
            .into_iter()
            .flat_map(|call| src.match_indices(call));
            for (at, _) in calls {
                let rest = &src[at..];
                let Some(open) = rest.find('"') else { continue };
                let close = rest[open + 1..].find('"').expect("a closed label") + open + 1;
                // The label is the launch's second argument: only a comma lies before it.
                if rest[..open].matches(',').count() == 1 {
                    found.insert(rest[open + 1..close].to_string());
                }
            }
        }
        let listed: std::collections::BTreeSet<String> =
            LAUNCH_LABELS.iter().map(|s| s.to_string()).collect();
        assert_eq!(found, listed);
    }
}
