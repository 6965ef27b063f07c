//! Slot size classes: slots sized to the experts that use them.
//!
//! A model whose layers quantize their experts differently (llama.cpp's `Q4_K_M`
//! gives some layers a `q6_k` `ffn_down`; `les pack --bits-per-weight` mixes types
//! per layer) has experts of several sizes. Slots all as large as the largest
//! expert waste the difference on every smaller one: on Qwen3-30B-A3B in
//! `Q4_K_M`, 13% of every slot of half the layers. Instead the slots are split
//! into a few runs ([`SlotClass`]), each as large as the experts of its sizes, and
//! an expert only ever goes into a slot of the smallest class it fits
//! ([`crate::schedule::Scheduler::with_slot_classes`]). [`plan_by_bytes`] and
//! [`plan_by_count`] split a memory budget or a slot count across the classes so
//! that each caches the same share of its experts.

use heapless::Vec;

/// Most slot classes a scheduler keeps; models with more distinct expert sizes
/// have neighbouring sizes merged ([`size_classes`]).
pub const MAX_SLOT_CLASSES: usize = 8;

/// A run of `slots` slots of `bytes` bytes each. A scheduler's slots are its
/// classes' runs back to back, smallest class first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotClass {
    /// Slots in the run.
    pub slots: u32,
    /// Bytes of each slot.
    pub bytes: u32,
}

/// The index of the smallest of `classes` (smallest first) whose slots hold
/// `bytes`: the only class an expert of that size may take.
pub fn class_for(classes: &[SlotClass], bytes: u32) -> Option<usize> {
    classes.iter().position(|c| bytes <= c.bytes)
}

/// Where slot `slot` lies in memory holding the runs of `classes` back to back
/// (the layout [`crate::schedule::Scheduler::with_slot_classes`] numbers slots
/// in): its byte offset and length; `None` past the last slot.
pub fn slot_span(classes: &[SlotClass], slot: usize) -> Option<(usize, usize)> {
    let (mut first, mut base) = (0usize, 0usize);
    for c in classes {
        let (n, bytes) = (c.slots as usize, c.bytes as usize);
        if slot < first + n {
            return Some((base + (slot - first) * bytes, bytes));
        }
        first += n;
        base += n * bytes;
    }
    None
}

/// Experts of one slot size: `count` experts needing `bytes` bytes each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizeGroup {
    /// Bytes of one expert's slot.
    pub bytes: u32,
    /// Experts of that size.
    pub count: u32,
}

/// Why a budget could not be split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlanError {
    /// No experts, or an expert of 0 bytes.
    Empty,
    /// The budget buys `slots` slots, fewer than the `needed` that hold one
    /// layer's picks of every size class.
    TooSmall {
        /// Slots the budget buys.
        slots: u64,
        /// Slots needed.
        needed: u64,
    },
}

impl core::fmt::Display for PlanError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            PlanError::Empty => f.write_str("no experts to hold"),
            PlanError::TooSmall { slots, needed } => write!(
                f,
                "the budget buys {slots} expert slots; the experts one layer uses need \
                 {needed}"
            ),
        }
    }
}

/// The distinct sizes of `sizes` (each a per-layer group: slot bytes and expert
/// count), smallest first with their counts summed; beyond [`MAX_SLOT_CLASSES`]
/// sizes, the neighbouring pair whose merge wastes the fewest bytes is merged
/// (the smaller experts then take the larger slots) until they fit.
pub fn size_classes(
    sizes: impl IntoIterator<Item = SizeGroup>,
) -> Result<Vec<SizeGroup, MAX_SLOT_CLASSES>, PlanError> {
    // Distinct sizes, merged early only past MAX_DISTINCT of them.
    let mut all: Vec<SizeGroup, MAX_DISTINCT> = Vec::new();
    for g in sizes {
        if g.count == 0 {
            continue;
        }
        if g.bytes == 0 {
            return Err(PlanError::Empty);
        }
        if let Some(c) = all.iter_mut().find(|c| c.bytes == g.bytes) {
            c.count = c.count.saturating_add(g.count);
            continue;
        }
        if all.is_full() {
            all.sort_unstable_by_key(|c| c.bytes);
            merge_cheapest(&mut all);
        }
        let _ = all.push(g);
    }
    if all.is_empty() {
        return Err(PlanError::Empty);
    }
    all.sort_unstable_by_key(|c| c.bytes);
    while all.len() > MAX_SLOT_CLASSES {
        merge_cheapest(&mut all);
    }
    Ok(all.iter().copied().collect())
}

/// Distinct sizes [`size_classes`] keeps apart before merging.
const MAX_DISTINCT: usize = 64;

/// Merges the neighbours of sorted `all` whose merge wastes the fewest bytes (the
/// first such pair on a tie) into the larger one.
fn merge_cheapest<const N: usize>(all: &mut Vec<SizeGroup, N>) {
    let waste = |i: usize| (all[i + 1].bytes - all[i].bytes) as u64 * all[i].count as u64;
    if let Some(i) = (0..all.len().saturating_sub(1)).min_by_key(|&i| waste(i)) {
        all[i + 1].count = all[i + 1].count.saturating_add(all[i].count);
        all.remove(i);
    }
}

