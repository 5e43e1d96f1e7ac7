//! Routed-expert dispatch: the host-side work list of a layer's routing ([`MoePlan`]), the expert
//! pointer tables, and the grouped expert kernels for resident experts and, through the expert
//! slots (src/backend/cuda/offload/slots.rs), for offloaded ones. Routing on the device is in
//! src/backend/cuda/moe/device.rs.

pub(in crate::backend::cuda) mod device;
pub mod experts;
pub(in crate::backend::cuda) mod int4;
mod kernel;
mod plan;
pub(in crate::backend::cuda) mod rows;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use crate::backend::cpu::{Cpu, Mat};
use crate::backend::cuda::backend::CudaBackend;
use crate::backend::cuda::moe::experts::{ExpertGroup, ExpertKind, MoeLaunch, SharedDown};
use crate::backend::cuda::offload::slots::{ExpertOffload, InPlaceExpert, SlotLayout};
use crate::backend::cuda::runtime::act::{GpuAct, GpuWeight};
use crate::backend::cuda::runtime::kernels::*;
use crate::backend::{Backend, GatedMlp, RouteSpec, Routing};
use crate::host_experts::{ExpertJob, HostExperts, HostRun};
use crate::offload::Elsewhere;
use crate::{Error, Result};
pub(crate) use plan::MoePlan;

/// The weight pointers of a resident expert (first/count left 0), its kind and its inner width
/// (`inter`).
pub(in crate::backend::cuda) fn expert_pointers(
    mlp: &GatedMlp<CudaBackend>,
    e: usize,
    stream: &CudaStream,
) -> Result<(ExpertGroup, ExpertKind, usize)> {
    let quantized = |gq: u64, gs: u64, dq: u64, ds: u64| ExpertGroup {
        gate_up: gq,
        gate_up_scales: gs,
        down: dq,
        down_scales: ds,
        ..Default::default()
    };
    match (&mlp.gate_up, &mlp.down) {
        (GpuWeight::F16 { buf: gu, shape, .. }, GpuWeight::F16 { buf: dn, .. })
            if shape.len() == 2 =>
        {
            Ok((
                ExpertGroup {
                    gate_up: ptr(gu, stream),
                    down: ptr(dn, stream),
                    ..Default::default()
                },
                ExpertKind::F16,
                shape[0] / 2,
            ))
        }
        (
            GpuWeight::Int4 {
                qweight: gq,
                scales: gs,
                n,
                ..
            },
            GpuWeight::Int4 {
                qweight: dq,
                scales: ds,
                ..
            },
        ) => Ok((
            quantized(
                ptr(gq, stream),
                ptr(gs, stream),
                ptr(dq, stream),
                ptr(ds, stream),
            ),
            ExpertKind::Int4,
            n / 2,
        )),
        (
            GpuWeight::Rows {
                qweight: gq,
                scales: gs,
                bits,
                n,
                ..
            },
            GpuWeight::Rows {
                qweight: dq,
                scales: ds,
                bits: down_bits,
                ..
            },
        ) if bits == down_bits => Ok((
            quantized(
                ptr(gq, stream),
                ptr(gs, stream),
                ptr(dq, stream),
                ptr(ds, stream),
            ),
            ExpertKind::Rows(*bits),
            n / 2,
        )),
        (a, b) => Err(shape_err(
            "moe_experts",
            format!(
                "expert {e}: {} / {} is not a resident expert",
                a.describe(),
                b.describe()
            ),
        )),
    }
}

impl CudaBackend {
    pub(in crate::backend::cuda) fn route_op(
        &self,
        logits: &GpuAct,
        spec: RouteSpec,
    ) -> Result<Routing> {
        Ok(self.route_on_host(logits, spec, None, || Ok(()))?.0)
    }

    /// The routing of `logits` brought to the host, with `input` read back in the same wait
    /// when given, and `meanwhile` issued on the device after the copies so that it runs while
    /// the host places the experts. The routing decides which experts are copied, so the host
    /// needs it. It is computed by the device's routing kernels wherever they take it, so that a
    /// layer routed for the host (offloaded experts, route hooks) has the same experts and
    /// weights, bit for bit, as one routed on the device alone (the CPU reference's softmax sums
    /// in another order and its `exp` is not the device's); elsewhere (top-k past the kernels'
    /// limit) by the CPU reference, as every placement then is.
    pub(in crate::backend::cuda) fn route_on_host<T>(
        &self,
        logits: &GpuAct,
        spec: RouteSpec,
        input: Option<&GpuAct>,
        meanwhile: impl FnOnce() -> Result<T>,
    ) -> Result<(Routing, Option<Vec<f32>>, T)> {
        let waiting = std::time::Instant::now();
        let routed = self.route_for_host(logits, spec)?;
        let first = routed.as_ref().map_or(logits, |(act, _)| act);
        let (mut parts, issued) = match input {
            Some(x) => self.read_back_then(&[first, x], meanwhile)?,
            None => self.read_back_then(&[first], meanwhile)?,
        };
        let xh = input.and_then(|_| parts.pop());
        let data = parts.pop().unwrap_or_default();
        if let Some(o) = &self.offload {
            self.lock(o)?
                .record_route_wait(waiting.elapsed().as_secs_f64());
        }
        let routing = match routed {
            Some((_, top_k)) => routing_from_words(&data, top_k, logits.cols)?,
            None => Cpu.route(
                &Mat {
                    rows: logits.rows,
                    cols: logits.cols,
                    data,
                },
                spec,
            )?,
        };
        Ok((routing, xh, issued))
    }

