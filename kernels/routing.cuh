// The per-row router top-k and the grouped-expert work list of the routing kernels (routing.cu).
// Spliced into each including file by build.rs, like common.cuh, which the file includes first.

#ifndef SPECTER_KERNELS_ROUTING_CUH
#define SPECTER_KERNELS_ROUTING_CUH

#if !defined(MAX_TOP_K) || !defined(PLAN_MAX_EXPERTS)
#error "build.rs defines the constants shared with the host (src/backend/cuda/runtime/kernel_defines.rs)"
#endif

// Probabilities per lane kept in registers by route_row (experts <= 32 * ROUTE_CACHE).
#define ROUTE_CACHE 4

// The warp's largest (value, id), ties to the lower id, by a xor butterfly: every lane gets it.
__device__ __forceinline__ void warp_best(float& best, int& best_e) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
        if (ob > best || (ob == best && oe < best_e)) {
            best = ob;
            best_e = oe;
        }
    }
}

// One top-k pick from the probabilities a lane keeps (expert lane + 32 u in pc[u]), the experts
// already taken marked in the lane's taken_bits: the warp's largest, ties to the lower id, then
// marked taken by its lane. Every lane gets (best, best_e).
__device__ __forceinline__ void pick_cached(const float pc[ROUTE_CACHE], unsigned& taken_bits, int experts,
                                            float& best, int& best_e) {
    const int lane = threadIdx.x & 31;
    best = -1.0f;
    best_e = experts;
#pragma unroll
    for (int u = 0; u < ROUTE_CACHE; ++u) {
        const int e = lane + 32 * u;
        if (e >= experts || ((taken_bits >> u) & 1u)) continue;
        if (pc[u] > best || (pc[u] == best && e < best_e)) {
            best = pc[u];
            best_e = e;
        }
    }
    warp_best(best, best_e);
    if (best_e < experts && (best_e & 31) == lane) taken_bits |= 1u << (best_e >> 5);
}

// Router softmax and top-k of one row by one warp (largest probability first, ties to the lower
// id), then optional renormalisation over the chosen k and scaling; as the CPU reference's
// SoftmaxTopK. `chosen`/`chosen_p`: the warp's own MAX_TOP_K shared slots.
__device__ __forceinline__ void route_row(const float* row, int experts, int top_k, int renormalize,
                                          float scale, int* chosen, float* chosen_p, unsigned* __restrict__ ids,
                                          float* __restrict__ weights) {
    const int lane = threadIdx.x & 31;
    float m = -__int_as_float(0x7f800000);
    for (int e = lane; e < experts; e += 32) m = fmaxf(m, row[e]);
    m = warp_max(m);
    float total = 0.0f;
    for (int e = lane; e < experts; e += 32) total += expf(row[e] - m);
    total = warp_sum(total);
    // Up to 32 * ROUTE_CACHE experts, each lane keeps its experts' probabilities in registers
    // across the top_k picks (the same values the loop below recomputes otherwise).
    const bool cached = experts <= 32 * ROUTE_CACHE;
    float pc[ROUTE_CACHE];
    unsigned taken_bits = 0;
    if (cached) {
#pragma unroll
        for (int u = 0; u < ROUTE_CACHE; ++u) {
            const int e = lane + 32 * u;
            pc[u] = e < experts ? expf(row[e] - m) / total : 0.0f;
        }
    }
    for (int j = 0; j < top_k; ++j) {
        float best = -1.0f;
        int best_e = experts;
        if (cached) {
            pick_cached(pc, taken_bits, experts, best, best_e);
        } else {
            for (int e = lane; e < experts; e += 32) {
                bool taken = false;
                for (int t = 0; t < j; ++t) taken |= chosen[t] == e;
                if (taken) continue;
                const float p = expf(row[e] - m) / total;
                if (p > best || (p == best && e < best_e)) {
                    best = p;
                    best_e = e;
                }
            }
            warp_best(best, best_e);
        }
        if (lane == 0) {
            chosen[j] = best_e;
            chosen_p[j] = best;
        }
        __syncwarp();
    }
    if (lane == 0) {
        float s = 0.0f;
        for (int j = 0; j < top_k; ++j) s += chosen_p[j];
        for (int j = 0; j < top_k; ++j) {
            float w = chosen_p[j];
            if (renormalize) w /= s;
            if (scale != 1.0f) w *= scale;
            ids[j] = (unsigned)chosen[j];
            weights[j] = w;
        }
    }
    __syncwarp();
}


// The work list's scratch in shared memory.
struct PlanShared {
    unsigned count[PLAN_MAX_EXPERTS];  // items per expert
    unsigned start[PLAN_MAX_EXPERTS];  // the expert's first item
    unsigned group[PLAN_MAX_EXPERTS];  // the expert's group, among the experts hit
    unsigned hits;
};

