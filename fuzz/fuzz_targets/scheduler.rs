//! The LES scheduler driven by the fuzzer: model shape, slot capacity, device
//! queue depth, configuration, routing, predictions, the order completions
//! arrive in, whether cancels are honoured, and device faults (transient and
//! permanent errors, bit flips) all come from the input. Invariants 1-5 of
//! DESIGN.md are checked after every event:
//!
//! 1. with only transient faults the output is bit-identical to the resident run;
//! 2. every picked expert is handed out exactly once per layer, at its index;
//! 3. slots never exceed capacity, the index agrees with the table, and a slot is
//!    never overwritten while loading, in use or after a stale completion (the
//!    device writes at completion time, so a reused slot would show wrong bytes);
//! 4. demand reads are never submitted after a prefetch in one call, and
//!    speculative bytes per token stay under the budget;
//! 5. permanent errors and bit flips end the run with an error, or the output is
//!    still exact: nothing computed from a bad slot gets through.
#![no_main]

use std::cell::RefCell;
use std::collections::VecDeque;
use std::fmt;
use std::rc::Rc;

use les_core::blockdev::{
    Alignment, BlockDevice, Completion, DeviceError, ReadRequest, ReadStatus, SlotId, SlotMemory,
    SubmitError, Tag,
};
use les_core::layout::checksum;
use les_core::schedule::{
    Error, ExpertSource, Extent, Extents, Finished, LayerState, Next, Scheduler, SchedulerConfig,
};
use les_core::slot_classes::SlotClass;
use les_core::slots::{EvictionPolicy, ExpertKey, IndexEntry, Slot, SlotState};
use libfuzzer_sys::fuzz_target;

/// The fuzzer's bytes, read as decisions; zeros once used up (so runs end).
struct Tape<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Tape<'_> {
    fn byte(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }
    fn below(&mut self, n: usize) -> usize {
        if n <= 1 {
            0
        } else {
            self.byte() as usize % n
        }
    }
    fn exhausted(&self) -> bool {
        self.pos >= self.data.len()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FuzzError {
    Transient,
    Permanent,
}

impl fmt::Display for FuzzError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?} fuzz fault")
    }
}

impl DeviceError for FuzzError {
    fn is_transient(&self) -> bool {
        *self == FuzzError::Transient
    }
}

#[derive(Default)]
struct Faults {
    permanent: bool,
    flips: bool,
}

struct InFlight {
    req: ReadRequest,
    cancelled: bool,
}

/// A device whose completion order, cancel behaviour and faults come from the
/// tape. Data lands in the slot when the completion is delivered; the slot is
/// scribbled at submit.
struct FuzzDevice<'t> {
    tape: Rc<RefCell<Tape<'t>>>,
    image: Vec<u8>,
    slots: Vec<u8>,
    slot_bytes: usize,
    depth: usize,
    honor_cancel: bool,
    fault_rate: u8,
    in_flight: Vec<InFlight>,
    ready: VecDeque<Completion<FuzzError>>,
    faults: Rc<RefCell<Faults>>,
    log: Vec<bool>,
}