    /// Launches the device's routing of `logits` into a new `[2, rows * top_k]` activation
    /// (the expert ids' bits, then the weights), the layout [`routing_from_words`] reads; `None`
    /// where the kernels do not take this routing (or there is nothing to route).
    fn route_for_host(&self, logits: &GpuAct, spec: RouteSpec) -> Result<Option<(GpuAct, usize)>> {
        let (rows, experts) = (logits.rows, logits.cols);
        let (top_k, least) = match spec {
            RouteSpec::SoftmaxTopK { top_k, .. } => (top_k, 1),
            RouteSpec::SparseMixer { .. } => (2, 2),
        };
        if rows == 0 || !(1..=MAX_TOP_K).contains(&top_k) || experts < top_k.max(least) {
            return Ok(None);
        }
        let n = rows * top_k;
        let out = self.alloc(2, n)?;
        let s = &self.stream;
        let ids = ptr(&out.buf, s);
        let (ids, weights) = (DevPtr(ids), DevPtr(ids + 4 * n as u64));
        self.route_rows(logits, spec, top_k, ids, weights)?;
        Ok(Some((out, top_k)))
    }

    /// Routes each row of `logits` on the device, one warp a row: ids and weights `[rows,
    /// top_k]` (`top_k` is 2 for SparseMixer). The one per-row routing launch, shared by the
    /// device's own MoE path and the routing read back to the host.
    pub(in crate::backend::cuda) fn route_rows(
        &self,
        logits: &GpuAct,
        spec: RouteSpec,
        top_k: usize,
        ids: DevPtr,
        weights: DevPtr,
    ) -> Result<()> {
        let s = &self.stream;
        let grid = (int(logits.rows, "rows")? as u32, 1, 1);
        let experts = int(logits.cols, "experts")?;
        match spec {
            RouteSpec::SoftmaxTopK {
                renormalize, scale, ..
            } => self.launch(
                &self.k.route_topk,
                "route top-k",
                grid,
                32,
                RouteTopkArgs {
                    logits: dptr(&logits.buf, s),
                    experts,
                    top_k: int(top_k, "top_k")?,
                    renormalize: i32::from(renormalize),
                    scale,
                    ids,
                    weights,
                },
            ),
            RouteSpec::SparseMixer { jitter_eps } => self.launch(
                &self.k.route_sparse_mixer,
                "route sparse mixer",
                grid,
                32,
                RouteSparseMixerArgs {
                    logits: dptr(&logits.buf, s),
                    experts,
                    jitter_eps,
                    ids,
                    weights,
                },
            ),
        }
    }

    /// Whether `experts` are offloaded and the host expert kernel may compute some of them.
    fn host_path_serves(&self, experts: &[GatedMlp<Self>]) -> Result<bool> {
        let offloaded = experts
            .first()
            .is_some_and(|m| matches!(m.gate_up, GpuWeight::Offloaded { .. }));
        Ok(match (&self.offload, offloaded) {
            (Some(o), true) => self.lock(o)?.host_kernel().is_some(),
            _ => false,
        })
    }

    pub(in crate::backend::cuda) fn routed_moe_op(
        &self,
        x: &GpuAct,
        logits: &GpuAct,
        spec: RouteSpec,
        experts: &[GatedMlp<Self>],
        host_routing: bool,
        count_as: Option<usize>,
    ) -> Result<(GpuAct, Option<Routing>)> {
        if let Some(top_k) = self.device_routing_fits(x, logits, spec, experts, host_routing) {
            return Ok((
                self.routed_moe_alone_on_device(x, logits, spec, top_k, experts, count_as)?,
                None,
            ));
        }
        let (out, routing, _) =
            self.routed_moe_on_host(x, logits, spec, experts, count_as, None)?;
        Ok((out, Some(routing)))
    }

