//! The two [`Experts`] suppliers: all resident, and streamed by the LES scheduler.

use super::forward::{Down, ExpertMatrices, Experts, GateUp, Handout, Residency, Step};
use crate::blockdev::{BlockDevice, SlotId, SlotMemory};
use crate::gemv::{GemvError, MatrixView};
use crate::quant::GgmlType;
use crate::schedule::{Error, ExpertSource, LayerState, Next, Scheduler, MAX_PICKS};
use crate::slots::{ExpertKey, IndexEntry, Slot};

/// How one layer's expert is laid out in a slot: gate (where it has one), up
/// and down back to back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertFormat {
    /// Gate projection type; `None` for an ungated expert (ReLU², Nemotron-H).
    pub gate: Option<GgmlType>,
    /// Up projection type.
    pub up: GgmlType,
    /// Down projection type.
    pub down: GgmlType,
    /// Model width.
    pub n_embd: usize,
    /// Expert hidden size.
    pub n_ff: usize,
}

impl ExpertFormat {
    /// Byte sizes of gate (0 without one), up and down, or `None` if a row is
    /// not whole blocks.
    pub fn part_bytes(&self) -> Option<[usize; 3]> {
        let gate = match self.gate {
            Some(ty) => ty.row_bytes(self.n_embd)?.checked_mul(self.n_ff)?,
            None => 0,
        };
        Some([
            gate,
            self.up.row_bytes(self.n_embd)?.checked_mul(self.n_ff)?,
            self.down.row_bytes(self.n_ff)?.checked_mul(self.n_embd)?,
        ])
    }

    /// The types of the projections in slot order: gate (where there is
    /// one), up, down.
    pub fn types(&self) -> impl Iterator<Item = GgmlType> {
        self.gate.into_iter().chain([self.up, self.down])
    }

    /// Total bytes of one expert.
    pub fn bytes(&self) -> Option<usize> {
        let [g, u, d] = self.part_bytes()?;
        g.checked_add(u)?.checked_add(d)
    }

    fn row_error(&self) -> GemvError {
        GemvError::RowLength {
            ty: self.gate.unwrap_or(self.up),
            cols: self.n_embd,
        }
    }

    /// The matrices of an expert stored at the start of `slot`.
    pub fn matrices<'a>(&self, slot: &'a [u8]) -> Result<ExpertMatrices<'a>, GemvError> {
        let [g, u, d] = self.part_bytes().ok_or(self.row_error())?;
        let down = slot.get(g + u..g + u + d).ok_or(GemvError::MatrixBytes {
            expected: g + u + d,
            len: slot.len(),
        })?;
        let (gate, up) = self.gate_up(slot)?;
        Ok(ExpertMatrices {
            gate,
            up,
            down: MatrixView::new(self.down, self.n_embd, self.n_ff, down)?,
        })
    }

    /// Bytes of the gate and up projections at the start of a slot.
    pub fn gate_up_bytes(&self) -> Option<usize> {
        let [g, u, _] = self.part_bytes()?;
        g.checked_add(u)
    }

    /// The gate (where there is one) and up projections of an expert whose
    /// slot starts with `bytes` (at least [`gate_up_bytes`](Self::gate_up_bytes)
    /// of them).
    pub fn gate_up<'a>(
        &self,
        bytes: &'a [u8],
    ) -> Result<(Option<MatrixView<'a>>, MatrixView<'a>), GemvError> {
        let [g, u, _] = self.part_bytes().ok_or(self.row_error())?;
        let too_short = GemvError::MatrixBytes {
            expected: g + u,
            len: bytes.len(),
        };
        let gate_bytes = bytes.get(..g).ok_or(too_short)?;
        let up = bytes.get(g..g + u).ok_or(too_short)?;
        let gate = self
            .gate
            .map(|ty| MatrixView::new(ty, self.n_ff, self.n_embd, gate_bytes))
            .transpose()?;
        Ok((gate, MatrixView::new(self.up, self.n_ff, self.n_embd, up)?))
    }
}

/// Every expert in RAM: hands out the picked experts in router order.
pub struct Resident<'w, F> {
    lookup: F,
    /// Ties the matrices' lifetime to the supplier's, so they outlive `next`'s borrow.
    _weights: core::marker::PhantomData<&'w ()>,
    layer: usize,
    picks: heapless::Vec<u16, MAX_PICKS>,
    next: usize,
}

