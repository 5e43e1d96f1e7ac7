// Routing of the MoE layers on the device: the router's softmax and top-k, PhiMoE's SparseMixer
// top-2, the routing counts of the draft's prefetch plan, and the grouped-expert work list built
// from device routing (alone, or fused with the routing for few rows).
//
// Exactness contract (as the CPU reference): a row's experts and weights depend only on its own
// logits (one warp per row, fixed shuffle trees), and the work list is the one the host builds,
// whatever the block size (routing.cuh, plan_list).

#include "common.cuh"

#include "routing.cuh"

#if !defined(ROUTE_PLAN_WARPS)
#error "build.rs defines the constants shared with the host (src/backend/cuda/runtime/kernel_defines.rs)"
#endif

// Router softmax and top-k on the device, one warp per row. ids/weights: [rows, top_k].
extern "C" __global__ void route_softmax_topk(const float* logits, int experts, int top_k,
                                              int renormalize, float scale, unsigned* __restrict__ ids,
                                              float* __restrict__ weights) {
    SPX_PROLOGUE();
    __shared__ int chosen[MAX_TOP_K];
    __shared__ float chosen_p[MAX_TOP_K];
    const size_t r = blockIdx.x;
    route_row(logits + r * experts, experts, top_k, renormalize, scale, chosen, chosen_p, ids + r * top_k,
              weights + r * top_k);
}

// PhiMoE's SparseMixer top-2 at inference, as the CPU reference: each pick is the arg-max (first
// index on ties) of the logits not yet picked, weighted by a softmax over the candidates that lie
// within the jitter threshold of it, evaluated at the pick. One warp per row; ids/weights [rows, 2].
extern "C" __global__ void route_sparse_mixer(const float* logits, int experts, float jitter_eps,
                                              unsigned* __restrict__ ids, float* __restrict__ weights) {
    SPX_PROLOGUE();
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
        warp_best(best, best_e);
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
extern "C" __global__ void count_routes(const unsigned* ids, int n, unsigned* __restrict__ counts) {
    SPX_PROLOGUE();
    for (int i = threadIdx.x; i < n; i += blockDim.x) atomicAdd(&counts[ids[i]], 1u);
}

// The work list after route_softmax_topk. Grid: 1; block: any multiple of 32 threads.
extern "C" __global__ void moe_plan(const unsigned* ids, const float* weights,
                                    int rows, int top_k, int experts, const ExpertGroup* SPX_READONLY table,
                                    int max_groups, ExpertGroup* __restrict__ groups,
                                    unsigned* __restrict__ item_row, float* __restrict__ item_weight,
                                    unsigned* __restrict__ row_items) {
    SPX_PROLOGUE();
    __shared__ PlanShared sh;
    plan_list(ids, weights, rows, top_k, experts, table, max_groups, groups, item_row, item_weight, row_items,
              &sh);
}


// route_softmax_topk and moe_plan in one launch, for few rows (decode, verification windows):
// route_plan_block (routing.cuh). Grid: 1; block: 32 * ROUTE_PLAN_WARPS.
extern "C" __global__ void __launch_bounds__(32 * ROUTE_PLAN_WARPS) route_plan(
    const float* logits, int experts, int top_k, int renormalize, float scale,
    unsigned* __restrict__ ids, float* __restrict__ weights, int rows, const ExpertGroup* SPX_READONLY table,
    int max_groups, ExpertGroup* __restrict__ groups, unsigned* __restrict__ item_row,
    float* __restrict__ item_weight, unsigned* __restrict__ row_items) {
    SPX_PROLOGUE();
    route_plan_block<ROUTE_PLAN_WARPS>(logits, experts, top_k, renormalize, scale, ids, weights, rows, table,
                                       max_groups, groups, item_row, item_weight, row_items);
}