    /// Routing on the host, then the routed experts; with `shared`, also the shared experts'
    /// MLP, issued on the device right after the routing's read-back, so that it runs while the
    /// host routes and places the experts (and, for offloaded layers, while host threads compute
    /// some of them). With the host path, the layer input comes back with the logits.
    pub(in crate::backend::cuda) fn routed_moe_on_host(
        &self,
        x: &GpuAct,
        logits: &GpuAct,
        spec: RouteSpec,
        experts: &[GatedMlp<Self>],
        count_as: Option<usize>,
        shared: Option<&GatedMlp<Self>>,
    ) -> Result<(GpuAct, Routing, Option<GpuAct>)> {
        let input = self.host_path_serves(experts)?.then_some(x);
        let (routing, xh, shared_out) = self.route_on_host(logits, spec, input, || {
            shared.map(|mlp| self.gated_mlp(x, mlp)).transpose()
        })?;
        if let Some(layer) = count_as {
            let ids = self.upload_u32(&routing.ids)?;
            self.count_routes(ptr(&ids, &self.stream), routing.ids.len(), layer)?;
        }
        let out = self.moe_experts_placed(x, &routing, experts, xh)?;
        Ok((out, routing, shared_out))
    }

    pub(in crate::backend::cuda) fn moe_experts_op(
        &self,
        x: &GpuAct,
        routing: &Routing,
        experts: &[GatedMlp<Self>],
    ) -> Result<GpuAct> {
        self.moe_experts_placed(x, routing, experts, None)
    }

    /// The routed experts of `routing` over `x`. For an offloaded layer, `xh` is `x` already on
    /// the host (read back with the routing).
    fn moe_experts_placed(
        &self,
        x: &GpuAct,
        routing: &Routing,
        experts: &[GatedMlp<Self>],
        xh: Option<Vec<f32>>,
    ) -> Result<GpuAct> {
        let k = routing.top_k;
        if k == 0 || routing.ids.len() != x.rows * k || routing.weights.len() != x.rows * k {
            return Err(shape_err(
                "moe_experts",
                format!(
                    "routing of {} ids (top {k}) for {} rows",
                    routing.ids.len(),
                    x.rows
                ),
            ));
        }
        if let Some(&bad) = routing.ids.iter().find(|&&e| e as usize >= experts.len()) {
            return Err(shape_err(
                "moe_experts",
                format!("expert id {bad} >= {}", experts.len()),
            ));
        }
        let hidden = x.cols;
        let y = self.alloc(x.rows, hidden)?;
        if x.rows == 0 {
            return Ok(y);
        }
        let plan = MoePlan::new(routing, experts.len());
        let first = &experts[plan.hit[0] as usize];
        let inter = match &first.gate_up {
            GpuWeight::Offloaded { layer, .. } => match &self.offload {
                Some(o) => self.lock(o)?.inter(*layer)?,
                None => {
                    return Err(shape_err(
                        "moe_experts",
                        "offloaded expert without a cache".into(),
                    ))
                }
            },
            _ => expert_pointers(first, plan.hit[0] as usize, &self.stream)?.2,
        };
        let h = self.alloc(plan.items(), inter)?;
        // An offloaded layer's host-computed items go up in one copy into a second half of
        // `out` (at the same item index), which the combine reads for them.
        let offloaded = matches!(first.gate_up, GpuWeight::Offloaded { .. });
        let out = self.alloc(plan.items() * if offloaded { 2 } else { 1 }, hidden)?;
        let d_items = self.upload_u32(&plan.item_words())?;
        let s = &self.stream;
        let items_base = ptr(&d_items, s);
        let mut launch = MoeLaunch {
            x: ptr(&x.buf, s),
            hidden,
            inter,
            groups: 0,
            num_groups: 0,
            max_count: 0,
            item_row: items_base,
            item_weight: items_base + 4 * plan.items() as u64,
            items: plan.items(),
            h: ptr(&h.buf, s),
            out: ptr(&out.buf, s),
        };
        let mut row_items = std::borrow::Cow::Borrowed(&plan.row_items);
        match &first.gate_up {
            GpuWeight::Offloaded { layer, .. } => {
                let host_groups = self.run_offloaded(*layer, &plan, x, &mut launch, xh)?;
                if !host_groups.is_empty() {
                    let items = plan.items() as u32;
                    let mut on_host = vec![false; plan.items()];
                    for &g in &host_groups {
                        let (first, count) = plan.range(g);
                        on_host[first as usize..(first + count) as usize].fill(true);
                    }
                    row_items = std::borrow::Cow::Owned(
                        plan.row_items
                            .iter()
                            .map(|&i| if on_host[i as usize] { i + items } else { i })
                            .collect(),
                    );
                }
            }
            _ => {
                let mut groups = Vec::with_capacity(plan.hit.len());
                let mut kind = None;
                for (g, &e) in plan.hit.iter().enumerate() {
                    let (mut group, k, _) = expert_pointers(&experts[e as usize], e as usize, s)?;
                    if *kind.get_or_insert(k) != k {
                        return Err(shape_err(
                            "moe_experts",
                            format!(
                                "expert {e} is not of the same kind as expert {} ({k:?}, {kind:?})",
                                plan.hit[0]
                            ),
                        ));
                    }
                    (group.first, group.count) = plan.range(g);
                    groups.push(group);
                }
                let d_groups = self.upload_groups(&groups)?;
                launch.groups = ptr(&d_groups, s);
                launch.num_groups = groups.len();
                launch.max_count = plan.max_count();
                self.launch_moe(&launch, kind.unwrap_or(ExpertKind::F16))?;
                // The uploaded group table must outlive the kernels that read it.
                self.defer_free(d_groups);
            }
        }
        let d_row_items = self.upload_u32(&row_items)?;
        let args = MoeCombineArgs {
            out: DevPtr(launch.out),
            row_items: dptr(&d_row_items, s),
            top_k: int(k, "top_k")?,
            hidden: int(hidden, "hidden")?,
            y: dptr(&y.buf, s),
            plus: DevPtr(0),
        };
        self.launch(
            &self.k.moe_combine,
            "moe combine",
            (x.rows as u32, grid_for(hidden, ROW_THREADS), 1),
            ROW_THREADS,
            args,
        )?;
        drop(d_items);
        drop(h);
        drop(out);
        Ok(y)
    }