impl<'w, F> Resident<'w, F>
where
    F: Fn(usize, u16) -> Result<ExpertMatrices<'w>, GemvError>,
{
    /// Experts found by `lookup(layer, expert)`.
    pub fn new(lookup: F) -> Self {
        Resident {
            lookup,
            _weights: core::marker::PhantomData,
            layer: 0,
            picks: heapless::Vec::new(),
            next: 0,
        }
    }
}

impl<'w, F> Experts for Resident<'w, F>
where
    F: Fn(usize, u16) -> Result<ExpertMatrices<'w>, GemvError>,
{
    type Error = GemvError;

    fn begin_layer(&mut self, layer: usize, routing: &[u16]) -> Result<(), GemvError> {
        self.layer = layer;
        self.picks.clear();
        for &e in routing {
            // MAX_PICKS >= router::MAX_TOP_K, the most a routing holds.
            let _ = self.picks.push(e);
        }
        self.next = 0;
        Ok(())
    }

    fn next(&mut self) -> Result<Option<Handout<'_>>, GemvError> {
        let Some(&e) = self.picks.get(self.next) else {
            return Ok(None);
        };
        let index = self.next;
        self.next += 1;
        Ok(Some(Handout {
            index,
            matrices: (self.lookup)(self.layer, e)?,
            verify: false,
        }))
    }

    fn finish(&mut self, _index: usize, _checksum: Option<u32>) -> Result<(), GemvError> {
        Ok(())
    }
}

/// Why streaming an expert failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamError<E> {
    /// The scheduler or the device failed.
    Schedule(Error<E>),
    /// A slot's bytes do not form the layer's expert matrices.
    Layout(GemvError),
}

impl<E: core::fmt::Display> core::fmt::Display for StreamError<E> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            StreamError::Schedule(e) => e.fmt(f),
            StreamError::Layout(e) => write!(f, "expert slot layout: {e}"),
        }
    }
}

impl<E: core::fmt::Debug + core::fmt::Display> core::error::Error for StreamError<E> {}

/// Experts streamed from a [`BlockDevice`] by the LES [`Scheduler`].
///
/// Owns its parts; pass `&mut` references to keep them (the device and source
/// traits are implemented for references).
pub struct Streamed<S, M, L, D, X, F> {
    /// The scheduler (its statistics are the run's I/O statistics).
    pub scheduler: Scheduler<S, M, L>,
    /// The device, which also owns the slot memory.
    pub device: D,
    /// Where experts are and how to verify them.
    pub source: X,
    /// Layout of layer `l`'s expert in a slot.
    pub format: F,
    /// Pass lookahead predictions to the scheduler.
    pub predict: bool,
}

impl<S, M, L, D, X, F> Streamed<S, M, L, D, X, F>
where
    D: SlotMemory,
    F: Fn(usize) -> ExpertFormat,
{
    /// The matrices of `key`, loaded in `slot`.
    fn matrices<E>(
        &self,
        key: ExpertKey,
        slot: SlotId,
    ) -> Result<ExpertMatrices<'_>, StreamError<E>> {
        (self.format)(key.layer as usize)
            .matrices(self.device.slot(slot))
            .map_err(StreamError::Layout)
    }
}

impl<S, M, L, D, X, F> Streamed<S, M, L, D, X, F>
where
    S: AsRef<[Slot]> + AsMut<[Slot]>,
    M: AsRef<[IndexEntry]> + AsMut<[IndexEntry]>,
    L: AsRef<[LayerState]> + AsMut<[LayerState]>,
    D: BlockDevice + SlotMemory,
    F: Fn(usize) -> ExpertFormat,
{
    /// The scheduler's answer as a step over the slots' matrices (`Pending` for
    /// a wait, unless `block`ing, where a wait means nothing can progress).
    fn step<E>(&self, next: Next, block: bool) -> Result<Step<'_>, StreamError<E>> {
        Ok(match next {
            Next::Compute {
                index,
                key,
                slot,
                verify,
            } => Step::Compute(Handout {
                index,
                matrices: self.matrices(key, slot)?,
                verify,
            }),
            Next::ComputeFirst {
                index,
                key,
                slot,
                bytes,
            } => {
                let prefix = self.device.slot_prefix(slot, bytes as usize);
                let (gate, up) = (self.format)(key.layer as usize)
                    .gate_up(prefix)
                    .map_err(StreamError::Layout)?;
                Step::GateUp(GateUp {
                    index,
                    gate,
                    up,
                    verify: true,
                })
            }
            Next::ComputeRest { index, key, slot } => Step::Down(Down {
                index,
                down: self.matrices(key, slot)?.down,
                verify: true,
            }),
            Next::Done => Step::Done,
            Next::Wait if !block && self.scheduler.reads_in_flight() > 0 => Step::Pending,
            Next::Wait => return Err(StreamError::Schedule(Error::Stuck)),
        })
    }
}

