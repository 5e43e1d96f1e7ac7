//! Routed experts with routing on the device: the router's top-k, the work list, the expert
//! kernels and the combine run in launches of their own with no host round trip (so recorded
//! passes replay them), optionally with the shared experts inside the routed launches; and the
//! per-layer routing counts the draft's prefetch planner reads.

use crate::backend::cuda::backend::{CudaBackend, RouteCounts};
use crate::backend::cuda::moe::expert_pointers;
use crate::backend::cuda::moe::experts::ExpertKind;
use crate::backend::cuda::moe::experts::{CombineInDown, ExpertGroup, MoeLaunch, SharedDown};
use crate::backend::cuda::runtime::act::{GpuAct, GpuWeight};
use crate::backend::cuda::runtime::driver::guarded;
use crate::backend::cuda::runtime::kernels::*;
use crate::backend::{Backend, GatedMlp, RouteSpec};
use crate::{Error, Result};

/// What an MoE layer's combine adds to its routed experts' output.
#[derive(Clone, Copy)]
enum Extra<'a> {
    Nothing,
    /// A finished `[rows, hidden]` output (the shared experts, run before).
    Output(&'a GpuAct),
    /// Ungated shared experts with FP16 weights (`SharedF16`, the addresses of that MLP), run
    /// in the routed experts' launches.
    Shared(SharedF16, &'a GatedMlp<CudaBackend>),
}

/// The device addresses and width of a layer's FP16 shared experts.
#[derive(Clone, Copy)]
struct SharedF16 {
    /// `[2 * inter, hidden]`: gate rows, then up rows.
    gate_up: u64,
    /// `[hidden, inter]`.
    down: u64,
    inter: usize,
}

impl CudaBackend {
    /// [`crate::backend::Backend::routed_moe_plus`]: on the device, `plus` is added in the
    /// combine's launch.
    pub(in crate::backend::cuda) fn routed_moe_plus_op(
        &self,
        x: &GpuAct,
        logits: &GpuAct,
        spec: RouteSpec,
        experts: &[GatedMlp<Self>],
        count_as: Option<usize>,
        plus: &GpuAct,
    ) -> Result<GpuAct> {
        if let Some(top_k) = self.device_routing_fits(x, logits, spec, experts, false) {
            if (plus.rows, plus.cols) == (x.rows, x.cols) {
                return self.routed_moe_on_device(
                    x,
                    logits,
                    spec,
                    top_k,
                    experts,
                    count_as,
                    Extra::Output(plus),
                );
            }
        }
        let (mut out, _) = self.routed_moe_op(x, logits, spec, experts, false, count_as)?;
        self.add_assign(&mut out, plus)?;
        Ok(out)
    }

    /// Routed experts plus ungated shared experts. With device routing of few rows and FP16
    /// shared weights, the shared gate/up runs in the routing launch and (FP16 routed experts)
    /// the shared down in the routed down's; otherwise (and with `CudaOptions::plain`) the
    /// shared MLP runs first. The same bits either way (tests/cuda_placement.rs and
    /// tests/cuda_fixtures.rs compare the two).
    pub(in crate::backend::cuda) fn routed_moe_shared_op(
        &self,
        x: &GpuAct,
        logits: &GpuAct,
        spec: RouteSpec,
        experts: &[GatedMlp<Self>],
        count_as: Option<usize>,
        shared: &GatedMlp<Self>,
    ) -> Result<GpuAct> {
        let few_rows =
            matches!(spec, RouteSpec::SoftmaxTopK { .. }) && x.rows <= ROUTE_PLAN_MAX_ROWS;
        // A prompt pass on tensor cores runs the shared MLP apart in every placement (the
        // routing launch's shared gate/up is a gemv).
        if self.fused && few_rows && !self.tensor_core_product(x.rows, x.cols) {
            if let (Some(top_k), Some(sh)) = (
                self.device_routing_fits(x, logits, spec, experts, false),
                self.shared_f16(shared, x.cols),
            ) {
                return self.routed_moe_on_device(
                    x,
                    logits,
                    spec,
                    top_k,
                    experts,
                    count_as,
                    Extra::Shared(sh, shared),
                );
            }
        }
        if self
            .device_routing_fits(x, logits, spec, experts, false)
            .is_none()
        {
            // Routing on the host: the shared MLP is issued right after the routing's read-back,
            // so the device runs it while the host routes and places the experts.
            let (mut out, _, s) =
                self.routed_moe_on_host(x, logits, spec, experts, count_as, Some(shared))?;
            let s = s.ok_or_else(|| Error::Backend("the shared experts did not run".into()))?;
            self.add_assign(&mut out, &s)?;
            return Ok(out);
        }
        let s = self.gated_mlp(x, shared)?;
        self.routed_moe_plus_op(x, logits, spec, experts, count_as, &s)
    }

    /// `mlp`'s addresses when it is an FP16 gated MLP over `hidden` inputs.
    fn shared_f16(&self, mlp: &GatedMlp<Self>, hidden: usize) -> Option<SharedF16> {
        let s = &self.stream;
        let (gate_up, two_inter, inp) = self.f16_matrix(&mlp.gate_up, "shared experts").ok()?;
        let (down, out, inter) = self.f16_matrix(&mlp.down, "shared experts").ok()?;
        (inp == hidden && out == hidden && two_inter == 2 * inter && inter > 0).then(|| SharedF16 {
            gate_up: ptr(gate_up, s),
            down: ptr(down, s),
            inter,
        })
    }

    /// The routing's top-k when routing, work list and experts can all run on the device.
    pub(in crate::backend::cuda) fn device_routing_fits(
        &self,
        x: &GpuAct,
        logits: &GpuAct,
        spec: RouteSpec,
        experts: &[GatedMlp<Self>],
        host_routing: bool,
    ) -> Option<usize> {
        let resident = experts
            .iter()
            .all(|m| !matches!(m.gate_up, GpuWeight::Offloaded { .. }));
        let top_k = match spec {
            RouteSpec::SoftmaxTopK { top_k, .. } => top_k,
            RouteSpec::SparseMixer { .. } => 2,
        };
        let fits = (1..=MAX_TOP_K).contains(&top_k)
            && top_k <= experts.len()
            && experts.len() <= PLAN_MAX_EXPERTS;
        (!host_routing
            && resident
            && fits
            && logits.cols == experts.len()
            && x.rows == logits.rows
            && x.rows > 0)
            .then_some(top_k)
    }

    /// [`Self::routed_moe_on_device`] with nothing added in the combine.
    pub(in crate::backend::cuda) fn routed_moe_alone_on_device(
        &self,
        x: &GpuAct,
        logits: &GpuAct,
        spec: RouteSpec,
        top_k: usize,
        experts: &[GatedMlp<Self>],
        count_as: Option<usize>,
    ) -> Result<GpuAct> {
        self.routed_moe_on_device(x, logits, spec, top_k, experts, count_as, Extra::Nothing)
    }

    /// Routing, work list and expert kernels all on the device: no host round trip. `extra` is
    /// added to the combined output in the combine's launch; shared experts to run (which the
    /// caller passes only for softmax top-k routing of at most `ROUTE_PLAN_MAX_ROWS` rows) run
    /// in the routing and expert launches.
    #[allow(clippy::too_many_arguments)]
    fn routed_moe_on_device(
        &self,
        x: &GpuAct,
        logits: &GpuAct,
        spec: RouteSpec,
        top_k: usize,
        experts: &[GatedMlp<Self>],
        count_as: Option<usize>,
        extra: Extra,
    ) -> Result<GpuAct> {
        let s = &self.stream;
        let rows = x.rows;
        let hidden = x.cols;
        let n_experts = experts.len();
        let mut templates = Vec::with_capacity(n_experts);
        let mut kind = None;
        let mut inter = 0;
        for (e, mlp) in experts.iter().enumerate() {
            let (t, k, i) = expert_pointers(mlp, e, s)?;
            if *kind.get_or_insert(k) != k {
                return Err(shape_err(
                    "moe_experts",
                    format!("expert {e} is not of the same kind as expert 0 ({k:?}, {kind:?})"),
                ));
            }
            inter = i;
            templates.push(t);
        }
        let kind = kind.unwrap_or(ExpertKind::F16);
        let int4 = kind == ExpertKind::Int4;
        let mut tables = self.lock(&self.expert_tables)?;
        let key = experts.as_ptr() as usize;
        let fresh = tables.get(&key).is_some_and(|(host, _)| *host == templates);
        if !fresh {
            let dev = self.upload_groups(&templates)?;
            tables.insert(key, (templates, dev));
        }
        let table = ptr(
            &tables
                .get(&key)
                .ok_or_else(|| shape_err("moe_experts", "no table".into()))?
                .1,
            s,
        );
        drop(tables);

        let shared_h = match extra {
            Extra::Shared(sh, _) => {
                let fused =
                    matches!(spec, RouteSpec::SoftmaxTopK { .. }) && rows <= ROUTE_PLAN_MAX_ROWS;
                if !fused {
                    return Err(shape_err(
                        "moe_experts",
                        format!(
                            "shared experts in the routing launch of {rows} rows: no such launch"
                        ),
                    ));
                }
                Some(self.alloc(rows, sh.inter)?)
            }
            _ => None,
        };
        let n_items = rows * top_k;
        let max_groups = n_items.min(n_experts);
        // 32-bit scratch from the activation pool (kernels see raw pointers); the routing and
        // plan kernels write every element before anything reads it.
        let alloc_u32 = |n: usize| self.alloc(n.max(1), 1).map(|a| a.buf);
        let ids = alloc_u32(n_items)?;
        let weights = alloc_u32(n_items)?;
        let item_row = alloc_u32(n_items)?;
        let item_weight = alloc_u32(n_items)?;
        let row_items = alloc_u32(n_items)?;
        let groups = alloc_u32(max_groups * std::mem::size_of::<ExpertGroup>() / 4)?;
        let (rows_i, top_k_i, experts_i) = (
            int(rows, "rows")?,
            int(top_k, "top_k")?,
            int(n_experts, "experts")?,
        );
        let list = WorkList {
            table: DevPtr(table),
            max_groups: int(max_groups, "groups")?,
            groups: dptr(&groups, s),
            item_row: dptr(&item_row, s),
            item_weight: dptr(&item_weight, s),
            row_items: dptr(&row_items, s),
        };
        let (ids_p, weights_p) = (dptr(&ids, s), dptr(&weights, s));
        let plan_separately = |this: &Self| -> Result<()> {
            let args = MoePlanArgs {
                ids: ids_p,
                weights: weights_p,
                rows: rows_i,
                top_k: top_k_i,
                experts: experts_i,
                list,
            };
            this.launch(
                &this.k.moe_plan,
                "moe plan",
                (1, 1, 1),
                ROUTE_PLAN_THREADS,
                args,
            )
        };
        match spec {
            RouteSpec::SoftmaxTopK {
                renormalize, scale, ..
            } => {
                let route_args = RouteTopkArgs {
                    logits: dptr(&logits.buf, s),
                    experts: experts_i,
                    top_k: top_k_i,
                    renormalize: i32::from(renormalize),
                    scale,
                    ids: ids_p,
                    weights: weights_p,
                };
                let route_plan = RoutePlanArgs {
                    route: route_args,
                    rows: rows_i,
                    list,
                };
                if let (Extra::Shared(sh, _), Some(hs)) = (extra, &shared_h) {
                    // Routing and work list in block 0, the shared gate/up in the others.
                    let args = RoutePlanSharedArgs {
                        plan: route_plan,
                        x: dptr(&x.buf, s),
                        k: int(hidden, "hidden")?,
                        w_shared: DevPtr(sh.gate_up),
                        inter_shared: int(sh.inter, "shared inter")?,
                        h_shared: dptr(&hs.buf, s),
                    };
                    // One row: the form whose shared gate/up holds one row's registers.
                    let f = if rows == 1 {
                        &self.k.route_plan_shared_1
                    } else {
                        &self.k.route_plan_shared
                    };
                    // Block 0 and the shared gate/up's work blocks.
                    let blocks = f
                        .grid(
                            1 + grid_for(sh.inter, GEMV_WARPS as u32) * gemv_row_groups(rows),
                            rows == 1,
                        )
                        .max(2);
                    self.launch(
                        &f.f,
                        "route + plan + shared gate/up",
                        (blocks, 1, 1),
                        32 * GEMV_WARPS as u32,
                        args,
                    )?;
                } else if rows <= ROUTE_PLAN_MAX_ROWS {
                    // Few rows: routing and work list in one launch.
                    self.launch(
                        &self.k.route_plan,
                        "route + plan",
                        (1, 1, 1),
                        ROUTE_PLAN_THREADS,
                        route_plan,
                    )?;
                } else {
                    self.route_rows(logits, spec, top_k, ids_p, weights_p)?;
                    plan_separately(self)?;
                }
            }
            RouteSpec::SparseMixer { .. } => {
                self.route_rows(logits, spec, top_k, ids_p, weights_p)?;
                plan_separately(self)?;
            }
        }
        if let Some(layer) = count_as {
            self.count_routes(ptr(&ids, s), n_items, layer)?;
        }
        let h = self.alloc(n_items, inter)?;
        let out = self.alloc(n_items, hidden)?;
        let launch = MoeLaunch {
            x: ptr(&x.buf, s),
            hidden,
            inter,
            groups: ptr(&groups, s),
            num_groups: max_groups,
            max_count: rows,
            item_row: ptr(&item_row, s),
            item_weight: ptr(&item_weight, s),
            items: n_items,
            h: ptr(&h.buf, s),
            out: ptr(&out.buf, s),
        };
        // The layer's output. A draft step (INT4 experts, one row, shared experts), where the
        // device has clusters and the top_k fit one: the down launch combines it (the same bits
        // as moe_combine below).
        let y = self.alloc(rows, hidden)?;
        let combine = (self.clusters
            && int4
            && rows == 1
            && max_groups == top_k
            && top_k <= 8
            && matches!(extra, Extra::Shared(..))
            && shared_h.is_some())
        .then(|| CombineInDown {
            top_k,
            y: ptr(&y.buf, s),
        });
        let shared_y = match (extra, &shared_h) {
            (Extra::Shared(sh, mlp), Some(hs)) => {
                if kind != ExpertKind::F16 && (rows != 1 || !int4) {
                    self.launch_moe(&launch, kind)?;
                    Some(self.linear(hs, &mlp.down, None)?)
                } else {
                    let shared_out = self.alloc(rows, hidden)?;
                    let down = SharedDown {
                        h: ptr(&hs.buf, s),
                        rows,
                        inter: sh.inter,
                        down: sh.down,
                        y: ptr(&shared_out.buf, s),
                    };
                    if kind == ExpertKind::F16 && self.experts_fit_one_launch(&launch, &down) {
                        // The shared down, routed experts and combine in one launch.
                        let (items, out) = (ptr(&row_items, s), ptr(&y.buf, s));
                        self.launch_moe_f16_one(&launch, &down, items, top_k, out)?;
                        return Ok(y);
                    }
                    match (int4, &combine) {
                        // One row (a draft step): the shared down runs in the gate/up launch's
                        // spare blocks, with linear_f16_1's bits.
                        (true, Some(c)) => self
                            .int4
                            .launch_with_shared_down_combined(s, &launch, &down, c)?,
                        (true, None) => self.int4.launch_with_shared_down(s, &launch, &down)?,
                        (false, _) => self.launch_moe_f16(&launch, Some(&down))?,
                    }
                    Some(shared_out)
                }
            }
            _ => {
                self.launch_moe(&launch, kind)?;
                None
            }
        };
        if combine.is_some() {
            return Ok(y);
        }
        let plus = match (extra, &shared_y) {
            (Extra::Output(p), _) => Some(p),
            (_, y) => y.as_ref(),
        };
        self.launch(
            &self.k.moe_combine,
            "moe combine",
            (rows as u32, grid_for(hidden, ROW_THREADS), 1),
            ROW_THREADS,
            MoeCombineArgs {
                out: DevPtr(launch.out),
                row_items: dptr(&row_items, s),
                top_k: int(top_k, "top_k")?,
                hidden: int(hidden, "hidden")?,
                y: dptr(&y.buf, s),
                plus: DevPtr(plus.map_or(0, |p| ptr(&p.buf, s))),
            },
        )?;
        Ok(y)
    }

    /// Adds `n` expert ids at device address `ids` to MoE layer `layer`'s routing counts, when
    /// counting is on.
    pub(in crate::backend::cuda) fn count_routes(
        &self,
        ids: u64,
        n: usize,
        layer: usize,
    ) -> Result<()> {
        let counts = self.lock(&self.route_counts)?;
        let Some(c) = counts.as_ref() else {
            return Ok(());
        };
        if layer >= c.moe_layers || n == 0 {
            return Ok(());
        }
        let row = ptr(&c.counts, &self.stream) + (4 * layer * c.experts) as u64;
        self.launch(
            &self.k.count_routes,
            "count routes",
            (1, 1, 1),
            128,
            CountRoutesArgs {
                ids: DevPtr(ids),
                n: int(n, "items")?,
                counts: DevPtr(row),
            },
        )
    }

    /// Starts counting, per MoE layer and expert, the routings of passes whose hook asks for
    /// device counts (from zero). A buffer of another shape replaces the old one and drops every
    /// recorded pass (they may write to the old one).
    pub fn enable_route_counts(&self, moe_layers: usize, experts: usize) -> Result<()> {
        let same = self
            .lock(&self.route_counts)?
            .as_ref()
            .is_some_and(|c| c.moe_layers == moe_layers && c.experts == experts);
        if same {
            // Keep the buffer: recorded draft passes write to its address.
            return self.reset_route_counts();
        }
        let counts = guarded("cuda: cannot allocate routing counts", || {
            self.stream
                .alloc_zeros::<u32>((moe_layers * experts).max(1))
        })?;
        self.drop_recordings()?;
        *self.lock(&self.route_counts)? = Some(RouteCounts {
            counts,
            moe_layers,
            experts,
        });
        Ok(())
    }

    /// Sets every routing count to zero (ordered after the passes already issued).
    pub fn reset_route_counts(&self) -> Result<()> {
        let mut counts = self.lock(&self.route_counts)?;
        if let Some(c) = counts.as_mut() {
            guarded("cuda: cannot reset routing counts", || {
                self.stream.memset_zeros(&mut c.counts)
            })?;
        }
        Ok(())
    }

    /// The routing counts `[moe layers, experts]` so far (waits for the passes issued).
    pub fn route_counts(&self) -> Result<Vec<u32>> {
        self.synchronize()?;
        let counts = self.lock(&self.route_counts)?;
        let Some(c) = counts.as_ref() else {
            return Err(Error::Request(
                "routing counts were never enabled on this backend".into(),
            ));
        };
        let mut host = vec![0u32; c.moe_layers * c.experts];
        if !host.is_empty() {
            let view = c.counts.slice(..host.len());
            guarded("cuda: routing counts device-to-host copy failed", || {
                self.stream.memcpy_dtoh(&view, &mut host)
            })?;
            guarded("cuStreamSynchronize", || self.stream.synchronize())?;
        }
        Ok(host)
    }
}