    /// Launches the grouped FP16 expert kernels (gate/up then down) for one work list.
    /// The grouped FP16 expert kernels; with `shared`, the down launch also computes the shared
    /// experts' down product in a last row of blocks.
    pub(in crate::backend::cuda) fn launch_moe_f16(
        &self,
        l: &MoeLaunch,
        shared: Option<&SharedDown>,
    ) -> Result<()> {
        if self.experts_on_tensor_cores(l) {
            return self.launch_moe_f16_tensor_cores(l, shared);
        }
        // Work blocks: (features, groups), run by grid-stride blocks.
        let blocks = |per_group: u32, rows: usize| per_group.saturating_mul(rows as u32);
        // Groups of at most one item (decode): the one-item forms, the same bits.
        let one = l.max_count <= 1;
        let gate_up = if one {
            &self.k.moe_gate_up_1
        } else {
            &self.k.moe_gate_up
        };
        let gx = grid_for(l.inter, GEMV_WARPS as u32);
        self.launch(
            &gate_up.f,
            "moe gate/up",
            (gate_up.grid(blocks(gx, l.num_groups), one), 1, 1),
            32 * GEMV_WARPS as u32,
            gate_up_args(l)?,
        )?;
        self.launch_moe_f16_down(l, shared)
    }

    /// The down half of [`Self::launch_moe_f16`]: `out[item] = weight[item] * (h[item] . down)`
    /// from the activations already in `l.h`.
    pub(in crate::backend::cuda) fn launch_moe_f16_down(
        &self,
        l: &MoeLaunch,
        shared: Option<&SharedDown>,
    ) -> Result<()> {
        let (h, i) = (int(l.hidden, "hidden")?, int(l.inter, "inter")?);
        let groups = int(l.num_groups, "groups")?;
        let blocks = |per_group: u32, rows: usize| per_group.saturating_mul(rows as u32);
        let one = l.max_count <= 1;
        // Work blocks of a group's down product: the one-item forms give a warp more features.
        let gx = grid_for(l.hidden, (GEMV_WARPS * GEMV_FEATURES) as u32);
        let gx_routed = if one {
            grid_for(l.hidden, (GEMV_WARPS * GEMV_DOWN_FEATURES_ONE) as u32)
        } else {
            gx
        };
        let routed = blocks(gx_routed, l.num_groups);
        let args = MoeDownArgs {
            h: DevPtr(l.h),
            hidden: h,
            inter: i,
            groups: DevPtr(l.groups),
            num_groups: groups,
            item_weight: DevPtr(l.item_weight),
            out: DevPtr(l.out),
        };
        let Some(sd) = shared else {
            let down = if one {
                &self.k.moe_down_1
            } else {
                &self.k.moe_down
            };
            return self.launch(
                &down.f,
                "moe down",
                (down.grid(routed, one), 1, 1),
                32 * GEMV_WARPS as u32,
                args,
            );
        };
        let down = if one {
            &self.k.moe_down_shared_1
        } else {
            &self.k.moe_down_shared
        };
        // The shared experts' down product: gx work blocks (the one-item form) or gx per row
        // group after the routed ones.
        let shared_blocks = if one {
            gx
        } else {
            gx.saturating_mul(gemv_row_groups(sd.rows))
        };
        let work_blocks = routed.saturating_add(shared_blocks);
        self.launch(
            &down.f,
            "moe down",
            (down.grid(work_blocks, one), 1, 1),
            32 * GEMV_WARPS as u32,
            MoeDownSharedArgs {
                down: args,
                h_shared: DevPtr(sd.h),
                rows: int(sd.rows, "rows")?,
                inter_shared: int(sd.inter, "shared inter")?,
                w_down: DevPtr(sd.down),
                y_shared: DevPtr(sd.y),
            },
        )
    }
}