impl<S, M, L, D, X, F> Experts for Streamed<S, M, L, D, X, F>
where
    S: AsRef<[Slot]> + AsMut<[Slot]>,
    M: AsRef<[IndexEntry]> + AsMut<[IndexEntry]>,
    L: AsRef<[LayerState]> + AsMut<[LayerState]>,
    D: BlockDevice + SlotMemory,
    X: ExpertSource,
    F: Fn(usize) -> ExpertFormat,
{
    type Error = StreamError<D::Error>;

    fn begin_token(&mut self) {
        // A layer an error left unfinished is given up. Its only failure, a
        // slot not in the state its pick says, would be a scheduler bug; the
        // next begin_layer then reports the layer still in progress.
        let _ = self.scheduler.abandon_layer(&mut self.device);
        self.scheduler.begin_token();
    }

    fn begin_layer(&mut self, layer: usize, routing: &[u16]) -> Result<(), Self::Error> {
        self.scheduler
            .begin_layer(layer as u16, routing, &mut self.device, &self.source)
            .map_err(StreamError::Schedule)
    }

    fn max_picks(&self, _layer: usize) -> usize {
        self.scheduler.max_picks()
    }

    fn router_logits(&mut self, layer: usize, logits: &[f32]) {
        if let Ok(layer) = u16::try_from(layer) {
            self.scheduler.observe_router(layer, logits);
        }
    }

    fn wants_predictions(&self) -> bool {
        self.predict
    }

    fn prefetch(&mut self, layer: usize, predicted: &[u16]) -> Result<(), Self::Error> {
        self.scheduler
            .prefetch(layer as u16, predicted, &mut self.device, &self.source)
            .map_err(StreamError::Schedule)
    }

    fn prefetch_known(&mut self, layer: usize, experts: &[u16]) -> Result<(), Self::Error> {
        self.scheduler
            .prefetch_known(layer as u16, experts, &mut self.device, &self.source)
            .map_err(StreamError::Schedule)
    }

    fn residency(&self, layer: usize, expert: u16) -> Residency {
        u16::try_from(layer).map_or(Residency::Missing, |l| self.scheduler.residency(l, expert))
    }

    fn next(&mut self) -> Result<Option<Handout<'_>>, Self::Error> {
        let next = self
            .scheduler
            .next_blocking(&mut self.device, &self.source)
            .map_err(StreamError::Schedule)?;
        match self.step(next, true)? {
            Step::Compute(h) => Ok(Some(h)),
            Step::Done => Ok(None),
            _ => Err(StreamError::Schedule(Error::Stuck)),
        }
    }

    fn try_next(&mut self) -> Result<Step<'_>, Self::Error> {
        if !self.scheduler.config().ready_first {
            // The on-demand baseline overlaps nothing: read, then compute.
            return self.next().map(Step::from);
        }
        let next = self
            .scheduler
            .next(&mut self.device, &self.source)
            .map_err(StreamError::Schedule)?;
        self.step(next, false)
    }

    fn next_part(&mut self, block: bool) -> Result<Step<'_>, Self::Error> {
        if !self.scheduler.config().ready_first {
            return self.next().map(Step::from);
        }
        let (dev, src) = (&mut self.device, &self.source);
        let next = if block {
            self.scheduler.next_blocking_parts(dev, src, true)
        } else {
            self.scheduler.next_parts(dev, src, true)
        }
        .map_err(StreamError::Schedule)?;
        self.step(next, block)
    }

    fn finish(&mut self, index: usize, checksum: Option<u32>) -> Result<(), Self::Error> {
        match checksum {
            // `Again`: the same index is handed out again once read again,
            // and the output computed then replaces this one (the forward
            // pass keeps each pick's output apart until it combines them).
            Some(crc) => self.scheduler.finish_checked(index, crc).map(drop),
            None => self.scheduler.finish(index),
        }
        .map_err(StreamError::Schedule)
    }
}
