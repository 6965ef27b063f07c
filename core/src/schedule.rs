//! The LES scheduler: which expert to read, when, into which slot, and which
//! expert to compute next.
//!
//! A state machine driven by the caller, one layer at a time:
//!
//! ```text
//! begin_token()
//! for each layer l:
//!     begin_layer(l, routing)      // demand reads for missing picked experts
//!     prefetch(l + 1, predicted)   // lookahead: speculative reads, under budget
//!     loop { match next()? {       // completions in, reads out, compute order out
//!         Compute { index, slot, .. } => { compute from the slot; finish(index) }
//!         Wait => device.wait(),
//!         Done => break,
//!     } }
//! // after an error: abandon_layer(), then the next token
//! ```
//!
//! Exactness: [`Next::Compute`] hands out a slot only when every part of its read
//! completed ([`Next::ComputeFirst`] only the bytes of parts that completed, the
//! gate and up projections, while the rest loads; [`Next::ComputeRest`] the down
//! projection once it has), and an expert's output counts only once its bytes
//! are checked:
//! on arrival by [`ExpertSource::verify`], or, for sources that know the
//! expert's [`ExpertSource::checksum`], when first computed (`verify` in
//! [`Next::Compute`], then [`Scheduler::finish_checked`]). Every picked expert is
//! handed out exactly once per layer (whole, or as its two halves), or, where
//! its bytes failed their check as it was computed, once more after it is read
//! again ([`Finished::Again`]: that output replaces the first); predictions
//! only decide what is read early. The
//! compute order is *ready-first* (resident experts while others load), so callers
//! must combine expert outputs by `index` (router order), not in compute order.
//!
//! The on-demand baseline ([`SchedulerConfig::on_demand`]) is the same machinery
//! with prefetching off and no overlap: nothing is handed out for compute until all
//! picked experts are loaded.

use core::convert::Infallible;
use core::fmt;
use core::ops::Range;

use heapless::Vec;

use crate::blockdev::{
    BlockDevice, Completion, DeviceError, ReadRequest, ReadStatus, SlotId, SlotMemory, SubmitError,
    Tag,
};
use crate::slot_classes::{class_for, SlotClass, MAX_SLOT_CLASSES};
use crate::slots::{
    EvictionPolicy, ExpertKey, IndexEntry, Load, Residency, Slot, SlotError, SlotState, SlotTable,
};

/// Most experts one layer's router may pick.
pub const MAX_PICKS: usize = 64;
/// Most experts one prediction may name.
pub const MAX_PREDICTED: usize = 64;
/// Most device reads one expert may need (3 = gate, up, down of a plain GGUF).
pub const MAX_PARTS: usize = 3;
/// Farthest lookahead the scheduler keeps apart: a prediction for layer `l + d`
/// made at layer `l` has depth `d`; deeper ones count as this depth.
pub const MAX_DEPTH: usize = 2;

/// One contiguous piece of an expert on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Device byte offset.
    pub offset: u64,
    /// Length in bytes.
    pub len: u32,
    /// Where the piece goes inside the slot.
    pub slot_offset: u32,
}

/// The pieces of one expert.
pub type Extents = Vec<Extent, MAX_PARTS>;

/// Where experts live, and how to check one that was read.
pub trait ExpertSource {
    /// The device extents of `key` (which the scheduler has range-checked).
    fn extents(&self, key: ExpertKey) -> Extents;

    /// Whether the bytes read into a slot for `key` are intact (e.g. a checksum).
    fn verify(&self, key: ExpertKey, slot: &[u8]) -> bool {
        let _ = (key, slot);
        true
    }

    /// The CRC-32 ([`crate::layout::checksum`]) of `key`'s expert bytes as its
    /// matrices hold them (gate, up, down back to back), if the source knows it.
    /// With [`SchedulerConfig::verify_on_compute`], such an expert is checked when
    /// first computed instead of by [`verify`](Self::verify) when loaded.
    fn checksum(&self, key: ExpertKey) -> Option<u32> {
        let _ = key;
        None
    }

    /// Bytes at the start of `key`'s slot that hold its gate and up projections,
    /// where they may be computed before the down projection after them has
    /// landed (see [`Next::ComputeFirst`]): useful where the extents put them in
    /// parts of their own. `None` (the default) computes experts only whole.
    fn gate_up_bytes(&self, key: ExpertKey) -> Option<u32> {
        let _ = key;
        None
    }
}

impl<T: ExpertSource + ?Sized> ExpertSource for &T {
    fn extents(&self, key: ExpertKey) -> Extents {
        (**self).extents(key)
    }

    fn verify(&self, key: ExpertKey, slot: &[u8]) -> bool {
        (**self).verify(key, slot)
    }

    fn checksum(&self, key: ExpertKey) -> Option<u32> {
        (**self).checksum(key)
    }

    fn gate_up_bytes(&self, key: ExpertKey) -> Option<u32> {
        (**self).gate_up_bytes(key)
    }
}

/// Scheduler settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Act on [`Scheduler::prefetch`] predictions.
    pub prefetch: bool,
    /// Hand out loaded experts while others still load (ready-first, overlap).
    /// When `false`, compute starts only once all picked experts are loaded.
    pub ready_first: bool,
    /// Which slot to reuse.
    pub eviction: EvictionPolicy,
    /// Speculative bytes allowed per token (reset by [`Scheduler::begin_token`]).
    pub prefetch_budget: u64,
    /// Device queue entries prefetches leave free for demand reads.
    pub demand_reserve: usize,
    /// Retries of a demand read after transient device errors, and reads
    /// again of a picked expert whose bytes failed their checksum (a bit
    /// flipped on its way), before either is an error.
    pub max_retries: u8,
    /// A layer whose measured prediction precision falls below this stops
    /// prefetching (predictions keep being scored, so it can come back).
    pub min_precision: f32,
    /// Predicted experts per precision measurement window.
    pub precision_window: u32,
    /// Prefetches of a prediction rank (1st, 2nd, ... most confident) whose
    /// measured precision is below this are issued only while the device is idle
    /// (no read in flight): they use bandwidth that would otherwise go unused, and
    /// never delay a read that is more likely to be needed. 0 issues every rank
    /// of the next layer at once. Predictions for layers further ahead (depth 2)
    /// are always issued only while the device is idle: where reads are the
    /// bottleneck they would take bandwidth from the next layer's.
    pub idle_only_below: f32,
    /// Check experts whose source knows their [`ExpertSource::checksum`] when they
    /// are first computed: [`Next::Compute`] asks for the CRC of the bytes the
    /// kernels read anyway, still in cache, and [`Scheduler::finish_checked`]
    /// compares it before the output may be used. Otherwise (and for sources
    /// without checksums) [`ExpertSource::verify`] checks each load on arrival,
    /// reading its bytes once more. Prefetches never used are never hashed.
    pub verify_on_compute: bool,
    /// Ready-first within an expert: where the source puts an expert's gate and
    /// up projections in parts of their own ([`ExpertSource::gate_up_bytes`])
    /// and checks it on compute, [`Scheduler::next_parts`] hands them out
    /// ([`Next::ComputeFirst`]) as soon as those parts landed, while its down
    /// projection still loads, and the down projection once it has
    /// ([`Next::ComputeRest`]). Only with [`verify_on_compute`](Self::verify_on_compute):
    /// the checksum then covers the bytes each half was computed from.
    pub split_compute: bool,
}

impl SchedulerConfig {
    /// Lookahead Expert Scheduling: prefetch, ready-first, popularity- and
    /// layer-aware eviction.
    pub const fn les() -> Self {
        SchedulerConfig {
            prefetch: true,
            ready_first: true,
            eviction: EvictionPolicy::Popularity,
            prefetch_budget: u64::MAX,
            demand_reserve: MAX_PARTS,
            max_retries: 3,
            min_precision: 0.2,
            precision_window: 64,
            idle_only_below: 0.75,
            verify_on_compute: true,
            split_compute: true,
        }
    }

    /// The on-demand baseline: after routing, read what is missing, then compute.
    pub const fn on_demand() -> Self {
        SchedulerConfig {
            prefetch: false,
            ready_first: false,
            eviction: EvictionPolicy::Lru,
            split_compute: false,
            ..Self::les()
        }
    }
}

