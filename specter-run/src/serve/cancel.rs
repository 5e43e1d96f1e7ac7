//! Stopping a generation between decode rounds: when its client went away, a stop string
//! appeared, or the server is shutting down. The decode loop asks its observer
//! ([`DecodeObserver::should_stop`]) before every round; this observer answers from a check and
//! passes everything else through to the observer that does the real work (prefetch, residency
//! simulation, automatic depth).

use specter::decode::DecodeObserver;
use specter::model::{RouteHook, Variant};

pub struct Stoppable<'a> {
    inner: &'a mut dyn DecodeObserver,
    stop: &'a dyn Fn() -> bool,
}

impl<'a> Stoppable<'a> {
    pub fn new(inner: &'a mut dyn DecodeObserver, stop: &'a dyn Fn() -> bool) -> Self {
        Stoppable { inner, stop }
    }
}

impl RouteHook for Stoppable<'_> {
    fn on_route(
        &mut self,
        variant: Variant,
        layer: usize,
        moe_layer: usize,
        top_k: usize,
        topk: &[u32],
    ) {
        self.inner.on_route(variant, layer, moe_layer, top_k, topk);
    }

    fn wants_routes(&self) -> bool {
        self.inner.wants_routes()
    }

    fn counts_routes_on_device(&self, variant: Variant) -> bool {
        self.inner.counts_routes_on_device(variant)
    }

    fn wants_moe_input(&self) -> bool {
        self.inner.wants_moe_input()
    }

    fn on_moe_input(&mut self, variant: Variant, moe_layer: usize, hidden: &[f32], topk: &[u32]) {
        self.inner.on_moe_input(variant, moe_layer, hidden, topk);
    }
}

impl DecodeObserver for Stoppable<'_> {
    fn on_target_pass(&mut self, rows: usize) {
        self.inner.on_target_pass(rows);
    }

    fn on_draft_window(&mut self, depth: usize) {
        self.inner.on_draft_window(depth);
    }

    fn on_draft_step(&mut self, step: usize) {
        self.inner.on_draft_step(step);
    }

    fn on_commit(&mut self, accepted: usize, committed: usize) {
        self.inner.on_commit(accepted, committed);
    }

    fn next_depth(&mut self, configured: usize) -> usize {
        self.inner.next_depth(configured)
    }

    fn should_stop(&mut self) -> bool {
        (self.stop)() || self.inner.should_stop()
    }
}
