//! `les pack`: rewrite a MoE GGUF so that every expert is one aligned extent.
//!
//! # The packed format
//! A plain GGUF stores expert `e` of layer `N` in three tensors
//! (`blk.N.ffn_{gate,up,down}_exps.weight`), so loading it takes three scattered
//! reads. A packed file replaces those three by one `I8` tensor
//! `blk.N.ffn_exps_packed.weight` of `n_experts * stride` bytes, in which expert
//! `e` occupies `e * stride ..`: gate, up and down back to back (the slot layout
//! of [`les_core::model::experts::ExpertFormat`]), then zeros up to `stride`, a
//! multiple of the alignment (4 KiB by default). `general.alignment` is set to the
//! same value, so the packed tensor, and with it every expert, starts on an
//! aligned file offset: one O_DIRECT read per expert, straight into a slot.
//! Everything else (tensors, metadata) is copied unchanged, in the same order,
//! and the file stays a valid GGUF that ggml tools and the Python `gguf` package
//! read. The metadata keys ([`les_core::layout::keys`]):
//!
//! | key | type | meaning |
//! |---|---|---|
//! | `les.pack.version` | u32 | [`les_core::layout::VERSION`] |
//! | `les.pack.alignment` | u32 | alignment of every expert extent |
//! | `les.pack.plan` | string | the per-layer types, in the `--expert-types` syntax |
//! | `les.pack.blk.N.types` | u32\[3\] or u32\[2\] | ggml type ids of gate, up, down (up, down: experts without a gate) |
//! | `les.pack.blk.N.stride` | u64 | bytes from one expert to the next |
//! | `les.pack.blk.N.checksums` | u32\[n_experts\] | CRC-32 of each expert's unpadded bytes |
//!
//! The shapes come from `{arch}.embedding_length` and
//! `{arch}.expert_feed_forward_length` (else `feed_forward_length`), the count
//! from `{arch}.expert_count`; [`PackedIndex::from_gguf`] reads and validates it all.
//!
//! # Expert types
//! Without a plan the source bytes are copied verbatim. A [`Plan`]
//! (`0-3:q6_k,4-:q4_k`) gives layers a type; a matrix whose type changes is
//! requantized through f32 (dequantize the source, quantize to the target);
//! one that already has the type is copied.
//!
//! A bits-per-weight budget chooses the plan: for each MoE layer and each
//! candidate (keep, or any type LES can quantize whose blocks divide the rows),
//! the packer measures the relative reconstruction error (sum of squared error
//! over sum of squares, against the dequantized source) on a deterministic
//! sample (a few experts spread over the layer, evenly spaced rows of each
//! matrix). A dynamic program over the byte budget then picks one candidate per
//! layer minimising the total error weighted by each layer's weight count, and
//! a greedy pass spends what the program's rounding left. The budget bounds the
//! average bits per expert weight, padding excluded.
//!
//! # Streaming
//! The input is memory-mapped and the output written sequentially: plain
//! tensors are copied, and each layer's experts are built one at a time (their
//! rows requantized on several threads, in a deterministic order) into a
//! `stride`-sized buffer. The checksums, known only at the end, are patched
//! into placeholder arrays in the header. The output is written to a temporary
//! file next to the target, read back and validated, then renamed over it.

mod convert;
mod index;
mod plan;
pub mod progress;
mod source;
mod write;

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use les_core::quant::{can_quantize, GgmlType, QuantError};

pub use index::{Extent, PackedIndex, PackedLayer};
pub use plan::{Choice, Plan, PlanEntry};
pub use write::check_output;

use crate::gguf::{Gguf, GgufError, MappedFile};
use source::MoeSource;

