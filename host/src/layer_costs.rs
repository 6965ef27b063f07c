//! Where a streamed decode waits, layer by layer.
//!
//! [`LayerCosts`] watches an expert supplier ([`crate::watch`]) and, at each
//! layer's [`begin_layer`](les_core::model::forward::Experts::begin_layer),
//! closes the previous layer's account: the time the decode was blocked on
//! reads since that layer began (its experts' reads: the forward pass waits
//! for them before the next layer starts) and the scheduler's misses and late
//! hits counted when it routed.
//! `les bench` prints the sums per token, so the shape of a token's stall
//! (which layers wait, and for how many reads) is measured in the run rather
//! than inferred.

use std::time::Duration;

use les_core::schedule::Stats;

use crate::supply::Supply;
use crate::watch::Watcher;

/// What one layer cost over the counted tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerCost {
    /// Time blocked on reads while the layer's experts were computed.
    pub stall: Duration,
    /// Picked experts found in a slot.
    pub hits: u64,
    /// Picked experts whose prefetch was still in flight.
    pub late_hits: u64,
    /// Picked experts that needed a demand read.
    pub misses: u64,
}

impl std::ops::AddAssign for LayerCost {
    fn add_assign(&mut self, o: LayerCost) {
        self.stall += o.stall;
        self.hits += o.hits;
        self.late_hits += o.late_hits;
        self.misses += o.misses;
    }
}

/// A supplier whose stall time and scheduler counters can be read at any moment.
pub trait Probe {
    /// Time blocked on reads so far, in nanoseconds.
    fn stall_nanos(&self) -> u64;
    /// The scheduler's counters so far (zero where nothing streams).
    fn stats(&self) -> Stats;
}

impl Probe for Supply<'_> {
    fn stall_nanos(&self) -> u64 {
        self.device()
            .map_or(0, |d| d.counters().snapshot().stall_nanos)
    }

    fn stats(&self) -> Stats {
        Supply::stats(self).unwrap_or_default()
    }
}

/// Accounts each layer's stall and misses (a [`Watcher`] of the supplier).
#[derive(Clone, Debug, Default)]
pub struct LayerCosts {
    costs: Vec<LayerCost>,
    /// The layer being computed, with the stall and counters when it began.
    open: Option<(usize, u64, Stats)>,
}

impl LayerCosts {
    /// Forgets what was counted so far (e.g. the prompt's tokens); the layer in
    /// progress starts counting now.
    pub fn reset(&mut self, supplier: &impl Probe) {
        self.costs.clear();
        if let Some((layer, _, _)) = self.open {
            self.open = Some((layer, supplier.stall_nanos(), supplier.stats()));
        }
    }

    /// Closes the account of the layer in progress and returns every layer's
    /// costs, indexed by layer (layers that never routed are zero; empty if none
    /// did).
    pub fn finish(&mut self, supplier: &impl Probe) -> Vec<LayerCost> {
        self.close(supplier);
        std::mem::take(&mut self.costs)
    }

    fn close(&mut self, supplier: &impl Probe) {
        let Some((layer, stall0, stats0)) = self.open.take() else {
            return;
        };
        let stats = supplier.stats().since(&stats0);
        let stall = supplier.stall_nanos().saturating_sub(stall0);
        if self.costs.len() <= layer {
            self.costs.resize(layer + 1, LayerCost::default());
        }
        self.costs[layer] += LayerCost {
            stall: Duration::from_nanos(stall),
            hits: stats.hits,
            late_hits: stats.late_hits,
            misses: stats.misses,
        };
    }
}

impl<X: Probe> Watcher<X> for LayerCosts {
    fn begin_layer(&mut self, supplier: &X, layer: usize, _: &[u16]) {
        self.close(supplier);
        self.open = Some((layer, supplier.stall_nanos(), supplier.stats()));
    }
}

/// Where `n_layers` layers split into `groups` runs of consecutive layers of
/// about equal length (fewer where there are fewer layers): the first layer of
/// each run, and one past the last.
pub fn group_bounds(n_layers: usize, groups: usize) -> Vec<usize> {
    let groups = groups.clamp(1, n_layers.max(1));
    let mut b: Vec<usize> = (0..=groups).map(|g| g * n_layers / groups).collect();
    b.dedup();
    b
}

