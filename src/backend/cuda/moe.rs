//! Routed-expert dispatch: the host-side work list of a layer's routing ([`MoePlan`]), the expert
//! pointer tables, and the grouped expert kernels for resident experts and, through the expert
//! slots (src/backend/cuda/slots.rs), for offloaded ones. Routing on the device is in
//! src/backend/cuda/moe_device.rs.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::act::{GpuAct, GpuWeight};
use super::backend::CudaBackend;
use super::driver::guarded;
use super::experts::{ExpertGroup, MoeLaunch, SharedDown};
use super::kernels::*;
use super::slots::{ExpertOffload, InPlaceExpert};
use crate::backend::cpu::{Cpu, Mat};
use crate::backend::{Backend, GatedMlp, RouteSpec, Routing};
use crate::host_experts::{ExpertJob, HostExperts};
use crate::{Error, Result};

/// Which rows go to which expert in one MoE call: items are (row, slot) pairs grouped by
/// ascending expert id.
pub(crate) struct MoePlan {
    /// Experts hit, ascending.
    pub hit: Vec<u32>,
    /// `hit[g]`'s items are `starts[g]..starts[g + 1]`.
    pub starts: Vec<u32>,
    pub item_row: Vec<u32>,
    pub item_weight: Vec<f32>,
    /// `[rows, top_k]`: each row's items in ascending expert id.
    pub row_items: Vec<u32>,
}

impl MoePlan {
    pub(crate) fn new(routing: &Routing, num_experts: usize) -> Self {
        let k = routing.top_k;
        let rows = routing.ids.len() / k;
        let mut per_expert: Vec<Vec<(u32, f32)>> = vec![Vec::new(); num_experts];
        for (i, (&e, &w)) in routing.ids.iter().zip(&routing.weights).enumerate() {
            per_expert[e as usize].push(((i / k) as u32, w));
        }
        let mut plan = MoePlan {
            hit: Vec::new(),
            starts: vec![0],
            item_row: Vec::with_capacity(rows * k),
            item_weight: Vec::with_capacity(rows * k),
            row_items: Vec::with_capacity(rows * k),
        };
        let mut row_lists: Vec<Vec<u32>> = vec![Vec::with_capacity(k); rows];
        for (e, list) in per_expert.iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            plan.hit.push(e as u32);
            for &(r, w) in list {
                row_lists[r as usize].push(plan.item_row.len() as u32);
                plan.item_row.push(r);
                plan.item_weight.push(w);
            }
            plan.starts.push(plan.item_row.len() as u32);
        }
        for list in row_lists {
            plan.row_items.extend(list);
        }
        plan
    }

    pub(crate) fn items(&self) -> usize {
        self.item_row.len()
    }

    /// `(first, count)` of group `g`.
    pub(crate) fn range(&self, g: usize) -> (u32, u32) {
        (self.starts[g], self.starts[g + 1] - self.starts[g])
    }

    pub(crate) fn max_count(&self) -> usize {
        (0..self.hit.len())
            .map(|g| self.range(g).1 as usize)
            .max()
            .unwrap_or(0)
    }

    /// `item_row` then the bits of `item_weight`, one upload.
    pub(crate) fn item_words(&self) -> Vec<u32> {
        let mut words = self.item_row.clone();
        words.extend(self.item_weight.iter().map(|w| w.to_bits()));
        words
    }
}