impl CudaBackend {
    /// Whether [`Self::launch_moe_f16_one`] runs this one-row FP16 layer.
    pub(in crate::backend::cuda) fn experts_fit_one_launch(
        &self,
        l: &MoeLaunch,
        shared: &SharedDown,
    ) -> bool {
        self.fused
            && l.max_count <= 1
            && shared.rows == 1
            && (1..=MAX_TOP_K).contains(&l.num_groups)
            && l.hidden <= EXPERTS_ONE_MAX_HIDDEN
    }

    /// A one-row MoE layer's FP16 experts in one launch (`moe_f16_experts_1`): the shared down
    /// into `shared.y`, the routed gate/up and down, and `y = sum of the top_k item outputs +
    /// shared.y` (with `moe_combine`'s bits), which the separate launches compute in three. For
    /// layers [`Self::experts_fit_one_launch`] takes; `row_items` as the routing launch wrote it.
    pub(in crate::backend::cuda) fn launch_moe_f16_one(
        &self,
        l: &MoeLaunch,
        shared: &SharedDown,
        row_items: u64,
        top_k: usize,
        y: u64,
    ) -> Result<()> {
        let per = |n: usize, width: usize| n.div_ceil(width);
        let blocks = per(l.hidden, GEMV_WARPS * GEMV_FEATURES)
            + l.num_groups
                * (per(l.inter, GEMV_WARPS).div_ceil(EXPERTS_ONE_GATE_UP_WORK)
                    + per(l.hidden, GEMV_WARPS * GEMV_DOWN_FEATURES_ONE));
        let blocks = u32::try_from(blocks)
            .map_err(|_| shape_err("moe_experts", format!("{blocks} work blocks")))?;
        // Consecutive launches take different slots (see EXPERTS_ONE_SLOTS).
        let slot = self
            .experts_slot
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            % EXPERTS_ONE_SLOTS;
        let counters =
            ptr(&self.experts_counters, &self.stream) + (4 * slot * EXPERTS_ONE_SLOT_WORDS) as u64;
        let args = MoeExpertsOneArgs {
            gate_up: gate_up_args(l)?,
            item_weight: DevPtr(l.item_weight),
            out: DevPtr(l.out),
            h_shared: DevPtr(shared.h),
            inter_shared: int(shared.inter, "shared inter")?,
            w_down: DevPtr(shared.down),
            y_shared: DevPtr(shared.y),
            row_items: DevPtr(row_items),
            top_k: int(top_k, "top_k")?,
            y: DevPtr(y),
            counters: DevPtr(counters),
        };
        self.launch(
            &self.k.moe_experts_1,
            "moe experts",
            (blocks, 1, 1),
            32 * GEMV_WARPS as u32,
            args,
        )
    }

    pub(crate) fn upload_groups(&self, groups: &[ExpertGroup]) -> Result<CudaSlice<u32>> {
        let words: &[u32] = bytemuck::cast_slice(groups);
        self.upload_u32(words)
    }

    /// Buffers freed while kernels may still read them: with stream-ordered allocation
    /// (cuMemFreeAsync on this stream) the free itself is ordered after those kernels.
    pub(crate) fn defer_free<T>(&self, buf: CudaSlice<T>) {
        drop(buf);
    }

    /// The grouped expert kernels of `kind` (gate/up then down) for one work list.
    pub(crate) fn launch_moe(&self, l: &MoeLaunch, kind: ExpertKind) -> Result<()> {
        match kind {
            ExpertKind::F16 => self.launch_moe_f16(l, None),
            ExpertKind::Int4 => self.int4.launch(&self.stream, l),
            ExpertKind::Rows(bits) => self.rows.launch(&self.stream, l, bits),
        }
    }

