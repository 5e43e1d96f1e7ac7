//! The expert cache, the planner's chunking and the simulated copy clock, checked against simple
//! reference models under seeded random operation sequences.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specter::offload::{
    Evicted, ExpertCache, HostShare, InitialResidency, Planner, Policy, ResidencyConfig,
    SimulatedTransfers, TransferEngine,
};
use specter::Error;

fn config(policy: Policy, layers: usize, experts: usize, slots: usize) -> ResidencyConfig {
    ResidencyConfig {
        num_moe_layers: layers,
        num_experts: experts,
        slots_per_layer: slots,
        expert_bytes: 4096,
        policy,
    }
}

/// The one outcome of serving a single expert: a hit, or a load with what it evicted.
fn serve_one(cache: &mut ExpertCache, layer: usize, expert: u32) -> Result<Option<Evicted>, bool> {
    let rounds = cache.serve(layer, &[expert]).expect("serve");
    assert_eq!(rounds.len(), 1, "one expert is served in one round");
    match (rounds[0].hits.as_slice(), rounds[0].loads.as_slice()) {
        ([hit], []) => {
            assert_eq!(hit.expert, expert);
            Err(true)
        }
        ([], [load]) => {
            assert_eq!(load.expert, expert);
            Ok(load.evicted)
        }
        other => panic!("unexpected round {other:?}"),
    }
}

#[test]
fn lru_order_and_eviction_match_a_reference_list() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let initial = vec![vec![3, 7, 1], vec![0, 9]];
    let mut cache = ExpertCache::new(
        config(Policy::Lru, 2, 10, 4),
        &InitialResidency::PerLayer(initial.clone()),
    )
    .expect("cache");
    // Reference: per layer, resident experts from least to most recently used.
    let mut reference = initial;
    let mut evictions = 0;
    for _ in 0..3000 {
        let layer = rng.random_range(0..2);
        let expert: u32 = rng.random_range(0..10);
        let list = &mut reference[layer];
        match serve_one(&mut cache, layer, expert) {
            Err(_hit) => {
                let at = list
                    .iter()
                    .position(|&e| e == expert)
                    .expect("hit on an expert the reference lacks");
                list.remove(at);
                list.push(expert);
            }
            Ok(evicted) => {
                assert!(!list.contains(&expert), "miss on a resident expert");
                let expected_victim = (list.len() == 4).then(|| list.remove(0));
                assert_eq!(evicted.map(|e| e.expert), expected_victim);
                evictions += usize::from(evicted.is_some());
                list.push(expert);
            }
        }
        assert_eq!(cache.resident(layer), reference[layer]);
    }
    assert!(evictions > 500);
    let stats = cache.stats();
    assert_eq!(stats.hits + stats.misses, 3000);
    assert_eq!(stats.bytes_copied, stats.misses * 4096);
}

#[test]
fn a_pass_runs_in_rounds_that_use_each_slot_once() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let slots = 4;
    let mut cache = ExpertCache::new(
        config(Policy::Specter, 1, 16, slots),
        &InitialResidency::FirstExperts,
    )
    .expect("cache");
    let mut multi_round = 0;
    for _ in 0..300 {
        if rng.random_bool(0.3) {
            let plan: Vec<u32> = (0..rng.random_range(1..=slots))
                .map(|_| rng.random_range(0..16))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            cache.prefetch(0, &plan).expect("prefetch");
        }
        let mut pass: Vec<u32> = (0..rng.random_range(1..=10))
            .map(|_| rng.random_range(0..16))
            .collect();
        pass.sort_unstable();
        pass.dedup();
        let rounds = cache.serve(0, &pass).expect("serve");
        multi_round += usize::from(rounds.len() > 1);
        let mut served = vec![false; pass.len()];
        for round in &rounds {
            let mut slot_used = vec![false; slots];
            assert!(!round.hits.is_empty() || !round.loads.is_empty());
            let indices = round.hits.iter().map(|h| (h.index, h.expert, h.slot));
            let loads = round.loads.iter().map(|l| (l.index, l.expert, l.slot));
            for (index, expert, slot) in indices.chain(loads) {
                assert_eq!(pass[index], expert);
                assert!(!std::mem::replace(&mut served[index], true), "served twice");
                assert!(
                    !std::mem::replace(&mut slot_used[slot], true),
                    "slot reused in a round"
                );
            }
        }
        assert!(
            served.iter().all(|&s| s),
            "every expert of the pass is served"
        );
        // The last round's experts are resident where the cache says.
        for load in &rounds.last().expect("a round").loads {
            assert_eq!(cache.slot_of(0, load.expert), Some(load.slot));
        }
        cache.clear_plans();
    }
    assert!(multi_round > 10, "passes wider than the slots must occur");
}