impl BlockDevice for FuzzDevice<'_> {
    type Error = FuzzError;
    fn alignment(&self) -> Alignment {
        Alignment::NONE
    }
    fn queue_depth(&self) -> usize {
        self.depth
    }
    fn submit(&mut self, req: ReadRequest) -> Result<(), SubmitError<FuzzError>> {
        if self.in_flight.len() + self.ready.len() >= self.depth {
            return Err(SubmitError::Busy);
        }
        let start = req.slot.0 as usize * self.slot_bytes + req.slot_offset as usize;
        assert!(
            req.slot_offset as usize + req.len as usize <= self.slot_bytes,
            "read past its slot"
        );
        assert!(
            !self.in_flight.iter().any(|f| f.req.slot == req.slot)
                || self.in_flight.iter().all(|f| {
                    let s = f.req.slot_offset as usize;
                    f.req.slot != req.slot
                        || s + f.req.len as usize <= req.slot_offset as usize
                        || req.slot_offset as usize + req.len as usize <= s
                }),
            "two reads in flight into the same bytes of a slot"
        );
        self.slots[start..start + req.len as usize].fill(0xa5);
        self.in_flight.push(InFlight {
            req,
            cancelled: false,
        });
        self.log.push(req.urgent);
        Ok(())
    }
    fn poll(&mut self) -> Option<Completion<FuzzError>> {
        if let Some(c) = self.ready.pop_front() {
            return Some(c);
        }
        if self.in_flight.is_empty() {
            return None;
        }
        let mut t = self.tape.borrow_mut();
        // Sometimes nothing is done yet (only while the tape lasts).
        if !t.exhausted() && t.below(4) == 0 {
            return None;
        }
        let i = t.below(self.in_flight.len());
        let f = self.in_flight.swap_remove(i);
        let status = if f.cancelled && self.honor_cancel {
            ReadStatus::Cancelled
        } else {
            let roll = if t.exhausted() { 255 } else { t.byte() };
            let fault = if roll < self.fault_rate {
                t.below(4)
            } else {
                9
            };
            let r = f.req;
            let start = r.slot.0 as usize * self.slot_bytes + r.slot_offset as usize;
            let dst = &mut self.slots[start..start + r.len as usize];
            match fault {
                0 => {
                    self.faults.borrow_mut().permanent = true;
                    ReadStatus::Failed(FuzzError::Permanent)
                }
                1 | 2 => ReadStatus::Failed(FuzzError::Transient),
                3 => {
                    dst.copy_from_slice(&self.image[r.offset as usize..][..r.len as usize]);
                    let bit = t.below(r.len as usize * 8);
                    dst[bit / 8] ^= 1 << (bit % 8);
                    self.faults.borrow_mut().flips = true;
                    ReadStatus::Done
                }
                _ => {
                    dst.copy_from_slice(&self.image[r.offset as usize..][..r.len as usize]);
                    ReadStatus::Done
                }
            }
        };
        Some(Completion {
            tag: f.req.tag,
            status,
        })
    }
    fn wait(&mut self) {
        // Complete something for sure: move one read to the ready queue.
        if self.ready.is_empty() && !self.in_flight.is_empty() {
            let saved = self.tape.borrow().pos;
            loop {
                if let Some(c) = self.poll() {
                    self.ready.push_back(c);
                    break;
                }
                // `poll` declined; the tape moved on, so this loop ends.
                debug_assert!(self.tape.borrow().pos > saved);
            }
        }
    }
    fn cancel(&mut self, tag: Tag) {
        if let Some(f) = self.in_flight.iter_mut().find(|f| f.req.tag == tag) {
            f.cancelled = true;
        }
    }
}

impl SlotMemory for FuzzDevice<'_> {
    fn slot(&self, slot: SlotId) -> &[u8] {
        let s = slot.0 as usize * self.slot_bytes;
        &self.slots[s..s + self.slot_bytes]
    }
}

/// Experts as byte runs on the image, one or three parts each, CRC-checked.
struct Model {
    n_layers: u16,
    n_experts: u16,
    image: Vec<u8>,
    experts: Vec<(Extents, u32, Vec<u8>)>,
    slot_bytes: u32,
    /// Tell the scheduler each expert's checksum, so it is checked when first
    /// computed instead of on arrival.
    on_compute: bool,
}