    /// Runs the routed experts of one offloaded layer as the cache policy decides: each round's
    /// resident experts from their slots, then the experts copied in for it; and, with the host
    /// path, the misses it leaves to the host, computed by the host kernel from `x` (`xh` when
    /// already on the host) while the GPU works, their outputs copied into `out` before the
    /// combine. The host kernel has the GPU kernel's bits, so the placement changes no
    /// output. Returns the work-list groups the host computed whole, whose items land in
    /// `out`'s second half (`out` holds twice the plan's items).
    fn run_offloaded(
        &self,
        layer: usize,
        plan: &MoePlan,
        x: &GpuAct,
        launch: &mut MoeLaunch,
        xh: Option<Vec<f32>>,
    ) -> Result<Vec<usize>> {
        let o = self
            .offload
            .as_ref()
            .ok_or_else(|| shape_err("moe_experts", "offloaded expert without a cache".into()))?;
        let entered = std::time::Instant::now();
        let mut slots = self.lock(o)?;
        let stream = self.stream.clone();
        let layout = slots.layout();
        let rows: Vec<u32> = (0..plan.hit.len()).map(|g| plan.range(g).1).collect();
        // The host kernel follows the gemv kernels' bits, not a prompt's tensor cores (which
        // take FP16 experts alone).
        let host_allowed = layout.kind != ExpertKind::F16 || !self.experts_on_tensor_cores(launch);
        let rounds = slots.serve(layer, &plan.hit, &rows, host_allowed)?;
        let (elsewhere, split) = rounds
            .first()
            .map(|r| (r.elsewhere.clone(), r.gate_up_elsewhere.clone()))
            .unwrap_or_default();
        if split.len() > 1 {
            return Err(Error::Backend(format!(
                "offload: {} split experts in one layer; the down stage holds one",
                split.len()
            )));
        }
        let (hidden, inter) = (launch.hidden, launch.inter);
        let mut enqueue_gpu = |slots: &mut ExpertOffload| -> Result<()> {
            for round in &rounds {
                if !round.hits.is_empty() {
                    let ptrs = slots.hit_slots(layer, &round.hits, &stream)?;
                    let groups: Vec<usize> = round.hits.iter().map(|h| h.index).collect();
                    self.launch_slot_groups(plan, &groups, &ptrs, layout, launch)?;
                }
                if !round.loads.is_empty() {
                    let ptrs = slots.load_slots(layer, &round.loads, &stream)?;
                    let groups: Vec<usize> = round.loads.iter().map(|l| l.index).collect();
                    self.launch_slot_groups(plan, &groups, &ptrs, layout, launch)?;
                }
                slots.release(&stream)?;
            }
            // Last on the link: the split expert's down is read only once the host is done.
            for e in &split {
                slots.load_down_stage(layer, e.expert)?;
            }
            Ok(())
        };
        if elsewhere.is_empty() && split.is_empty() {
            enqueue_gpu(&mut slots)?;
            return Ok(Vec::new());
        }
        let Some(kernel) = slots.host_kernel() else {
            return Err(Error::Backend(
                "the cache left experts to the host, but no host kernel runs".into(),
            ));
        };
        let in_place = |slots: &mut ExpertOffload, list: &[Elsewhere]| {
            list.iter()
                .map(|e| Ok((e.index, slots.in_place(layer, e.expert)?)))
                .collect::<Result<Vec<_>>>()
        };
        let experts = in_place(&mut slots, &elsewhere)?;
        let halves = in_place(&mut slots, &split)?;
        let xh = match xh {
            Some(xh) => xh,
            None => self.to_host(x)?,
        };
        // The host's outputs land in page-locked memory, each expert's items where they sit in
        // `out` (then the split experts' activations, where they sit in `h`), and go up
        // asynchronously once the host is done.
        let out_values = plan.items() * hidden;
        let mut staging = self.host_output_staging(out_values + plan.items() * inter)?;
        let staged = staging
            .as_mut()
            .ok_or_else(|| Error::Backend("cuda: no host output staging".into()))?;
        let (out_stage, h_stage) = staged.as_mut_f32()?.split_at_mut(out_values);
        let mut outs = item_slices(out_stage, plan, &experts, hidden)?;
        let mut hs = item_slices(h_stage, plan, &halves, inter)?;
        // The host experts run on the kernel's threads while this thread enqueues the GPU's
        // share (hits and copies, all asynchronous); then it joins them.
        let mut work = HostWork::gather(plan, &xh, hidden, &experts, &halves)?;
        let dispatch = entered.elapsed().as_secs_f64();
        let run = work.run(&kernel, (hidden, inter), &mut outs, &mut hs, || {
            enqueue_gpu(&mut slots)
        })?;
        drop((outs, hs));
        run.side?;
        let finishing = std::time::Instant::now();
        if !experts.is_empty() {
            let dst = launch.out + (out_values * 4) as u64;
            // SAFETY: `out` holds twice the plan's items (`moe_experts_placed` allocates it so
            // for offloaded layers): `dst` is its second half, `out_values` f32, made on this
            // stream and alive until the combine that follows on it has run.
            unsafe { staged.copy_to_device_ptr(0..out_values * 4, dst, &stream)? };
        }
        for (g, _) in &halves {
            let (first, count) = plan.range(*g);
            let at = out_values * 4;
            let bytes = first as usize * inter * 4..(first + count) as usize * inter * 4;
            let dst = launch.h + bytes.start as u64;
            // SAFETY: `dst` lies inside `h`'s allocation (items `first..first + count`, `inter`
            // f32 each), made on this stream and alive until the down launch below has run.
            unsafe { staged.copy_to_device_ptr(at + bytes.start..at + bytes.end, dst, &stream)? };
            let group = ExpertGroup {
                gate_up: 0,
                gate_up_scales: 0,
                down: slots.down_stage_ptr(&stream)?,
                down_scales: 0,
                first,
                count,
            };
            let d_group = self.upload_groups(&[group])?;
            let down = MoeLaunch {
                groups: d_group.device_ptr(&self.stream).0,
                num_groups: 1,
                max_count: count as usize,
                ..*launch
            };
            self.launch_moe_f16_down(&down, None)?;
            slots.release_down_stage(&stream)?;
            self.defer_free(d_group);
        }
        // The split learns the kernel's own time (under whatever the link's copies cost it in
        // memory bandwidth), not the wall time, which also holds the GPU share's enqueueing.
        slots.record_host(experts.len(), halves.len(), run.seconds);
        slots.record_host_stall(run.stall_seconds);
        slots.record_host_serial(dispatch, finishing.elapsed().as_secs_f64());
        Ok(experts.iter().map(|(g, _)| *g).collect())
    }