#[test]
fn planned_experts_are_evicted_only_when_every_other_slot_is_planned() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let slots = 5;
    let mut cache = ExpertCache::new(
        config(Policy::Specter, 1, 12, slots),
        &InitialResidency::FirstExperts,
    )
    .expect("cache");
    let mut full_plans = 0;
    for _ in 0..400 {
        let plan_len = rng.random_range(0..=slots);
        let mut plan: Vec<u32> = Vec::new();
        while plan.len() < plan_len {
            let e = rng.random_range(0..12);
            if !plan.contains(&e) {
                plan.push(e);
            }
        }
        cache.prefetch(0, &plan).expect("prefetch");
        for &e in &plan {
            assert!(cache.is_resident(0, e) && cache.is_planned(0, e));
        }
        for _ in 0..20 {
            let e = rng.random_range(0..12);
            let planned: Vec<u32> = (0..12).filter(|&p| cache.is_planned(0, p)).collect();
            if let Ok(Some(evicted)) = serve_one(&mut cache, 0, e) {
                assert!(
                    !planned.contains(&evicted.expert) || planned.len() == slots,
                    "evicted planned expert {} with an unplanned slot left",
                    evicted.expert
                );
                full_plans += usize::from(planned.len() == slots);
            }
        }
        cache.clear_plans();
        assert!(!plan.iter().any(|&e| cache.is_planned(0, e)));
    }
    assert!(full_plans > 0, "the fully-planned case must occur");
}

#[test]
fn unused_prefetches_are_reported_once() {
    let mut cache = ExpertCache::new(config(Policy::Specter, 1, 8, 3), &InitialResidency::Empty)
        .expect("cache");
    let loads = cache.prefetch(0, &[4, 5, 6]).expect("prefetch");
    assert_eq!(
        loads.iter().map(|l| l.expert).collect::<Vec<_>>(),
        [4, 5, 6]
    );
    assert_eq!(serve_one(&mut cache, 0, 5), Err(true));
    assert_eq!(cache.stats().prefetch_used, 1);
    assert_eq!(serve_one(&mut cache, 0, 5), Err(true));
    assert_eq!(cache.stats().prefetch_used, 1, "a prefetch is used once");
    cache.clear_plans();
    // 4 is the least recently used and unused: its eviction is a wasted prefetch.
    assert_eq!(
        serve_one(&mut cache, 0, 1),
        Ok(Some(Evicted {
            expert: 4,
            unused_prefetch: true
        }))
    );
    assert_eq!(cache.take_unused_prefetches(), 1); // expert 6
    assert_eq!(cache.take_unused_prefetches(), 0);
    let stats = cache.stats();
    assert_eq!(stats.prefetched, 3);
    assert_eq!(
        stats.prefetch_used + stats.prefetch_wasted,
        stats.prefetched
    );
}