impl Model {
    fn new(t: &mut Tape<'_>, n_layers: u16, n_experts: u16, parts: usize) -> Model {
        let mut image = Vec::new();
        let mut experts = Vec::new();
        let mut slot_bytes = 0;
        for id in 0..n_layers as usize * n_experts as usize {
            let mut ext = Extents::new();
            let mut bytes = Vec::new();
            for p in 0..parts {
                image.extend(std::iter::repeat_n(0x11, t.below(4)));
                let len = 1 + t.below(12);
                let offset = image.len() as u64;
                let data: Vec<u8> = (0..len)
                    .map(|i| (id * 31 + p * 7 + i * 13) as u8 ^ t.byte())
                    .collect();
                image.extend_from_slice(&data);
                ext.push(Extent {
                    offset,
                    len: len as u32,
                    slot_offset: bytes.len() as u32,
                })
                .unwrap();
                bytes.extend_from_slice(&data);
            }
            slot_bytes = slot_bytes.max(bytes.len() as u32);
            experts.push((ext, checksum(&bytes), bytes));
        }
        Model {
            n_layers,
            n_experts,
            image,
            experts,
            slot_bytes,
            on_compute: false,
        }
    }
    fn id(&self, k: ExpertKey) -> usize {
        k.layer as usize * self.n_experts as usize + k.expert as usize
    }
    fn bytes(&self, k: ExpertKey) -> &[u8] {
        &self.experts[self.id(k)].2
    }
}

impl ExpertSource for Model {
    fn extents(&self, key: ExpertKey) -> Extents {
        self.experts[self.id(key)].0.clone()
    }
    fn verify(&self, key: ExpertKey, slot: &[u8]) -> bool {
        let e = &self.experts[self.id(key)];
        checksum(&slot[..e.2.len()]) == e.1
    }
    fn checksum(&self, key: ExpertKey) -> Option<u32> {
        self.on_compute.then(|| self.experts[self.id(key)].1)
    }
}

/// The toy expert: output from the input and the expert's bytes, fixed order.
/// One layer of one token from the tape: the router's picks with their weights,
/// and the lookahead's prediction for it.
struct Step {
    picked: Vec<(u16, f32)>,
    predicted: Vec<u16>,
    /// Router scores for the popularity (none: picks are counted).
    logits: Option<Vec<f32>>,
}

fn expert_output(bytes: &[u8], h: f32) -> f32 {
    let mut acc = h;
    for (i, &b) in bytes.iter().enumerate() {
        acc = acc * 0.5 + (b as f32 - 127.5) / (64.0 + i as f32);
    }
    acc
}

fn check_call<S, M, L>(sched: &Scheduler<S, M, L>, submits: &[bool], budget: u64, on_demand: bool)
where
    S: AsRef<[Slot]> + AsMut<[Slot]>,
    M: AsRef<[IndexEntry]> + AsMut<[IndexEntry]>,
    L: AsRef<[LayerState]> + AsMut<[LayerState]>,
{
    if let Some(first) = submits.iter().position(|u| !u) {
        assert!(
            submits[first..].iter().all(|u| !u),
            "demand read after a prefetch in one call: {submits:?}"
        );
    }
    assert!(sched.token_prefetch_bytes() <= budget, "prefetch budget");
    if on_demand {
        assert_eq!(sched.stats().prefetch_bytes, 0, "on-demand prefetched");
    }
}

fn check_table<S, M, L>(
    sched: &Scheduler<S, M, L>,
    m: &Model,
    capacity: usize,
    picks: &[ExpertKey],
    computing: &[(usize, SlotId, bool)],
) where
    S: AsRef<[Slot]> + AsMut<[Slot]>,
    M: AsRef<[IndexEntry]> + AsMut<[IndexEntry]>,
    L: AsRef<[LayerState]> + AsMut<[LayerState]>,
{
    let t = sched.table();
    assert_eq!(t.capacity(), capacity);
    let mut outstanding = 0;
    for (slot, state) in t.iter() {
        if let Some(key) = state.key() {
            assert_eq!(t.lookup(key), Some(slot), "index of {key}");
            assert!(key.layer < m.n_layers && key.expert < m.n_experts);
            // In the smallest slot class it fits.
            let need = m.bytes(key).len() as u32;
            let (mut start, mut below) = (0usize, 0u32);
            for c in sched.slot_classes() {
                if (slot.0 as usize) < start + c.slots as usize {
                    assert!(below < need && need <= c.bytes, "{key} in slot {}", slot.0);
                    break;
                }
                start += c.slots as usize;
                below = c.bytes;
            }
        }
        match state {
            // Pinned: picked experts of the current layer only.
            SlotState::InUse { key } => assert!(picks.contains(key), "{key} pinned, not picked"),
            SlotState::Loading(l) => outstanding += l.outstanding.count_ones() as usize,
            _ => {}
        }
    }
    // What is being computed stays pinned, never evicted or reloaded.
    for &(index, slot, _) in computing {
        assert_eq!(
            *t.state(slot),
            SlotState::InUse { key: picks[index] },
            "slot of a computing expert"
        );
    }
    assert_eq!(outstanding, sched.reads_in_flight(), "reads in flight");
}

