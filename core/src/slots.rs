//! The fixed-capacity table of expert slots.
//!
//! A slot is a region of RAM one expert is read into. The table tracks what each
//! slot holds and maps `(layer, expert)` to the slot holding it, over storage the
//! caller provides (an array on a microcontroller, a `Vec` sized from the memory
//! budget on a host), so its capacity is fixed for its life and it never allocates.
//!
//! States and the only transitions allowed:
//!
//! ```text
//!   Free --start_load--> Loading --finish_load--> Ready --pin--> InUse
//!    ^                      |                      |  ^            |
//!    +------abandon---------+                      |  +---unpin----+
//!    +------evict----------------------------------+
//! ```
//!
//! Only `Ready` slots can be evicted: a slot whose read is in flight (the device
//! may still write into it) or whose expert is being computed is never reused.
//!
//! The table also counts how often each expert is picked ([`SlotTable::record_use`],
//! resident or not), with periodic halving so the counts follow drifting
//! popularity; [`EvictionPolicy::Popularity`] keeps the popular experts.

use core::fmt;

use crate::blockdev::SlotId;

/// Names one expert of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertKey {
    /// Layer index.
    pub layer: u16,
    /// Expert index within the layer.
    pub expert: u16,
}

impl fmt::Display for ExpertKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "layer {} expert {}", self.layer, self.expert)
    }
}

/// An expert read in progress (possibly made of several device reads, "parts").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Load {
    /// The expert being read.
    pub key: ExpertKey,
    /// Identifier of this attempt; device tags are derived from it.
    pub id: u32,
    /// Number of parts (1 for a packed expert, 3 for gate/up/down of a plain GGUF).
    pub parts: u8,
    /// Parts not yet accepted by the device (bit mask).
    pub unsubmitted: u8,
    /// Parts submitted whose completion has not arrived (bit mask).
    pub outstanding: u8,
    /// The current layer's router picked this expert: the computation waits for it.
    pub demand: bool,
    /// Issued as a speculative prefetch.
    pub prefetched: bool,
    /// A cancel was sent to the device.
    pub cancelled: bool,
    /// Some part came back cancelled or failed: the data is unusable.
    pub failed: bool,
    /// Attempts that failed with a device error (cancellations excluded).
    pub faults: u8,
}

impl Load {
    /// Whether no part is still pending (submitted or not).
    pub fn settled(&self) -> bool {
        self.unsubmitted == 0 && self.outstanding == 0
    }
}

/// What a slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// Nothing.
    Free,
    /// A read is in flight into it.
    Loading(Load),
    /// A complete, verified expert, evictable.
    Ready {
        /// The expert.
        key: ExpertKey,
        /// Loaded by a prefetch and not used since.
        prefetched: bool,
    },
    /// A complete expert being computed: pinned.
    InUse {
        /// The expert.
        key: ExpertKey,
    },
}

impl SlotState {
    /// The expert the slot holds or is loading.
    pub fn key(&self) -> Option<ExpertKey> {
        match self {
            SlotState::Free => None,
            SlotState::Loading(l) => Some(l.key),
            SlotState::Ready { key, .. } | SlotState::InUse { key } => Some(*key),
        }
    }
}

/// One entry of slot storage. Create storage with [`Slot::EMPTY`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    state: SlotState,
    last_used: u64,
    /// Its bytes have not been checked yet (see [`SlotTable::set_unverified`]).
    unverified: bool,
}

impl Slot {
    /// A free slot, to fill caller storage with.
    pub const EMPTY: Slot = Slot {
        state: SlotState::Free,
        last_used: 0,
        unverified: false,
    };
}

