//! Where a run's routed experts come from: the `--schedule` choice.
//!
//! - `resident`: experts are read straight from the memory-mapped file.
//! - `on-demand`: after routing, missing experts are read into slots, then computed.
//! - `les`: lookahead prefetch, ready-first compute, I/O overlapped with compute.
//!
//! The two streamed schedules share the slots, the file device and the kernels;
//! only the scheduler configuration differs, so comparisons between them are fair.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use les_core::gemv::GemvError;
use les_core::model::experts::{ExpertFormat, Resident, StreamError, Streamed};
use les_core::model::forward::{ExpertMatrices, Experts, Handout, Residency, Step};
use les_core::schedule::{
    ExpertSource, Extent, Extents, LayerState, Scheduler, SchedulerConfig, Stats,
};
use les_core::slot_classes::SlotClass;
use les_core::slots::{ExpertKey, IndexEntry, Slot};

use crate::flash::{FileDevice, FileDeviceConfig, FileError};
use crate::model::Model;

/// The expert schedule of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// All experts in RAM (the mapped file).
    Resident,
    /// Read missing experts after routing, then compute.
    OnDemand,
    /// Lookahead Expert Scheduling.
    Les,
}

impl Schedule {
    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Schedule::Resident => "resident",
            Schedule::OnDemand => "on-demand",
            Schedule::Les => "les",
        }
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Schedule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "resident" => Ok(Schedule::Resident),
            "on-demand" | "ondemand" => Ok(Schedule::OnDemand),
            "les" => Ok(Schedule::Les),
            _ => Err(format!(
                "unknown schedule {s:?} (expected resident, on-demand or les)"
            )),
        }
    }
}

/// Parses a byte size such as `2GiB`, `512MiB`, `1.5G`, `4096`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("invalid size {s:?}"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tb" => 1e12,
        "tib" => 1024f64.powi(4),
        u => return Err(format!("unknown size unit {u:?} in {s:?}")),
    };
    let v = n * mult;
    if !(v.is_finite() && (0.0..1.8e19).contains(&v)) {
        return Err(format!("size {s:?} out of range"));
    }
    Ok(v as u64)
}

/// The model file as an expert source: three extents per expert in a plain GGUF,
/// one checksummed aligned extent in a packed one (or two, see
/// [`ModelSource::split_reads_above`]).
pub struct ModelSource<'m> {
    model: &'m Model,
    device_checks: bool,
    split_above: Option<u64>,
}

impl<'m> ModelSource<'m> {
    /// A source that knows each packed expert's checksum: the scheduler checks
    /// it when the expert is first computed
    /// ([`SchedulerConfig::verify_on_compute`]), or `verify` hashes each read on
    /// arrival where that is off.
    pub fn new(model: &'m Model) -> Self {
        ModelSource {
            model,
            device_checks: false,
            split_above: None,
        }
    }

    /// Reads each packed expert longer than `bytes` as two extents, its gate and
    /// up projections (to the next multiple of `bytes`, or of the alignment, past
    /// them) and the rest, so that
    /// `les` can compute the first half while the second still loads
    /// ([`SchedulerConfig::split_compute`]). For a device that splits long reads
    /// into chunks of `bytes` anyway, this costs no extra reads.
    pub fn split_reads_above(self, bytes: u64) -> Self {
        ModelSource {
            split_above: Some(bytes),
            ..self
        }
    }

    /// Where `key`'s single packed extent `ext` is split, if it is: past the
    /// gate and up projections, at the extent's own alignment (up to 4 KiB);
    /// and the bytes of those projections.
    fn split_at(&self, key: ExpertKey, ext: &Extents) -> Option<(u32, u32)> {
        let min = self.split_above?;
        let [e] = ext.as_slice() else {
            return None;
        };
        if self.device_checks || u64::from(e.len) <= min {
            return None;
        }
        let g = self
            .model
            .expert_format(key.layer as usize)?
            .gate_up_bytes()? as u64;
        let align = 1u64 << (e.offset | u64::from(e.len)).trailing_zeros().min(12);
        // At a chunk boundary where one is past the gate and up projections (the
        // device's chunks of the two reads are then those of the one they replace),
        // else at the next aligned byte.
        let fits = |at: u64| at > 0 && at < u64::from(e.len);
        let at = Some(g.div_ceil(min.max(1)) * min.max(1))
            .filter(|&at| fits(at) && at.is_multiple_of(align))
            .unwrap_or(g.div_ceil(align) * align);
        fits(at).then_some((at as u32, u32::try_from(g).ok()?))
    }