/// Why packing, or reading a packed layout, failed. `Display` is one line.
#[derive(Debug)]
#[non_exhaustive]
pub enum PackError {
    /// Reading or writing a file failed.
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// The input is not a valid GGUF, or a metadata value is missing or wrong.
    Gguf(GgufError),
    /// The input has no routed experts.
    NotMoe(String),
    /// The input is already packed.
    AlreadyPacked,
    /// The output's filesystem has less free space than the packed file needs.
    NoSpace {
        /// The output.
        path: PathBuf,
        /// Bytes the packed file needs (an estimate from the plan).
        need: u64,
        /// Bytes free for this user on the output's filesystem.
        free: u64,
    },
    /// The experts' tensors are missing or inconsistent.
    Model(String),
    /// A plan that does not parse or does not fit the model.
    Plan(String),
    /// A type name that ggml does not have.
    UnknownType(String),
    /// A layer would need a type that LES cannot quantize to.
    NoQuantizer {
        /// The layer.
        layer: usize,
        /// The type.
        ty: GgmlType,
    },
    /// A type whose block size does not divide a matrix's row length.
    RowLength {
        /// The layer.
        layer: usize,
        /// The type.
        ty: GgmlType,
        /// The matrix (`gate`, `up` or `down`).
        matrix: &'static str,
        /// Its row length.
        cols: usize,
    },
    /// The bits-per-weight budget is below what the cheapest types need.
    Budget {
        /// The budget.
        bpw: f64,
        /// The least average any plan reaches.
        min_bpw: f64,
    },
    /// An option out of range.
    BadOption(String),
    /// The output is the input.
    SameFile {
        /// The output path.
        path: PathBuf,
    },
    /// A packed layout that is inconsistent or corrupt.
    Index(String),
}

fn weight_types(keep: impl Fn(GgmlType) -> bool) -> String {
    GgmlType::ALL
        .iter()
        .filter(|t| !t.is_activation_only() && keep(**t))
        .map(|t| t.name())
        .collect::<Vec<_>>()
        .join(", ")
}

impl fmt::Display for PackError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PackError::Io { path, source } => write!(f, "{}: {source}", path.display()),
            PackError::Gguf(e) => e.fmt(f),
            PackError::NotMoe(d) => write!(f, "not a MoE model: {d}"),
            PackError::AlreadyPacked => {
                f.write_str("the input is already packed (it has les.pack.* metadata)")
            }
            PackError::NoSpace { path, need, free } => write!(
                f,
                "{}: the packed file needs about {:.2} GiB but its filesystem has {:.2} GiB free",
                path.display(),
                gib(*need),
                gib(*free)
            ),
            PackError::Model(d) => f.write_str(d),
            PackError::Plan(d) => write!(f, "bad expert-type plan: {d}"),
            PackError::UnknownType(name) => write!(
                f,
                "unknown ggml type '{name}' (weight types: {})",
                weight_types(|_| true)
            ),
            PackError::NoQuantizer { layer, ty } => write!(
                f,
                "layer {layer}: LES has no quantizer for {ty} (it quantizes to {})",
                weight_types(can_quantize)
            ),
            PackError::RowLength {
                layer,
                ty,
                matrix,
                cols,
            } => write!(
                f,
                "layer {layer}: {ty} needs rows that are a multiple of {} elements, \
                 but the {matrix} rows have {cols}",
                ty.block_elems()
            ),
            PackError::Budget { bpw, min_bpw } => write!(
                f,
                "a budget of {bpw} bits per weight is too small: the smallest expert types \
                 need {min_bpw:.3}"
            ),
            PackError::BadOption(d) => f.write_str(d),
            PackError::SameFile { path } => write!(
                f,
                "refusing to overwrite the input {} (choose another output)",
                path.display()
            ),
            PackError::Index(d) => write!(f, "bad packed layout: {d}"),
        }
    }
}

impl std::error::Error for PackError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PackError::Io { source, .. } => Some(source),
            PackError::Gguf(e) => Some(e),
            _ => None,
        }
    }
}

impl From<GgufError> for PackError {
    fn from(e: GgufError) -> Self {
        PackError::Gguf(e)
    }
}

/// How the expert types are chosen.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum ExpertTypes {
    /// Keep the source types (bytes copied verbatim).
    #[default]
    Keep,
    /// Per-layer types from a plan.
    Plan(Plan),
    /// The least-error plan within this average bits per expert weight.
    BitsPerWeight(f64),
}

/// Options of [`pack`].
#[derive(Clone, Debug, PartialEq)]
pub struct PackOptions {
    /// How the expert types are chosen.
    pub types: ExpertTypes,
    /// Alignment of every expert extent and of the file's tensors: a power of
    /// two from 32 to 1 GiB.
    pub align: u64,
    /// Worker threads for measuring and requantizing; 0 means all cores.
    pub threads: usize,
    /// Experts per layer the bits-per-weight planner measures.
    pub sample_experts: usize,
    /// Rows per matrix and sampled expert the planner measures.
    pub sample_rows: usize,
}

/// The default alignment: a page, what O_DIRECT needs on common devices.
pub const DEFAULT_ALIGN: u64 = 4096;