/// Which `Ready` slot to reuse when none is free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// Least recently used.
    Lru,
    /// Layer-aware "least stale": layers are visited in a cycle each token, so the
    /// expert whose layer comes up again furthest in the future is evicted first
    /// (ties broken by LRU). Approximates Belady's optimal policy.
    LayerDistance,
    /// Popularity- and layer-aware: never the next [`PROTECTED_LAYERS`] layers'
    /// experts (what the lookahead just prefetched) while others are evictable;
    /// then the expert picked least often (aged counts, see
    /// [`SlotTable::record_use`]); ties by layer distance as in
    /// [`LayerDistance`](Self::LayerDistance), then LRU.
    /// MoE routers favour some experts across tokens, which LRU forgets.
    Popularity,
}

/// Errors of the slot table: construction errors and illegal transitions (which
/// mean a bug in the caller, reported instead of corrupting state).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotError {
    /// Slot storage is empty or has more than [`MAX_TABLE_SLOTS`] entries.
    BadCapacity,
    /// Index storage length is not `n_layers * n_experts`.
    BadIndex,
    /// The key is outside the model.
    BadKey(ExpertKey),
    /// The key is already resident or loading.
    AlreadyMapped(ExpertKey),
    /// The transition is not allowed from the slot's state.
    InvalidTransition(SlotId),
}

impl fmt::Display for SlotError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SlotError::BadCapacity => {
                write!(f, "slot storage must hold 1..={MAX_TABLE_SLOTS} slots")
            }
            SlotError::BadIndex => {
                f.write_str("index storage must hold n_layers * n_experts entries")
            }
            SlotError::BadKey(k) => write!(f, "{k} is outside the model"),
            SlotError::AlreadyMapped(k) => write!(f, "{k} already has a slot"),
            SlotError::InvalidTransition(s) => {
                write!(f, "invalid state transition of slot {}", s.0)
            }
        }
    }
}

impl core::error::Error for SlotError {}

/// Bits of an index entry that hold the slot (+ 1; 0 = none).
const SLOT_BITS: u32 = 22;
const SLOT_MASK: u32 = (1 << SLOT_BITS) - 1;
/// Largest use count an index entry holds (the entry's upper bits).
pub const MAX_USE_COUNT: u32 = u32::MAX >> SLOT_BITS;
/// Layers ahead whose experts [`EvictionPolicy::Popularity`] keeps while others
/// are evictable: what the lookahead prefetched for them is about to be used.
pub const PROTECTED_LAYERS: u32 = 2;
/// Most slots a table manages (the index entry's slot field).
pub const MAX_TABLE_SLOTS: usize = SLOT_MASK as usize;

/// The slot table over caller storage `S` (slots) and `M` (the key index).
pub struct SlotTable<S, M> {
    slots: S,
    /// `index[layer * n_experts + expert]`: the slot + 1 (0 = none) in the low
    /// [`SLOT_BITS`] bits, the expert's aged use count above them.
    index: M,
    n_layers: u16,
    n_experts: u16,
    tick: u64,
    /// Uses recorded since the counts were last halved.
    uses_since_aging: u32,
}