#[test]
fn reset_restores_the_initial_residency_exactly() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let initial = vec![vec![5, 2, 8], vec![], vec![1, 0, 3, 4]];
    let mut cache = ExpertCache::new(
        config(Policy::Specter, 3, 9, 4),
        &InitialResidency::PerLayer(initial.clone()),
    )
    .expect("cache");
    for _ in 0..500 {
        let layer = rng.random_range(0..3);
        let e = rng.random_range(0..9);
        if rng.random_bool(0.3) {
            cache.prefetch(layer, &[e]).expect("prefetch");
        } else {
            let _ = serve_one(&mut cache, layer, e);
        }
    }
    assert_ne!(
        (0..3).map(|l| cache.resident(l)).collect::<Vec<_>>(),
        initial
    );
    cache.reset();
    for (layer, expected) in initial.iter().enumerate() {
        assert_eq!(&cache.resident(layer), expected, "layer {layer}");
        assert!((0..9).all(|e| !cache.is_planned(layer, e)));
    }
    assert_eq!(cache.take_unused_prefetches(), 0);
    assert_eq!(cache.stats().lookups, 0);
    // Recency is restored too: the first listed expert of the full layer is the next victim.
    assert_eq!(
        serve_one(&mut cache, 2, 7).map(|e| e.map(|e| e.expert)),
        Ok(Some(1))
    );
}

#[test]
fn policies_fix_the_resident_set() {
    let mut all = ExpertCache::new(
        config(Policy::AllResident, 2, 6, 1),
        &InitialResidency::Empty,
    )
    .expect("cache");
    assert_eq!(all.slots_per_layer(), 6);
    for layer in 0..2 {
        for e in 0..6 {
            assert_eq!(serve_one(&mut all, layer, e), Err(true));
        }
    }
    let mut on_demand = ExpertCache::new(
        config(Policy::OnDemand, 2, 6, 3),
        &InitialResidency::FirstExperts,
    )
    .expect("cache");
    assert!(on_demand.resident(0).is_empty() && on_demand.resident(1).is_empty());
    assert_eq!(serve_one(&mut on_demand, 0, 2), Ok(None));
    assert_eq!(
        serve_one(&mut on_demand, 0, 2),
        Ok(None),
        "on demand keeps nothing"
    );
    let first = ExpertCache::new(
        config(Policy::Lru, 2, 6, 3),
        &InitialResidency::FirstExperts,
    )
    .expect("cache");
    assert_eq!(first.resident(1), vec![0, 1, 2]);
}

#[test]
fn bad_configurations_are_refused() {
    let cases = [
        (
            config(Policy::Lru, 2, 6, 0),
            InitialResidency::Empty,
            "resident experts",
        ),
        (
            config(Policy::Lru, 2, 6, 7),
            InitialResidency::Empty,
            "resident experts",
        ),
        (
            config(Policy::Lru, 0, 6, 2),
            InitialResidency::Empty,
            "at least one",
        ),
        (
            config(Policy::Lru, 2, 6, 2),
            InitialResidency::PerLayer(vec![vec![1]]),
            "layers",
        ),
        (
            config(Policy::Lru, 2, 6, 2),
            InitialResidency::PerLayer(vec![vec![1], vec![6]]),
            "expert 6",
        ),
        (
            config(Policy::Lru, 2, 6, 2),
            InitialResidency::PerLayer(vec![vec![1, 1], vec![]]),
            "twice",
        ),
        (
            config(Policy::Lru, 2, 6, 2),
            InitialResidency::PerLayer(vec![vec![1, 2, 3], vec![]]),
            "slots",
        ),
    ];
    for (cfg, initial, needle) in cases {
        match ExpertCache::new(cfg, &initial) {
            Err(Error::Request(message)) => assert!(message.contains(needle), "{message}"),
            other => panic!(
                "expected an error mentioning {needle:?}, got {:?}",
                other.map(|_| ())
            ),
        }
    }
    assert!(SimulatedTransfers::new(0.0, 0.0).is_err());
    assert!(SimulatedTransfers::new(1e9, -1.0).is_err());
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1.0)
}