impl Default for PackOptions {
    fn default() -> Self {
        PackOptions {
            types: ExpertTypes::Keep,
            align: DEFAULT_ALIGN,
            threads: 0,
            sample_experts: 4,
            sample_rows: 256,
        }
    }
}

/// One candidate the planner measured for a layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CandidateReport {
    /// The candidate.
    pub choice: Choice,
    /// Its bits per weight.
    pub bpw: f64,
    /// Its measured relative error.
    pub error: f64,
}

/// What one MoE layer's experts become.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerReport {
    /// The layer.
    pub layer: usize,
    /// The choice that gave `types`.
    pub choice: Choice,
    /// Source types of gate (where the experts have one), up, down.
    pub source: Vec<GgmlType>,
    /// Packed types, in the same order.
    pub types: Vec<GgmlType>,
    /// Bytes of one packed expert, without padding.
    pub expert_bytes: u64,
    /// Bytes of one source expert.
    pub source_expert_bytes: u64,
    /// Bytes from one packed expert to the next.
    pub stride: u64,
    /// Weights of one expert.
    pub expert_weights: u64,
    /// Measured relative error against the source: 0 when nothing changed,
    /// `None` when requantized but not measured (an explicit plan).
    pub error: Option<f64>,
    /// Every candidate measured (bits-per-weight planning only).
    pub candidates: Vec<CandidateReport>,
}

impl LayerReport {
    /// Bits per weight of the packed experts (padding excluded).
    pub fn bpw(&self) -> f64 {
        self.expert_bytes as f64 * 8.0 / self.expert_weights as f64
    }

    /// Bits per weight of the source experts.
    pub fn source_bpw(&self) -> f64 {
        self.source_expert_bytes as f64 * 8.0 / self.expert_weights as f64
    }
}

/// The plan and its cost, from [`Packer::report`] before writing or [`pack`] after.
#[derive(Clone, Debug, PartialEq)]
pub struct PackReport {
    /// Per MoE layer, ascending.
    pub layers: Vec<LayerReport>,
    /// The plan, in the `--expert-types` syntax (stored as `les.pack.plan`).
    pub plan: String,
    /// The bits-per-weight budget, if one chose the plan.
    pub budget: Option<f64>,
    /// Experts per layer.
    pub n_experts: usize,
    /// Alignment of the experts.
    pub alignment: u64,
    /// Length of the written file (0 before writing).
    pub file_bytes: u64,
}

fn avg_bpw(layers: &[LayerReport], bytes: impl Fn(&LayerReport) -> u64) -> f64 {
    let b: u64 = layers.iter().map(&bytes).sum();
    let w: u64 = layers.iter().map(|l| l.expert_weights).sum();
    if w == 0 {
        0.0
    } else {
        b as f64 * 8.0 / w as f64
    }
}

impl PackReport {
    /// The report of layer `layer`.
    pub fn layer_report(&self, layer: usize) -> Option<&LayerReport> {
        self.layers.iter().find(|l| l.layer == layer)
    }

    /// Average bits per packed expert weight (padding excluded).
    pub fn bpw(&self) -> f64 {
        avg_bpw(&self.layers, |l| l.expert_bytes)
    }

    /// Average bits per source expert weight.
    pub fn source_bpw(&self) -> f64 {
        avg_bpw(&self.layers, |l| l.source_expert_bytes)
    }

    /// Relative error over all expert weights (the layers' errors weighted by
    /// their weight counts), if every layer's is known.
    pub fn error(&self) -> Option<f64> {
        let w: u64 = self.layers.iter().map(|l| l.expert_weights).sum();
        let mut e = 0.0;
        for l in &self.layers {
            e += l.error? * l.expert_weights as f64;
        }
        Some(if w == 0 { 0.0 } else { e / w as f64 })
    }

    /// Bytes of all packed experts, padding included.
    pub fn packed_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.stride).sum::<u64>() * self.n_experts as u64
    }

    /// Bytes of alignment padding among the packed experts.
    pub fn padding_bytes(&self) -> u64 {
        let unpadded = self.layers.iter().map(|l| l.expert_bytes).sum::<u64>();
        self.packed_bytes()
            .saturating_sub(unpadded * self.n_experts as u64)
    }

    /// The share of the packed experts' bytes that is alignment padding (0 to 1).
    pub fn padding_share(&self) -> f64 {
        match self.packed_bytes() {
            0 => 0.0,
            packed => self.padding_bytes() as f64 / packed as f64,
        }
    }
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