    /// A source for a [`FileDevice`] given [`Model::read_checks`]: the device's
    /// I/O threads hash every packed read and fail the ones that do not match,
    /// so `verify` has nothing left to check.
    pub fn checked_by_device(model: &'m Model) -> Self {
        ModelSource {
            model,
            device_checks: true,
            split_above: None,
        }
    }
}

impl ExpertSource for ModelSource<'_> {
    fn extents(&self, key: ExpertKey) -> Extents {
        let mut ext = self.model.expert_extents(key);
        if let Some((at, _)) = self.split_at(key, &ext) {
            let e = ext[0];
            ext.clear();
            let _ = ext.push(Extent { len: at, ..e });
            let _ = ext.push(Extent {
                offset: e.offset + u64::from(at),
                len: e.len - at,
                slot_offset: e.slot_offset + at,
            });
        }
        ext
    }

    fn gate_up_bytes(&self, key: ExpertKey) -> Option<u32> {
        self.split_at(key, &self.model.expert_extents(key))
            .map(|(_, gate_up)| gate_up)
    }

    fn verify(&self, key: ExpertKey, slot: &[u8]) -> bool {
        self.device_checks || self.model.verify_expert(key, slot)
    }

    fn checksum(&self, key: ExpertKey) -> Option<u32> {
        if self.device_checks {
            None
        } else {
            self.model.expert_checksum(key)
        }
    }
}

/// The scheduler over host (`Vec`) storage.
pub type HostScheduler = Scheduler<Vec<Slot>, Vec<IndexEntry>, Vec<LayerState>>;
/// A layer's expert slot layout.
pub type FormatFn<'m> = Box<dyn Fn(usize) -> ExpertFormat + 'm>;
/// A resident expert by (layer, expert).
pub type LookupFn<'m> = Box<dyn Fn(usize, u16) -> Result<ExpertMatrices<'m>, GemvError> + 'm>;

/// Why experts could not be supplied.
#[derive(Debug)]
pub enum SupplyError {
    /// Reading or computing from a slot failed.
    Stream(StreamError<FileError>),
    /// Viewing a resident expert failed.
    Resident(GemvError),
    /// A resident expert's bytes do not match its packed CRC-32.
    Corrupt(ExpertKey),
}

impl fmt::Display for SupplyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SupplyError::Stream(e) => e.fmt(f),
            SupplyError::Resident(e) => write!(f, "resident expert: {e}"),
            SupplyError::Corrupt(k) => write!(f, "{k}: checksum mismatch in the model file"),
        }
    }
}

impl std::error::Error for SupplyError {}

/// Experts streamed from the model file through the slots.
pub type HostStreamed<'m> = Streamed<
    Vec<Slot>,
    Vec<IndexEntry>,
    Vec<LayerState>,
    FileDevice,
    ModelSource<'m>,
    FormatFn<'m>,
>;

/// Every expert in the mapped file, each checked against its packed CRC-32 the
/// first time it is computed, as the streamed schedules check each read: a
/// corrupt expert ends the run under every schedule alike.
pub struct CheckedResident<'m> {
    inner: Resident<'m, LookupFn<'m>>,
    model: &'m Model,
    layer: usize,
    /// The layer's routing, and which of its picks were handed out to check.
    picks: Vec<(u16, bool)>,
    /// Per layer and expert: checked already.
    checked: Vec<bool>,
    n_experts: usize,
}

impl<'m> CheckedResident<'m> {
    fn new(model: &'m Model, lookup: LookupFn<'m>) -> Self {
        let n_experts = model.hp.moe.map_or(0, |m| m.n_experts);
        CheckedResident {
            inner: Resident::new(lookup),
            model,
            layer: 0,
            picks: Vec::new(),
            // The layers' and the multi-token-prediction block's (layer `n_layers`).
            checked: vec![false; (model.hp.n_layers + 1) * n_experts],
            n_experts,
        }
    }

    fn key(&self, expert: u16) -> ExpertKey {
        ExpertKey {
            layer: self.layer as u16,
            expert,
        }
    }
}