#[test]
fn simulated_copies_cost_bytes_over_bandwidth() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for _ in 0..50 {
        let bandwidth = rng.random_range(1e8..1e11);
        let size = rng.random_range(1_000..50_000_000usize);
        let n = rng.random_range(1..40usize);
        let mut engine = SimulatedTransfers::new(bandwidth, 0.0).expect("engine");
        let ids: Vec<_> = (0..n).map(|i| engine.issue(0, i, size)).collect();
        let expected = n as f64 * size as f64 / bandwidth;
        let stalled = engine.wait(ids[n - 1]);
        assert!(
            close(engine.now(), expected),
            "{} vs {expected}",
            engine.now()
        );
        assert!(close(stalled, expected));
        assert!(ids.iter().all(|&id| engine.is_complete(id)));
        assert_eq!(engine.wait(ids[0]), 0.0);

        // Copies overlap with compute: only the part compute does not cover stalls.
        let latency = rng.random_range(0.0..1e-4);
        let compute = rng.random_range(0.0..2.0 * expected);
        let mut engine = SimulatedTransfers::new(bandwidth, latency).expect("engine");
        let ids: Vec<_> = (0..n).map(|i| engine.issue(1, i, size)).collect();
        engine.advance(compute);
        let copy_total = n as f64 * (latency + size as f64 / bandwidth);
        let stalled = engine.wait(ids[n - 1]);
        assert!(
            close(stalled, (copy_total - compute).max(0.0)),
            "{stalled} vs {copy_total} - {compute}"
        );
        assert!(close(engine.now(), copy_total.max(compute)));
        assert!(close(engine.stall_s(), stalled));
    }
}

#[test]
fn copies_issued_later_queue_behind_earlier_ones() {
    let mut engine = SimulatedTransfers::new(1e9, 0.0).expect("engine");
    let a = engine.issue(0, 0, 1_000_000); // done at 1 ms
    engine.advance(0.5e-3);
    let b = engine.issue(0, 1, 1_000_000); // starts at 1 ms, done at 2 ms
    assert!(!engine.is_complete(a));
    engine.advance(1.0e-3);
    assert!(engine.is_complete(a) && !engine.is_complete(b));
    assert!(close(engine.wait(b), 0.5e-3));
    assert!(close(engine.now(), 2e-3));
}

#[test]
fn out_of_range_requests_are_refused() {
    let mut cache =
        ExpertCache::new(config(Policy::Lru, 1, 8, 4), &InitialResidency::Empty).expect("cache");
    assert!(cache.serve(0, &[8]).is_err());
    assert!(cache.serve(1, &[0]).is_err());
    assert!(cache.prefetch(0, &[9]).is_err());
    assert!(cache.prefetch(3, &[1]).is_err());
}

#[test]
fn planner_ranks_draft_routing_and_lists_missing_experts_layer_by_layer() {
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let (layers, experts, slots) = (3, 10, 3);
    let cache = ExpertCache::new(
        config(Policy::Specter, layers, experts, slots),
        &InitialResidency::FirstExperts,
    )
    .expect("cache");
    let mut planner = Planner::new(layers, experts, 1e-3, 1e9);
    planner.begin_window(6);
    let mut counts = vec![vec![0u32; experts]; layers];
    for _ in 0..6 {
        for (layer, row) in counts.iter_mut().enumerate() {
            // Skewed routing so the ranking is mostly strict.
            let topk: Vec<u32> = (0..2)
                .map(|_| (rng.random_range(0.0f64..1.0).powi(2) * experts as f64) as u32)
                .collect();
            topk.iter().for_each(|&e| row[e as usize] += 1);
            assert!(planner.record(layer, &topk));
        }
    }
    let plan = planner.plan_for(&cache);
    for (layer, planned) in plan.experts.iter().enumerate() {
        assert!(planned.len() <= slots);
        let routed = counts[layer].iter().filter(|&&c| c > 0).count();
        assert_eq!(planned.len(), routed.min(slots));
        // Ranked by count; nothing left out outranks anything planned.
        for pair in planned.windows(2) {
            let (a, b) = (
                counts[layer][pair[0] as usize],
                counts[layer][pair[1] as usize],
            );
            assert!(a > b || (a == b && pair[0] < pair[1]));
        }
        let lowest = planned.last().map_or(0, |&e| counts[layer][e as usize]);
        for e in 0..experts as u32 {
            if !planned.contains(&e) {
                assert!(counts[layer][e as usize] <= lowest);
            }
        }
    }
    let expected: Vec<(usize, u32)> = plan
        .experts
        .iter()
        .enumerate()
        .flat_map(|(l, p)| {
            p.iter()
                .filter(|&&e| e as usize >= slots)
                .map(move |&e| (l, e))
        })
        .collect();
    assert_eq!(plan.prefetch, expected);
    assert!(!plan.prefetch.is_empty());
}

