//! The expert cache, the planner's chunking and the simulated copy clock, checked against simple
//! reference models under seeded random operation sequences.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specter::offload::{
    Evicted, ExpertCache, InitialResidency, Insert, LoadKind, Lookup, Planner, Policy,
    ResidencyConfig, SimulatedTransfers, TransferEngine,
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
        match cache.lookup(layer, expert) {
            Lookup::Hit { .. } => {
                let at = list
                    .iter()
                    .position(|&e| e == expert)
                    .expect("hit on an expert the reference lacks");
                list.remove(at);
                list.push(expert);
            }
            Lookup::Miss => {
                assert!(!list.contains(&expert), "miss on a resident expert");
                let expected_victim = (list.len() == 4).then(|| list.remove(0));
                match cache.insert(layer, expert, LoadKind::Demand, None) {
                    Insert::Inserted { evicted } => {
                        assert_eq!(evicted.map(|e| e.expert), expected_victim);
                        evictions += usize::from(evicted.is_some());
                    }
                    other => panic!("unexpected {other:?}"),
                }
                list.push(expert);
            }
        }
        assert_eq!(cache.resident(layer), reference[layer]);
    }
    assert!(evictions > 500);
}

#[test]
fn planned_experts_are_never_evicted_while_planned() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let slots = 5;
    let mut cache = ExpertCache::new(
        config(Policy::Specter, 1, 12, slots),
        &InitialResidency::FirstExperts,
    )
    .expect("cache");
    let mut no_slot = 0;
    for _ in 0..400 {
        let plan_len = rng.random_range(0..=slots);
        let mut plan: Vec<u32> = Vec::new();
        while plan.len() < plan_len {
            let e = rng.random_range(0..12);
            if !plan.contains(&e) {
                plan.push(e);
            }
        }
        cache.set_plan(0, &plan);
        // Bring the planned experts in (as the prefetcher would), then hammer the layer.
        for &e in &plan {
            cache.insert(0, e, LoadKind::Prefetch, None);
        }
        for &e in &plan {
            assert!(cache.is_resident(0, e) && cache.is_planned(0, e));
        }
        for _ in 0..20 {
            let e = rng.random_range(0..12);
            if let Lookup::Miss = cache.lookup(0, e) {
                match cache.insert(0, e, LoadKind::Demand, None) {
                    Insert::Inserted { evicted } => {
                        assert!(
                            evicted.is_none_or(|v| !plan.contains(&v.expert)),
                            "evicted a planned expert"
                        );
                    }
                    Insert::NoSlot => {
                        assert_eq!(
                            plan.len(),
                            slots,
                            "NoSlot with an unplanned resident expert"
                        );
                        no_slot += 1;
                    }
                    Insert::AlreadyResident => panic!("miss then already resident"),
                }
            }
            for &p in &plan {
                assert!(cache.is_resident(0, p), "planned expert {p} was evicted");
            }
        }
        cache.clear_plans();
        assert!(!plan.iter().any(|&e| cache.is_planned(0, e)));
    }
    assert!(no_slot > 0, "the fully-planned case must occur");
}

#[test]
fn unused_prefetches_are_reported_once() {
    let mut cache = ExpertCache::new(config(Policy::Specter, 1, 8, 3), &InitialResidency::Empty)
        .expect("cache");
    cache.insert(0, 4, LoadKind::Prefetch, None);
    cache.insert(0, 5, LoadKind::Prefetch, None);
    cache.insert(0, 6, LoadKind::Prefetch, None);
    assert!(matches!(
        cache.lookup(0, 5),
        Lookup::Hit {
            first_use_of_prefetch: true,
            ..
        }
    ));
    assert!(matches!(
        cache.lookup(0, 5),
        Lookup::Hit {
            first_use_of_prefetch: false,
            ..
        }
    ));
    // 4 is the LRU and unused: its eviction reports a wasted prefetch.
    assert_eq!(
        cache.insert(0, 1, LoadKind::Demand, None),
        Insert::Inserted {
            evicted: Some(Evicted {
                expert: 4,
                unused_prefetch: true
            })
        }
    );
    assert_eq!(cache.take_unused_prefetches(), 1); // expert 6
    assert_eq!(cache.take_unused_prefetches(), 0);
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
        if rng.random_bool(0.2) {
            cache.set_plan(layer, &[e]);
        }
        if let Lookup::Miss = cache.lookup(layer, e) {
            let kind = if rng.random_bool(0.5) {
                LoadKind::Prefetch
            } else {
                LoadKind::Demand
            };
            cache.insert(layer, e, kind, None);
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
    // LRU order is restored too: the first listed expert is the next victim.
    assert_eq!(cache.eviction_candidate(0), Some(5));
    assert_eq!(cache.eviction_candidate(2), Some(1));
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
            assert!(matches!(all.lookup(layer, e), Lookup::Hit { .. }));
        }
    }
    let on_demand = ExpertCache::new(
        config(Policy::OnDemand, 2, 6, 3),
        &InitialResidency::FirstExperts,
    )
    .expect("cache");
    assert!(on_demand.resident(0).is_empty() && on_demand.resident(1).is_empty());
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
fn explicit_eviction_respects_the_plan() {
    let mut cache = ExpertCache::new(
        config(Policy::Specter, 1, 8, 4),
        &InitialResidency::FirstExperts,
    )
    .expect("cache");
    cache.set_plan(0, &[1]);
    assert_eq!(cache.evict(0, 1), None, "a planned expert was evicted");
    assert_eq!(cache.evict(0, 5), None, "a non-resident expert was evicted");
    assert_eq!(
        cache.evict(0, 2),
        Some(Evicted {
            expert: 2,
            unused_prefetch: false
        })
    );
    assert_eq!(cache.resident(0), vec![0, 1, 3]);
    assert_eq!(cache.free_slots(0), 1);
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