impl Experts for CheckedResident<'_> {
    type Error = SupplyError;

    fn begin_layer(&mut self, layer: usize, routing: &[u16]) -> Result<(), SupplyError> {
        self.layer = layer;
        self.picks.clear();
        self.picks.extend(routing.iter().map(|&e| (e, false)));
        self.inner
            .begin_layer(layer, routing)
            .map_err(SupplyError::Resident)
    }

    fn max_picks(&self, layer: usize) -> usize {
        self.inner.max_picks(layer)
    }

    fn next(&mut self) -> Result<Option<Handout<'_>>, SupplyError> {
        let Some(mut h) = self.inner.next().map_err(SupplyError::Resident)? else {
            return Ok(None);
        };
        if let Some((e, check)) = self.picks.get_mut(h.index) {
            let key = ExpertKey {
                layer: self.layer as u16,
                expert: *e,
            };
            let i = self.layer * self.n_experts + *e as usize;
            *check =
                self.checked.get(i) == Some(&false) && self.model.expert_checksum(key).is_some();
            h.verify = *check;
        }
        Ok(Some(h))
    }

    fn finish(&mut self, index: usize, checksum: Option<u32>) -> Result<(), SupplyError> {
        if let Some(&(e, true)) = self.picks.get(index) {
            let key = self.key(e);
            if checksum.is_none() || checksum != self.model.expert_checksum(key) {
                return Err(SupplyError::Corrupt(key));
            }
            self.checked[self.layer * self.n_experts + e as usize] = true;
        }
        self.inner
            .finish(index, checksum)
            .map_err(SupplyError::Resident)
    }
}

/// The experts of a run, for any schedule.
pub enum Supply<'m> {
    /// Experts in the mapped file.
    Resident(Box<CheckedResident<'m>>),
    /// Experts streamed through slots.
    Streamed(Box<HostStreamed<'m>>),
}

/// The expert slots (runs of slots per expert size, see
/// `les_core::slot_classes`) and how they are read.
#[derive(Clone, Debug)]
pub struct SlotBudget {
    /// The slots' size classes, smallest first (empty: no slots).
    pub classes: Vec<SlotClass>,
    /// I/O settings.
    pub io: FileDeviceConfig,
}

impl SlotBudget {
    /// No slots (everything resident).
    pub fn none(io: FileDeviceConfig) -> Self {
        SlotBudget {
            classes: Vec::new(),
            io,
        }
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.classes.iter().map(|c| c.slots as usize).sum()
    }

    /// Bytes of all slots.
    pub fn bytes(&self) -> u64 {
        self.classes
            .iter()
            .map(|c| c.slots as u64 * c.bytes as u64)
            .sum()
    }
}

impl<'m> Supply<'m> {
    /// Experts for `schedule`, streaming from `path` (the model's file) when not
    /// resident.
    pub fn new(
        model: &'m Model,
        path: &Path,
        schedule: Schedule,
        budget: SlotBudget,
    ) -> Result<Supply<'m>, String> {
        if schedule == Schedule::Resident {
            let lookup: LookupFn<'m> = Box::new(move |l, e| {
                model.expert(l, e).ok_or(GemvError::RowRange {
                    start: e as usize,
                    end: e as usize + 1,
                    rows: 0,
                })
            });
            return Ok(Supply::Resident(Box::new(CheckedResident::new(
                model, lookup,
            ))));
        }
        let moe = model
            .hp
            .moe
            .ok_or("the model has no experts to stream; use --schedule resident")?;
        for l in 0..model.hp.n_layers {
            let fits = model
                .slot_class_of(&budget.classes, l)
                .map(|c| budget.classes[c].slots as usize >= moe.top_k);
            if fits == Some(false) || (fits.is_none() && model.expert_format(l).is_some()) {
                return Err(format!(
                    "{} expert slots cannot hold the {} experts one layer uses",
                    budget.slots(),
                    moe.top_k
                ));
            }
        }
        let device = FileDevice::open_classes(path, &budget.classes, budget.io)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        // Checksums are verified where each expert is first computed: the compute
        // threads hash the bytes their products just read, still in cache
        // (`verify_on_compute`), instead of the I/O threads reading them again
        // from RAM, which on few cores slows the compute they overlap with.
        let config = match schedule {
            Schedule::Les => SchedulerConfig::les(),
            _ => SchedulerConfig::on_demand(),
        };
        let n_layers = model.hp.n_layers;
        let scheduler: HostScheduler = Scheduler::with_slot_classes(
            config,
            vec![Slot::EMPTY; budget.slots()],
            vec![IndexEntry::EMPTY; n_layers * moe.n_experts],
            vec![LayerState::INITIAL; n_layers],
            n_layers as u16,
            moe.n_experts as u16,
            &budget.classes,
        )
        .map_err(|e| e.to_string())?;
        let format: FormatFn<'m> = Box::new(move |l| {
            model
                .expert_format(l)
                .expect("the scheduler only hands out experts of MoE layers")
        });
        Ok(Supply::Streamed(Box::new(Streamed {
            scheduler,
            device,
            source: match budget.io.chunk_bytes {
                0 => ModelSource::new(model),
                c => ModelSource::new(model).split_reads_above(c as u64),
            },
            format,
            predict: schedule == Schedule::Les,
        })))
    }

    /// Scheduler counters (streamed schedules).
    pub fn stats(&self) -> Option<Stats> {
        match self {
            Supply::Resident(_) => None,
            Supply::Streamed(s) => Some(s.scheduler.stats()),
        }
    }

    /// The file device (streamed schedules).
    pub fn device(&self) -> Option<&FileDevice> {
        match self {
            Supply::Resident(_) => None,
            Supply::Streamed(s) => Some(&s.device),
        }
    }

    /// Per-layer prediction state (streamed schedules).
    pub fn layers(&self) -> Option<&[LayerState]> {
        match self {
            Supply::Resident(_) => None,
            Supply::Streamed(s) => Some(s.scheduler.layers()),
        }
    }
}