/// `costs` summed over the runs of [`group_bounds`]: `(first, last, cost)`.
pub fn grouped(costs: &[LayerCost], groups: usize) -> Vec<(usize, usize, LayerCost)> {
    group_bounds(costs.len(), groups)
        .windows(2)
        .map(|w| {
            let mut sum = LayerCost::default();
            for &c in &costs[w[0]..w[1]] {
                sum += c;
            }
            (w[0], w[1] - 1, sum)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::watch::Watched;
    use les_core::model::forward::{Experts, Handout};

    /// A supplier that stalls `wait` ns per `next` and misses what it is told.
    struct Fake {
        stall: u64,
        stats: Stats,
        wait: u64,
        misses_per_layer: Vec<u64>,
    }

    impl Probe for Fake {
        fn stall_nanos(&self) -> u64 {
            self.stall
        }
        fn stats(&self) -> Stats {
            self.stats
        }
    }

    impl Experts for Fake {
        type Error = ();
        fn begin_layer(&mut self, layer: usize, routing: &[u16]) -> Result<(), ()> {
            self.stats.misses += self.misses_per_layer[layer];
            self.stats.hits += routing.len() as u64 - self.misses_per_layer[layer];
            Ok(())
        }
        fn next(&mut self) -> Result<Option<Handout<'_>>, ()> {
            self.stall += self.wait;
            Ok(None)
        }
        fn finish(&mut self, _: usize, _: Option<u32>) -> Result<(), ()> {
            Ok(())
        }
    }

    #[test]
    fn each_layer_gets_the_stall_and_misses_after_it_began() {
        let mut fake = Fake {
            stall: 0,
            stats: Stats::default(),
            wait: 0,
            misses_per_layer: vec![3, 1, 0],
        };
        let mut costs = Watched::new(&mut fake, LayerCosts::default());
        // A prompt token, forgotten by `reset`.
        for l in 0..3 {
            costs.begin_layer(l, &[0, 1, 2, 3]).unwrap();
            costs.next().unwrap();
        }
        costs.watcher.reset(costs.inner);
        for _token in 0..2 {
            for (l, wait) in [(0, 5_000_000u64), (1, 1_000_000), (2, 0)] {
                costs.inner.wait = wait;
                costs.begin_layer(l, &[0, 1, 2, 3]).unwrap();
                costs.next().unwrap();
                costs.next().unwrap();
            }
        }
        let c = costs.watcher.finish(costs.inner);
        assert_eq!(c.len(), 3);
        assert_eq!(c[0].stall, Duration::from_millis(20));
        assert_eq!(c[1].stall, Duration::from_millis(4));
        assert_eq!(c[2].stall, Duration::ZERO);
        assert_eq!((c[0].misses, c[0].hits), (6, 2));
        assert_eq!((c[1].misses, c[1].hits), (2, 6));
        assert_eq!((c[2].misses, c[2].hits), (0, 8));
        // The layer in progress at `reset` (2, of the prompt) counted nothing.
        let g = grouped(&c, 2);
        assert_eq!(g.len(), 2);
        assert_eq!((g[0].0, g[0].1, g[0].2.misses), (0, 0, 6));
        assert_eq!((g[1].0, g[1].1, g[1].2.misses), (1, 2, 2));
        assert_eq!(g[1].2.stall, Duration::from_millis(4));
    }

    #[test]
    fn grouping_covers_every_layer_once() {
        for n in 0..20 {
            let costs: Vec<LayerCost> = (0..n)
                .map(|i| LayerCost {
                    misses: i as u64,
                    ..LayerCost::default()
                })
                .collect();
            for groups in 0..10 {
                let g = grouped(&costs, groups);
                assert!(g.len() <= groups.max(1));
                let total: u64 = g.iter().map(|x| x.2.misses).sum();
                assert_eq!(total, (0..n as u64).sum::<u64>());
                for w in g.windows(2) {
                    assert_eq!(w[0].1 + 1, w[1].0);
                }
            }
        }
    }
}
