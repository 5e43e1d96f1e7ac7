//! The host-side work list of one MoE call: which rows go to which expert.

use crate::backend::Routing;

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