/// Splits `budget` bytes across the size classes of `sizes`: every class gets the
/// same share of its experts (`budget / total bytes`), rounded down and at most all
/// of them; a class below `min_per_class` slots (or all its experts, if fewer) is
/// raised to that, taking slots from the classes with the most to spare, else
/// [`PlanError::TooSmall`]. The slots' bytes never exceed `budget`.
pub fn plan_by_bytes(
    sizes: impl IntoIterator<Item = SizeGroup>,
    budget: u64,
    min_per_class: u32,
) -> Result<Vec<SlotClass, MAX_SLOT_CLASSES>, PlanError> {
    let groups = size_classes(sizes)?;
    let total: u128 = groups
        .iter()
        .map(|g| g.bytes as u128 * g.count as u128)
        .sum();
    let slots: Vec<u32, MAX_SLOT_CLASSES> = groups
        .iter()
        .map(|g| (budget as u128 * g.count as u128 / total).min(g.count as u128) as u32)
        .collect();
    let bought = slots.iter().map(|&s| s as u64).sum();
    settle(&groups, slots, min_per_class, bought, |c| {
        c.iter()
            .map(|x| x.slots as u128 * x.bytes as u128)
            .sum::<u128>()
            > budget as u128
    })
}

/// Splits `n_slots` slots across the size classes of `sizes` in proportion to
/// their expert counts (largest remainders first), at most all of a class's
/// experts; a class below `min_per_class` slots (or all its experts, if fewer) is
/// raised to that as in [`plan_by_bytes`].
pub fn plan_by_count(
    sizes: impl IntoIterator<Item = SizeGroup>,
    n_slots: u32,
    min_per_class: u32,
) -> Result<Vec<SlotClass, MAX_SLOT_CLASSES>, PlanError> {
    let groups = size_classes(sizes)?;
    let total: u64 = groups.iter().map(|g| g.count as u64).sum();
    let n = (n_slots as u64).min(total);
    let mut share: Vec<(u32, u64), MAX_SLOT_CLASSES> = groups
        .iter()
        .map(|g| {
            (
                (n * g.count as u64 / total) as u32,
                n * g.count as u64 % total,
            )
        })
        .collect();
    let mut left = n - share.iter().map(|s| s.0 as u64).sum::<u64>();
    while left > 0 {
        // Largest remainder first; ties to the smaller class. Each class gets at
        // most one extra slot, and `left` < number of classes.
        let Some(i) = (0..share.len())
            .filter(|&i| share[i].1 > 0)
            .max_by_key(|&i| (share[i].1, core::cmp::Reverse(i)))
        else {
            break;
        };
        share[i].0 += 1;
        share[i].1 = 0;
        left -= 1;
    }
    let slots = share.iter().map(|s| s.0).collect();
    settle(&groups, slots, min_per_class, n, |c| {
        c.iter().map(|x| x.slots as u64).sum::<u64>() > n
    })
}

/// The smallest plan: every size class at its minimum, `min_per_class` slots (or
/// all its experts, if fewer).
pub fn plan_minimum(
    sizes: impl IntoIterator<Item = SizeGroup>,
    min_per_class: u32,
) -> Result<Vec<SlotClass, MAX_SLOT_CLASSES>, PlanError> {
    let groups = size_classes(sizes)?;
    let zeros = groups.iter().map(|_| 0).collect();
    settle(&groups, zeros, min_per_class, 0, |_| false)
}

/// The smallest slot count class `g` may have.
fn minimum(g: &SizeGroup, min_per_class: u32) -> u32 {
    min_per_class.min(g.count).max(1)
}