/// The weight pointers of a resident expert (first/count left 0), and whether it is INT4.
pub(super) fn expert_pointers(
    mlp: &GatedMlp<CudaBackend>,
    e: usize,
    stream: &CudaStream,
) -> Result<(ExpertGroup, bool)> {
    match (&mlp.gate_up, &mlp.down) {
        (GpuWeight::F16 { buf: gu, .. }, GpuWeight::F16 { buf: dn, .. }) => Ok((
            ExpertGroup {
                gate_up: ptr(gu, stream),
                down: ptr(dn, stream),
                ..Default::default()
            },
            false,
        )),
        (
            GpuWeight::Int4 {
                qweight: gq,
                scales: gs,
                ..
            },
            GpuWeight::Int4 {
                qweight: dq,
                scales: ds,
                ..
            },
        ) => Ok((
            ExpertGroup {
                gate_up: ptr(gq, stream),
                gate_up_scales: ptr(gs, stream),
                down: ptr(dq, stream),
                down_scales: ptr(ds, stream),
                ..Default::default()
            },
            true,
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
    pub(super) fn route_op(&self, logits: &GpuAct, spec: RouteSpec) -> Result<Routing> {
        // The routing decides which experts are copied, so the host needs it anyway; computing
        // it with the CPU reference's code keeps top-k ties and SparseMixer identical.
        let data = self.to_host(logits)?;
        Cpu.route(
            &Mat {
                rows: logits.rows,
                cols: logits.cols,
                data,
            },
            spec,
        )
    }

    pub(super) fn routed_moe_op(
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
        let routing = self.route(logits, spec)?;
        if let Some(layer) = count_as {
            let ids = self.upload_u32(&routing.ids)?;
            self.count_routes(ptr(&ids, &self.stream), routing.ids.len(), layer)?;
        }
        let out = self.moe_experts(x, &routing, experts)?;
        Ok((out, Some(routing)))
    }

    pub(super) fn moe_experts_op(
        &self,
        x: &GpuAct,
        routing: &Routing,
        experts: &[GatedMlp<Self>],
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
        let inter = match (&first.gate_up, &first.down) {
            (GpuWeight::F16 { shape, .. }, _) if shape.len() == 2 => shape[0] / 2,
            (GpuWeight::Int4 { n, .. }, _) => n / 2,
            (GpuWeight::Offloaded { layer, .. }, _) => match &self.offload {
                Some(o) => self.lock(o)?.inter(*layer)?,
                None => {
                    return Err(shape_err(
                        "moe_experts",
                        "offloaded expert without a cache".into(),
                    ))
                }
            },
            (other, _) => {
                return Err(shape_err(
                    "moe_experts",
                    format!("{} is not an expert", other.describe()),
                ))
            }
        };
        let h = self.alloc(plan.items(), inter)?;
        let out = self.alloc(plan.items(), hidden)?;
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
        match &first.gate_up {
            GpuWeight::Offloaded { layer, .. } => {
                self.run_offloaded(*layer, &plan, x, &mut launch)?;
            }
            _ => {
                let mut groups = Vec::with_capacity(plan.hit.len());
                let int4 = matches!(first.gate_up, GpuWeight::Int4 { .. });
                for (g, &e) in plan.hit.iter().enumerate() {
                    let (mut group, q) = expert_pointers(&experts[e as usize], e as usize, s)?;
                    if q != int4 {
                        return Err(shape_err(
                            "moe_experts",
                            format!(
                                "expert {e} is not of the same kind (FP16 or INT4) as expert {}",
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
                self.launch_moe(&launch, int4)?;
                // The uploaded group table must outlive the kernels that read it.
                self.defer_free(d_groups);
            }
        }
        let d_row_items = self.upload_u32(&plan.row_items)?;
        let args = [
            launch.out,
            ptr(&d_row_items, s),
            int(k, "top_k")?,
            int(hidden, "hidden")?,
            ptr(&y.buf, s),
            0,
        ];
        self.launch(
            &self.k.moe_combine,
            "moe combine",
            (x.rows as u32, grid_for(hidden, ROW_THREADS), 1),
            ROW_THREADS,
            &args,
        )?;
        drop(d_items);
        drop(h);
        drop(out);
        Ok(y)
    }

    /// Launches the grouped FP16 expert kernels (gate/up then down) for one work list.
    /// The grouped FP16 expert kernels; with `shared`, the down launch also computes the shared
    /// experts' down product in a last row of blocks.
    pub(super) fn launch_moe_f16(&self, l: &MoeLaunch, shared: Option<&SharedDown>) -> Result<()> {
        let (h, i) = (int(l.hidden, "hidden")?, int(l.inter, "inter")?);
        let groups = int(l.num_groups, "groups")?;
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
            &[l.x, h, i, l.groups, groups, l.item_row, l.h],
        )?;
        // Work blocks of a group's down product: the one-item forms give a warp more features.
        let gx = grid_for(l.hidden, (GEMV_WARPS * GEMV_FEATURES) as u32);
        let gx_routed = if one {
            grid_for(l.hidden, (GEMV_WARPS * GEMV_DOWN_FEATURES_ONE) as u32)
        } else {
            gx
        };
        let routed = blocks(gx_routed, l.num_groups);
        let mut args = vec![l.h, h, i, l.groups, groups, l.item_weight, l.out];
        let (down, work_blocks) = match shared {
            None if one => (&self.k.moe_down_1, routed),
            None => (&self.k.moe_down, routed),
            Some(sd) => {
                args.extend_from_slice(&[
                    sd.h,
                    int(sd.rows, "rows")?,
                    int(sd.inter, "shared inter")?,
                    sd.down,
                    sd.y,
                ]);
                let k = if one {
                    &self.k.moe_down_shared_1
                } else {
                    &self.k.moe_down_shared
                };
                // The shared experts' down product: gx work blocks (the one-item form) or gx
                // per row group after the routed ones.
                let shared_blocks = if one {
                    gx
                } else {
                    gx.saturating_mul(gemv_row_groups(sd.rows))
                };
                (k, routed.saturating_add(shared_blocks))
            }
        };
        self.launch(
            &down.f,
            "moe down",
            (down.grid(work_blocks, one), 1, 1),
            32 * GEMV_WARPS as u32,
            &args,
        )
    }
}

impl CudaBackend {
    pub(crate) fn upload_groups(&self, groups: &[ExpertGroup]) -> Result<CudaSlice<u32>> {
        let words: &[u32] = bytemuck::cast_slice(groups);
        self.upload_u32(words)
    }

    /// Buffers freed while kernels may still read them: with stream-ordered allocation
    /// (cuMemFreeAsync on this stream) the free itself is ordered after those kernels.
    pub(crate) fn defer_free<T>(&self, buf: CudaSlice<T>) {
        drop(buf);
    }

    pub(crate) fn launch_moe(&self, l: &MoeLaunch, int4: bool) -> Result<()> {
        if int4 {
            self.launch_moe_int4(l)
        } else {
            self.launch_moe_f16(l, None)
        }
    }

    fn launch_moe_int4(&self, l: &MoeLaunch) -> Result<()> {
        self.int4.launch(&self.stream, l)
    }

    /// Runs the routed experts of one offloaded layer as the cache policy decides: each round's
    /// resident experts from their slots, then the experts copied in for it; and, with the host
    /// path, the misses it leaves to the host, computed by the host kernel from `x` while the GPU
    /// works, their outputs copied into `out`'s items before the combine. The host kernel has the
    /// GPU kernel's bits, so the placement changes no output.
    fn run_offloaded(
        &self,
        layer: usize,
        plan: &MoePlan,
        x: &GpuAct,
        launch: &mut MoeLaunch,
    ) -> Result<()> {
        let o = self
            .offload
            .as_ref()
            .ok_or_else(|| shape_err("moe_experts", "offloaded expert without a cache".into()))?;
        let mut slots = self.lock(o)?;
        let stream = self.stream.clone();
        let down_offset = 2 * slots.matrix_bytes() as u64;
        let rows: Vec<u32> = (0..plan.hit.len()).map(|g| plan.range(g).1).collect();
        let rounds = slots.serve(layer, &plan.hit, &rows)?;
        let elsewhere = rounds
            .first()
            .map(|r| r.elsewhere.clone())
            .unwrap_or_default();
        let host_job = match (elsewhere.is_empty(), slots.host_kernel()) {
            (true, _) => None,
            (false, None) => {
                return Err(Error::Backend(
                    "the cache left experts to the host, but no host kernel runs".into(),
                ))
            }
            (false, Some(kernel)) => {
                let experts = elsewhere
                    .iter()
                    .map(|e| Ok((e.index, slots.in_place(layer, e.expert)?)))
                    .collect::<Result<Vec<_>>>()?;
                Some((kernel, experts, self.to_host(x)?))
            }
        };
        let (hidden, inter) = (launch.hidden, launch.inter);
        let mut enqueue_gpu = |slots: &mut ExpertOffload| -> Result<()> {
            for round in &rounds {
                if !round.hits.is_empty() {
                    let ptrs = slots.hit_slots(layer, &round.hits, &stream)?;
                    let groups: Vec<usize> = round.hits.iter().map(|h| h.index).collect();
                    self.launch_slot_groups(plan, &groups, &ptrs, down_offset, launch)?;
                }
                if !round.loads.is_empty() {
                    let ptrs = slots.load_slots(layer, &round.loads, &stream)?;
                    let groups: Vec<usize> = round.loads.iter().map(|l| l.index).collect();
                    self.launch_slot_groups(plan, &groups, &ptrs, down_offset, launch)?;
                }
                slots.release(&stream)?;
            }
            Ok(())
        };
        let Some((kernel, experts, xh)) = host_job else {
            return enqueue_gpu(&mut slots);
        };
        // The host experts run on the kernel's pool while this thread enqueues the GPU's share
        // (hits and copies, all asynchronous); then it waits for the host, whose outputs go up
        // in one small copy per expert before the combine reads them.
        let mut host_result = None;
        let mut gpu_result = Ok(());
        let mut waited = std::time::Instant::now();
        kernel.pool().in_place_scope(|scope| {
            let host_result = &mut host_result;
            let (kernel, experts, xh) = (&kernel, &experts, &xh);
            scope.spawn(move |_| {
                let computing = std::time::Instant::now();
                // A panic in the pool would otherwise unwind through this thread; it becomes an
                // error, as the per-layer thread's join made it before.
                let outputs = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    host_expert_outputs(kernel, plan, experts, xh, hidden, inter)
                }))
                .unwrap_or_else(|_| Err(Error::Backend("a host expert task panicked".into())));
                *host_result = Some((outputs, computing.elapsed().as_secs_f64()));
            });
            gpu_result = enqueue_gpu(&mut slots);
            waited = std::time::Instant::now();
        });
        let stall = waited.elapsed().as_secs_f64();
        gpu_result?;
        let (outputs, compute_seconds) =
            host_result.ok_or_else(|| Error::Backend("the host expert job did not run".into()))?;
        let outputs = outputs?;
        for (first_item, out) in &outputs {
            let dst = launch.out + (first_item * hidden * 4) as u64;
            guarded("cuMemcpyHtoDAsync (host expert outputs)", || {
                // SAFETY: `dst` lies inside `out`'s allocation (items `first_item..` of a group
                // of this plan, `hidden` f32 each), made on this stream; the source is pageable,
                // which the driver stages before returning.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(
                        dst,
                        out.as_slice(),
                        stream.cu_stream(),
                    )
                }
            })?;
        }
        // The split learns the kernel's own time (under whatever the link's copies cost it in
        // memory bandwidth), not the wall time, which also holds the GPU share's enqueueing.
        slots.record_host(outputs.len(), compute_seconds);
        slots.record_host_stall(stall);
        Ok(())
    }

    /// Launches the FP16 expert kernels over work-list groups `groups` of `plan` whose weights
    /// sit in expert slots at `slot_ptrs` (gate/up first, down at `down_offset`).
    fn launch_slot_groups(
        &self,
        plan: &MoePlan,
        groups: &[usize],
        slot_ptrs: &[u64],
        down_offset: u64,
        launch: &mut MoeLaunch,
    ) -> Result<()> {
        let list: Vec<ExpertGroup> = groups
            .iter()
            .zip(slot_ptrs)
            .map(|(&g, &base)| {
                let (first, count) = plan.range(g);
                ExpertGroup {
                    gate_up: base,
                    gate_up_scales: 0,
                    down: base + down_offset,
                    down_scales: 0,
                    first,
                    count,
                }
            })
            .collect();
        let d_groups = self.upload_groups(&list)?;
        launch.groups = d_groups.device_ptr(&self.stream).0;
        launch.num_groups = list.len();
        launch.max_count = list.iter().map(|g| g.count as usize).max().unwrap_or(0);
        self.launch_moe(launch, false)?;
        self.defer_free(d_groups);
        Ok(())
    }
}

/// The host's share of a layer: every expert's rows gathered from `xh` (the layer input on the
/// host, `rows x hidden`), all experts in one call of the host kernel. Returns each expert's
/// first item and its items' outputs (`items x hidden`).
fn host_expert_outputs(
    kernel: &HostExperts,
    plan: &MoePlan,
    experts: &[(usize, InPlaceExpert)],
    xh: &[f32],
    hidden: usize,
    inter: usize,
) -> Result<Vec<(usize, Vec<f32>)>> {
    let mut inputs = Vec::with_capacity(experts.len());
    for (g, _) in experts {
        let (first, count) = plan.range(*g);
        let items = first as usize..(first + count) as usize;
        let mut xs = Vec::with_capacity(items.len() * hidden);
        for &row in &plan.item_row[items.clone()] {
            let row = row as usize;
            xs.extend_from_slice(&xh[row * hidden..(row + 1) * hidden]);
        }
        inputs.push((items, xs));
    }
    let jobs = experts
        .iter()
        .zip(&inputs)
        .map(|((_, expert), (items, xs))| {
            Ok(ExpertJob {
                weights: expert.weights(hidden, inter)?,
                x: xs,
                row_weights: &plan.item_weight[items.clone()],
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let mut outs: Vec<Vec<f32>> = inputs
        .iter()
        .map(|(items, _)| vec![0.0f32; items.len() * hidden])
        .collect();
    let mut refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
    kernel.experts(&jobs, &mut refs)?;
    Ok(inputs
        .into_iter()
        .map(|(items, _)| items.start)
        .zip(outs)
        .collect())
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
}