/// Per-layer prediction bookkeeping; caller storage of one entry per layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerState {
    /// Whether prefetching is currently enabled for this layer.
    pub prefetch_enabled: bool,
    /// Experts predicted for this layer (all tokens).
    pub predicted: u64,
    /// Predicted experts the router then picked.
    pub true_positives: u64,
    /// Experts picked in layers that had a prediction.
    pub picked: u64,
    window_predicted: u32,
    window_hits: u32,
}

impl LayerState {
    /// Initial state: prefetching enabled, no history.
    pub const INITIAL: LayerState = LayerState {
        prefetch_enabled: true,
        predicted: 0,
        true_positives: 0,
        picked: 0,
        window_predicted: 0,
        window_hits: 0,
    };

    /// Fraction of predicted experts that were picked (1 when nothing was predicted).
    pub fn precision(&self) -> f32 {
        ratio(self.true_positives, self.predicted)
    }

    /// Fraction of picked experts that were predicted (1 when nothing was picked).
    pub fn recall(&self) -> f32 {
        ratio(self.true_positives, self.picked)
    }

    /// The counts since `earlier`, a copy of this state taken before (each
    /// count saturating at 0 where `earlier` is not); the rest is this state's.
    pub fn since(&self, earlier: &LayerState) -> LayerState {
        LayerState {
            predicted: self.predicted.saturating_sub(earlier.predicted),
            true_positives: self.true_positives.saturating_sub(earlier.true_positives),
            picked: self.picked.saturating_sub(earlier.picked),
            ..*self
        }
    }
}

fn ratio(a: u64, b: u64) -> f32 {
    if b == 0 {
        1.0
    } else {
        a as f32 / b as f32
    }
}

/// Counters for `les bench` and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Picked experts already resident.
    pub hits: u64,
    /// Picked experts whose prefetch was still in flight.
    pub late_hits: u64,
    /// Picked experts that needed a demand read.
    pub misses: u64,
    /// Bytes submitted as demand reads (retries included).
    pub demand_bytes: u64,
    /// Bytes submitted as prefetches.
    pub prefetch_bytes: u64,
    /// Prefetched experts that were then picked.
    pub useful_prefetches: u64,
    /// Prefetches started.
    pub prefetches: u64,
    /// Times [`Scheduler::next`] had nothing to compute and asked the caller to wait.
    pub stalls: u64,
    /// Loads cancelled (stale prefetches, or to free a slot for a demand read).
    pub cancels: u64,
    /// Demand reads retried after transient errors.
    pub retries: u64,
    /// Completions that matched no read in flight (ignored).
    pub stale_completions: u64,
    /// Prefetched experts that failed verification (dropped).
    pub bad_prefetches: u64,
    /// Picked experts whose gate and up projections were computed before their
    /// down projection landed ([`Next::ComputeFirst`]).
    pub split_computes: u64,
    /// Picked experts read again because their bytes failed their checksum
    /// (on arrival, or where first computed: then computed again).
    pub rereads: u64,
}

impl Stats {
    /// The counts since `earlier`, a copy of these counters taken before (each
    /// count saturating at 0 where `earlier` is not).
    pub fn since(&self, earlier: &Stats) -> Stats {
        Stats {
            hits: self.hits.saturating_sub(earlier.hits),
            late_hits: self.late_hits.saturating_sub(earlier.late_hits),
            misses: self.misses.saturating_sub(earlier.misses),
            demand_bytes: self.demand_bytes.saturating_sub(earlier.demand_bytes),
            prefetch_bytes: self.prefetch_bytes.saturating_sub(earlier.prefetch_bytes),
            useful_prefetches: self
                .useful_prefetches
                .saturating_sub(earlier.useful_prefetches),
            prefetches: self.prefetches.saturating_sub(earlier.prefetches),
            stalls: self.stalls.saturating_sub(earlier.stalls),
            cancels: self.cancels.saturating_sub(earlier.cancels),
            retries: self.retries.saturating_sub(earlier.retries),
            stale_completions: self
                .stale_completions
                .saturating_sub(earlier.stale_completions),
            bad_prefetches: self.bad_prefetches.saturating_sub(earlier.bad_prefetches),
            split_computes: self.split_computes.saturating_sub(earlier.split_computes),
            rereads: self.rereads.saturating_sub(earlier.rereads),
        }
    }

    /// Picked experts that needed no demand read, as a fraction of all picked
    /// (a prefetch still in flight counts: see [`ready_hit_rate`](Self::ready_hit_rate)).
    pub fn hit_rate(&self) -> f32 {
        ratio(
            self.hits + self.late_hits,
            self.hits + self.late_hits + self.misses,
        )
    }

    /// Picked experts already resident and landed when picked, as a fraction of
    /// all picked: what a cache without prefetching calls a hit, so the one
    /// figure to compare with LRU's or Belady's.
    pub fn ready_hit_rate(&self) -> f32 {
        ratio(self.hits, self.hits + self.late_hits + self.misses)
    }
}

/// What the caller should do next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Compute picked expert `index` (position in the routing) from `slot`, then
    /// call [`Scheduler::finish`].
    Compute {
        /// Position in the routing passed to [`Scheduler::begin_layer`].
        index: usize,
        /// The expert.
        key: ExpertKey,
        /// The slot holding it, pinned until `finish`.
        slot: SlotId,
        /// Its bytes are not checked yet: compute their CRC-32 (gate, up, down
        /// back to back, as [`ExpertSource::checksum`]) along with the expert and
        /// finish with [`Scheduler::finish_checked`], which must accept it before
        /// the expert's output is used.
        verify: bool,
    },
    /// ([`Scheduler::next_parts`] only.) Compute the gate and up projections of
    /// picked expert `index` from the first `bytes` bytes of `slot`, which have
    /// landed; the rest of the slot is still being read, so touch nothing past
    /// them. Keep their SwiGLU activations and the CRC-32 of those bytes: the
    /// down projection follows as [`Next::ComputeRest`].
    ComputeFirst {
        /// Position in the routing passed to [`Scheduler::begin_layer`].
        index: usize,
        /// The expert.
        key: ExpertKey,
        /// The slot it is loading into.
        slot: SlotId,
        /// Bytes of the slot that hold the gate and up projections.
        bytes: u32,
    },
    /// The down projection of picked expert `index`, whose gate and up were
    /// handed out as [`Next::ComputeFirst`], from `slot` (now loaded and pinned
    /// until `finish`); then [`Scheduler::finish_checked`] with the CRC-32 of the
    /// whole expert (both halves' checksums concatenated).
    ComputeRest {
        /// Position in the routing passed to [`Scheduler::begin_layer`].
        index: usize,
        /// The expert.
        key: ExpertKey,
        /// The slot holding it.
        slot: SlotId,
    },
    /// Reads are in flight and nothing is ready: block on the device, then call
    /// `next` again.
    Wait,
    /// Every picked expert of the layer was handed out and finished.
    Done,
}

/// Scheduler errors; `E` is the device's error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Error<E> {
    /// Reading `key` failed permanently (or transiently more than allowed).
    Device {
        /// The expert.
        key: ExpertKey,
        /// The device's error.
        error: E,
    },
    /// The bytes read for `key` failed verification.
    Checksum {
        /// The expert.
        key: ExpertKey,
    },
    /// The expert's extents do not fit a slot or exceed [`MAX_PARTS`].
    BadExtents {
        /// The expert.
        key: ExpertKey,
    },
    /// Invalid configuration or storage.
    Config(&'static str),
    /// A layer or expert index outside the model, or a repeated expert.
    BadRouting,
    /// `begin_layer` before every expert of the previous layer was finished.
    LayerInProgress,
    /// `finish` of an index that is not being computed.
    NotComputing(usize),
    /// `finish` of an index handed out with `verify`, without its checksum.
    Unverified(usize),
    /// No read is in flight, yet a picked expert cannot be loaded (a device that
    /// reports `Busy` with an empty queue, or a caller holding slots).
    Stuck,
    /// Internal slot-state violation (a bug); reported instead of corrupting slots.
    Slot(SlotError),
}