    /// Launches the expert kernels over work-list groups `groups` of `plan` whose weights sit
    /// in expert slots at `slot_ptrs`, laid out as `layout` says.
    fn launch_slot_groups(
        &self,
        plan: &MoePlan,
        groups: &[usize],
        slot_ptrs: &[u64],
        layout: SlotLayout,
        launch: &mut MoeLaunch,
    ) -> Result<()> {
        let list: Vec<ExpertGroup> = groups
            .iter()
            .zip(slot_ptrs)
            .map(|(&g, &base)| {
                let (first, count) = plan.range(g);
                layout.group(base, first, count)
            })
            .collect();
        let d_groups = self.upload_groups(&list)?;
        launch.groups = d_groups.device_ptr(&self.stream).0;
        launch.num_groups = list.len();
        launch.max_count = list.iter().map(|g| g.count as usize).max().unwrap_or(0);
        self.launch_moe(launch, layout.kind)?;
        self.defer_free(d_groups);
        Ok(())
    }
}

/// The routing in `words` as [`CudaBackend::route_for_host`] lays it out: `rows * top_k` expert
/// ids (their bits in f32 words), then as many weights.
fn routing_from_words(words: &[f32], top_k: usize, experts: usize) -> Result<Routing> {
    let n = words.len() / 2;
    if words.len() != 2 * n || !n.is_multiple_of(top_k) {
        return Err(Error::Backend(format!(
            "device routing: {} words read back for top {top_k}",
            words.len()
        )));
    }
    let ids: Vec<u32> = words[..n].iter().map(|w| w.to_bits()).collect();
    if let Some(bad) = ids.iter().find(|&&e| e as usize >= experts) {
        return Err(Error::Backend(format!(
            "device routing chose expert {bad} of {experts}"
        )));
    }
    Ok(Routing {
        top_k,
        ids,
        weights: words[n..].to_vec(),
    })
}

/// The FP16 gate/up kernels' arguments for `l`.
fn gate_up_args(l: &MoeLaunch) -> Result<MoeGateUpArgs> {
    Ok(MoeGateUpArgs {
        x: DevPtr(l.x),
        hidden: int(l.hidden, "hidden")?,
        inter: int(l.inter, "inter")?,
        groups: DevPtr(l.groups),
        num_groups: int(l.num_groups, "groups")?,
        item_row: DevPtr(l.item_row),
        h: DevPtr(l.h),
    })
}

/// The staging slices of the host's experts: `experts[i]`'s items (`first..first + count` of
/// `plan`'s group) as `count x hidden` values of `staged`, where they sit in the layer's output.
fn item_slices<'a>(
    staged: &'a mut [f32],
    plan: &MoePlan,
    experts: &[(usize, InPlaceExpert)],
    hidden: usize,
) -> Result<Vec<&'a mut [f32]>> {
    let mut rest = staged;
    let mut at = 0;
    let mut outs = Vec::with_capacity(experts.len());
    for (g, _) in experts {
        let (first, count) = plan.range(*g);
        let (first, count) = (first as usize * hidden, count as usize * hidden);
        if first < at || first + count > at + rest.len() {
            return Err(Error::Backend(format!(
                "host experts: items {first}.. out of order or past the staging of {} values",
                at + rest.len()
            )));
        }
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(first - at);
        let (mine, tail) = tail.split_at_mut(count);
        outs.push(mine);
        rest = tail;
        at = first + count;
    }
    Ok(outs)
}