// The grouped-MoE work list from device routing (src/backend/cuda/moe/experts.rs): items grouped by
// ascending expert id, each expert's in ascending (row, slot) order, exactly as the host builds it.
// `table[e]` holds expert e's weight pointers. Groups past the number of experts hit get count 0,
// so kernels launched over `max_groups` groups do nothing there. Run by the whole block (any
// size): counts by shared atomics (integers, so their order does not matter), offsets by one
// warp's scan in expert order, and each hit expert's items placed by one warp in ascending item
// order (ballots), so the list does not depend on the launch.
// ids/weights carry no __restrict__: in route_plan they were written earlier in the same kernel,
// so they must not be read through the non-coherent read-only path.
__device__ void plan_list(const unsigned* ids, const float* weights, int rows, int top_k,
                          int experts, const ExpertGroup* SPX_READONLY table, int max_groups,
                          ExpertGroup* __restrict__ groups, unsigned* __restrict__ item_row,
                          float* __restrict__ item_weight, unsigned* row_items, PlanShared* sh) {
    const int n = rows * top_k;
    const int tid = threadIdx.x, threads = blockDim.x;
    const int warp = tid >> 5, lane = tid & 31, warps = threads >> 5;
    for (int e = tid; e < experts; e += threads) sh->count[e] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += threads) atomicAdd(&sh->count[ids[i]], 1u);
    __syncthreads();
    if (warp == 0) {
        // Lane l scans experts [l * per, (l + 1) * per): its totals, then the warp's exclusive
        // prefix of them, then its own experts in order.
        const int per = (experts + 31) / 32;
        const int e0 = min(experts, lane * per), e1 = min(experts, e0 + per);
        unsigned items = 0, hit = 0;
        for (int e = e0; e < e1; ++e) {
            items += sh->count[e];
            hit += sh->count[e] > 0;
        }
        unsigned items_before = items, hit_before = hit;
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned a = __shfl_up_sync(0xffffffffu, items_before, o);
            const unsigned b = __shfl_up_sync(0xffffffffu, hit_before, o);
            if (lane >= o) {
                items_before += a;
                hit_before += b;
            }
        }
        items_before -= items;
        hit_before -= hit;
        for (int e = e0; e < e1; ++e) {
            sh->start[e] = items_before;
            sh->group[e] = hit_before;
            items_before += sh->count[e];
            hit_before += sh->count[e] > 0;
        }
        if (lane == 31) sh->hits = hit_before;
    }
    __syncthreads();
    for (int e = tid; e < experts; e += threads) {
        if (sh->count[e] > 0) {
            ExpertGroup grp = table[e];
            grp.first = sh->start[e];
            grp.count = sh->count[e];
            groups[sh->group[e]] = grp;
        }
    }
    for (int g = (int)sh->hits + tid; g < max_groups; g += threads) {
        ExpertGroup grp = table[0];
        grp.first = 0;
        grp.count = 0;
        groups[g] = grp;
    }
    for (int e = warp; e < experts; e += warps) {
        if (sh->count[e] == 0) continue;
        unsigned pos = sh->start[e];
        for (int i0 = 0; i0 < n; i0 += 32) {
            const int i = i0 + lane;
            const bool mine = i < n && ids[i] == (unsigned)e;
            const unsigned m = __ballot_sync(0xffffffffu, mine);
            if (mine) {
                const unsigned p = pos + __popc(m & ((1u << lane) - 1u));
                item_row[p] = (unsigned)(i / top_k);
                item_weight[p] = weights[i];
                row_items[i] = p;
            }
            pos += __popc(m);
        }
    }
    __syncthreads();
    // Each row's items in ascending expert id, which is ascending item position: sorted in
    // registers (one round of loads, not one per step of the sort).
    for (int r = tid; r < rows; r += threads) {
        unsigned* list = row_items + (size_t)r * top_k;
        unsigned v[MAX_TOP_K];
#pragma unroll
        for (int a = 0; a < MAX_TOP_K; ++a) v[a] = a < top_k ? list[a] : 0xffffffffu;
#pragma unroll
        for (int a = 1; a < MAX_TOP_K; ++a) {
#pragma unroll
            for (int b = a; b > 0; --b) {
                const unsigned lo = min(v[b - 1], v[b]), hi = max(v[b - 1], v[b]);
                v[b - 1] = lo;
                v[b] = hi;
            }
        }
#pragma unroll
        for (int a = 0; a < MAX_TOP_K; ++a) {
            if (a < top_k) list[a] = v[a];
        }
    }
}

