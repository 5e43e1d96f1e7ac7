// Routing of the MoE layers on the device: the router's softmax and top-k, PhiMoE's SparseMixer
// top-2, the routing counts of the draft's prefetch plan, and the grouped-expert work list built
// from device routing (alone, or fused with the routing for few rows).
//
// Exactness contract (as the CPU reference): a row's experts and weights depend only on its own
// logits (one warp per row, fixed shuffle trees), and the work list is built in one fixed order
// by one thread, the order in which the host builds it.

#include "common.cuh"

#define MAX_TOP_K 16

// Router softmax and top-k of one row by one warp (largest probability first, ties to the lower
// id), then optional renormalisation over the chosen k and scaling; as the CPU reference's
// SoftmaxTopK. `chosen`/`chosen_p`: the warp's own MAX_TOP_K shared slots.
__device__ __forceinline__ void route_row(const float* __restrict__ row, int experts, int top_k, int renormalize,
                                          float scale, int* chosen, float* chosen_p, unsigned* __restrict__ ids,
                                          float* __restrict__ weights) {
    const int lane = threadIdx.x & 31;
    float m = -__int_as_float(0x7f800000);
    for (int e = lane; e < experts; e += 32) m = fmaxf(m, row[e]);
    m = warp_max(m);
    float total = 0.0f;
    for (int e = lane; e < experts; e += 32) total += expf(row[e] - m);
    total = warp_sum(total);
    for (int j = 0; j < top_k; ++j) {
        float best = -1.0f;
        int best_e = experts;
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
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) {
                best = ob;
                best_e = oe;
            }
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

// Router softmax and top-k on the device, one warp per row. ids/weights: [rows, top_k].
extern "C" __global__ void route_softmax_topk(const float* __restrict__ logits, int experts, int top_k,
                                              int renormalize, float scale, unsigned* __restrict__ ids,
                                              float* __restrict__ weights) {
    __shared__ int chosen[MAX_TOP_K];
    __shared__ float chosen_p[MAX_TOP_K];
    const size_t r = blockIdx.x;
    route_row(logits + r * experts, experts, top_k, renormalize, scale, chosen, chosen_p, ids + r * top_k,
              weights + r * top_k);
}

// PhiMoE's SparseMixer top-2 at inference, as the CPU reference: each pick is the arg-max (first
// index on ties) of the logits not yet picked, weighted by a softmax over the candidates that lie
// within the jitter threshold of it, evaluated at the pick. One warp per row; ids/weights [rows, 2].
extern "C" __global__ void route_sparse_mixer(const float* __restrict__ logits, int experts, float jitter_eps,
                                              unsigned* __restrict__ ids, float* __restrict__ weights) {
    const int lane = threadIdx.x;
    const float* row = logits + (size_t)blockIdx.x * experts;
    const float neg_inf = -__int_as_float(0x7f800000);
    int first = -1;
    for (int j = 0; j < 2; ++j) {
        float best = neg_inf;
        int best_e = experts;
        for (int e = lane; e < experts; e += 32) {
            if (e == first) continue;
            const float v = row[e];
            if (v > best || (v == best && e < best_e)) {
                best = v;
                best_e = e;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) {
                best = ob;
                best_e = oe;
            }
        }
        const float threshold = row[best_e];
        float m = neg_inf;
        for (int e = lane; e < experts; e += 32) {
            const float s = row[e];
            const float c = e == first ? neg_inf : s;
            m = fmaxf(m, (threshold - s) / fmaxf(fabsf(s), threshold) > 2.0f * jitter_eps ? neg_inf : c);
        }
        m = warp_max(m);
        float total = 0.0f;
        for (int e = lane; e < experts; e += 32) {
            const float s = row[e];
            const float c = e == first ? neg_inf : s;
            const float kept = (threshold - s) / fmaxf(fabsf(s), threshold) > 2.0f * jitter_eps ? neg_inf : c;
            total += expf(kept - m);
        }
        total = warp_sum(total);
        if (lane == 0) {
            ids[(size_t)blockIdx.x * 2 + j] = (unsigned)best_e;
            weights[(size_t)blockIdx.x * 2 + j] = expf(threshold - m) / total;
        }
        first = best_e;
    }
}

// counts[ids[i]] += 1 for i < n: the draft's routing counted on the device for the prefetch plan.
// Integer adds, so their order does not matter. One block.
extern "C" __global__ void count_routes(const unsigned* __restrict__ ids, int n, unsigned* __restrict__ counts) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) atomicAdd(&counts[ids[i]], 1u);
}

#define PLAN_MAX_EXPERTS 1024