/// One layer of 8 experts and 4 slots with experts 0 and 1 resident, and a pass needing
/// `SPLIT_EXPERTS` used by `SPLIT_ROWS` rows: 2, 3, 5 and 7 miss, used by 4, 1, 3 and 1 rows.
fn cache_for_split() -> ExpertCache {
    ExpertCache::new(
        config(Policy::Lru, 1, 8, 4),
        &InitialResidency::PerLayer(vec![vec![0, 1]]),
    )
    .expect("cache")
}
const SPLIT_EXPERTS: [u32; 6] = [0, 1, 2, 3, 5, 7];
const SPLIT_ROWS: [u32; 6] = [2, 2, 4, 1, 3, 1];

#[test]
fn misses_left_elsewhere_are_those_fewest_rows_use_and_take_no_slot() {
    let mut cache = cache_for_split();
    let (experts, rows) = (SPLIT_EXPERTS, SPLIT_ROWS);
    let rounds = cache.serve_split(0, &experts, &rows, 2).expect("serve");
    let away: Vec<u32> = rounds[0].elsewhere.iter().map(|e| e.expert).collect();
    assert_eq!(away, vec![3, 7], "the two misses with one row each");
    for e in &rounds[0].elsewhere {
        assert_eq!(experts[e.index], e.expert);
        assert!(!cache.is_resident(0, e.expert), "a host expert took a slot");
    }
    let hits: Vec<u32> = rounds
        .iter()
        .flat_map(|r| r.hits.iter().map(|h| h.expert))
        .collect();
    let loads: Vec<u32> = rounds
        .iter()
        .flat_map(|r| r.loads.iter().map(|l| l.expert))
        .collect();
    assert_eq!(hits, vec![0, 1]);
    assert_eq!(loads, vec![2, 5]);
    let stats = cache.stats();
    assert_eq!((stats.hits, stats.misses, stats.host_experts), (2, 2, 2));
    assert_eq!(stats.host_bytes, 2 * 4096);
    // More left elsewhere than there are misses: every miss, never a hit.
    let rounds = cache.serve_split(0, &experts, &rows, 10).expect("serve");
    assert_eq!(rounds[0].elsewhere.len(), 2, "only 3 and 7 miss now");
    assert!(rounds.iter().all(|r| r.loads.is_empty()));
}