fuzz_target!(|data: &[u8]| {
    let tape = Rc::new(RefCell::new(Tape { data, pos: 0 }));
    let (n_layers, n_experts, top_k, parts, extra, depth, tokens, flags, budget, fault_rate) = {
        let mut t = tape.borrow_mut();
        let n_layers = 1 + t.below(4) as u16;
        let n_experts = 1 + t.below(10) as u16;
        let top_k = 1 + t.below(n_experts.min(4) as usize);
        let parts = if t.byte() & 1 == 0 { 1 } else { 3 };
        let extra = t.below(8);
        let depth = 1 + t.below(8);
        let tokens = 1 + t.below(4);
        let flags = t.byte();
        let budget = match t.byte() {
            0..=127 => u64::MAX,
            b => (b as u64 - 128) * 2,
        };
        let fault_rate = match t.byte() {
            0..=159 => 0,
            b => b - 159,
        };
        (
            n_layers, n_experts, top_k, parts, extra, depth, tokens, flags, budget, fault_rate,
        )
    };
    let mut m = Model::new(&mut tape.borrow_mut(), n_layers, n_experts, parts);
    m.on_compute = flags & 0x80 != 0;
    let on_demand = flags & 1 != 0;
    let mut config = if on_demand {
        SchedulerConfig::on_demand()
    } else {
        SchedulerConfig::les()
    };
    config.eviction = match (flags >> 4) % 3 {
        0 => EvictionPolicy::Popularity,
        1 => EvictionPolicy::LayerDistance,
        _ => EvictionPolicy::Lru,
    };
    config.prefetch_budget = budget;
    config.ready_first = !on_demand && flags & 4 == 0;
    config.demand_reserve = config.demand_reserve.min(depth.saturating_sub(1));
    config.max_retries = u8::MAX; // transient faults end only with the tape
                                  // Slots of two sizes in some runs: the median expert's and the largest (each
                                  // class holds a layer's picks); the device's slots stay all of the largest.
    let mut needs: Vec<u32> = m.experts.iter().map(|e| e.2.len() as u32).collect();
    needs.sort_unstable();
    let median = needs[needs.len() / 2];
    let two_sizes = flags & 0x40 != 0 && median < m.slot_bytes;
    let small = top_k + extra / 2;
    let capacity = if two_sizes {
        small + top_k + extra - extra / 2
    } else {
        top_k + extra
    };
    let faults = Rc::new(RefCell::new(Faults::default()));
    let mut dev = FuzzDevice {
        tape: tape.clone(),
        image: m.image.clone(),
        slots: vec![0; capacity * m.slot_bytes as usize],
        slot_bytes: m.slot_bytes as usize,
        depth,
        honor_cancel: flags & 8 != 0,
        fault_rate,
        in_flight: Vec::new(),
        ready: VecDeque::new(),
        faults: faults.clone(),
        log: Vec::new(),
    };
    if parts > depth {
        return; // a 3-part expert cannot be read by a 1- or 2-deep queue at once
    }
    let n = n_layers as usize * n_experts as usize;
    let classes = if two_sizes {
        vec![
            SlotClass {
                slots: small as u32,
                bytes: median,
            },
            SlotClass {
                slots: (capacity - small) as u32,
                bytes: m.slot_bytes,
            },
        ]
    } else {
        vec![SlotClass {
            slots: capacity as u32,
            bytes: m.slot_bytes,
        }]
    };
    let mut sched = Scheduler::with_slot_classes(
        config,
        vec![Slot::EMPTY; capacity],
        vec![IndexEntry::EMPTY; n],
        vec![LayerState::INITIAL; n_layers as usize],
        n_layers,
        n_experts,
        &classes,
    )
    .expect("valid configuration");

    // Routing and predictions from the tape; the resident reference alongside.
    let mut steps: Vec<Step> = Vec::new();
    {
        let mut t = tape.borrow_mut();
        for _ in 0..tokens * n_layers as usize {
            let mut picked: Vec<(u16, f32)> = Vec::new();
            let mut e = t.below(n_experts as usize) as u16;
            while picked.len() < top_k {
                if !picked.iter().any(|p| p.0 == e) {
                    picked.push((e, (1 + t.below(100)) as f32 / 100.0));
                }
                e = (e + 1 + t.below(3) as u16) % n_experts;
            }
            let n_pred = t.below(n_experts as usize + 1);
            let predicted: Vec<u16> = (0..n_pred)
                .map(|_| t.below(n_experts as usize) as u16)
                .collect();
            // Any scores, including too few and not finite ones (ignored).
            let logits = (t.below(4) != 0).then(|| {
                let n = n_experts as usize - usize::from(t.below(16) == 0);
                (0..n)
                    .map(|_| match t.byte() {
                        255 => f32::NAN,
                        b => (b as f32 - 128.0) / 16.0,
                    })
                    .collect()
            });
            steps.push(Step {
                picked,
                predicted,
                logits,
            });
        }
    }
    let mut want = Vec::new();
    let mut h = 0.25f32;
    for (step, r) in steps.iter().map(|s| &s.picked).enumerate() {
        let layer = (step % n_layers as usize) as u16;
        let mut acc = 0f32;
        for &(e, w) in r {
            acc += w * expert_output(m.bytes(ExpertKey { layer, expert: e }), h);
        }
        h += acc;
        want.push(h);
    }

    // A run that a fault ends is run again once the device reads well (as
    // a server answers its next request): after `abandon_layer` nothing is
    // pinned and nothing read before is used unchecked, so it is exact.
    let mut ended = false;
    loop {
        let outcome = (|| -> Result<Vec<f32>, Error<FuzzError>> {
            let mut h = 0.25f32;
            let mut got = Vec::new();
            for (step, r) in steps.iter().map(|s| &s.picked).enumerate() {
                let layer = (step % n_layers as usize) as u16;
                if layer == 0 {
                    sched.begin_token();
                }
                let experts: Vec<u16> = r.iter().map(|p| p.0).collect();
                let picks: Vec<ExpertKey> = experts
                    .iter()
                    .map(|&expert| ExpertKey { layer, expert })
                    .collect();
                if let Some(logits) = &steps[step].logits {
                    sched.observe_router(layer, logits);
                }
                let before = dev.log.len();
                sched.begin_layer(layer, &experts, &mut dev, &m)?;
                check_call(&sched, &dev.log[before..], budget, on_demand);
                if let Some(pred) = steps.get(step + 1).map(|s| &s.predicted) {
                    let next = ((step + 1) % n_layers as usize) as u16;
                    let before = dev.log.len();
                    sched.prefetch(next, pred, &mut dev, &m)?;
                    check_call(&sched, &dev.log[before..], budget, on_demand);
                }
                if let Some(pred) = steps
                    .get(step + 2)
                    .filter(|_| flags & 2 != 0)
                    .map(|s| &s.predicted)
                {
                    let next = ((step + 2) % n_layers as usize) as u16;
                    let before = dev.log.len();
                    sched.prefetch(next, pred, &mut dev, &m)?;
                    check_call(&sched, &dev.log[before..], budget, on_demand);
                }
                let mut outs: Vec<Option<f32>> = vec![None; r.len()];
                let mut computing: Vec<(usize, SlotId, bool)> = Vec::new();
                loop {
                    let before = dev.log.len();
                    let next = sched.next(&mut dev, &m)?;
                    check_call(&sched, &dev.log[before..], budget, on_demand);
                    check_table(&sched, &m, capacity, &picks, &computing);
                    match next {
                        Next::Compute {
                            index,
                            key,
                            slot,
                            verify,
                        } => {
                            assert!(!verify || m.on_compute, "verify without checksums");
                            assert_eq!(
                                key,
                                ExpertKey {
                                    layer,
                                    expert: r[index].0
                                }
                            );
                            assert!(outs[index].is_none(), "index {index} handed out twice");
                            outs[index] = Some(f32::NAN);
                            computing.push((index, slot, verify));
                        }
                        Next::Wait => {
                            if sched.reads_in_flight() > 0 {
                                dev.wait();
                            } else {
                                assert!(!computing.is_empty(), "Wait with nothing to wait for");
                            }
                        }
                        Next::ComputeFirst { .. } | Next::ComputeRest { .. } => {
                            unreachable!("next hands out whole experts")
                        }
                        Next::Done => {
                            assert!(computing.is_empty(), "Done while computing");
                            break;
                        }
                    }
                    // Finish some computes, in a fuzzer-chosen order.
                    // (All of them once the tape is used up, so every run ends.)
                    while !computing.is_empty() && {
                        let mut t = tape.borrow_mut();
                        t.exhausted() || t.below(3) != 0
                    } {
                        let i = tape.borrow_mut().below(computing.len());
                        let (index, slot, verify) = computing.remove(i);
                        let key = ExpertKey {
                            layer,
                            expert: r[index].0,
                        };
                        let bytes = &dev.slot(slot)[..m.bytes(key).len()];
                        let out = expert_output(bytes, h);
                        if verify {
                            // Unchecked bytes: the output counts only if accepted.
                            let intact = bytes == m.bytes(key);
                            match sched.finish_checked(index, checksum(bytes)) {
                                Ok(Finished::Done) => assert!(intact, "corrupt {key} accepted"),
                                Ok(Finished::Again) => {
                                    // Handed out again once read again.
                                    assert!(!intact, "intact {key} read again");
                                    outs[index] = None;
                                    check_table(&sched, &m, capacity, &picks, &computing);
                                    continue;
                                }
                                Err(e) => {
                                    assert!(!intact, "intact {key} refused: {e}");
                                    return Err(e);
                                }
                            }
                        } else {
                            assert_eq!(bytes, m.bytes(key), "slot of {key} holds its bytes");
                            sched.finish::<()>(index).expect("computing");
                        }
                        outs[index] = Some(out);
                        check_table(&sched, &m, capacity, &picks, &computing);
                    }
                }
                let mut acc = 0f32;
                for (o, &(_, w)) in outs.iter().zip(r) {
                    acc += w * o.expect("every picked expert computed");
                }
                h += acc;
                got.push(h);
            }
            Ok(got)
        })();
        let (permanent, flips) = {
            let f = faults.borrow();
            (f.permanent, f.flips)
        };
        match outcome {
            Ok(got) => {
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same && got.len() == want.len(),
                    "output differs: {got:?} vs {want:?}"
                );
                break;
            }
            Err(e) if ended => panic!("the run again, without faults, failed: {e}"),
            Err(Error::Device { error, .. }) => {
                assert!(permanent, "device error {error} without a permanent fault");
            }
            Err(Error::Checksum { .. }) => assert!(flips, "checksum error without a bit flip"),
            Err(e) => panic!("unexpected error: {e}"),
        }
        ended = true;
        dev.fault_rate = 0;
        sched.abandon_layer(&mut dev).expect("abandoning the layer");
        assert!(
            sched
                .table()
                .iter()
                .all(|(_, st)| !matches!(st, SlotState::InUse { .. })),
            "pinned after abandon_layer"
        );
    }
    sched.drain(&mut dev);
});