impl fmt::Display for PackReport {
    /// A table of the layers and a summary, one line each.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let types = |t: &[GgmlType]| {
            let names: Vec<String> = t.iter().map(|t| t.to_string()).collect();
            if t.windows(2).all(|w| w[0] == w[1]) {
                names.first().cloned().unwrap_or_default()
            } else {
                names.join("/")
            }
        };
        let err = |e: Option<f64>| match e {
            None => "-".to_string(),
            Some(0.0) => "0".to_string(),
            Some(e) => format!("{e:.3e}"),
        };
        writeln!(
            f,
            "{:>5}  {:<16} {:<16} {:>6}  {:>9}  {:>10}",
            "layer", "source", "packed", "bpw", "error", "stride"
        )?;
        for l in &self.layers {
            writeln!(
                f,
                "{:>5}  {:<16} {:<16} {:>6.3}  {:>9}  {:>10}",
                l.layer,
                types(&l.source),
                types(&l.types),
                l.bpw(),
                err(l.error),
                l.stride
            )?;
        }
        let expert_bytes: u64 = self.layers.iter().map(|l| l.expert_bytes).sum();
        let source_bytes: u64 = self.layers.iter().map(|l| l.source_expert_bytes).sum();
        write!(
            f,
            "experts: {} layers x {}, {:.3} bpw (source {:.3}",
            self.layers.len(),
            self.n_experts,
            self.bpw(),
            self.source_bpw()
        )?;
        if let Some(b) = self.budget {
            write!(f, ", budget {b}")?;
        }
        write!(
            f,
            "), error {}, {:.1} MiB -> {:.1} MiB ({:.1} MiB with {}-byte alignment)",
            err(self.error()),
            mib(source_bytes * self.n_experts as u64),
            mib(expert_bytes * self.n_experts as u64),
            mib(self.packed_bytes()),
            self.alignment
        )?;
        writeln!(f)?;
        write!(f, "plan: {}", self.plan)
    }
}