impl<E: fmt::Display> fmt::Display for Error<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Device { key, error } => write!(f, "reading {key} failed: {error}"),
            Error::Checksum { key } => write!(f, "{key}: checksum mismatch in the data read"),
            Error::BadExtents { key } => write!(f, "{key}: extents do not fit a slot"),
            Error::Config(why) => write!(f, "invalid scheduler configuration: {why}"),
            Error::BadRouting => f.write_str("routing names an expert outside the model or twice"),
            Error::LayerInProgress => f.write_str("previous layer still has experts to compute"),
            Error::NotComputing(i) => write!(f, "picked expert {i} is not being computed"),
            Error::Unverified(i) => write!(f, "picked expert {i} finished without its checksum"),
            Error::Stuck => f.write_str("no read in flight but picked experts cannot be loaded"),
            Error::Slot(e) => write!(f, "slot table: {e}"),
        }
    }
}

impl<E: fmt::Debug + fmt::Display> core::error::Error for Error<E> {}

impl<E> From<SlotError> for Error<E> {
    fn from(e: SlotError) -> Self {
        Error::Slot(e)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PickStatus {
    NeedsSlot,
    Loading(SlotId),
    Ready(SlotId),
    Computing(SlotId),
    /// Its gate and up were handed out; the rest is still loading.
    FirstDone(SlotId),
    /// Loaded and pinned after its gate and up were computed: the down projection
    /// is left.
    RestReady(SlotId),
    Done,
}

/// A prefetch waiting to be issued.
#[derive(Clone, Copy, Debug)]
struct Queued {
    key: ExpertKey,
    /// 1 = the next layer; 0 = known to be picked
    /// ([`prefetch_known`](Scheduler::prefetch_known)).
    depth: u8,
    /// 0 = the most confident.
    rank: u8,
}

/// A prediction waiting for its layer's routing, to be scored.
#[derive(Clone, Debug)]
struct Prediction {
    layer: u16,
    depth: u8,
    set: Vec<u16, MAX_PREDICTED>,
}

#[derive(Clone, Copy, Debug)]
struct Pick {
    key: ExpertKey,
    status: PickStatus,
    /// The checksum its computation must match (handed out unverified).
    expect: Option<u32>,
    /// Times its bytes failed their checksum where computed and it was
    /// read again.
    rereads: u8,
}

/// What [`Scheduler::finish_checked`] made of a computed expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finished {
    /// Its bytes are intact: its output stands.
    Done,
    /// Its bytes failed their checksum: its output must not be used; it is
    /// read again and handed out again (the same `index`), and its output
    /// computed then replaces this one.
    Again,
}

/// The LES scheduler over slot storage `S`, index storage `M` and per-layer
/// storage `L` (see [`SlotTable`] and [`LayerState`]).
pub struct Scheduler<S, M, L> {
    table: SlotTable<S, M>,
    layers: L,
    config: SchedulerConfig,
    /// The slots' sizes: runs of slots, smallest first.
    classes: Vec<SlotClass, MAX_SLOT_CLASSES>,
    next_load: u32,
    layer: Option<u16>,
    picks: Vec<Pick, MAX_PICKS>,
    /// Prefetches to issue, nearest layer and most confident first.
    queue: Vec<Queued, { MAX_DEPTH * MAX_PREDICTED }>,
    /// Per prediction depth and rank: (predicted, picked), halved as they grow.
    rank_score: [[(u32, u32); MAX_PREDICTED]; MAX_DEPTH],
    /// Predictions not yet scored: at most one per (layer, depth), for the next
    /// [`MAX_DEPTH`] layers.
    predictions: Vec<Prediction, { MAX_DEPTH * MAX_DEPTH }>,
    token_prefetch_bytes: u64,
    in_flight: usize,
    /// Some prefetch has parts the device refused (busy): resubmit them.
    partial_prefetch: bool,
    /// The layer whose popularity this token already counted (from the router
    /// scores [`Scheduler::observe_router`] took, or the first group of picks):
    /// its picks are not counted again. Cleared by [`Scheduler::begin_token`].
    observed: Option<u16>,
    /// A picked expert's read failed or its bytes their checksum: what was
    /// read but not yet checked is given up with the layer
    /// ([`Scheduler::abandon_layer`]).
    faulted: bool,
    stats: Stats,
}

/// Predictions per rank after which the rank's counts are halved (recent past).
const RANK_WINDOW: u32 = 1024;
/// Predictions of a rank before its precision is trusted.
const RANK_MIN_SAMPLES: u32 = 32;

const PART_BITS: u32 = 2;
const GEN_BITS: u32 = 8;
const SLOT_SHIFT: u32 = PART_BITS + GEN_BITS;
/// Most slots a scheduler manages (tags carry the slot index).
pub const MAX_SLOTS: usize = crate::slots::MAX_TABLE_SLOTS;
const _: () = assert!(
    MAX_SLOTS < 1 << (32 - SLOT_SHIFT),
    "slot indices must fit a tag"
);

/// A read's tag: the slot, the low bits of the load id (so a completion of an
/// earlier attempt into the same slot is recognised as stale) and the part.
fn tag(slot: SlotId, load: u32, part: usize) -> Tag {
    Tag((slot.0 << SLOT_SHIFT) | ((load & ((1 << GEN_BITS) - 1)) << PART_BITS) | part as u32)
}

/// `(slot, load id low bits, part bit)` of a tag.
fn untag(t: Tag) -> (SlotId, u32, u8) {
    (
        SlotId(t.0 >> SLOT_SHIFT),
        (t.0 >> PART_BITS) & ((1 << GEN_BITS) - 1),
        1u8 << (t.0 & ((1 << PART_BITS) - 1)),
    )
}

impl<S, M, L> Scheduler<S, M, L>
where
    S: AsRef<[Slot]> + AsMut<[Slot]>,
    M: AsRef<[IndexEntry]> + AsMut<[IndexEntry]>,
    L: AsRef<[LayerState]> + AsMut<[LayerState]>,
{
    /// A scheduler for `n_layers` layers of `n_experts` experts, with one slot of
    /// `slot_bytes` bytes per entry of `slots`. `index` needs `n_layers * n_experts`
    /// entries and `layers` needs `n_layers`.
    pub fn new(
        config: SchedulerConfig,
        slots: S,
        index: M,
        layers: L,
        n_layers: u16,
        n_experts: u16,
        slot_bytes: u32,
    ) -> Result<Self, Error<Infallible>> {
        let class = SlotClass {
            slots: slots.as_ref().len() as u32,
            bytes: slot_bytes,
        };
        Self::with_slot_classes(config, slots, index, layers, n_layers, n_experts, &[class])
    }

    /// [`new`](Self::new) with slots of several sizes: `classes` (smallest first,
    /// sizes strictly increasing) cover the entries of `slots` in order, and each
    /// expert only takes slots of the smallest class it fits (see
    /// [`crate::slot_classes`]). A layer's picks must fit their class.
    pub fn with_slot_classes(
        config: SchedulerConfig,
        slots: S,
        index: M,
        mut layers: L,
        n_layers: u16,
        n_experts: u16,
        classes: &[SlotClass],
    ) -> Result<Self, Error<Infallible>> {
        if layers.as_ref().len() != n_layers as usize {
            return Err(Error::Config("layer storage must hold n_layers entries"));
        }
        if !(0.0..=1.0).contains(&config.min_precision) {
            return Err(Error::Config("min_precision must lie in 0..=1"));
        }
        if !(0.0..=1.0).contains(&config.idle_only_below) {
            return Err(Error::Config("idle_only_below must lie in 0..=1"));
        }
        if slots.as_ref().len() > MAX_SLOTS {
            return Err(Error::Config("more slots than MAX_SLOTS"));
        }
        if classes.is_empty()
            || classes.len() > MAX_SLOT_CLASSES
            || classes.iter().any(|c| c.slots == 0)
            || classes.windows(2).any(|w| w[0].bytes >= w[1].bytes)
        {
            return Err(Error::Config(
                "slot classes: 1..=MAX_SLOT_CLASSES non-empty runs, sizes increasing",
            ));
        }
        if classes.iter().map(|c| c.slots as usize).sum::<usize>() != slots.as_ref().len() {
            return Err(Error::Config("slot classes must cover the slots exactly"));
        }
        layers.as_mut().fill(LayerState::INITIAL);
        let table = SlotTable::new(slots, index, n_layers, n_experts)?;
        Ok(Scheduler {
            table,
            layers,
            config,
            classes: classes.iter().copied().collect(),
            next_load: 0,
            layer: None,
            picks: Vec::new(),
            queue: Vec::new(),
            rank_score: [[(0, 0); MAX_PREDICTED]; MAX_DEPTH],
            predictions: Vec::new(),
            token_prefetch_bytes: 0,
            in_flight: 0,
            partial_prefetch: false,
            observed: None,
            faulted: false,
            stats: Stats::default(),
        })
    }

    /// The slots' size classes, smallest first, in slot order.
    pub fn slot_classes(&self) -> &[SlotClass] {
        &self.classes
    }

    /// The settings.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Counters so far.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Per-layer prediction state.
    pub fn layers(&self) -> &[LayerState] {
        self.layers.as_ref()
    }

    /// The slot table (read-only).
    pub fn table(&self) -> &SlotTable<S, M> {
        &self.table
    }

    /// The most experts one [`begin_layer`](Self::begin_layer) may name: every
    /// slot of a size could hold one of them ([`MAX_PICKS`] at most).
    pub fn max_picks(&self) -> usize {
        self.classes
            .iter()
            .map(|c| c.slots as usize)
            .chain([self.table.capacity(), MAX_PICKS])
            .min()
            .unwrap_or(0)
    }

    /// Whether `expert` of `layer` is in a slot, on its way, or neither.
    pub fn residency(&self, layer: u16, expert: u16) -> Residency {
        self.table.residency(ExpertKey { layer, expert })
    }

    /// Device reads submitted and not yet completed.
    pub fn reads_in_flight(&self) -> usize {
        self.in_flight
    }

    /// Speculative bytes submitted since [`begin_token`](Self::begin_token).
    pub fn token_prefetch_bytes(&self) -> u64 {
        self.token_prefetch_bytes
    }

    /// Whether a picked expert of the current layer waits for a slot or for its
    /// read to be submitted (prefetches are held back meanwhile).
    pub fn demand_pending(&self) -> bool {
        // Demand loads are exactly the current picks' loads.
        self.picks.iter().any(|p| match p.status {
            PickStatus::NeedsSlot => true,
            PickStatus::Loading(slot) | PickStatus::FirstDone(slot) => {
                matches!(self.table.state(slot), SlotState::Loading(l) if l.unsubmitted != 0)
            }
            _ => false,
        })
    }

    /// Starts a new token: resets the per-token prefetch budget.
    pub fn begin_token(&mut self) {
        self.token_prefetch_bytes = 0;
        self.observed = None;
    }

    /// `layer`'s router scored its experts `logits` (one per expert), before
    /// [`begin_layer`](Self::begin_layer) of that layer: the eviction policy's
    /// popularity then learns from every expert's probability
    /// ([`SlotTable::observe_router`]) instead of counting the picks. Scores
    /// that do not fit the model (wrong length, not finite) are ignored, and the
    /// picks are counted.
    pub fn observe_router(&mut self, layer: u16, logits: &[f32]) {
        self.observed = self.table.observe_router(layer, logits).then_some(layer);
    }

    /// Starts `layer` with the experts its router picked (in router order): pins
    /// resident ones, cancels stale prefetches of this layer and issues demand reads.
    pub fn begin_layer<D, X>(
        &mut self,
        layer: u16,
        routing: &[u16],
        dev: &mut D,
        src: &X,
    ) -> Result<(), Error<D::Error>>
    where
        D: BlockDevice + SlotMemory,
        X: ExpertSource,
    {
        if self.picks.iter().any(|p| p.status != PickStatus::Done) {
            return Err(Error::LayerInProgress);
        }
        let n_experts = self.table.n_experts();
        if layer >= self.table.n_layers()
            || routing.len() > MAX_PICKS
            || routing
                .iter()
                .enumerate()
                .any(|(i, e)| *e >= n_experts || routing[..i].contains(e))
        {
            return Err(Error::BadRouting);
        }
        if routing.len() > self.table.capacity() {
            return Err(Error::Config("fewer slots than experts per layer"));
        }
        if self.classes.len() > 1 {
            let mut need = [0usize; MAX_SLOT_CLASSES];
            for &expert in routing {
                let (_, c) = self.placement(ExpertKey { layer, expert }, src)?;
                need[c] += 1;
                if need[c] > self.classes[c].slots as usize {
                    return Err(Error::Config(
                        "fewer slots of a size than experts per layer",
                    ));
                }
            }
        }
        self.score_prediction(layer, routing);
        // A token's picks of a layer asked for in groups (a batch's union) are
        // counted once: by the router scores, or else here, for the first group.
        if self.observed != Some(layer) {
            self.table.record_picks(layer, routing);
            self.observed = Some(layer);
        }
        self.layer = Some(layer);
        self.queue.clear();
        self.picks.clear();

        // Stale prefetches of this layer: predicted, not picked.
        let stale: Vec<SlotId, MAX_PREDICTED> = self
            .table
            .iter()
            .filter_map(|(slot, s)| match s {
                SlotState::Loading(l)
                    if l.key.layer == layer
                        && !l.demand
                        && !l.cancelled
                        && !routing.contains(&l.key.expert) =>
                {
                    Some(slot)
                }
                _ => None,
            })
            .take(MAX_PREDICTED)
            .collect();
        for slot in stale {
            self.cancel_load(slot, dev)?;
        }

        for &expert in routing {
            let key = ExpertKey { layer, expert };
            let status = match self.table.lookup(key) {
                None => {
                    self.stats.misses += 1;
                    PickStatus::NeedsSlot
                }
                Some(slot) => match *self.table.state(slot) {
                    SlotState::Ready { .. } => {
                        self.stats.hits += 1;
                        if self.table.pin(slot)? {
                            self.stats.useful_prefetches += 1;
                        }
                        PickStatus::Ready(slot)
                    }
                    SlotState::Loading(_) => {
                        let load = self
                            .table
                            .load_mut(slot)
                            .ok_or(SlotError::InvalidTransition(slot))?;
                        if load.prefetched && !load.demand {
                            self.stats.useful_prefetches += 1;
                        }
                        load.demand = true;
                        self.stats.late_hits += 1;
                        PickStatus::Loading(slot)
                    }
                    SlotState::InUse { .. } | SlotState::Free => {
                        return Err(SlotError::InvalidTransition(slot).into())
                    }
                },
            };
            // Capacity MAX_PICKS, routing.len() <= MAX_PICKS checked above.
            let _ = self.picks.push(Pick {
                key,
                status,
                expect: None,
                rereads: 0,
            });
        }
        self.pump(dev, src)
    }

    /// Records the lookahead prediction for `layer` (normally the next one, or
    /// the one after: see [`MAX_DEPTH`]) and, where prefetching is on for that
    /// layer, queues speculative reads of the predicted experts, most confident
    /// first. A new prediction for a layer replaces the queued reads of an
    /// earlier one; reads of nearer layers go first.
    pub fn prefetch<D, X>(
        &mut self,
        layer: u16,
        predicted: &[u16],
        dev: &mut D,
        src: &X,
    ) -> Result<(), Error<D::Error>>
    where
        D: BlockDevice + SlotMemory,
        X: ExpertSource,
    {
        if layer >= self.table.n_layers() {
            return Err(Error::BadRouting);
        }
        let mut set: Vec<u16, MAX_PREDICTED> = Vec::new();
        for &e in predicted {
            if e < self.table.n_experts() && !set.contains(&e) && set.push(e).is_err() {
                break;
            }
        }
        let depth = match self.layer {
            Some(now) if layer > now => (layer - now) as usize,
            _ => 1,
        }
        .min(MAX_DEPTH) as u8;
        self.queue.retain(|q| q.key.layer != layer);
        if self.config.prefetch && self.layers.as_ref()[layer as usize].prefetch_enabled {
            for (rank, &expert) in set.iter().enumerate() {
                let key = ExpertKey { layer, expert };
                if self.table.lookup(key).is_some() {
                    continue;
                }
                if !self.make_room(depth) {
                    continue;
                }
                let _ = self.queue.push(Queued {
                    key,
                    depth,
                    rank: rank as u8,
                }); // room made just above
            }
        }
        self.queue.sort_unstable_by_key(|q| (q.depth, q.rank));
        self.predictions
            .retain(|p| !(p.layer == layer && p.depth == depth));
        if self.predictions.is_full() {
            self.predictions.remove(0);
        }
        let _ = self.predictions.push(Prediction { layer, depth, set });
        self.pump(dev, src)
    }

    /// Queues reads of `experts` of `layer` known, or nearly, to be picked next
    /// (a batch's next group of a layer's picks, or the next layer's experts
    /// most of its positions are predicted to pick, see
    /// [`forward_batch`](crate::model::forward::forward_batch)), ahead of every
    /// lookahead prediction: they are not predictions (never scored, never
    /// held back for an idle device, not counted in the token's prefetch
    /// budget), and replace the known reads queued before. Only with
    /// [`SchedulerConfig::prefetch`]. Like a prefetch, a
    /// read the layer's picks do not name is cancelled, and none evicts an
    /// expert of `layer` or a pick of the current layer.
    pub fn prefetch_known<D, X>(
        &mut self,
        layer: u16,
        experts: &[u16],
        dev: &mut D,
        src: &X,
    ) -> Result<(), Error<D::Error>>
    where
        D: BlockDevice + SlotMemory,
        X: ExpertSource,
    {
        if layer >= self.table.n_layers() {
            return Err(Error::BadRouting);
        }
        self.queue.retain(|q| q.depth != 0);
        if !self.config.prefetch {
            // The on-demand baseline reads a group when it is asked for.
            return Ok(());
        }
        for (rank, &expert) in experts.iter().enumerate().take(MAX_PREDICTED) {
            let key = ExpertKey { layer, expert };
            if expert >= self.table.n_experts()
                || self.table.lookup(key).is_some()
                || self.queue.iter().any(|q| q.key == key)
            {
                continue;
            }
            if !self.make_room(0) {
                break;
            }
            let _ = self.queue.push(Queued {
                key,
                depth: 0,
                rank: rank as u8,
            }); // room made just above
        }
        self.queue.sort_unstable_by_key(|q| (q.depth, q.rank));
        self.pump(dev, src)
    }

    /// Whether the queue has room for a read of `depth`: where it is full, the
    /// deepest, least confident queued read deeper than `depth` is dropped.
    fn make_room(&mut self, depth: u8) -> bool {
        if !self.queue.is_full() {
            return true;
        }
        let deepest = (0..self.queue.len())
            .max_by_key(|&i| (self.queue[i].depth, self.queue[i].rank))
            .filter(|&i| self.queue[i].depth > depth);
        match deepest {
            Some(i) => {
                self.queue.swap_remove(i);
                true
            }
            None => false,
        }
    }

    /// Processes completions, submits what can be submitted, and says what to do
    /// (whole experts only: [`next_parts`](Self::next_parts) with `split` off).
    pub fn next<D, X>(&mut self, dev: &mut D, src: &X) -> Result<Next, Error<D::Error>>
    where
        D: BlockDevice + SlotMemory,
        X: ExpertSource,
    {
        self.next_parts(dev, src, false)
    }

    /// Like [`next`](Self::next); with `split` (and
    /// [`SchedulerConfig::split_compute`]) it may also hand out a loading expert's
    /// gate and up projections once their parts landed ([`Next::ComputeFirst`]),
    /// then its down projection ([`Next::ComputeRest`]). A caller that takes
    /// split work for a layer keeps calling with `split` until
    /// [`Next::Done`].
    pub fn next_parts<D, X>(
        &mut self,
        dev: &mut D,
        src: &X,
        split: bool,
    ) -> Result<Next, Error<D::Error>>
    where
        D: BlockDevice + SlotMemory,
        X: ExpertSource,
    {
        while let Some(c) = dev.poll() {
            self.on_completion(c, dev, src)?;
        }
        self.pump(dev, src)?;

        let all_loaded = self.picks.iter().all(|p| {
            !matches!(
                p.status,
                PickStatus::NeedsSlot | PickStatus::Loading(_) | PickStatus::FirstDone(_)
            )
        });
        if self.config.ready_first || all_loaded {
            if let Some((index, slot)) = self.first_pick(|s| match s {
                PickStatus::Ready(slot) => Some(slot),
                _ => None,
            }) {
                let key = self.picks[index].key;
                let expect = if self.table.unverified(slot) {
                    src.checksum(key)
                } else {
                    None
                };
                self.picks[index].status = PickStatus::Computing(slot);
                self.picks[index].expect = expect;
                return Ok(Next::Compute {
                    index,
                    key,
                    slot,
                    verify: expect.is_some(),
                });
            }
            if let Some((index, slot)) = self.first_pick(|s| match s {
                PickStatus::RestReady(slot) => Some(slot),
                _ => None,
            }) {
                self.picks[index].status = PickStatus::Computing(slot);
                return Ok(Next::ComputeRest {
                    index,
                    key: self.picks[index].key,
                    slot,
                });
            }
            if split {
                if let Some(next) = self.first_half(src) {
                    return Ok(next);
                }
            }
        }
        if self.picks.iter().all(|p| p.status == PickStatus::Done) {
            return Ok(Next::Done);
        }
        if self.in_flight > 0 {
            self.stats.stalls += 1;
            return Ok(Next::Wait);
        }
        if self
            .picks
            .iter()
            .any(|p| matches!(p.status, PickStatus::Computing(_)))
        {
            // Another thread is computing; its `finish` frees what we need.
            return Ok(Next::Wait);
        }
        Err(Error::Stuck)
    }

    /// The first pick (routing index) whose status `slot_of` maps to a slot, and
    /// that slot.
    fn first_pick(
        &self,
        slot_of: impl Fn(PickStatus) -> Option<SlotId>,
    ) -> Option<(usize, SlotId)> {
        self.picks
            .iter()
            .enumerate()
            .find_map(|(i, p)| slot_of(p.status).map(|s| (i, s)))
    }

    /// A loading pick whose gate and up parts landed, handed out as
    /// [`Next::ComputeFirst`].
    fn first_half<X: ExpertSource>(&mut self, src: &X) -> Option<Next> {
        let (index, slot) = self.first_pick(|s| match s {
            PickStatus::Loading(slot) => match self.table.state(slot) {
                SlotState::Loading(l)
                    if l.first_parts != 0
                        && !l.failed
                        && l.landed & l.first_parts == l.first_parts =>
                {
                    Some(slot)
                }
                _ => None,
            },
            _ => None,
        })?;
        let key = self.picks[index].key;
        // `first_parts` is only set where both are known (see `first_parts`).
        let (bytes, expect) = (src.gate_up_bytes(key)?, src.checksum(key)?);
        self.picks[index].status = PickStatus::FirstDone(slot);
        self.picks[index].expect = Some(expect);
        self.stats.split_computes += 1;
        Some(Next::ComputeFirst {
            index,
            key,
            slot,
            bytes,
        })
    }

    /// Like [`next`](Self::next), but blocks on the device instead of returning
    /// [`Next::Wait`] while reads are in flight.
    pub fn next_blocking<D, X>(&mut self, dev: &mut D, src: &X) -> Result<Next, Error<D::Error>>
    where
        D: BlockDevice + SlotMemory,
        X: ExpertSource,
    {
        self.next_blocking_parts(dev, src, false)
    }

    /// Like [`next_parts`](Self::next_parts), but blocks on the device instead of
    /// returning [`Next::Wait`] while reads are in flight.
    pub fn next_blocking_parts<D, X>(
        &mut self,
        dev: &mut D,
        src: &X,
        split: bool,
    ) -> Result<Next, Error<D::Error>>
    where
        D: BlockDevice + SlotMemory,
        X: ExpertSource,
    {
        loop {
            match self.next_parts(dev, src, split)? {
                Next::Wait if self.in_flight > 0 => dev.wait(),
                other => return Ok(other),
            }
        }
    }

    /// Marks picked expert `index` computed and unpins its slot. An expert handed
    /// out with `verify` needs [`finish_checked`](Self::finish_checked) instead.
    pub fn finish<E>(&mut self, index: usize) -> Result<(), Error<E>> {
        let Some(pick) = self.picks.get(index) else {
            return Err(Error::NotComputing(index));
        };
        if pick.expect.is_some() {
            return Err(Error::Unverified(index));
        }
        let PickStatus::Computing(slot) = pick.status else {
            return Err(Error::NotComputing(index));
        };
        self.table.unpin(slot)?;
        self.picks[index].status = PickStatus::Done;
        Ok(())
    }

    /// Like [`finish`](Self::finish), given the CRC-32 of the expert's bytes
    /// computed along with it. For an expert handed out with `verify`, a
    /// checksum other than the source's means its output must not be used:
    /// its slot is freed so the corrupt bytes are never reused, and it is
    /// read again and handed out again ([`Finished::Again`]), up to
    /// [`SchedulerConfig::max_retries`] times; then [`Error::Checksum`]. For
    /// others `checksum` is ignored.
    pub fn finish_checked<E>(&mut self, index: usize, checksum: u32) -> Result<Finished, Error<E>> {
        let Some(pick) = self.picks.get_mut(index) else {
            return Err(Error::NotComputing(index));
        };
        let PickStatus::Computing(slot) = pick.status else {
            return Err(Error::NotComputing(index));
        };
        let (key, expect) = (pick.key, pick.expect.take());
        if expect.is_some_and(|e| e != checksum) {
            self.table.unpin(slot)?;
            self.table.evict(slot)?;
            let pick = &mut self.picks[index];
            if pick.rereads < self.config.max_retries {
                pick.rereads += 1;
                pick.status = PickStatus::NeedsSlot;
                self.stats.rereads += 1;
                return Ok(Finished::Again);
            }
            pick.status = PickStatus::Done;
            self.faulted = true;
            return Err(Error::Checksum { key });
        }
        if expect.is_some() {
            self.table.set_unverified(slot, false);
        }
        self.finish(index).map(|()| Finished::Done)
    }

    /// Gives up the current layer's unfinished picks after an error stopped
    /// their computation (a failed or corrupt read, a failed product): the
    /// slots they pinned become evictable, their reads are cancelled and the
    /// queued prefetches dropped, so that the next
    /// [`begin_layer`](Self::begin_layer) starts clean. Other reads in flight
    /// go on. After a picked expert's read failed or failed its checksum,
    /// every read not yet checked is given up too (cancelled, or its slot
    /// freed): a failing device may have returned bad bytes elsewhere in the
    /// same while, which would fail a later pass even once it reads well
    /// again. Without an error, nothing to do. The streamed supplier calls it
    /// as each token begins
    /// ([`Experts::begin_token`](crate::model::forward::Experts::begin_token)).
    pub fn abandon_layer<D: BlockDevice>(&mut self, dev: &mut D) -> Result<(), Error<D::Error>> {
        if !self.faulted && self.picks.iter().all(|p| p.status == PickStatus::Done) {
            return Ok(()); // every token's case: its last layer finished
        }
        let picks = core::mem::take(&mut self.picks);
        for pick in &picks {
            match pick.status {
                PickStatus::NeedsSlot | PickStatus::Done => {}
                PickStatus::Ready(slot)
                | PickStatus::Computing(slot)
                | PickStatus::RestReady(slot) => self.table.unpin(slot)?,
                PickStatus::Loading(slot) | PickStatus::FirstDone(slot) => {
                    self.give_up_load(slot, dev)?
                }
            }
        }
        if core::mem::take(&mut self.faulted) {
            for i in 0..self.table.capacity() {
                let slot = SlotId(i as u32);
                match *self.table.state(slot) {
                    SlotState::Ready { .. } if self.table.unverified(slot) => {
                        self.table.evict(slot)?;
                    }
                    SlotState::Loading(l) if !l.cancelled => self.give_up_load(slot, dev)?,
                    _ => {}
                }
            }
        }
        self.queue.clear();
        self.layer = None;
        Ok(())
    }

    /// Cancels the load in `slot` (if it is loading and not cancelled yet),
    /// demanded or not: nobody waits for it, so a part that fails is not
    /// read again.
    fn give_up_load<D: BlockDevice>(
        &mut self,
        slot: SlotId,
        dev: &mut D,
    ) -> Result<(), Error<D::Error>> {
        let Some(load) = self.table.load_mut(slot) else {
            return Ok(());
        };
        load.demand = false;
        if load.cancelled {
            return Ok(());
        }
        self.cancel_load(slot, dev)
    }

    /// Waits for every read in flight to complete, e.g. before dropping the slot
    /// memory. Errors of prefetches are ignored; the current layer is abandoned
    /// ([`abandon_layer`](Self::abandon_layer)).
    pub fn drain<D: BlockDevice>(&mut self, dev: &mut D) {
        // Its only failure, a slot not in its pick's state, leaves the table
        // to the loop below.
        let _ = self.abandon_layer(dev);
        while self.in_flight > 0 {
            match dev.poll() {
                Some(c) => {
                    if let Some((slot, bit)) = self.match_completion(c.tag) {
                        if let Some(load) = self.table.load_mut(slot) {
                            load.outstanding &= !bit;
                            self.in_flight -= 1;
                            load.failed = true;
                            load.unsubmitted = 0;
                            if load.outstanding == 0 {
                                let _ = self.table.abandon(slot);
                            }
                        }
                    }
                }
                None => dev.wait(),
            }
        }
        self.picks.clear();
        self.queue.clear();
    }

    /// The slot and part bit of an outstanding read with tag `t`, or `None` for a
    /// completion that matches no read in flight.
    fn match_completion(&self, t: Tag) -> Option<(SlotId, u8)> {
        let (slot, generation, bit) = untag(t);
        if slot.0 as usize >= self.table.capacity() {
            return None;
        }
        match self.table.state(slot) {
            SlotState::Loading(l)
                if l.id & ((1 << GEN_BITS) - 1) == generation && l.outstanding & bit != 0 =>
            {
                Some((slot, bit))
            }
            _ => None,
        }
    }

    /// Scores the predictions made for `layer` (and forgets those of layers
    /// already passed): per rank, and the nearest one per layer.
    fn score_prediction(&mut self, layer: u16, routing: &[u16]) {
        let mut nearest: Option<Prediction> = None;
        for p in self.predictions.iter().filter(|p| p.layer == layer) {
            for (rank, e) in p.set.iter().enumerate() {
                let (n, hits) = &mut self.rank_score[p.depth as usize - 1][rank];
                if *n >= RANK_WINDOW {
                    *n /= 2;
                    *hits /= 2;
                }
                *n += 1;
                *hits += routing.contains(e) as u32;
            }
            if nearest.as_ref().is_none_or(|q| p.depth < q.depth) {
                nearest = Some(p.clone());
            }
        }
        self.predictions.retain(|p| p.layer > layer);
        let Some(Prediction { set: predicted, .. }) = nearest else {
            return;
        };
        let tp = predicted.iter().filter(|e| routing.contains(e)).count() as u32;
        let (min_precision, window) = (
            self.config.min_precision,
            self.config.precision_window.max(1),
        );
        let st = &mut self.layers.as_mut()[layer as usize];
        st.predicted += predicted.len() as u64;
        st.true_positives += tp as u64;
        st.picked += routing.len() as u64;
        st.window_predicted += predicted.len() as u32;
        st.window_hits += tp;
        if st.window_predicted >= window {
            let precision = st.window_hits as f32 / st.window_predicted as f32;
            st.prefetch_enabled = precision >= min_precision;
            st.window_predicted = 0;
            st.window_hits = 0;
        }
    }

    /// Measured precision of prediction rank `rank` at `depth` (1 before any
    /// measurement).
    fn rank_precision(&self, depth: u8, rank: u8) -> f32 {
        let (n, hits) = self.rank_score[(depth as usize).clamp(1, MAX_DEPTH) - 1]
            [rank as usize % MAX_PREDICTED];
        if n < RANK_MIN_SAMPLES {
            1.0
        } else {
            hits as f32 / n as f32
        }
    }

    fn cancel_load<D: BlockDevice>(
        &mut self,
        slot: SlotId,
        dev: &mut D,
    ) -> Result<(), Error<D::Error>> {
        let load = self
            .table
            .load_mut(slot)
            .ok_or(SlotError::InvalidTransition(slot))?;
        load.cancelled = true;
        load.failed = true;
        load.unsubmitted = 0;
        let (id, outstanding) = (load.id, load.outstanding);
        self.stats.cancels += 1;
        if outstanding == 0 {
            self.table.abandon(slot)?;
            return Ok(());
        }
        for part in 0..MAX_PARTS {
            if outstanding & (1 << part) != 0 {
                dev.cancel(tag(slot, id, part));
            }
        }
        Ok(())
    }

    /// The parts of `ext` that hold `key`'s gate and up projections, where those
    /// may be computed before the rest lands ([`SchedulerConfig::split_compute`]):
    /// they must cover the source's [`ExpertSource::gate_up_bytes`] from the
    /// slot's start, and some part must lie wholly past it. 0 otherwise.
    fn first_parts<X: ExpertSource>(&self, key: ExpertKey, ext: &Extents, src: &X) -> u8 {
        let c = &self.config;
        if !(c.split_compute && c.verify_on_compute && c.ready_first) || src.checksum(key).is_none()
        {
            return 0;
        }
        let Some(split) = src.gate_up_bytes(key) else {
            return 0;
        };
        let mask = ext
            .iter()
            .enumerate()
            .filter(|(_, e)| e.slot_offset < split)
            .fold(0u8, |m, (i, _)| m | 1 << i);
        // Walk the first parts from the slot's start: they must leave no gap.
        let mut covered = 0u32;
        while covered < split {
            let next = ext
                .iter()
                .filter(|e| e.slot_offset <= covered)
                .map(|e| e.slot_offset.saturating_add(e.len))
                .filter(|&end| end > covered)
                .max();
            match next {
                Some(end) => covered = end,
                None => return 0,
            }
        }
        let all = ((1u16 << ext.len()) - 1) as u8;
        if split == 0 || mask == all {
            0
        } else {
            mask
        }
    }

    fn new_load(&mut self, key: ExpertKey, parts: usize, demand: bool, first_parts: u8) -> Load {
        self.next_load = (self.next_load + 1) & ((1 << (32 - PART_BITS)) - 1);
        Load {
            key,
            id: self.next_load,
            parts: parts as u8,
            unsubmitted: ((1u16 << parts) - 1) as u8,
            outstanding: 0,
            demand,
            prefetched: !demand,
            cancelled: false,
            failed: false,
            faults: 0,
            landed: 0,
            first_parts,
        }
    }

    fn extents<E, X: ExpertSource>(&self, key: ExpertKey, src: &X) -> Result<Extents, Error<E>> {
        self.placement(key, src).map(|(ext, _)| ext)
    }

    /// The slots of class `c`.
    fn class_slots(&self, c: usize) -> Range<usize> {
        let start = self.classes[..c].iter().map(|x| x.slots as usize).sum();
        start..start + self.classes[c].slots as usize
    }

    /// `key`'s extents and the class of slots it may take: the smallest whose
    /// slots hold every extent.
    fn placement<E, X: ExpertSource>(
        &self,
        key: ExpertKey,
        src: &X,
    ) -> Result<(Extents, usize), Error<E>> {
        let ext = src.extents(key);
        let need = ext.iter().try_fold(0u32, |m, e| {
            e.slot_offset.checked_add(e.len).map(|end| m.max(end))
        });
        match need
            .filter(|_| !ext.is_empty())
            .and_then(|n| class_for(&self.classes, n))
        {
            Some(c) => Ok((ext, c)),
            None => Err(Error::BadExtents { key }),
        }
    }

    fn layer_now(&self) -> u16 {
        self.layer.unwrap_or(0)
    }

    /// Submits, in priority order: slots for picked experts, their reads, then
    /// prefetch reads. Stops at the first `Busy`.
    fn pump<D, X>(&mut self, dev: &mut D, src: &X) -> Result<(), Error<D::Error>>
    where
        D: BlockDevice + SlotMemory,
        X: ExpertSource,
    {
        let current = self.layer_now();
        // 1. Slots for picked experts that have none.
        for i in 0..self.picks.len() {
            if self.picks[i].status != PickStatus::NeedsSlot {
                continue;
            }
            let key = self.picks[i].key;
            let (ext, c) = self.placement(key, src)?;
            let class = self.class_slots(c);
            let slot = loop {
                if let Some(slot) =
                    self.table
                        .victim_in(self.config.eviction, current, class.clone(), |_| true)
                {
                    break Some(slot);
                }
                // Everything is pinned or loading: free a slot by cancelling a
                // prefetch. A prefetch with reads in flight frees its slot only when
                // its completions arrive; one with none frees it at once.
                let victim = self.table.iter().find_map(|(s, st)| match st {
                    SlotState::Loading(l)
                        if !l.demand && !l.cancelled && class.contains(&(s.0 as usize)) =>
                    {
                        Some(s)
                    }
                    _ => None,
                });
                match victim {
                    Some(s) => {
                        self.cancel_load(s, dev)?;
                        if *self.table.state(s) != SlotState::Free {
                            break None;
                        }
                    }
                    None => break None,
                }
            };
            let Some(slot) = slot else { break };
            if matches!(self.table.state(slot), SlotState::Ready { .. }) {
                self.table.evict(slot)?;
            }
            let first = self.first_parts(key, &ext, src);
            let load = self.new_load(key, ext.len(), true, first);
            self.table.start_load(slot, load)?;
            self.picks[i].status = PickStatus::Loading(slot);
        }

        // 2. Demand reads, in routing order.
        for i in 0..self.picks.len() {
            if let PickStatus::Loading(slot) | PickStatus::FirstDone(slot) = self.picks[i].status {
                if !self.submit_parts(slot, true, dev, src)? {
                    return Ok(()); // device busy
                }
            }
        }
        if self.demand_pending() {
            return Ok(());
        }

        // 3. Prefetch reads: partially submitted ones first, then the queue.
        let reserve = self.config.demand_reserve;
        let depth = dev.queue_depth();
        let room = |in_flight: usize, parts: usize| in_flight + parts + reserve <= depth;
        let partial: Vec<SlotId, MAX_PREDICTED> = if !self.partial_prefetch {
            Vec::new()
        } else {
            self.table
                .iter()
                .filter_map(|(s, st)| match st {
                    SlotState::Loading(l) if !l.demand && l.unsubmitted != 0 => Some(s),
                    _ => None,
                })
                .take(MAX_PREDICTED)
                .collect()
        };
        self.partial_prefetch = false;
        for slot in partial {
            if !room(self.in_flight, 1) || !self.submit_parts(slot, false, dev, src)? {
                self.partial_prefetch = true;
                return Ok(());
            }
        }
        while let Some(&Queued { key, depth, rank }) = self.queue.first() {
            if self.table.lookup(key).is_some() {
                self.queue.remove(0);
                continue;
            }
            let known = depth == 0;
            if self.in_flight > 0
                && !known
                && (depth > 1 || self.rank_precision(depth, rank) < self.config.idle_only_below)
            {
                // Later entries are deeper or less confident, measured no better in
                // practice; retried on the next pump, once the device drained.
                break;
            }
            let (ext, c) = self.placement(key, src)?;
            let class = self.class_slots(c);
            let bytes: u64 = ext.iter().map(|e| e.len as u64).sum();
            if !known && self.token_prefetch_bytes + bytes > self.config.prefetch_budget {
                self.queue.clear(); // budget spent for this token
                break;
            }
            if !room(self.in_flight, ext.len()) {
                break;
            }
            // Never evict what the target layer or the current layer still needs.
            let picks = &self.picks;
            let Some(slot) = self
                .table
                .victim_in(self.config.eviction, current, class, |k| {
                    // Picks are all of the current layer: only check those.
                    k.layer != key.layer
                        && (k.layer != current
                            || !picks
                                .iter()
                                .any(|p| p.key == k && p.status != PickStatus::Done))
                })
            else {
                break; // retried when computed experts free their slots
            };
            self.queue.remove(0);
            if matches!(self.table.state(slot), SlotState::Ready { .. }) {
                self.table.evict(slot)?;
            }
            let first = self.first_parts(key, &ext, src);
            let load = self.new_load(key, ext.len(), false, first);
            self.table.start_load(slot, load)?;
            self.token_prefetch_bytes += bytes;
            self.stats.prefetches += 1;
            if !self.submit_parts(slot, false, dev, src)? {
                self.partial_prefetch = true;
                return Ok(());
            }
        }
        Ok(())
    }

    /// Submits the unsubmitted parts of the load in `slot`; `false` if the device
    /// was busy.
    fn submit_parts<D, X>(
        &mut self,
        slot: SlotId,
        urgent: bool,
        dev: &mut D,
        src: &X,
    ) -> Result<bool, Error<D::Error>>
    where
        D: BlockDevice + SlotMemory,
        X: ExpertSource,
    {
        let load = *self
            .table
            .load_mut(slot)
            .ok_or(SlotError::InvalidTransition(slot))?;
        if load.unsubmitted == 0 {
            return Ok(true);
        }
        let ext = self.extents(load.key, src)?;
        for (part, e) in ext.iter().enumerate() {
            let bit = 1u8 << part;
            if load.unsubmitted & bit == 0 {
                continue;
            }
            let req = ReadRequest {
                tag: tag(slot, load.id, part),
                offset: e.offset,
                len: e.len,
                slot,
                slot_offset: e.slot_offset,
                urgent,
            };
            match dev.submit(req) {
                Ok(()) => {
                    let l = self
                        .table
                        .load_mut(slot)
                        .ok_or(SlotError::InvalidTransition(slot))?;
                    l.unsubmitted &= !bit;
                    l.outstanding |= bit;
                    self.in_flight += 1;
                    if urgent {
                        self.stats.demand_bytes += e.len as u64;
                    } else {
                        self.stats.prefetch_bytes += e.len as u64;
                    }
                }
                Err(SubmitError::Busy) => return Ok(false),
                Err(SubmitError::Device(error)) => {
                    return Err(Error::Device {
                        key: load.key,
                        error,
                    });
                }
            }
        }
        Ok(true)
    }

    fn on_completion<D, X>(
        &mut self,
        c: Completion<D::Error>,
        dev: &mut D,
        src: &X,
    ) -> Result<(), Error<D::Error>>
    where
        D: BlockDevice + SlotMemory,
        X: ExpertSource,
    {
        let Some((slot, bit)) = self.match_completion(c.tag) else {
            self.stats.stale_completions += 1;
            return Ok(());
        };
        let max_retries = self.config.max_retries;
        let load = self
            .table
            .load_mut(slot)
            .ok_or(SlotError::InvalidTransition(slot))?;
        load.outstanding &= !bit;
        self.in_flight -= 1;
        match c.status {
            ReadStatus::Done => load.landed |= bit,
            ReadStatus::Cancelled => load.failed = true,
            ReadStatus::Failed(error) => {
                load.failed = true;
                load.faults = load.faults.saturating_add(1);
                // A cancelled read's error is of a read given up on: one
                // asked for again since is read again (below), not failed.
                if load.demand
                    && !load.cancelled
                    && (!error.is_transient() || load.faults > max_retries)
                {
                    self.faulted = true;
                    return Err(Error::Device {
                        key: load.key,
                        error,
                    });
                }
            }
        }
        if load.outstanding != 0 {
            return Ok(()); // other parts still in flight
        }
        if load.unsubmitted != 0 && !load.failed {
            return Ok(()); // parts still to submit
        }
        let load = *load;
        if load.failed {
            if load.demand {
                // Read it again into the same slot, under a fresh id.
                if load.faults > 0 {
                    self.stats.retries += 1;
                }
                let mut fresh =
                    self.new_load(load.key, load.parts as usize, true, load.first_parts);
                if self
                    .picks
                    .iter()
                    .any(|p| p.status == PickStatus::FirstDone(slot))
                {
                    // Its gate and up were computed from the parts that hold them:
                    // those stay, and only the rest is read again. Read again, they
                    // could differ from what was computed (a flipped bit), and the
                    // slot, passing the check of the bytes computed, would then be
                    // reused as verified with bytes nobody checked.
                    fresh.unsubmitted &= !load.first_parts;
                    fresh.landed = load.first_parts;
                }
                let l = self
                    .table
                    .load_mut(slot)
                    .ok_or(SlotError::InvalidTransition(slot))?;
                *l = Load {
                    faults: load.faults,
                    prefetched: load.prefetched,
                    ..fresh
                };
            } else {
                self.table.abandon(slot)?;
            }
            return Ok(());
        }
        let deferred = self.config.verify_on_compute && src.checksum(load.key).is_some();
        if !deferred && !src.verify(load.key, dev.slot(slot)) {
            if load.demand && load.faults < max_retries {
                // A bit flipped on its way, perhaps: read it again.
                self.stats.rereads += 1;
                let fresh = self.new_load(load.key, load.parts as usize, true, load.first_parts);
                let l = self
                    .table
                    .load_mut(slot)
                    .ok_or(SlotError::InvalidTransition(slot))?;
                *l = Load {
                    faults: load.faults + 1,
                    prefetched: load.prefetched,
                    ..fresh
                };
                return Ok(());
            }
            if load.demand {
                self.faulted = true;
                return Err(Error::Checksum { key: load.key });
            }
            self.stats.bad_prefetches += 1;
            let l = self
                .table
                .load_mut(slot)
                .ok_or(SlotError::InvalidTransition(slot))?;
            l.failed = true;
            self.table.abandon(slot)?;
            return Ok(());
        }
        self.table.finish_load(slot)?;
        self.table.set_unverified(slot, deferred);
        if let Some(p) = self.picks.iter_mut().find(
            |p| matches!(p.status, PickStatus::Loading(s) | PickStatus::FirstDone(s) if s == slot),
        ) {
            self.table.pin(slot)?;
            p.status = match p.status {
                PickStatus::FirstDone(_) => PickStatus::RestReady(slot),
                _ => PickStatus::Ready(slot),
            };
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_since_subtracts_every_count() {
        let counts = |k: u64| Stats {
            hits: k,
            late_hits: 2 * k,
            misses: 3 * k,
            demand_bytes: 4 * k,
            prefetch_bytes: 5 * k,
            useful_prefetches: 6 * k,
            prefetches: 7 * k,
            stalls: 8 * k,
            cancels: 9 * k,
            retries: 10 * k,
            stale_completions: 11 * k,
            bad_prefetches: 12 * k,
            split_computes: 13 * k,
            rereads: 14 * k,
        };
        assert_eq!(counts(5).since(&counts(2)), counts(3));
        assert_eq!(counts(2).since(&counts(5)), Stats::default());
        assert_eq!(counts(4).since(&Stats::default()), counts(4));
    }

    #[test]
    fn ready_hit_rate_leaves_out_prefetches_still_in_flight() {
        let s = Stats {
            hits: 6,
            late_hits: 2,
            misses: 2,
            ..Stats::default()
        };
        assert_eq!(s.hit_rate(), 0.8);
        assert_eq!(s.ready_hit_rate(), 0.6);
        assert_eq!(Stats::default().ready_hit_rate(), 1.0);
    }

    #[test]
    fn layer_state_since_subtracts_the_counts_and_keeps_the_rest() {
        let at = |k: u64, enabled: bool| LayerState {
            prefetch_enabled: enabled,
            predicted: 8 * k,
            true_positives: 6 * k,
            picked: 7 * k,
            ..LayerState::INITIAL
        };
        let d = at(5, false).since(&at(2, true));
        assert_eq!((d.predicted, d.true_positives, d.picked), (24, 18, 21));
        assert!(!d.prefetch_enabled, "the current state's flag");
        assert_eq!(d.precision(), 0.75);
        assert_eq!(at(2, true).since(&at(5, true)).predicted, 0);
    }
}