impl<S, M> SlotTable<S, M>
where
    S: AsRef<[Slot]> + AsMut<[Slot]>,
    M: AsRef<[u32]> + AsMut<[u32]>,
{
    /// A table of `slots.len()` free slots for a model of `n_layers` layers of
    /// `n_experts` experts; `index` must hold `n_layers * n_experts` entries.
    pub fn new(
        mut slots: S,
        mut index: M,
        n_layers: u16,
        n_experts: u16,
    ) -> Result<Self, SlotError> {
        let n = slots.as_ref().len();
        if n == 0 || n > MAX_TABLE_SLOTS {
            return Err(SlotError::BadCapacity);
        }
        if index.as_ref().len() != n_layers as usize * n_experts as usize {
            return Err(SlotError::BadIndex);
        }
        slots.as_mut().fill(Slot::EMPTY);
        index.as_mut().fill(0);
        Ok(SlotTable {
            slots,
            index,
            n_layers,
            n_experts,
            tick: 0,
            uses_since_aging: 0,
        })
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.slots.as_ref().len()
    }

    /// Layers of the model.
    pub fn n_layers(&self) -> u16 {
        self.n_layers
    }

    /// Experts per layer.
    pub fn n_experts(&self) -> u16 {
        self.n_experts
    }

    /// The state of `slot`.
    pub fn state(&self, slot: SlotId) -> &SlotState {
        &self.slots.as_ref()[slot.0 as usize].state
    }

    /// All slots with their states.
    pub fn iter(&self) -> impl Iterator<Item = (SlotId, &SlotState)> {
        self.slots
            .as_ref()
            .iter()
            .enumerate()
            .map(|(i, s)| (SlotId(i as u32), &s.state))
    }

    fn index_of(&self, key: ExpertKey) -> Result<usize, SlotError> {
        if key.layer >= self.n_layers || key.expert >= self.n_experts {
            return Err(SlotError::BadKey(key));
        }
        Ok(key.layer as usize * self.n_experts as usize + key.expert as usize)
    }

    /// The slot holding or loading `key`.
    pub fn lookup(&self, key: ExpertKey) -> Option<SlotId> {
        let i = self.index_of(key).ok()?;
        match self.index.as_ref()[i] & SLOT_MASK {
            0 => None,
            s => Some(SlotId(s - 1)),
        }
    }

    /// How often `key` was picked (see [`record_use`](Self::record_use)); 0 for
    /// keys outside the model.
    pub fn use_count(&self, key: ExpertKey) -> u32 {
        self.index_of(key)
            .map_or(0, |i| self.index.as_ref()[i] >> SLOT_BITS)
    }

    /// Counts one use of `key` (the router picked it), saturating at
    /// [`MAX_USE_COUNT`]. After `2 * n_layers * n_experts` uses all counts are
    /// halved, so popularity follows the recent past (amortised O(1) per use).
    pub fn record_use(&mut self, key: ExpertKey) {
        let Ok(i) = self.index_of(key) else {
            return;
        };
        let e = &mut self.index.as_mut()[i];
        if *e >> SLOT_BITS < MAX_USE_COUNT {
            *e += 1 << SLOT_BITS;
        }
        self.uses_since_aging += 1;
        if self.uses_since_aging as usize >= 2 * self.index.as_ref().len() {
            self.uses_since_aging = 0;
            for e in self.index.as_mut() {
                *e = ((*e >> SLOT_BITS) / 2) << SLOT_BITS | (*e & SLOT_MASK);
            }
        }
    }

    /// Sets the slot field of `key`'s index entry (`None` = not mapped), keeping
    /// its use count.
    fn map(&mut self, i: usize, slot: Option<SlotId>) {
        let e = &mut self.index.as_mut()[i];
        *e = (*e & !SLOT_MASK) | slot.map_or(0, |s| s.0 + 1);
    }

    /// The in-flight load of `slot`, if it is loading.
    pub fn load_mut(&mut self, slot: SlotId) -> Option<&mut Load> {
        match &mut self.slots.as_mut()[slot.0 as usize].state {
            SlotState::Loading(l) => Some(l),
            _ => None,
        }
    }

    /// A free slot, or else the `Ready` slot `policy` prefers among those whose key
    /// `allowed` accepts, given that `current_layer` is being computed.
    pub fn victim(
        &self,
        policy: EvictionPolicy,
        current_layer: u16,
        allowed: impl FnMut(ExpertKey) -> bool,
    ) -> Option<SlotId> {
        self.victim_in(policy, current_layer, 0..self.capacity(), allowed)
    }

    /// [`victim`](Self::victim) among the slots `range` (one size class, see
    /// [`crate::slot_classes`]); `None` for a range outside the table.
    pub fn victim_in(
        &self,
        policy: EvictionPolicy,
        current_layer: u16,
        range: core::ops::Range<usize>,
        mut allowed: impl FnMut(ExpertKey) -> bool,
    ) -> Option<SlotId> {
        let first = range.start;
        let slots = self.slots.as_ref().get(range)?;
        if let Some(i) = slots.iter().position(|s| s.state == SlotState::Free) {
            return Some(SlotId((first + i) as u32));
        }
        let n_layers = self.n_layers.max(1) as u32;
        let mut best: Option<(usize, (bool, u32, u32, u64))> = None;
        for (i, s) in slots.iter().enumerate() {
            let i = first + i;
            let SlotState::Ready { key, .. } = s.state else {
                continue;
            };
            if !allowed(key) {
                continue;
            }
            // Layers ahead of the current one, in the per-token cycle; the current
            // layer itself comes back only after a full cycle.
            let distance =
                match (key.layer as u32 + n_layers - current_layer as u32 % n_layers) % n_layers {
                    0 => n_layers,
                    d => d,
                };
            // Higher rank = better victim.
            let rank = match policy {
                EvictionPolicy::Lru => (true, 0, 0, u64::MAX - s.last_used),
                EvictionPolicy::LayerDistance => (true, 0, distance, u64::MAX - s.last_used),
                EvictionPolicy::Popularity => (
                    distance > PROTECTED_LAYERS,
                    MAX_USE_COUNT - self.use_count(key),
                    distance,
                    u64::MAX - s.last_used,
                ),
            };
            if best.is_none_or(|(_, r)| rank > r) {
                best = Some((i, rank));
            }
        }
        best.map(|(i, _)| SlotId(i as u32))
    }

    /// Frees a `Ready` slot.
    pub fn evict(&mut self, slot: SlotId) -> Result<ExpertKey, SlotError> {
        let SlotState::Ready { key, .. } = *self.state(slot) else {
            return Err(SlotError::InvalidTransition(slot));
        };
        let i = self.index_of(key)?;
        self.map(i, None);
        self.slots.as_mut()[slot.0 as usize].state = SlotState::Free;
        Ok(key)
    }

    /// Starts loading `load.key` into the free slot `slot`.
    pub fn start_load(&mut self, slot: SlotId, load: Load) -> Result<(), SlotError> {
        if *self.state(slot) != SlotState::Free {
            return Err(SlotError::InvalidTransition(slot));
        }
        let i = self.index_of(load.key)?;
        if self.index.as_ref()[i] & SLOT_MASK != 0 {
            return Err(SlotError::AlreadyMapped(load.key));
        }
        self.map(i, Some(slot));
        let s = &mut self.slots.as_mut()[slot.0 as usize];
        s.state = SlotState::Loading(load);
        s.unverified = false;
        Ok(())
    }

    /// Whether the expert in `slot` still awaits its checksum.
    pub fn unverified(&self, slot: SlotId) -> bool {
        self.slots.as_ref()[slot.0 as usize].unverified
    }

    /// Marks the expert in `slot` as loaded but not yet checked (its checksum is
    /// verified when it is first computed), or as checked. Loading clears it.
    pub fn set_unverified(&mut self, slot: SlotId, unverified: bool) {
        self.slots.as_mut()[slot.0 as usize].unverified = unverified;
    }

    /// Marks a settled load complete: the slot becomes `Ready`.
    pub fn finish_load(&mut self, slot: SlotId) -> Result<ExpertKey, SlotError> {
        let SlotState::Loading(load) = *self.state(slot) else {
            return Err(SlotError::InvalidTransition(slot));
        };
        if !load.settled() || load.failed {
            return Err(SlotError::InvalidTransition(slot));
        }
        self.tick += 1;
        let s = &mut self.slots.as_mut()[slot.0 as usize];
        s.state = SlotState::Ready {
            key: load.key,
            prefetched: load.prefetched && !load.demand,
        };
        s.last_used = self.tick;
        Ok(load.key)
    }

    /// Gives up a settled load: the slot becomes `Free`.
    pub fn abandon(&mut self, slot: SlotId) -> Result<ExpertKey, SlotError> {
        let SlotState::Loading(load) = *self.state(slot) else {
            return Err(SlotError::InvalidTransition(slot));
        };
        if load.outstanding != 0 {
            // The device may still write into it.
            return Err(SlotError::InvalidTransition(slot));
        }
        let i = self.index_of(load.key)?;
        self.map(i, None);
        self.slots.as_mut()[slot.0 as usize].state = SlotState::Free;
        Ok(load.key)
    }

    /// Pins a `Ready` slot for compute; returns whether it was an unused prefetch.
    pub fn pin(&mut self, slot: SlotId) -> Result<bool, SlotError> {
        let SlotState::Ready { key, prefetched } = *self.state(slot) else {
            return Err(SlotError::InvalidTransition(slot));
        };
        self.slots.as_mut()[slot.0 as usize].state = SlotState::InUse { key };
        Ok(prefetched)
    }

    /// Unpins an `InUse` slot after compute; it becomes the most recently used.
    pub fn unpin(&mut self, slot: SlotId) -> Result<(), SlotError> {
        let SlotState::InUse { key } = *self.state(slot) else {
            return Err(SlotError::InvalidTransition(slot));
        };
        self.tick += 1;
        let s = &mut self.slots.as_mut()[slot.0 as usize];
        s.state = SlotState::Ready {
            key,
            prefetched: false,
        };
        s.last_used = self.tick;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(layer: u16, expert: u16) -> ExpertKey {
        ExpertKey { layer, expert }
    }

    fn load(k: ExpertKey, id: u32) -> Load {
        Load {
            key: k,
            id,
            parts: 1,
            unsubmitted: 0,
            outstanding: 0,
            demand: true,
            prefetched: false,
            cancelled: false,
            failed: false,
            faults: 0,
        }
    }

    fn table(n: usize) -> SlotTable<[Slot; 4], [u32; 12]> {
        assert_eq!(n, 4);
        SlotTable::new([Slot::EMPTY; 4], [0; 12], 3, 4).unwrap()
    }

    #[test]
    fn lifecycle_and_index() {
        let mut t = table(4);
        let s = t.victim(EvictionPolicy::Lru, 0, |_| true).unwrap();
        t.start_load(s, load(key(1, 2), 7)).unwrap();
        assert_eq!(t.lookup(key(1, 2)), Some(s));
        assert_eq!(
            t.start_load(SlotId(1), load(key(1, 2), 8)),
            Err(SlotError::AlreadyMapped(key(1, 2)))
        );
        assert_eq!(
            t.evict(s),
            Err(SlotError::InvalidTransition(s)),
            "loading is not evictable"
        );
        t.finish_load(s).unwrap();
        assert!(!t.pin(s).unwrap());
        assert_eq!(
            t.evict(s),
            Err(SlotError::InvalidTransition(s)),
            "in use is not evictable"
        );
        t.unpin(s).unwrap();
        assert_eq!(t.evict(s), Ok(key(1, 2)));
        assert_eq!(t.lookup(key(1, 2)), None);
        assert_eq!(
            t.lookup(key(3, 0)),
            None,
            "out of range keys are simply absent"
        );
    }

    #[test]
    fn never_abandons_a_slot_with_reads_outstanding() {
        let mut t = table(4);
        let mut l = load(key(0, 0), 1);
        l.outstanding = 1;
        t.start_load(SlotId(0), l).unwrap();
        assert!(t.abandon(SlotId(0)).is_err());
        t.load_mut(SlotId(0)).unwrap().outstanding = 0;
        assert_eq!(t.abandon(SlotId(0)), Ok(key(0, 0)));
    }

    fn fill(t: &mut SlotTable<[Slot; 4], [u32; 12]>, keys: [ExpertKey; 4]) {
        for (i, k) in keys.into_iter().enumerate() {
            t.start_load(SlotId(i as u32), load(k, i as u32)).unwrap();
            t.finish_load(SlotId(i as u32)).unwrap();
        }
    }

    #[test]
    fn lru_and_layer_distance_choose_differently() {
        let mut t = table(4);
        fill(&mut t, [key(2, 0), key(1, 0), key(0, 1), key(1, 1)]);
        // Oldest first.
        assert_eq!(t.victim(EvictionPolicy::Lru, 1, |_| true), Some(SlotId(0)));
        assert_eq!(
            t.victim(EvictionPolicy::Lru, 1, |k| k.layer != 2),
            Some(SlotId(1))
        );
        // At layer 1, layer 0 comes back last (distance 2), then layer 1 after a
        // full cycle (3): layer 1's done experts are the best victims.
        assert_eq!(
            t.victim(EvictionPolicy::LayerDistance, 1, |_| true),
            Some(SlotId(1))
        );
        assert_eq!(
            t.victim(EvictionPolicy::LayerDistance, 1, |k| k.layer != 1),
            Some(SlotId(2))
        );
        t.pin(SlotId(1)).unwrap();
        t.pin(SlotId(3)).unwrap();
        assert_eq!(
            t.victim(EvictionPolicy::LayerDistance, 1, |_| true),
            Some(SlotId(2))
        );
        assert_eq!(t.victim(EvictionPolicy::Lru, 1, |k| k.layer == 1), None);
    }

    #[test]
    fn popularity_keeps_popular_experts_and_the_next_layer() {
        let mut t = table(4);
        fill(&mut t, [key(2, 0), key(0, 0), key(0, 1), key(1, 1)]);
        for _ in 0..3 {
            t.record_use(key(0, 0));
        }
        t.record_use(key(0, 1));
        t.record_use(key(2, 0));
        assert_eq!(t.use_count(key(0, 0)), 3);
        // At layer 1: layer 2 is next (kept while others are evictable); of the
        // rest, (1, 1) was never picked.
        assert_eq!(
            t.victim(EvictionPolicy::Popularity, 1, |_| true),
            Some(SlotId(3))
        );
        assert_eq!(
            t.victim(EvictionPolicy::Popularity, 1, |k| k.layer != 1),
            Some(SlotId(2)),
            "picked once beats picked three times"
        );
        assert_eq!(
            t.victim(EvictionPolicy::Popularity, 1, |k| k.layer == 2),
            Some(SlotId(0)),
            "the next layer when nothing else is allowed"
        );
        // Counts survive eviction and reloading.
        t.evict(SlotId(1)).unwrap();
        assert_eq!(t.use_count(key(0, 0)), 3);
        assert_eq!(t.lookup(key(0, 0)), None);
        t.start_load(SlotId(1), load(key(0, 0), 9)).unwrap();
        assert_eq!(t.lookup(key(0, 0)), Some(SlotId(1)));
        assert_eq!(t.use_count(key(0, 0)), 3);
    }

    #[test]
    fn use_counts_saturate_and_age() {
        let mut t = table(4);
        t.start_load(SlotId(2), load(key(1, 3), 1)).unwrap();
        // 2 * 12 uses halve every count; a count never touches the slot field.
        for _ in 0..23 {
            t.record_use(key(1, 3));
        }
        assert_eq!(t.use_count(key(1, 3)), 23);
        t.record_use(key(0, 0));
        assert_eq!(t.use_count(key(1, 3)), 11);
        assert_eq!(t.use_count(key(0, 0)), 0);
        assert_eq!(t.lookup(key(1, 3)), Some(SlotId(2)));
        for _ in 0..5000 {
            t.record_use(key(1, 3));
            t.record_use(key(1, 3));
            assert!(t.use_count(key(1, 3)) <= MAX_USE_COUNT);
        }
        assert_eq!(t.lookup(key(1, 3)), Some(SlotId(2)));
        t.record_use(ExpertKey {
            layer: 9,
            expert: 0,
        }); // outside the model: ignored
    }

    #[test]
    fn rejects_bad_storage() {
        assert!(matches!(
            SlotTable::new([Slot::EMPTY; 0], [0u32; 12], 3, 4),
            Err(SlotError::BadCapacity)
        ));
        assert!(matches!(
            SlotTable::new([Slot::EMPTY; 2], [0u32; 11], 3, 4),
            Err(SlotError::BadIndex)
        ));
    }
}