fn threads(n: usize) -> usize {
    if n > 0 {
        n
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
}

fn round_up(n: u64, align: u64) -> u64 {
    n.div_ceil(align) * align
}

/// An opened input with its plan resolved, ready to [`Packer::write`].
#[derive(Debug)]
pub struct Packer {
    gguf: Gguf<MappedFile>,
    input: PathBuf,
    source: MoeSource,
    report: PackReport,
    threads: usize,
}

/// The types a layer's matrices get for `choice`, or why they cannot.
fn resolve(l: &source::SourceLayer, choice: Choice) -> Result<Vec<GgmlType>, PackError> {
    let Choice::Type(ty) = choice else {
        return Ok(l.types());
    };
    for (m, mat) in l.mats.iter().enumerate() {
        if ty.row_bytes(mat.cols).is_none() {
            return Err(PackError::RowLength {
                layer: l.layer,
                ty,
                matrix: l.names()[m],
                cols: mat.cols,
            });
        }
        if mat.ty != ty && !can_quantize(ty) {
            return Err(PackError::NoQuantizer { layer: l.layer, ty });
        }
    }
    Ok(vec![ty; l.mats.len()])
}

fn expert_bytes(l: &source::SourceLayer, types: &[GgmlType]) -> u64 {
    l.mats
        .iter()
        .zip(types)
        .map(|(m, t)| t.row_bytes(m.cols).expect("resolved") as u64 * m.rows as u64)
        .sum()
}

impl Packer {
    /// Opens `input`, finds its experts and resolves the types (measuring and
    /// allocating for a bits-per-weight budget).
    pub fn open(input: &Path, opts: &PackOptions) -> Result<Packer, PackError> {
        if !(32..=1 << 30).contains(&opts.align) || !opts.align.is_power_of_two() {
            return Err(PackError::BadOption(format!(
                "alignment {} is not a power of two from 32 to 1 GiB",
                opts.align
            )));
        }
        let threads = threads(opts.threads);
        let gguf = Gguf::open(input)?;
        let src = MoeSource::from_gguf(&gguf)?;
        let mut layers = Vec::with_capacity(src.layers.len());
        let mut budget = None;
        let new_layer =
            |l: &source::SourceLayer, choice, types: Vec<GgmlType>, error, candidates| {
                let bytes = expert_bytes(l, &types);
                LayerReport {
                    layer: l.layer,
                    choice,
                    source: l.types(),
                    types,
                    expert_bytes: bytes,
                    source_expert_bytes: l.mats.iter().map(|m| m.expert_bytes as u64).sum(),
                    stride: round_up(bytes, opts.align),
                    expert_weights: l.expert_weights(),
                    error,
                    candidates,
                }
            };
        match &opts.types {
            ExpertTypes::Keep => {
                for l in &src.layers {
                    layers.push(new_layer(l, Choice::Keep, l.types(), Some(0.0), vec![]));
                }
            }
            ExpertTypes::Plan(plan) => {
                for e in &plan.entries {
                    if !src.layers.iter().any(|l| e.covers(l.layer)) {
                        let moe: Vec<_> =
                            src.layers.iter().map(|l| (l.layer, Choice::Keep)).collect();
                        let moe = Plan::from_choices(&moe).to_string().replace(":keep", "");
                        return Err(PackError::Plan(format!(
                            "'{e}' covers no MoE layer (the MoE layers are {moe})"
                        )));
                    }
                }
                for l in &src.layers {
                    let choice = plan.choice(l.layer).unwrap_or(Choice::Keep);
                    let types = resolve(l, choice)?;
                    let error = (types == l.types()).then_some(0.0);
                    layers.push(new_layer(l, choice, types, error, vec![]));
                }
            }
            &ExpertTypes::BitsPerWeight(bpw) => {
                if !(bpw.is_finite() && bpw > 0.0) {
                    return Err(PackError::BadOption(format!(
                        "bits per weight must be a positive number, not {bpw}"
                    )));
                }
                budget = Some(bpw);
                layers = plan_budget(&gguf, &src, opts, threads, bpw, new_layer)?;
            }
        }
        let plan = Plan::from_choices(
            &layers
                .iter()
                .map(|l| (l.layer, l.choice))
                .collect::<Vec<_>>(),
        );
        let report = PackReport {
            layers,
            plan: plan.to_string(),
            budget,
            n_experts: src.n_experts,
            alignment: opts.align,
            file_bytes: 0,
        };
        Ok(Packer {
            gguf,
            input: input.to_owned(),
            source: src,
            report,
            threads,
        })
    }

    /// The resolved plan and its cost (`file_bytes` is 0 until written).
    pub fn report(&self) -> &PackReport {
        &self.report
    }

    /// About how many bytes the packed file will have: the input's header, its
    /// other tensors each padded to the alignment, and the packed experts
    /// (padding included); the packed index adds a little metadata.
    pub fn estimated_file_bytes(&self) -> u64 {
        let align = self.report.alignment;
        let others: u64 = self
            .gguf
            .tensors()
            .filter(|t| source::expert_tensor(t.name()).is_none())
            .map(|t| round_up(t.size(), align))
            .fold(0, u64::saturating_add);
        self.gguf
            .data_offset()
            .saturating_add(align)
            .saturating_add(others)
            .saturating_add(self.report.packed_bytes())
    }

    /// Writes the packed file to `output` (never the input), reporting bytes
    /// written and the total through `progress`. Refuses with
    /// [`PackError::NoSpace`] when the output's filesystem has less room than
    /// [`estimated_file_bytes`](Self::estimated_file_bytes).
    pub fn write(
        self,
        output: &Path,
        progress: impl FnMut(u64, u64),
    ) -> Result<PackReport, PackError> {
        check_output(&self.input, output)?;
        // Refuse up front rather than fail after hours of writing, or fill the disk.
        let need = self.estimated_file_bytes();
        if let Ok(st) = rustix::fs::statvfs(crate::interrupt::directory_of(output)) {
            check_space(output, need, st.f_bavail.saturating_mul(st.f_frsize))?;
        }
        let mut report = self.report;
        report.file_bytes = write::write_packed(
            &self.gguf,
            &self.source,
            &report,
            self.threads,
            output,
            progress,
        )?;
        Ok(report)
    }
}

/// [`PackError::NoSpace`] unless `free` bytes hold `need` plus a margin for
/// the metadata (1 MiB, and 1% of `need` for the filesystem's own overhead).
fn check_space(output: &Path, need: u64, free: u64) -> Result<(), PackError> {
    let margin = (1 << 20) + need / 100;
    if free < need.saturating_add(margin) {
        return Err(PackError::NoSpace {
            path: output.to_path_buf(),
            need,
            free,
        });
    }
    Ok(())
}

/// Measures every candidate of every layer and allocates the budget.
fn plan_budget(
    g: &Gguf<MappedFile>,
    src: &MoeSource,
    opts: &PackOptions,
    threads: usize,
    bpw: f64,
    new_layer: impl Fn(
        &source::SourceLayer,
        Choice,
        Vec<GgmlType>,
        Option<f64>,
        Vec<CandidateReport>,
    ) -> LayerReport,
) -> Result<Vec<LayerReport>, PackError> {
    let quantizable: Vec<GgmlType> = GgmlType::ALL
        .into_iter()
        .filter(|&t| can_quantize(t) && !t.is_activation_only())
        .collect();
    // Per layer: the candidates (keep first) and their types.
    let options: Vec<Vec<(Choice, Vec<GgmlType>)>> = src
        .layers
        .iter()
        .map(|l| {
            let mut c = vec![(Choice::Keep, l.types())];
            for &t in &quantizable {
                if let Ok(types) = resolve(l, Choice::Type(t)) {
                    if types != l.types() {
                        c.push((Choice::Type(t), types));
                    }
                }
            }
            c
        })
        .collect();
    let errors: Vec<Vec<f64>> = convert::par_map(src.layers.len(), threads, |i| {
        let types: Vec<Vec<GgmlType>> = options[i].iter().map(|c| c.1.clone()).collect();
        convert::measure_layer(
            g.bytes(),
            &src.layers[i],
            src.n_experts,
            &types,
            opts.sample_experts,
            opts.sample_rows,
        )
    })
    .map_err(|e: QuantError| PackError::Model(format!("measuring errors: {e}")))?;

    let n = src.n_experts as u64;
    let cands: Vec<Vec<plan::Candidate>> = src
        .layers
        .iter()
        .zip(&options)
        .zip(&errors)
        .map(|((l, opts), errs)| {
            let weights = l.expert_weights() * n;
            opts.iter()
                .zip(errs)
                .map(|((_, types), &e)| plan::Candidate {
                    bytes: expert_bytes(l, types) * n,
                    error: e * weights as f64,
                })
                .collect()
        })
        .collect();
    let total_weights: u64 = src.layers.iter().map(|l| l.expert_weights() * n).sum();
    let budget = (bpw * total_weights as f64 / 8.0).floor() as u64;
    let pick = plan::allocate(&cands, budget).ok_or_else(|| {
        let min: u64 = cands
            .iter()
            .map(|c| c.iter().map(|c| c.bytes).min().unwrap_or(0))
            .sum();
        PackError::Budget {
            bpw,
            min_bpw: min as f64 * 8.0 / total_weights as f64,
        }
    })?;
    Ok(src
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let reports = options[i]
                .iter()
                .zip(&errors[i])
                .map(|((choice, types), &error)| CandidateReport {
                    choice: *choice,
                    bpw: expert_bytes(l, types) as f64 * 8.0 / l.expert_weights() as f64,
                    error,
                })
                .collect();
            let (choice, types) = options[i][pick[i]].clone();
            new_layer(l, choice, types, Some(errors[i][pick[i]]), reports)
        })
        .collect())
}

/// Packs `input` into `output` (see the [module](self) documentation), calling
/// `progress(bytes_written, total_bytes)` as the output grows.
pub fn pack(
    input: &Path,
    output: &Path,
    opts: &PackOptions,
    progress: impl FnMut(u64, u64),
) -> Result<PackReport, PackError> {
    check_output(input, output)?;
    Packer::open(input, opts)?.write(output, progress)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn space_check_keeps_a_margin_and_names_the_sizes() {
        let out = Path::new("/data/out.gguf");
        assert!(check_space(out, 100 << 30, 102 << 30).is_ok());
        // 1% + 1 MiB of margin.
        assert!(check_space(out, 100 << 30, 101 << 30).is_err());
        assert!(check_space(out, 0, 1 << 20).is_ok());
        assert!(check_space(out, u64::MAX / 2, u64::MAX / 2).is_err());
        let e = check_space(out, 3 << 30, 1 << 30).unwrap_err().to_string();
        assert_eq!(
            e,
            "/data/out.gguf: the packed file needs about 3.00 GiB but its filesystem has 1.00 GiB free"
        );
    }
}