/// The host's share of a layer: each expert's rows gathered from `xh` (the layer input on the
/// host, `rows x hidden`): whole experts and split ones (their gate and up only).
struct HostWork<'a> {
    experts: &'a [(usize, InPlaceExpert)],
    halves: &'a [(usize, InPlaceExpert)],
    plan: &'a MoePlan,
    /// Per expert (whole ones first), its items and their rows' inputs.
    inputs: Vec<(std::ops::Range<usize>, Vec<f32>)>,
}

impl<'a> HostWork<'a> {
    fn gather(
        plan: &'a MoePlan,
        xh: &[f32],
        hidden: usize,
        experts: &'a [(usize, InPlaceExpert)],
        halves: &'a [(usize, InPlaceExpert)],
    ) -> Result<Self> {
        let mut inputs = Vec::with_capacity(experts.len() + halves.len());
        for (g, _) in experts.iter().chain(halves) {
            let (first, count) = plan.range(*g);
            let items = first as usize..(first + count) as usize;
            let mut xs = Vec::with_capacity(items.len() * hidden);
            for &row in &plan.item_row[items.clone()] {
                let row = row as usize;
                let x = xh
                    .get(row * hidden..(row + 1) * hidden)
                    .ok_or_else(|| Error::Backend(format!("host experts: no input row {row}")))?;
                xs.extend_from_slice(x);
            }
            inputs.push((items, xs));
        }
        Ok(HostWork {
            experts,
            halves,
            plan,
            inputs,
        })
    }

    /// All of it in one call of the host kernel: whole experts' item outputs (`items x
    /// hidden`) into `outs`, split experts' activations (`items x inter`) into `hs`, while this
    /// thread first runs `side`.
    fn run<R>(
        &mut self,
        kernel: &HostExperts,
        (hidden, inter): (usize, usize),
        outs: &mut [&mut [f32]],
        hs: &mut [&mut [f32]],
        side: impl FnOnce() -> R,
    ) -> Result<HostRun<R>> {
        let jobs = self
            .experts
            .iter()
            .chain(self.halves)
            .zip(&self.inputs)
            .map(|((_, expert), (items, xs))| {
                Ok(ExpertJob {
                    weights: expert.weights(hidden, inter)?,
                    x: xs,
                    row_weights: &self.plan.item_weight[items.clone()],
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let (whole, halves) = jobs.split_at(self.experts.len());
        kernel.experts_and_gate_ups_while(whole, outs, halves, hs, side)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_work_list_groups_rows_by_ascending_expert() {
        // 3 rows, top 2: row 0 -> experts 4, 1; row 1 -> 1, 0; row 2 -> 4, 0.
        let routing = Routing {
            top_k: 2,
            ids: vec![4, 1, 1, 0, 4, 0],
            weights: vec![0.6, 0.4, 0.7, 0.3, 0.9, 0.1],
        };
        let plan = MoePlan::new(&routing, 6);
        assert_eq!(plan.hit, vec![0, 1, 4]);
        assert_eq!(plan.starts, vec![0, 2, 4, 6]);
        // Each expert's items in ascending row order.
        assert_eq!(plan.item_row, vec![1, 2, 0, 1, 0, 2]);
        assert_eq!(plan.item_weight, vec![0.3, 0.1, 0.4, 0.7, 0.6, 0.9]);
        // Each row's items in ascending expert id: row 0 has expert 1 (item 2) then 4 (item 4).
        assert_eq!(plan.row_items, vec![2, 4, 0, 3, 1, 5]);
        assert_eq!(plan.range(2), (4, 2));
        assert_eq!(plan.max_count(), 2);
    }

    #[test]
    fn device_routing_words_read_back_as_ids_then_weights() {
        // 2 rows, top 2: the ids' bits, then the weights, as route_for_host lays them out.
        let mut words: Vec<f32> = [3u32, 0, 5, 1].iter().map(|&i| f32::from_bits(i)).collect();
        words.extend([0.75f32, 0.25, 0.5, 0.5]);
        let routing = routing_from_words(&words, 2, 6).unwrap();
        assert_eq!(routing.top_k, 2);
        assert_eq!(routing.ids, vec![3, 0, 5, 1]);
        assert_eq!(routing.weights, vec![0.75, 0.25, 0.5, 0.5]);
        // An id past the experts, or words that are not two equal halves of whole rows, are
        // errors naming what was read, not a routing.
        let err = routing_from_words(&words, 2, 5).unwrap_err().to_string();
        assert!(err.contains("expert 5 of 5"), "{err}");
        let err = routing_from_words(&words[..6], 2, 6)
            .unwrap_err()
            .to_string();
        assert!(err.contains("6 words"), "{err}");
        assert!(routing_from_words(&words[..7], 2, 6).is_err());
    }
}
