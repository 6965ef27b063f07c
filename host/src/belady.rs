//! The most hits any expert cache could get without predicting: Belady's optimal
//! policy over a recorded routing.
//!
//! `les bench` records the experts the router picked ([`Recording`]), layer by
//! layer, and replays them through [`optimal_hits`]: on a miss with the cache
//! full, evict the expert whose next use lies furthest in the future. No policy
//! that only reacts to what was picked (LRU, popularity, layer distance) can hit
//! more often with the same number of slots, so this bounds every schedule that
//! does not read ahead; `les` can exceed it only because its lookahead predicts.
//! (The bound ignores that a layer's picks are pinned while it computes, which
//! can only lower what a real cache reaches.)

use std::collections::{BTreeSet, HashMap};

use les_core::slots::ExpertKey;

use crate::watch::Watcher;

/// Records every layer's routing, in order (a [`Watcher`] of the supplier).
#[derive(Clone, Debug, Default)]
pub struct Recording {
    /// The picked experts, in the order the forward pass asked for them.
    pub picks: Vec<ExpertKey>,
}

impl<X> Watcher<X> for Recording {
    fn begin_layer(&mut self, _: &X, layer: usize, routing: &[u16]) {
        self.picks.extend(routing.iter().map(|&expert| ExpertKey {
            layer: layer as u16,
            expert,
        }));
    }
}

/// Hits and misses of a cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheCount {
    /// Picks found in the cache.
    pub hits: u64,
    /// Picks that had to be read.
    pub misses: u64,
}

impl CacheCount {
    /// Hits over picks (0 when there were none).
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }
}

/// Belady's optimal cache of `slots` experts over `picks` (empty at first),
/// counting the picks from index `count_from` on (earlier ones only warm it up).
/// O(n log slots).
pub fn optimal_hits(picks: &[ExpertKey], slots: usize, count_from: usize) -> CacheCount {
    let mut count = CacheCount::default();
    if slots == 0 {
        count.misses = picks.len().saturating_sub(count_from) as u64;
        return count;
    }
    // next[i]: the position of the next pick of picks[i]'s expert (len = never).
    let mut next = vec![picks.len(); picks.len()];
    let mut seen: HashMap<ExpertKey, usize> = HashMap::new();
    for (i, k) in picks.iter().enumerate().rev() {
        if let Some(j) = seen.insert(*k, i) {
            next[i] = j;
        }
    }
    // The cache, ordered by next use; `at` maps each cached expert to its entry.
    let mut by_next: BTreeSet<(usize, ExpertKey)> = BTreeSet::new();
    let mut at: HashMap<ExpertKey, usize> = HashMap::new();
    for (i, k) in picks.iter().enumerate() {
        let hit = match at.get(k) {
            Some(&n) => {
                by_next.remove(&(n, *k));
                true
            }
            None => {
                if at.len() == slots {
                    if let Some((_, victim)) = by_next.pop_last() {
                        at.remove(&victim);
                    }
                }
                false
            }
        };
        by_next.insert((next[i], *k));
        at.insert(*k, next[i]);
        if i >= count_from {
            if hit {
                count.hits += 1;
            } else {
                count.misses += 1;
            }
        }
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn keys(ids: &[u16]) -> Vec<ExpertKey> {
        ids.iter()
            .map(|&expert| ExpertKey { layer: 0, expert })
            .collect()
    }

    /// LRU over the same picks, for comparison.
    fn lru_hits(picks: &[ExpertKey], slots: usize) -> u64 {
        let mut cache: Vec<ExpertKey> = Vec::new(); // most recent last
        let mut hits = 0;
        for k in picks {
            if let Some(p) = cache.iter().position(|c| c == k) {
                cache.remove(p);
                hits += 1;
            } else if cache.len() == slots {
                cache.remove(0);
            }
            cache.push(*k);
        }
        hits
    }

    #[test]
    fn textbook_sequence() {
        // 7 0 1 2 0 3 0 4 2 3 0 3 2 with 3 frames: MIN faults 7 times (Silberschatz).
        let p = keys(&[7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2]);
        let c = optimal_hits(&p, 3, 0);
        assert_eq!(c.misses, 7);
        assert_eq!(c.hits, 6);
        // LRU faults 9 times on it.
        assert_eq!(lru_hits(&p, 3), 4);
    }

    #[test]
    fn warm_up_is_not_counted_and_layers_are_distinct_experts() {
        let mut p = keys(&[1, 2, 1, 2]);
        p.push(ExpertKey {
            layer: 1,
            expert: 1,
        });
        let c = optimal_hits(&p, 2, 2);
        assert_eq!(c, CacheCount { hits: 2, misses: 1 });
        assert_eq!(optimal_hits(&p, 0, 1).misses, 4);
    }

    proptest! {
        #[test]
        fn never_below_lru_and_at_most_every_repeat(
            ids in prop::collection::vec(0u16..12, 0..200),
            slots in 1usize..8,
        ) {
            let p = keys(&ids);
            let c = optimal_hits(&p, slots, 0);
            prop_assert_eq!(c.hits + c.misses, p.len() as u64);
            prop_assert!(c.hits >= lru_hits(&p, slots));
            // First uses always miss.
            let distinct = ids.iter().collect::<std::collections::HashSet<_>>().len();
            prop_assert!(c.misses >= distinct as u64);
            // With room for every expert, only first uses miss.
            prop_assert_eq!(optimal_hits(&p, 12, 0).misses, distinct as u64);
        }
    }
}