impl Experts for Supply<'_> {
    type Error = SupplyError;

    fn begin_token(&mut self) {
        if let Supply::Streamed(s) = self {
            s.begin_token();
        }
    }

    fn begin_layer(&mut self, layer: usize, routing: &[u16]) -> Result<(), SupplyError> {
        match self {
            Supply::Resident(r) => r.begin_layer(layer, routing),
            Supply::Streamed(s) => s.begin_layer(layer, routing).map_err(SupplyError::Stream),
        }
    }

    fn max_picks(&self, layer: usize) -> usize {
        match self {
            Supply::Resident(r) => r.max_picks(layer),
            Supply::Streamed(s) => s.max_picks(layer),
        }
    }

    fn router_logits(&mut self, layer: usize, logits: &[f32]) {
        if let Supply::Streamed(s) = self {
            s.router_logits(layer, logits);
        }
    }

    fn wants_predictions(&self) -> bool {
        match self {
            Supply::Resident(_) => false,
            Supply::Streamed(s) => s.wants_predictions(),
        }
    }

    fn prefetch(&mut self, layer: usize, predicted: &[u16]) -> Result<(), SupplyError> {
        match self {
            Supply::Resident(_) => Ok(()),
            Supply::Streamed(s) => s.prefetch(layer, predicted).map_err(SupplyError::Stream),
        }
    }

    fn prefetch_known(&mut self, layer: usize, experts: &[u16]) -> Result<(), SupplyError> {
        match self {
            Supply::Resident(_) => Ok(()),
            Supply::Streamed(s) => s
                .prefetch_known(layer, experts)
                .map_err(SupplyError::Stream),
        }
    }

    fn residency(&self, layer: usize, expert: u16) -> Residency {
        match self {
            Supply::Resident(r) => r.residency(layer, expert),
            Supply::Streamed(s) => s.residency(layer, expert),
        }
    }

    fn next(&mut self) -> Result<Option<Handout<'_>>, SupplyError> {
        match self {
            Supply::Resident(r) => r.next(),
            Supply::Streamed(s) => s.next().map_err(SupplyError::Stream),
        }
    }

    fn try_next(&mut self) -> Result<Step<'_>, SupplyError> {
        match self {
            Supply::Resident(r) => r.try_next(),
            Supply::Streamed(s) => s.try_next().map_err(SupplyError::Stream),
        }
    }

    fn next_part(&mut self, block: bool) -> Result<Step<'_>, SupplyError> {
        match self {
            Supply::Resident(r) => r.next_part(block),
            Supply::Streamed(s) => s.next_part(block).map_err(SupplyError::Stream),
        }
    }

    fn finish(&mut self, index: usize, checksum: Option<u32>) -> Result<(), SupplyError> {
        match self {
            Supply::Resident(r) => r.finish(index, checksum),
            Supply::Streamed(s) => s.finish(index, checksum).map_err(SupplyError::Stream),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5G"), Ok(1_500_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("-1G").is_err());
        assert!(parse_size("1e30").is_err());
    }

    #[test]
    fn schedules_parse() {
        assert_eq!("les".parse(), Ok(Schedule::Les));
        assert_eq!("on-demand".parse(), Ok(Schedule::OnDemand));
        assert!("fast".parse::<Schedule>().is_err());
    }
}