// The grouped-MoE work list from device routing (src/backend/cuda/experts.rs): items grouped by
// ascending expert id, each expert's in ascending (row, slot) order, exactly as the host builds it.
// `table[e]` holds expert e's weight pointers. Groups past the number of experts hit get count 0,
// so kernels launched over `max_groups` groups do nothing there. Run by one thread: the lists are
// short. `cursor`: PLAN_MAX_EXPERTS shared words.
// ids/weights carry no __restrict__: in route_plan they were written earlier in the same kernel,
// so they must not be read through the non-coherent read-only path.
__device__ void plan_list(const unsigned* ids, const float* weights, int rows, int top_k,
                          int experts, const ExpertGroup* __restrict__ table, int max_groups,
                          ExpertGroup* __restrict__ groups, unsigned* __restrict__ item_row,
                          float* __restrict__ item_weight, unsigned* __restrict__ row_items, unsigned* cursor) {
    const int n = rows * top_k;
    for (int e = 0; e < experts; ++e) cursor[e] = 0;
    for (int i = 0; i < n; ++i) cursor[ids[i]] += 1;
    unsigned start = 0;
    int g = 0;
    for (int e = 0; e < experts; ++e) {
        const unsigned c = cursor[e];
        cursor[e] = start;
        if (c > 0) {
            ExpertGroup grp = table[e];
            grp.first = start;
            grp.count = c;
            groups[g++] = grp;
        }
        start += c;
    }
    for (; g < max_groups; ++g) {
        ExpertGroup grp = table[0];
        grp.first = 0;
        grp.count = 0;
        groups[g] = grp;
    }
    for (int i = 0; i < n; ++i) {
        const unsigned pos = cursor[ids[i]]++;
        item_row[pos] = (unsigned)(i / top_k);
        item_weight[pos] = weights[i];
        row_items[i] = pos;
    }
    // Each row's items in ascending expert id, which is ascending item position.
    for (int r = 0; r < rows; ++r) {
        unsigned* list = row_items + (size_t)r * top_k;
        for (int a = 1; a < top_k; ++a) {
            const unsigned v = list[a];
            int b = a - 1;
            while (b >= 0 && list[b] > v) {
                list[b + 1] = list[b];
                --b;
            }
            list[b + 1] = v;
        }
    }
}

// The work list after route_softmax_topk. Grid: 1; block: any (thread 0 works).
extern "C" __global__ void moe_plan(const unsigned* __restrict__ ids, const float* __restrict__ weights,
                                    int rows, int top_k, int experts, const ExpertGroup* __restrict__ table,
                                    int max_groups, ExpertGroup* __restrict__ groups,
                                    unsigned* __restrict__ item_row, float* __restrict__ item_weight,
                                    unsigned* __restrict__ row_items) {
    __shared__ unsigned cursor[PLAN_MAX_EXPERTS];
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    plan_list(ids, weights, rows, top_k, experts, table, max_groups, groups, item_row, item_weight, row_items,
              cursor);
}

#define ROUTE_PLAN_WARPS 8

// route_softmax_topk and moe_plan in one launch, for few rows (decode, verification windows):
// warp w routes rows w, w + ROUTE_PLAN_WARPS, ... (the same per-row code as route_softmax_topk),
// then, after the block barrier makes ids/weights visible, thread 0 builds the work list as
// moe_plan does. Grid: 1; block: 32 * ROUTE_PLAN_WARPS.
extern "C" __global__ void __launch_bounds__(32 * ROUTE_PLAN_WARPS) route_plan(
    const float* __restrict__ logits, int experts, int top_k, int renormalize, float scale,
    unsigned* __restrict__ ids, float* __restrict__ weights, int rows, const ExpertGroup* __restrict__ table,
    int max_groups, ExpertGroup* __restrict__ groups, unsigned* __restrict__ item_row,
    float* __restrict__ item_weight, unsigned* __restrict__ row_items) {
    __shared__ int chosen[ROUTE_PLAN_WARPS][MAX_TOP_K];
    __shared__ float chosen_p[ROUTE_PLAN_WARPS][MAX_TOP_K];
    __shared__ unsigned cursor[PLAN_MAX_EXPERTS];
    const int warp = threadIdx.x >> 5;
    for (int r = warp; r < rows; r += ROUTE_PLAN_WARPS) {
        route_row(logits + (size_t)r * experts, experts, top_k, renormalize, scale, chosen[warp], chosen_p[warp],
                  ids + (size_t)r * top_k, weights + (size_t)r * top_k);
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    plan_list(ids, weights, rows, top_k, experts, table, max_groups, groups, item_row, item_weight, row_items,
              cursor);
}
