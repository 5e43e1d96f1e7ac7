//! Measurement only (the `measure` cargo feature, which examples/bench_step.rs needs): launches
//! a pass leaves out or starts late, named by their labels, to measure what a kernel or its early
//! start costs inside a recorded pass, which timing the kernel alone does not show.

/// Launches to leave out of every pass, and launches that start only once the kernel before them
/// has finished. A pass that skips a launch computes meaningless outputs (where the skipped
/// kernel feeds the routing, the experts it then picks are arbitrary); the step time it saves is
/// what that kernel costs. The bits are the same with or without `serial`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MeasureOptions {
    pub skip: Vec<LaunchMatch>,
    pub serial: Vec<LaunchMatch>,
}

/// The labels of the kernel launches [`MeasureOptions`] can name: the names the backend gives its
/// launches in errors, and those of the INT4 and row-layout expert kernels' launches.
pub const LAUNCH_LABELS: &[&str] = &[
    "add",
    "add_rms_norm",
    "add_rms_norm_linear",
    "add_sigmoid_gated",
    "argmax",
    "attention",
    "attention combine",
    "attention prompt",
    "clamp",
    "count routes",
    "embedding",
    "gate/up silu",
    "gemm",
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
    "moe gather",
    "moe gemm down",
    "moe gemm gate/up",
    "moe gate/up",
    "moe int4 down",
    "moe int4 down + combine",
    "moe int4 gate/up",
    "moe plan",
    "moe rows down",
    "moe rows gate/up",
    "rms_norm",
    "rope",
    "route + plan",
    "route + plan + shared gate/up",
    "route sparse mixer",
    "route top-k",
    "split_cols",
    "to f16",
    "write_rows",
];

/// One kind of launch, by label and grid: what a measurement pass leaves out
/// ([`MeasureOptions::skip`]) or launches without the early start ([`MeasureOptions::serial`]).
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
    pub(in crate::backend::cuda) fn any(list: &[LaunchMatch], kernel: &str, blocks: u32) -> bool {
        list.iter().any(|m| m.matches(kernel, blocks))
    }
}

#[cfg(test)]
mod tests {
    use super::super::LaunchRule;
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
        let measure = MeasureOptions {
            skip: LaunchMatch::parse_list("moe combine").unwrap(),
            serial: LaunchMatch::parse_list("attention@16").unwrap(),
        };
        let rule = LaunchRule::new(true).measuring(measure);
        assert_eq!(rule.overlap_for("moe combine", 8), None);
        assert_eq!(rule.overlap_for("attention", 16), Some(false));
        assert_eq!(rule.overlap_for("attention", 272), Some(true));
        let plain = LaunchRule::new(false);
        assert_eq!(plain.overlap_for("attention", 16), Some(false));
    }

    /// Every label the backend gives a launch is one a skip list may name, and no other.
    #[test]
    fn launch_labels_are_the_backends() {
        let sources = [
            include_str!("../ops/attention.rs"),
            include_str!("../backend.rs"),
            include_str!("../ops/fused.rs"),
            include_str!("../moe/mod.rs"),
            include_str!("../moe/device.rs"),
            include_str!("../moe/int4.rs"),
            include_str!("../moe/rows.rs"),
            include_str!("../ops/mod.rs"),
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