#[test]
fn a_split_miss_follows_the_whole_host_ones_and_takes_no_slot() {
    let mut cache = cache_for_split();
    let (experts, rows) = (SPLIT_EXPERTS, SPLIT_ROWS);
    // 3 and 7 go to the host whole (one row each), then 5 (three rows) is split, and 2 is
    // copied.
    let share = HostShare {
        full: 2,
        gate_up: 1,
    };
    let rounds = cache
        .serve_placed(0, &experts, &rows, share)
        .expect("serve");
    let away: Vec<u32> = rounds[0].elsewhere.iter().map(|e| e.expert).collect();
    let split: Vec<u32> = rounds[0]
        .gate_up_elsewhere
        .iter()
        .map(|e| e.expert)
        .collect();
    assert_eq!((away, split), (vec![3, 7], vec![5]));
    assert_eq!(experts[rounds[0].gate_up_elsewhere[0].index], 5);
    let loads: Vec<u32> = rounds
        .iter()
        .flat_map(|r| r.loads.iter().map(|l| l.expert))
        .collect();
    assert_eq!(loads, vec![2]);
    assert!(!cache.is_resident(0, 5), "a split expert took a slot");
    let stats = cache.stats();
    assert_eq!(
        (stats.misses, stats.host_experts, stats.split_experts),
        (1, 2, 1)
    );
    // Two whole experts and two thirds of one on the host; one whole and a third copied.
    assert_eq!(stats.host_bytes, 2 * 4096 + 2 * (4096 / 3));
    assert_eq!(stats.bytes_copied, 4096 + 4096 / 3);
    // A share larger than the misses takes them all, whole first.
    let rounds = cache
        .serve_placed(
            0,
            &[2, 5],
            &[1, 1],
            HostShare {
                full: 1,
                gate_up: 1,
            },
        )
        .expect("serve");
    assert_eq!(
        rounds[0].elsewhere.len() + rounds[0].gate_up_elsewhere.len(),
        1
    );
    assert_eq!(
        rounds[0].elsewhere.len(),
        1,
        "2 is resident now; 5 goes whole"
    );
}

#[test]
fn empty_slots_count_what_no_expert_holds_and_fill_as_misses_are_copied() {
    let mut cache = cache_for_split();
    // 4 slots, experts 0 and 1 resident.
    assert_eq!(cache.empty_slots(0), 2);
    assert_eq!(cache.empty_slots(1), 0, "a layer out of range has none");
    // 2 is copied into an empty slot; 3 goes elsewhere and takes none.
    cache
        .serve_split(0, &[0, 2, 3], &[1, 1, 1], 1)
        .expect("serve");
    assert!(cache.is_resident(0, 2) && !cache.is_resident(0, 3));
    assert_eq!(cache.empty_slots(0), 1);
    // Two more misses fill the last slot and then evict: never below zero.
    cache.serve(0, &[4, 5]).expect("serve");
    assert_eq!(cache.empty_slots(0), 0);
}

#[test]
fn of_misses_with_as_many_rows_the_recently_needed_are_copied_and_the_others_left_elsewhere() {
    // One layer, 8 experts, 2 slots, both full (0 and 1).
    let mut cache = ExpertCache::new(
        config(Policy::Lru, 1, 8, 2),
        &InitialResidency::PerLayer(vec![vec![0, 1]]),
    )
    .expect("cache");
    // 5 misses and goes elsewhere (the later of two never-needed misses).
    let rounds = cache.serve_split(0, &[4, 5], &[1, 1], 1).expect("serve");
    let away: Vec<u32> = rounds[0].elsewhere.iter().map(|e| e.expert).collect();
    assert_eq!(away, vec![5]);
    // 5 is needed again beside 6, never needed before: 6 goes elsewhere and 5 is copied,
    // though 5 is the later one, which alone would have kept it elsewhere.
    let rounds = cache.serve_split(0, &[6, 5], &[1, 1], 1).expect("serve");
    let away: Vec<u32> = rounds[0].elsewhere.iter().map(|e| e.expert).collect();
    let loads: Vec<u32> = rounds
        .iter()
        .flat_map(|r| r.loads.iter().map(|l| l.expert))
        .collect();
    assert_eq!((away, loads), (vec![6], vec![5]));
    assert!(cache.is_resident(0, 5));
    // Rows still come first: an expert many rows use is copied however long ago it was needed.
    let rounds = cache.serve_split(0, &[6, 7], &[1, 3], 1).expect("serve");
    let away: Vec<u32> = rounds[0].elsewhere.iter().map(|e| e.expert).collect();
    assert_eq!(away, vec![6]);
}