/// `slots` per class, each raised to its [`minimum`], then one slot at a time
/// taken from the class with the most above its minimum (the larger class on a
/// tie) while `over` says the plan exceeds the budget; fails where no class has
/// any to spare (the budget bought `bought` slots).
fn settle(
    groups: &[SizeGroup],
    slots: Vec<u32, MAX_SLOT_CLASSES>,
    min_per_class: u32,
    bought: u64,
    over: impl Fn(&[SlotClass]) -> bool,
) -> Result<Vec<SlotClass, MAX_SLOT_CLASSES>, PlanError> {
    let mut out: Vec<SlotClass, MAX_SLOT_CLASSES> = groups
        .iter()
        .zip(slots)
        .map(|(g, s)| SlotClass {
            slots: s.max(minimum(g, min_per_class)),
            bytes: g.bytes,
        })
        .collect();
    while over(&out) {
        let spare = |i: usize| out[i].slots - minimum(&groups[i], min_per_class);
        let Some(i) = (0..out.len())
            .filter(|&i| spare(i) > 0)
            .max_by_key(|&i| (spare(i), i))
        else {
            return Err(PlanError::TooSmall {
                slots: bought,
                needed: out.iter().map(|c| c.slots as u64).sum(),
            });
        };
        out[i].slots -= 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(bytes: u32, count: u32) -> SizeGroup {
        SizeGroup { bytes, count }
    }

    #[test]
    fn equal_sizes_are_one_class() {
        let c = size_classes([g(100, 8), g(100, 8), g(0, 0)]).unwrap();
        assert_eq!(c.as_slice(), [g(100, 16)]);
        assert_eq!(size_classes([]), Err(PlanError::Empty));
        assert_eq!(size_classes([g(0, 3)]), Err(PlanError::Empty));
    }

    #[test]
    fn slots_lie_in_their_runs_back_to_back() {
        let c = [
            SlotClass {
                slots: 2,
                bytes: 10,
            },
            SlotClass {
                slots: 1,
                bytes: 30,
            },
        ];
        let spans: std::vec::Vec<_> = (0..4).map(|s| slot_span(&c, s)).collect();
        assert_eq!(spans, [Some((0, 10)), Some((10, 10)), Some((20, 30)), None]);
        assert_eq!(slot_span(&[], 0), None);
    }

    #[test]
    fn too_many_sizes_merge_where_least_is_wasted() {
        // Ten sizes 100, 200, ..., 1000, 10 experts each, except 10 of size 950.
        let mut sizes: std::vec::Vec<SizeGroup> = (1..=10).map(|i| g(100 * i, 10)).collect();
        sizes.push(g(950, 10));
        let c = size_classes(sizes.iter().copied()).unwrap();
        assert_eq!(c.len(), MAX_SLOT_CLASSES);
        assert_eq!(c.iter().map(|x| x.count).sum::<u32>(), 110);
        // Sorted, every size fits its class, the largest class is the largest size.
        assert!(c.windows(2).all(|w| w[0].bytes < w[1].bytes));
        assert_eq!(c.last().unwrap().bytes, 1000);
        // 900 into 950 wastes least (50 bytes x 10), then the first of the pairs
        // wasting 1000.
        assert!(!c.iter().any(|x| x.bytes == 900 || x.bytes == 100));
        assert!(c.iter().any(|x| x.bytes == 950 && x.count == 20));
    }

    #[test]
    fn a_budget_gives_every_class_the_same_share() {
        // Half the layers' experts 2.53 MiB, half 2.92 MiB (Qwen3-30B-A3B Q4_K_M).
        let sizes = [g(2_654_208, 3072), g(3_059_712, 3072)];
        let total = 3072 * (2_654_208u64 + 3_059_712);
        let c = plan_by_bytes(sizes, total / 4, 8).unwrap();
        assert_eq!(
            c[0],
            SlotClass {
                slots: 768,
                bytes: 2_654_208
            }
        );
        assert_eq!(
            c[1],
            SlotClass {
                slots: 768,
                bytes: 3_059_712
            }
        );
        // 1536 slots where slots of the largest size would be 1434.
        assert_eq!(total / 4 / 3_059_712, 1434);
        let used: u64 = c.iter().map(|x| x.slots as u64 * x.bytes as u64).sum();
        assert!(used <= total / 4);
        // More than everything: every expert gets a slot.
        let c = plan_by_bytes(sizes, u64::MAX, 8).unwrap();
        assert_eq!((c[0].slots, c[1].slots), (3072, 3072));
        // Too little for 8 slots of each class.
        assert!(plan_by_bytes(sizes, 14 * 3_059_712, 8).is_err());
        let c = plan_by_bytes(sizes, 16 * 3_059_712, 8).unwrap();
        assert_eq!((c[0].slots, c[1].slots), (8, 8));
        let c = plan_minimum(sizes, 8).unwrap();
        assert_eq!((c[0].slots, c[1].slots), (8, 8));
        let c = plan_minimum([g(10, 3), g(20, 100)], 8).unwrap();
        assert_eq!((c[0].slots, c[1].slots), (3, 8));
    }

    #[test]
    fn a_count_is_split_by_expert_counts() {
        let sizes = [g(10, 30), g(20, 10), g(30, 20)];
        let c = plan_by_count(sizes, 31, 2).unwrap();
        let n: std::vec::Vec<u32> = c.iter().map(|x| x.slots).collect();
        // 15.5, 5.17, 10.33 -> 15, 5, 10, and the one left to the largest remainder.
        assert_eq!(n, [16, 5, 10]);
        assert_eq!(
            plan_by_count(sizes, 1000, 2)
                .unwrap()
                .iter()
                .map(|x| x.slots)
                .sum::<u32>(),
            60
        );
        assert!(plan_by_count(sizes, 5, 2).is_err());
        // A small class still gets its minimum (all its experts, if fewer).
        let c = plan_by_count([g(10, 1), g(20, 100)], 50, 4).unwrap();
        assert_eq!((c[0].slots, c[1].slots), (1, 49));
        let c = plan_by_count([g(10, 10), g(20, 100)], 20, 4).unwrap();
        assert_eq!((c[0].slots, c[1].slots), (4, 16));
        let c = plan_by_bytes([g(10, 10), g(20, 100)], 200, 4).unwrap();
        assert_eq!((c[0].slots, c[1].slots), (4, 8));
    }
}