// route_plan_block for one row of at most 32 * ROUTE_CACHE experts, by one warp in registers (a
// decode step's routing is a latency chain: no shared memory, barriers or reloads here). The
// routing is route_row's (its probabilities, picks and weights, in its order); the work list is
// the one plan_list gives one row: the picked experts (all different) a group of one item each,
// groups and items in ascending expert id, and row_items 0 .. top_k - 1 (ascending item).
__device__ __forceinline__ void route_plan_one(const float* row, int experts, int top_k,
                                               int renormalize, float scale, unsigned* __restrict__ ids,
                                               float* __restrict__ weights, const ExpertGroup* SPX_READONLY table,
                                               int max_groups, ExpertGroup* __restrict__ groups,
                                               unsigned* __restrict__ item_row, float* __restrict__ item_weight,
                                               unsigned* __restrict__ row_items) {
    const int lane = threadIdx.x & 31;
    float x[ROUTE_CACHE];
#pragma unroll
    for (int u = 0; u < ROUTE_CACHE; ++u) {
        const int e = lane + 32 * u;
        x[u] = e < experts ? row[e] : 0.0f;
    }
    float m = -__int_as_float(0x7f800000);
#pragma unroll
    for (int u = 0; u < ROUTE_CACHE; ++u) {
        if (lane + 32 * u < experts) m = fmaxf(m, x[u]);
    }
    m = warp_max(m);
    float total = 0.0f;
#pragma unroll
    for (int u = 0; u < ROUTE_CACHE; ++u) {
        if (lane + 32 * u < experts) total += expf(x[u] - m);
    }
    total = warp_sum(total);
    float pc[ROUTE_CACHE];
#pragma unroll
    for (int u = 0; u < ROUTE_CACHE; ++u) {
        pc[u] = lane + 32 * u < experts ? expf(x[u] - m) / total : 0.0f;
    }
    // Lane j keeps pick j.
    unsigned taken_bits = 0;
    int my_e = experts;
    float my_p = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        float best;
        int best_e;
        pick_cached(pc, taken_bits, experts, best, best_e);
        if (lane == j) {
            my_e = best_e;
            my_p = best;
        }
    }
    float s = 0.0f;
    int rank = 0;
    for (int j = 0; j < top_k; ++j) {
        s += __shfl_sync(0xffffffffu, my_p, j);
        rank += __shfl_sync(0xffffffffu, my_e, j) < my_e;
    }
    if (lane < top_k) {
        float w = my_p;
        if (renormalize) w /= s;
        if (scale != 1.0f) w *= scale;
        ids[lane] = (unsigned)my_e;
        weights[lane] = w;
        ExpertGroup grp = table[my_e];
        grp.first = (unsigned)rank;
        grp.count = 1;
        groups[rank] = grp;
        item_row[rank] = 0;
        item_weight[rank] = w;
        row_items[lane] = (unsigned)lane;
    }
    for (int g = top_k + lane; g < max_groups; g += 32) {
        ExpertGroup grp = table[0];
        grp.first = 0;
        grp.count = 0;
        groups[g] = grp;
    }
}

// Routing of `rows` rows (warp w of the block's RW routes rows w, w + RW, ...: the per-row code of
// route_softmax_topk), then, after the block barrier makes ids/weights visible, the work list as
// moe_plan builds it (one row: route_plan_one, the same values). The body of route_plan
// (routing.cu) and of block 0 of route_plan_shared_f16 (gemv_f16.cu); the block has 32 * RW
// threads.
template <int RW>
__device__ __forceinline__ void route_plan_block(const float* logits, int experts, int top_k,
                                                 int renormalize, float scale, unsigned* ids, float* weights,
                                                 int rows, const ExpertGroup* SPX_READONLY table, int max_groups,
                                                 ExpertGroup* __restrict__ groups, unsigned* __restrict__ item_row,
                                                 float* __restrict__ item_weight, unsigned* row_items) {
    __shared__ int chosen[RW][MAX_TOP_K];
    __shared__ float chosen_p[RW][MAX_TOP_K];
    __shared__ PlanShared sh;
    const int warp = threadIdx.x >> 5;
    if (rows == 1 && experts <= 32 * ROUTE_CACHE && top_k <= min(experts, 32)) {
        if (warp == 0) {
            route_plan_one(logits, experts, top_k, renormalize, scale, ids, weights, table, max_groups, groups,
                           item_row, item_weight, row_items);
        }
        return;
    }
    for (int r = warp; r < rows; r += RW) {
        route_row(logits + (size_t)r * experts, experts, top_k, renormalize, scale, chosen[warp], chosen_p[warp],
                  ids + (size_t)r * top_k, weights + (size_t)r * top_k);
    }
    __syncthreads();
    plan_list(ids, weights, rows, top_k, experts, table, max_groups, groups, item_row, item_weight, row_items,
              &sh);
}

#endif  // SPECTER_KERNELS_ROUTING_CUH
