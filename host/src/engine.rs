//! Prefill and decode: the KV cache, the scratch buffers and the token loop around
//! [`les_core::model::forward::forward`].

use std::time::{Duration, Instant};

use les_core::model::forward::{
    forward_hybrid_at, forward_sequences, BatchScratch, Experts, ForwardError, KvBuf, KvCache,
    KvLayout, KvRing, KvType, Lookahead, MatVec, Place, RecurrentState, Scratch, Sequence,
    TokenInput,
};

use les_core::model::ops::MAX_F16_HEAD_DIM;

use crate::draft::{Drafter, Speculation};
use crate::model::Model;

/// Timings and counts of one generation.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GenStats {
    /// Prompt tokens evaluated.
    pub prompt_tokens: usize,
    /// Tokens sampled, an end-of-generation token that stopped the run
    /// included; the last one sampled is not evaluated.
    pub generated: usize,
    /// Time spent on the prompt.
    pub prefill: Duration,
    /// Time spent generating (after the prompt).
    pub decode: Duration,
    /// Draft tokens verified (speculative decoding).
    pub drafted: usize,
    /// Draft tokens the model's own samples agreed with.
    pub accepted: usize,
    /// Passes that verified a draft.
    pub verify_passes: usize,
    /// Passes after the prompt's: one a token, or one a verified draft.
    pub passes: usize,
}

impl GenStats {
    /// Prompt tokens per second.
    pub fn prefill_tok_s(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill)
    }

    /// Generated tokens per second.
    pub fn decode_tok_s(&self) -> f64 {
        rate(self.generated, self.decode)
    }

    /// The share of draft tokens accepted (0 without drafts).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

fn rate(n: usize, d: Duration) -> f64 {
    if d.is_zero() {
        0.0
    } else {
        n as f64 / d.as_secs_f64()
    }
}

/// A session's position and recurrent state, to go back to
/// ([`Session::checkpoint`], [`Session::restore`]).
#[derive(Clone, Debug, Default)]
pub struct Checkpoint {
    pos: usize,
    conv: Vec<f32>,
    ssm: Vec<f32>,
}

impl Checkpoint {
    /// The position it was taken at.
    pub fn position(&self) -> usize {
        self.pos
    }
}

/// Per-sequence state: KV cache (attention layers), recurrent state
/// (linear-attention layers) and scratch for one model.
pub struct Session<'m> {
    model: &'m Model,
    max_positions: usize,
    state: SequenceBuffers,
    /// Buffers of [`eval_batch`](Session::eval_batch), for `batch_positions`
    /// positions (the larger of the prefill batch and a verifying pass).
    batch_floats: Vec<f32>,
    batch_ids: Vec<u16>,
    /// Positions the batch buffers hold (1: none).
    batch_positions: usize,
    prefill_batch: usize,
    /// Most draft tokens one [`verify`](Session::verify) checks.
    max_draft: usize,
    /// The recurrent state before the last [`verify`](Session::verify), and
    /// logits to replay into (models with linear attention only).
    saved_conv: Vec<f32>,
    saved_ssm: Vec<f32>,
    replay_logits: Vec<f32>,
    /// With [`set_keep_hidden`](Session::set_keep_hidden): the final hidden
    /// states of the last pass's positions.
    keep_hidden: bool,
    hidden: Vec<f32>,
    pos: usize,
    /// M-RoPE models ([`HybridParams::rope_sections`]): for each evaluated
    /// position, the temporal position of the text after it (llama.cpp's
    /// `n_past` after it: an image chunk advances it by its larger side, not
    /// its count). Empty for other models, whose positions are their index.
    next_t: Vec<u32>,
    /// Where the last pass's positions sat ([`last_places`](Session::last_places)).
    places: Vec<Place>,
    swa: SwaCache,
}

/// One session's part of a pass over several
/// ([`Session::eval_together_placed`]).
#[derive(Clone, Copy, Debug)]
pub struct SessionInputs<'a, 'i> {
    /// Its inputs, at its next positions (one or more).
    pub inputs: &'a [TokenInput<'i>],
    /// Where they sit: one place an input, or none (all text).
    pub places: &'a [InputPlace],
    /// Whether each of its positions gets next-token logits (verifying a
    /// draft), or only its last.
    pub every: bool,
}

impl SessionInputs<'_, '_> {
    /// Rows of next-token logits it gets.
    fn logit_rows(&self) -> usize {
        if self.every {
            self.inputs.len()
        } else {
            1
        }
    }
}

/// Where an input of a prompt sits, for models that rotate by M-RoPE
/// sections (Qwen3-VL, Qwen3.5), as llama.cpp's `mtmd` places them; other
/// models place every input at its index. With `t` the temporal position
/// after the inputs before (the index, until a grid of embeddings):
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputPlace {
    /// A token: `[t, t, t, 0]`, then `t + 1`.
    Text,
    /// An embedding in sequence: `[t, t, t, t]`, then `t + 1` (`mtmd`'s
    /// "normal" image positions, MiniCPM-V's overview and slices).
    Sequence,
    /// Embedding `k` of an image chunk of `nx` x `ny`, row by row: the
    /// chunk's embeddings share the temporal position `t0` of the text
    /// before it, their row and column added in the height and width
    /// sections (`[t0, t0 + k / nx, t0 + k % nx, 0]`), and the text after
    /// the chunk goes on from `t0 + max(nx, ny)` (Qwen3-VL's merged patches;
    /// Gemma 3's embeddings as one row).
    Image {
        /// Index in the chunk.
        k: u32,
        /// Embeddings per row.
        nx: u32,
        /// Rows.
        ny: u32,
    },
}

/// How a session keeps the keys and values of the layers whose queries see
/// only the last positions (gpt-oss's sliding windows, Llama 4's chunks:
/// [`Model::kv_window`]), as llama.cpp's `--swa-full` chooses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SwaCache {
    /// In rings of the window plus the largest pass (prefill batch or
    /// verified draft) less one position, as llama.cpp does by default:
    /// about half the KV memory of gpt-oss at long contexts, up to three
    /// quarters of Llama 4's (its chunked layers keep twice a chunk and a
    /// pass, past which rings start). The session then
    /// goes back ([`Session::rewind`]) at most that pass, and a prompt cache
    /// it saves restores only (nearly) all of its tokens.
    #[default]
    Window,
    /// Every position, as the other layers (`--swa-full`).
    Full,
}

/// Positions a prompt is evaluated in at once by default (see
/// [`Session::set_prefill_batch`]).
pub const DEFAULT_PREFILL_BATCH: usize = 256;

/// Most positions [`Session::set_prefill_batch`] accepts.
pub const MAX_PREFILL_BATCH: usize = 4096;

/// Most bytes of batch buffers [`Session::set_prefill_batch`] allocates (64
/// positions of `a3b` take about 10 MiB).
pub const MAX_BATCH_BYTES: usize = 256 << 20;

/// Element types of a session's KV cache: llama.cpp's `--cache-type-k` and
/// `--cache-type-v` (both `f16` by default, as there).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvTypes {
    /// The keys'.
    pub k: KvType,
    /// The values'.
    pub v: KvType,
}

/// Keys or values of a KV cache, in its element type.
enum KvStore {
    F32(Vec<f32>),
    F16(Vec<u16>),
}

impl KvStore {
    /// `n` zeroed values of type `t`; huge pages, since attention streams the
    /// cache every token.
    fn zeroed(t: KvType, n: usize) -> Option<KvStore> {
        Some(match t {
            KvType::F32 => KvStore::F32(crate::hugepages::zeroed_vec(n)?),
            KvType::F16 => KvStore::F16(crate::hugepages::zeroed_vec(n)?),
        })
    }

    fn bytes(&self) -> usize {
        match self {
            KvStore::F32(x) => 4 * x.len(),
            KvStore::F16(x) => 2 * x.len(),
        }
    }

    fn element_bytes(&self) -> usize {
        match self {
            KvStore::F32(_) => 4,
            KvStore::F16(_) => 2,
        }
    }

    /// Writes values `range` little-endian.
    fn write(
        &self,
        range: std::ops::Range<usize>,
        out: &mut dyn std::io::Write,
    ) -> std::io::Result<()> {
        let mut bytes = Vec::with_capacity(range.len() * self.element_bytes());
        match self {
            KvStore::F32(x) => bytes.extend(x[range].iter().flat_map(|v| v.to_le_bytes())),
            KvStore::F16(x) => bytes.extend(x[range].iter().flat_map(|v| v.to_le_bytes())),
        }
        out.write_all(&bytes)
    }

    /// Reads `n` values little-endian and keeps the first `keep` at `at`.
    fn read(
        &mut self,
        at: usize,
        n: usize,
        keep: usize,
        input: &mut dyn std::io::Read,
    ) -> std::io::Result<()> {
        let mut bytes = vec![0u8; n * self.element_bytes()];
        input.read_exact(&mut bytes)?;
        match self {
            KvStore::F32(x) => {
                for (d, b) in x[at..at + keep].iter_mut().zip(bytes.chunks_exact(4)) {
                    *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            KvStore::F16(x) => {
                for (d, b) in x[at..at + keep].iter_mut().zip(bytes.chunks_exact(2)) {
                    *d = u16::from_le_bytes([b[0], b[1]]);
                }
            }
        }
        Ok(())
    }

    fn buf(&mut self) -> KvBuf<'_> {
        match self {
            KvStore::F32(x) => KvBuf::F32(x),
            KvStore::F16(x) => KvBuf::F16(x),
        }
    }

    fn ty(&self) -> KvType {
        match self {
            KvStore::F32(_) => KvType::F32,
            KvStore::F16(_) => KvType::F16,
        }
    }

    /// Copies `n` values from `from` to each of `to` in `into` (of the same type).
    fn copy_into(&self, from: usize, n: usize, into: &mut KvStore, to: &[usize]) {
        for &at in to {
            match (self, &mut *into) {
                (KvStore::F32(a), KvStore::F32(b)) => {
                    b[at..at + n].copy_from_slice(&a[from..from + n])
                }
                (KvStore::F16(a), KvStore::F16(b)) => {
                    b[at..at + n].copy_from_slice(&a[from..from + n])
                }
                _ => unreachable!("stores of one session share their type"),
            }
        }
    }
}

/// Reads one row (`layout.kv_dim()` values) of position `pos` of cache layer
/// `c` from `input` into `store`, in every copy `layout` keeps of it, or
/// skips it where not `keep`.
fn read_row(
    store: &mut KvStore,
    layout: KvLayout,
    c: usize,
    pos: usize,
    keep: bool,
    input: &mut dyn std::io::Read,
) -> std::io::Result<()> {
    let d = layout.kv_dim();
    if !keep {
        return store.read(0, d, 0, input);
    }
    let (at, copies) = layout.slots(c, pos);
    store.read(at[0], d, d, input)?;
    let (from, rest) = (at[0], &at[1..copies]);
    for &to in rest {
        match store {
            KvStore::F32(x) => x.copy_within(from..from + d, to),
            KvStore::F16(x) => x.copy_within(from..from + d, to),
        }
    }
    Ok(())
}

/// The KV layout of a session of `model` over `max_positions` positions
/// whose passes and rewinds take at most `passes` positions: with
/// [`SwaCache::Window`], rings for the sliding-window layers where they take
/// less memory than the positions (models whose layers all have attention).
fn kv_layout(model: &Model, max_positions: usize, swa: SwaCache, passes: usize) -> KvLayout {
    let (hp, hy) = (&model.hp, &model.hybrid);
    let ring = match (swa, model.kv_window) {
        (SwaCache::Window, Some(w)) if hy.n_attn_layers == hp.n_layers && hy.mla.is_none() => {
            Some(KvRing::for_passes(w, passes)).filter(|r| r.span.saturating_mul(2) < max_positions)
        }
        _ => None,
    };
    KvLayout::new(hp, hy, max_positions, ring)
        .or_else(|| KvLayout::new(hp, hy, max_positions, None))
        .expect("a layout without rings")
}

/// A sequence's KV cache, recurrent state and scratch, as allocated by
/// [`Session::new`].
struct SequenceBuffers {
    kv_k: KvStore,
    kv_v: KvStore,
    /// Where `kv_k` and `kv_v` keep each layer's positions.
    layout: KvLayout,
    conv_state: Vec<f32>,
    ssm_state: Vec<f32>,
    scratch: Vec<f32>,
}

impl SequenceBuffers {
    /// The forward pass's views of the buffers, for `model` and `max_positions`
    /// (what they were allocated for).
    fn views(
        &mut self,
        model: &Model,
        max_positions: usize,
    ) -> (KvCache<'_>, RecurrentState<'_>, Scratch<'_>) {
        let (hp, hy) = (&model.hp, &model.hybrid);
        (
            KvCache::with_layout(hp, self.layout, self.kv_k.buf(), self.kv_v.buf())
                .expect("KV buffers sized and typed by Session::new"),
            RecurrentState::new(hy, &mut self.conv_state, &mut self.ssm_state)
                .expect("recurrent state sized by Session::new"),
            Scratch::new_for(hp, hy, &mut self.scratch, max_positions)
                .expect("scratch sized by Session::new"),
        )
    }
}

/// The buffers of a [`Session`] could not be allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionAllocError {
    /// The positions asked for.
    pub positions: usize,
    /// The bytes they need (KV cache, recurrent state and scratch).
    pub bytes: u128,
}

impl std::fmt::Display for SessionAllocError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.positions > MAX_POSITIONS {
            return write!(
                f,
                "a context of {} positions is more than the {MAX_POSITIONS} a session holds",
                self.positions
            );
        }
        write!(
            f,
            "cannot allocate the KV cache and scratch of {} positions ({:.2} GiB); \
             ask for fewer (--ctx, -n, --batch-size)",
            self.positions,
            self.bytes as f64 / (1u64 << 30) as f64
        )
    }
}

impl std::error::Error for SessionAllocError {}

/// A [`Session`] could not be made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionError {
    /// Its buffers could not be allocated.
    Alloc(SessionAllocError),
    /// An `f16` KV cache was asked for heads wider than it supports (the
    /// model's `head_dim`).
    F16HeadDim(usize),
}

impl From<SessionAllocError> for SessionError {
    fn from(e: SessionAllocError) -> Self {
        SessionError::Alloc(e)
    }
}

impl std::fmt::Display for SessionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SessionError::Alloc(e) => e.fmt(f),
            SessionError::F16HeadDim(d) => write!(
                f,
                "an f16 KV cache supports heads of at most {MAX_F16_HEAD_DIM} values, and this \
                 model's have {d}; use --cache-type-k f32 --cache-type-v f32"
            ),
        }
    }
}

impl std::error::Error for SessionError {}

/// Most positions a [`Session`] holds.
pub const MAX_POSITIONS: usize = 1 << 24;

/// `n` zeroed floats, or `None` where the allocator refuses them.
pub(crate) fn zeroed(n: usize) -> Option<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).ok()?;
    v.resize(n, 0.0);
    Some(v)
}

impl<'m> Session<'m> {
    /// A session of up to `max_positions` tokens with the default (`f16`) KV
    /// cache; an error (not an abort) where its buffers cannot be allocated.
    pub fn new(model: &'m Model, max_positions: usize) -> Result<Session<'m>, SessionError> {
        Self::with_kv_types(model, max_positions, KvTypes::default())
    }

    /// [`new`](Self::new) with the KV cache's element types `kv`, which must
    /// hold the model's heads ([`KvType::holds_head_dim`]: `f16` up to
    /// [`MAX_F16_HEAD_DIM`] values, far above any model llama.cpp runs).
    pub fn with_kv_types(
        model: &'m Model,
        max_positions: usize,
        kv_types: KvTypes,
    ) -> Result<Session<'m>, SessionError> {
        Self::with_kv(model, max_positions, kv_types, SwaCache::default())
    }

    /// [`with_kv_types`](Self::with_kv_types) with the sliding-window
    /// layers' keys and values kept as `swa` says.
    pub fn with_kv(
        model: &'m Model,
        max_positions: usize,
        kv_types: KvTypes,
        swa: SwaCache,
    ) -> Result<Session<'m>, SessionError> {
        let (hp, hy) = (&model.hp, &model.hybrid);
        if ![kv_types.k, kv_types.v]
            .iter()
            .all(|t| t.holds_head_dim(hp.head_dim))
        {
            return Err(SessionError::F16HeadDim(hp.head_dim));
        }
        let (conv, ssm) = RecurrentState::len(hy);
        if max_positions > MAX_POSITIONS {
            // Beyond any machine's memory, and keeps the sizes below from overflowing.
            return Err(SessionAllocError {
                positions: max_positions,
                bytes: u128::MAX,
            }
            .into());
        }
        let layout = kv_layout(model, max_positions, swa, 1);
        let kv = layout.len();
        let scratch = Scratch::len_for(hp, hy, max_positions);
        let err = SessionAllocError {
            positions: max_positions,
            bytes: (kv_types.k.bytes() + kv_types.v.bytes()) as u128 * kv as u128
                + 4 * (conv as u128 + ssm as u128 + scratch as u128),
        };
        Ok(Session {
            model,
            max_positions,
            state: SequenceBuffers {
                kv_k: KvStore::zeroed(kv_types.k, kv).ok_or(err)?,
                kv_v: KvStore::zeroed(kv_types.v, kv).ok_or(err)?,
                layout,
                conv_state: zeroed(conv).ok_or(err)?,
                ssm_state: zeroed(ssm).ok_or(err)?,
                scratch: zeroed(scratch).ok_or(err)?,
            },
            batch_floats: Vec::new(),
            batch_ids: Vec::new(),
            batch_positions: 1,
            prefill_batch: 1,
            max_draft: 0,
            saved_conv: Vec::new(),
            saved_ssm: Vec::new(),
            replay_logits: Vec::new(),
            keep_hidden: false,
            hidden: Vec::new(),
            pos: 0,
            next_t: Vec::new(),
            places: Vec::new(),
            swa,
        })
    }

    /// Whether [`write_state`](Self::write_state) saves only the last
    /// window of the sliding-window layers (the session keeps them in rings).
    pub fn saves_windows(&self) -> bool {
        self.state.layout.ring().is_some()
    }

    /// The positions of cache layer `c` a state of `n` positions holds: all
    /// of them, or the last window of a sliding-window layer in a state that
    /// [`saves_windows`](Self::saves_windows).
    fn saved_positions(&self, c: usize, n: usize, windows: bool) -> std::ops::Range<usize> {
        match self.model.kv_window {
            Some(w) if windows && w.of_layer(c).is_some() => n.saturating_sub(w.window)..n,
            _ => 0..n,
        }
    }

    /// Bytes [`write_state`](Self::write_state) writes for `n` positions, in
    /// a state that keeps only the last window of sliding-window layers where
    /// `windows` (see [`saves_windows`](Self::saves_windows)).
    pub fn state_bytes(&self, n: usize, windows: bool) -> u64 {
        let hy = &self.model.hybrid;
        let kv = (self.state.kv_k.element_bytes() + self.state.kv_v.element_bytes()) as u64;
        let recurrent = 4 * (self.state.conv_state.len() + self.state.ssm_state.len()) as u64;
        let rows: u64 = (0..hy.n_attn_layers)
            .map(|c| self.saved_positions(c, n, windows).len() as u64)
            .sum();
        rows * self.model.hp.kv_dim() as u64 * kv + recurrent
    }

    /// Writes the state of the positions evaluated so far: each attention
    /// layer's keys, then its values, of positions `0..position()` (of a
    /// sliding-window layer kept in a ring, its last window only: see
    /// [`saves_windows`](Self::saves_windows)), in the cache's element type,
    /// then the recurrent state (f32); little-endian.
    /// [`read_state`](Self::read_state) of a session of the same model and KV
    /// types takes it back.
    pub fn write_state(&self, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        let (layout, windows) = (self.state.layout, self.saves_windows());
        let d = layout.kv_dim();
        for c in 0..layout.n_layers() {
            for store in [&self.state.kv_k, &self.state.kv_v] {
                for p in self.saved_positions(c, self.pos, windows) {
                    let (at, _) = layout.slots(c, p);
                    store.write(at[0]..at[0] + d, out)?;
                }
            }
        }
        let recurrent = self.state.conv_state.iter().chain(&self.state.ssm_state);
        let bytes: Vec<u8> = recurrent.flat_map(|v| v.to_le_bytes()).collect();
        out.write_all(&bytes)
    }

    /// Whether a state of `n` positions ([`saves_windows`](Self::saves_windows)
    /// where `windows`) can continue after its first `keep`; why not if not.
    pub fn can_restore(&self, n: usize, keep: usize, windows: bool) -> Result<(), String> {
        if keep > n || keep > self.max_positions {
            return Err(format!(
                "{keep} positions of a state of {n} in a session of {}",
                self.max_positions
            ));
        }
        if keep != n && self.model.hybrid.linear.is_some() {
            return Err("a recurrent state cannot be cut short".into());
        }
        if let Some(w) = self.model.kv_window.filter(|_| windows && keep < n) {
            // The next position's window: the `window - 1` before it.
            let needed = keep.saturating_sub(w.window - 1);
            if needed < n.saturating_sub(w.window) {
                return Err(format!(
                    "it keeps the last {} positions of the sliding-window layers, too few to go \
                     back to {keep} of its {n} (--swa-full keeps them all)",
                    w.window
                ));
            }
        }
        Ok(())
    }

    /// Reads a state of `n` positions written by
    /// [`write_state`](Self::write_state) (of a session that
    /// [`saves_windows`](Self::saves_windows) where `windows`) and continues
    /// after its first `keep`: the session is then as if those positions had
    /// been evaluated. What [`can_restore`](Self::can_restore) refuses is an
    /// error. On an error the session is back at position 0.
    pub fn read_state(
        &mut self,
        input: &mut dyn std::io::Read,
        n: usize,
        keep: usize,
        windows: bool,
    ) -> Result<(), String> {
        self.can_restore(n, keep, windows)?;
        self.set_pos(0);
        let layout = self.state.layout;
        let io = |e: std::io::Error| e.to_string();
        for c in 0..layout.n_layers() {
            let saved = self.saved_positions(c, n, windows);
            for store in [&mut self.state.kv_k, &mut self.state.kv_v] {
                for p in saved.clone() {
                    read_row(store, layout, c, p, p < keep, input).map_err(io)?;
                }
            }
        }
        let n_conv = self.state.conv_state.len();
        let mut bytes = vec![0u8; 4 * (n_conv + self.state.ssm_state.len())];
        input.read_exact(&mut bytes).map_err(io)?;
        let mut values = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        for d in self
            .state
            .conv_state
            .iter_mut()
            .chain(&mut self.state.ssm_state)
        {
            *d = values.next().unwrap_or(0.0);
        }
        // A saved state holds text positions only (prompt caches keep text
        // prompts).
        self.set_pos(0);
        for i in 0..keep {
            self.advance(Place::text(i), InputPlace::Text);
        }
        Ok(())
    }

    /// Bytes of the KV cache (keys and values).
    pub fn kv_bytes(&self) -> usize {
        self.state.kv_k.bytes() + self.state.kv_v.bytes()
    }

    /// Most positions the batch buffers can hold within [`MAX_BATCH_BYTES`] and
    /// the session.
    fn batch_limit(&self) -> usize {
        let (hp, hy) = (&self.model.hp, &self.model.hybrid);
        let per_position = 4 * BatchScratch::floats(hp, hy, 1) + 2 * BatchScratch::ids(hp, hy, 1);
        MAX_PREFILL_BATCH
            .min(self.max_positions.max(1))
            .min((MAX_BATCH_BYTES / per_position.max(1)).max(1))
    }

    /// (Re)allocates the batch buffers for `n` positions (none for 1).
    fn alloc_batch(&mut self, n: usize) -> Result<(), SessionAllocError> {
        if n == self.batch_positions {
            return Ok(());
        }
        if n <= 1 {
            (self.batch_floats, self.batch_ids) = (Vec::new(), Vec::new());
            self.batch_positions = 1;
            return Ok(());
        }
        let (hp, hy) = (&self.model.hp, &self.model.hybrid);
        let (nf, ni) = (
            BatchScratch::floats(hp, hy, n),
            BatchScratch::ids(hp, hy, n),
        );
        let err = SessionAllocError {
            positions: self.max_positions,
            bytes: 4 * nf as u128 + 2 * ni as u128,
        };
        (self.batch_floats, self.batch_ids) = (Vec::new(), Vec::new());
        self.batch_positions = 1;
        let floats = zeroed(nf).ok_or(err)?;
        let mut ids = Vec::new();
        ids.try_reserve_exact(ni).map_err(|_| err)?;
        ids.resize(ni, 0);
        (self.batch_floats, self.batch_ids) = (floats, ids);
        self.batch_positions = n;
        self.grow_rings(n)
    }

    /// Makes the sliding-window layers' rings (if any) hold passes of `n`
    /// positions, keeping the positions they hold. At position 0 the old
    /// rings go first (the memory is never held twice); should the new ones
    /// then not be allocated, the session holds no positions at all.
    fn grow_rings(&mut self, n: usize) -> Result<(), SessionAllocError> {
        let old = self.state.layout;
        if old.ring().is_none_or(|r| n <= r.passes()) {
            return Ok(());
        }
        let new = kv_layout(self.model, self.max_positions, self.swa, n);
        let len = new.len();
        let (tk, tv) = (self.state.kv_k.ty(), self.state.kv_v.ty());
        let err = SessionAllocError {
            positions: self.max_positions,
            bytes: (tk.bytes() + tv.bytes()) as u128 * len as u128,
        };
        if self.pos == 0 {
            let (hp, hy) = (&self.model.hp, &self.model.hybrid);
            let empty = KvLayout::new(hp, hy, 0, None).expect("a layout without rings");
            self.state.kv_k = KvStore::zeroed(tk, 0).ok_or(err)?;
            self.state.kv_v = KvStore::zeroed(tv, 0).ok_or(err)?;
            self.state.layout = empty;
        }
        let mut k = KvStore::zeroed(tk, len).ok_or(err)?;
        let mut v = KvStore::zeroed(tv, len).ok_or(err)?;
        let d = old.kv_dim();
        for c in 0..old.n_layers() {
            for p in old.held(c, self.pos) {
                let ((from, _), (to, copies)) = (old.slots(c, p), new.slots(c, p));
                self.state.kv_k.copy_into(from[0], d, &mut k, &to[..copies]);
                self.state.kv_v.copy_into(from[0], d, &mut v, &to[..copies]);
            }
        }
        (self.state.kv_k, self.state.kv_v, self.state.layout) = (k, v, new);
        Ok(())
    }

    /// The sliding-window layers' rings, if the session keeps them in rings.
    pub fn kv_ring(&self) -> Option<KvRing> {
        self.state.layout.ring()
    }

    /// How many prompt positions [`generate_from`] evaluates at once
    /// ([`eval_batch`](Self::eval_batch); 1, the default, = one at a time, with
    /// lookahead prefetching), and allocates the batch buffers. The size is
    /// clamped to `1..=`[`MAX_PREFILL_BATCH`], to the session's positions and to
    /// what [`MAX_BATCH_BYTES`] of buffers hold (the model's dimensions come from
    /// its file); returns the size set. The logits are the same whatever the size.
    pub fn set_prefill_batch(&mut self, n: usize) -> Result<usize, SessionAllocError> {
        let n = n.clamp(1, self.batch_limit());
        self.alloc_batch(n.max(self.verify_positions()))?;
        self.prefill_batch = n;
        Ok(n)
    }

    /// How many draft tokens one [`verify`](Self::verify) checks at most (0, the
    /// default: no speculative decoding), and allocates what that needs: batch
    /// buffers for the draft and the token before it, and, for models with
    /// linear attention, a copy of the recurrent state to go back to when a
    /// draft is rejected. Clamped like
    /// [`set_prefill_batch`](Self::set_prefill_batch); returns the number set.
    pub fn set_max_draft(&mut self, n: usize) -> Result<usize, SessionAllocError> {
        let n = n.min(self.batch_limit() - 1);
        self.alloc_batch((n + 1).max(self.prefill_batch))?;
        let (conv, ssm) = RecurrentState::len(&self.model.hybrid);
        let err = SessionAllocError {
            positions: self.max_positions,
            bytes: 4 * (conv as u128 + ssm as u128 + self.model.hp.n_vocab as u128),
        };
        (self.saved_conv, self.saved_ssm, self.replay_logits) =
            (Vec::new(), Vec::new(), Vec::new());
        self.max_draft = 0;
        if n > 0 && conv + ssm > 0 {
            self.saved_conv = zeroed(conv).ok_or(err)?;
            self.saved_ssm = zeroed(ssm).ok_or(err)?;
            self.replay_logits = zeroed(self.model.hp.n_vocab).ok_or(err)?;
        }
        self.max_draft = n;
        Ok(n)
    }

    /// See [`set_max_draft`](Self::set_max_draft).
    pub fn max_draft(&self) -> usize {
        self.max_draft
    }

    /// Positions one [`verify`](Self::verify) evaluates at most (1: no drafts).
    fn verify_positions(&self) -> usize {
        self.max_draft + 1
    }

    /// See [`set_prefill_batch`](Self::set_prefill_batch).
    pub fn prefill_batch(&self) -> usize {
        self.prefill_batch
    }

    /// Keeps each pass's final hidden states (before the output norm) for
    /// [`hidden`](Self::hidden), as a multi-token-prediction drafter needs.
    pub fn set_keep_hidden(&mut self, on: bool) {
        self.keep_hidden = on;
        if !on {
            self.hidden = Vec::new();
        }
    }

    /// With [`set_keep_hidden`](Self::set_keep_hidden), the final hidden
    /// states (before the output norm, `n_embd` floats each) of the positions
    /// the last [`eval`](Self::eval), [`eval_batch`](Self::eval_batch) or
    /// [`keep`](Self::keep)'s replay evaluated; else empty.
    pub fn hidden(&self) -> &[f32] {
        &self.hidden
    }

    /// Positions evaluated so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Goes back to position `pos` (at most [`position`](Self::position)), as if
    /// only the first `pos` inputs had been evaluated: the KV cache needs
    /// nothing (later positions are overwritten). A recurrent state cannot go
    /// back, so for models with linear attention only `pos == 0` (a new
    /// sequence) or the current position is accepted; sliding-window layers
    /// in rings ([`SwaCache::Window`]) go back to 0 or by at most the largest
    /// pass the session was set up for (prefill batch, verified draft).
    pub fn rewind(&mut self, pos: usize) -> Result<(), &'static str> {
        if pos > self.pos {
            return Err("rewinding past the session's position");
        }
        if pos != 0 && pos != self.pos && self.model.hybrid.linear.is_some() {
            return Err("a recurrent state cannot go back");
        }
        self.rings_hold(pos)?;
        self.set_pos(pos);
        Ok(())
    }

    /// Where the positions of the last [`eval`](Self::eval),
    /// [`eval_batch`](Self::eval_batch) (or their `_placed` forms) or
    /// [`keep`](Self::keep)'s replay sat, in order: what a drafter that
    /// follows the model's positions ([`Drafter::observe`]) is shown.
    pub fn last_places(&self) -> &[Place] {
        &self.places
    }

    /// Shows `drafter` the first positions the last pass (or
    /// [`keep`](Self::keep)'s replay) evaluated, one for each of `inputs`:
    /// where each sat, its input and its final hidden state (kept with
    /// [`set_keep_hidden`](Self::set_keep_hidden)) ([`Drafter::observe`],
    /// which refuses rows that do not fit).
    pub fn show(&self, drafter: &mut (dyn Drafter + '_), inputs: &[TokenInput<'_>]) {
        let n = inputs.len();
        let places = self.places.get(..n).unwrap_or(&self.places);
        let rows = n * self.model.hp.n_embd;
        let hidden = self.hidden.get(..rows).unwrap_or(&self.hidden);
        drafter.observe(places, inputs, hidden);
    }

    /// A copy of the recurrent state at the current position (empty for
    /// models without recurrent layers), to go back to with
    /// [`restore`](Self::restore).
    pub fn checkpoint(&self) -> Checkpoint {
        let mut at = Checkpoint::default();
        self.checkpoint_into(&mut at);
        at
    }

    /// [`checkpoint`](Self::checkpoint) into `at`, reusing its buffers (a
    /// drafter takes one every pass; a DeltaNet state can be tens of MB).
    pub fn checkpoint_into(&self, at: &mut Checkpoint) {
        at.pos = self.pos;
        at.conv.clone_from(&self.state.conv_state);
        at.ssm.clone_from(&self.state.ssm_state);
    }

    /// Goes back to `at` (taken by [`checkpoint`](Self::checkpoint) of this
    /// session, at most the current position, with no [`rewind`](Self::rewind)
    /// below it in between): the session as it was then. The KV cache needs
    /// nothing; the recurrent state is copied back. Refused where the
    /// sliding-window layers' rings no longer hold the positions after it.
    pub fn restore(&mut self, at: &Checkpoint) -> Result<(), &'static str> {
        if at.pos > self.pos
            || at.conv.len() != self.state.conv_state.len()
            || at.ssm.len() != self.state.ssm_state.len()
        {
            return Err("a checkpoint of another state");
        }
        self.rings_hold(at.pos)?;
        self.state.conv_state.copy_from_slice(&at.conv);
        self.state.ssm_state.copy_from_slice(&at.ssm);
        self.set_pos(at.pos);
        Ok(())
    }

    /// Whether the sliding-window layers' KV rings (if any) still hold what
    /// going back to position `pos` needs: back to 0, or by at most the
    /// largest pass the session was set up for.
    fn rings_hold(&self, pos: usize) -> Result<(), &'static str> {
        match self.state.layout.ring() {
            Some(r) if pos != 0 && self.pos - pos > r.passes() => Err(
                "going back further than the sliding-window layers' KV rings hold \
                 (--swa-full keeps every position)",
            ),
            _ => Ok(()),
        }
    }

    /// Moves to position `pos` (at most the current one), forgetting the
    /// places of the positions after it.
    fn set_pos(&mut self, pos: usize) {
        self.pos = pos;
        self.next_t.truncate(pos);
    }

    /// Whether positions rotate by M-RoPE sections (and so are placed by
    /// [`InputPlace`]).
    fn mrope(&self) -> bool {
        self.model.hybrid.rope_sections.is_some()
    }

    /// Where the next input, placed as `place`, sits: its cache index and
    /// (M-RoPE models) rotation positions; an error for an image place that
    /// does not fit its chunk.
    pub fn next_place(&self, place: InputPlace) -> Result<Place, &'static str> {
        let index = self.pos;
        if !self.mrope() {
            return Ok(Place::text(index));
        }
        let text_t = match index.checked_sub(1) {
            Some(p) => self.next_t.get(p).copied().unwrap_or(index as u32),
            None => 0,
        };
        Ok(match place {
            InputPlace::Text => Place::text_at(index, text_t),
            InputPlace::Sequence => Place {
                index,
                rope: [text_t; 4],
            },
            InputPlace::Image { k, nx, ny } => {
                if nx == 0 || ny == 0 || k >= nx.saturating_mul(ny) {
                    return Err("an image embedding outside its chunk's grid");
                }
                // The chunk's temporal position: the text's before it, which
                // its other embeddings recorded their end from.
                let t0 = if k == 0 {
                    text_t
                } else {
                    text_t.saturating_sub(nx.max(ny))
                };
                Place {
                    index,
                    rope: [t0, t0 + k / nx, t0 + k % nx, 0],
                }
            }
        })
    }

    /// Records that the next position was evaluated at `at`, placed as
    /// `place`.
    fn advance(&mut self, at: Place, place: InputPlace) {
        self.pos += 1;
        if self.mrope() {
            let next = match place {
                InputPlace::Text | InputPlace::Sequence => at.rope[0] + 1,
                InputPlace::Image { nx, ny, .. } => at.rope[0] + nx.max(ny),
            };
            self.next_t.push(next);
        }
    }

    /// Most positions the session holds.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Evaluates `input` (a token or an embedding) at the next position and writes
    /// the next-token logits.
    pub fn eval<M: MatVec, X: Experts>(
        &mut self,
        mv: &mut M,
        experts: &mut X,
        lookahead: Option<&Lookahead>,
        input: TokenInput<'_>,
        logits: &mut [f32],
    ) -> Result<(), ForwardError<X::Error>> {
        self.eval_placed(mv, experts, lookahead, input, InputPlace::Text, logits)
    }

    /// [`eval`](Self::eval) of an input placed as `place` (an image
    /// embedding of an M-RoPE model).
    pub fn eval_placed<M: MatVec, X: Experts>(
        &mut self,
        mv: &mut M,
        experts: &mut X,
        lookahead: Option<&Lookahead>,
        input: TokenInput<'_>,
        place: InputPlace,
        logits: &mut [f32],
    ) -> Result<(), ForwardError<X::Error>> {
        let at = self.next_place(place).map_err(ForwardError::Shape)?;
        let (hp, hy) = (&self.model.hp, &self.model.hybrid);
        let (mut kv, mut rs, mut s) = self.state.views(self.model, self.max_positions);
        forward_hybrid_at(
            hp, hy, self.model, mv, experts, lookahead, input, at, &mut kv, &mut rs, &mut s, logits,
        )?;
        if self.keep_hidden {
            self.hidden.clear();
            self.hidden.extend_from_slice(s.hidden());
        }
        self.advance(at, place);
        self.places.clear();
        self.places.push(at);
        Ok(())
    }
}

impl Session<'_> {
    /// Evaluates `inputs` at the next positions in one pass, layer by layer
    /// ([`forward_batch`](les_core::model::forward::forward_batch): each
    /// layer's experts are asked for once for all the positions), and
    /// writes the last one's next-token logits (`logits` holds
    /// `n_vocab` floats) or every one's (`inputs.len() * n_vocab`): the same
    /// logits, caches and state as [`eval`](Self::eval) of each input in turn.
    pub fn eval_batch<M: MatVec, X: Experts>(
        &mut self,
        mv: &mut M,
        experts: &mut X,
        inputs: &[TokenInput<'_>],
        logits: &mut [f32],
    ) -> Result<(), ForwardError<X::Error>> {
        self.eval_batch_placed(mv, experts, inputs, &[], logits)
    }

    /// [`eval_batch`](Self::eval_batch) of inputs placed as `places` (one
    /// each, or none: all text).
    pub fn eval_batch_placed<M: MatVec, X: Experts>(
        &mut self,
        mv: &mut M,
        experts: &mut X,
        inputs: &[TokenInput<'_>],
        places: &[InputPlace],
        logits: &mut [f32],
    ) -> Result<(), ForwardError<X::Error>> {
        let every = inputs.len() > 1 && logits.len() == inputs.len() * self.model.hp.n_vocab;
        let part = SessionInputs {
            inputs,
            places,
            every,
        };
        Self::eval_together_placed(&mut [self], mv, experts, &[part], logits)
    }

    /// Evaluates each session's inputs (`inputs[i]` for `sessions[i]`, one or
    /// more, at text places) at its next positions in one pass
    /// ([`forward_sequences`]: every layer's experts asked for once for all
    /// the sessions, so that sequences decoded side by side read an expert
    /// they share once), and writes each session's last position's next-token
    /// logits, in order (`logits` holds `sessions.len() * n_vocab` floats), or
    /// every position's (all the inputs' count times `n_vocab`). Each session
    /// is left with the logits, cache and state [`eval`](Self::eval) of each
    /// of its inputs in turn gives, bit for bit. The sessions are of one
    /// model; the pass uses the first one's batch buffers, so its
    /// [`prefill_batch`](Self::prefill_batch) must hold all the inputs (one
    /// input needs none). On an error no session has moved.
    pub fn eval_together<M: MatVec, X: Experts>(
        sessions: &mut [&mut Session<'_>],
        mv: &mut M,
        experts: &mut X,
        inputs: &[&[TokenInput<'_>]],
        logits: &mut [f32],
    ) -> Result<(), ForwardError<X::Error>> {
        let total: usize = inputs.iter().map(|i| i.len()).sum();
        let n_vocab = sessions.first().map_or(0, |s| s.model.hp.n_vocab);
        let every = total > inputs.len() && logits.len() == total * n_vocab;
        let parts: Vec<SessionInputs<'_, '_>> = inputs
            .iter()
            .map(|&inputs| SessionInputs {
                inputs,
                places: &[],
                every,
            })
            .collect();
        Self::eval_together_placed(sessions, mv, experts, &parts, logits)
    }

    /// [`eval_together`](Self::eval_together) with each session's inputs
    /// placed as its [`SessionInputs`] says, and its last position's logits
    /// or every one's ([`SessionInputs::every`]), back to back in order:
    /// `logits` holds that many rows of `n_vocab` floats.
    pub fn eval_together_placed<M: MatVec, X: Experts>(
        sessions: &mut [&mut Session<'_>],
        mv: &mut M,
        experts: &mut X,
        parts: &[SessionInputs<'_, '_>],
        logits: &mut [f32],
    ) -> Result<(), ForwardError<X::Error>> {
        let Some(model) = sessions.first().map(|s| s.model) else {
            return Err(ForwardError::Shape("no sessions"));
        };
        if parts.len() != sessions.len() || parts.iter().any(|p| p.inputs.is_empty()) {
            return Err(ForwardError::Shape("one or more inputs for each session"));
        }
        if sessions.iter().any(|s| !std::ptr::eq(s.model, model)) {
            return Err(ForwardError::Shape("sessions of different models"));
        }
        let total: usize = parts.iter().map(|p| p.inputs.len()).sum();
        if total > sessions[0].batch_positions {
            return Err(ForwardError::Shape("more positions than the batch buffers"));
        }
        let rows: usize = parts.iter().map(SessionInputs::logit_rows).sum();
        if logits.len() != rows * model.hp.n_vocab {
            return Err(ForwardError::Shape("logits length"));
        }
        if parts
            .iter()
            .any(|p| !p.places.is_empty() && p.places.len() != p.inputs.len())
        {
            return Err(ForwardError::Shape("one place per input"));
        }
        let place =
            |i: usize, j: usize| parts[i].places.get(j).copied().unwrap_or(InputPlace::Text);
        if let ([one], [part]) = (&mut *sessions, parts) {
            if let ([input], true) = (part.inputs, one.batch_floats.is_empty()) {
                // One position and no batch buffers: the one-position pass.
                return one.eval_placed(mv, experts, None, *input, place(0, 0), logits);
            }
        }
        // Each input's place, recorded as it is found (each depends on the
        // ones before); all undone if a place or the pass fails.
        let mut at: Vec<Vec<Place>> = Vec::with_capacity(parts.len());
        let mut starts = Vec::with_capacity(parts.len());
        for (i, (s, part)) in sessions.iter_mut().zip(parts).enumerate() {
            starts.push(s.pos);
            let mut places = Vec::with_capacity(part.inputs.len());
            for j in 0..part.inputs.len() {
                match s.next_place(place(i, j)) {
                    Ok(p) => {
                        s.advance(p, place(i, j));
                        places.push(p);
                    }
                    Err(e) => {
                        at.push(places);
                        for ((s, start), _) in sessions.iter_mut().zip(&starts).zip(&at) {
                            s.set_pos(*start);
                        }
                        return Err(ForwardError::Shape(e));
                    }
                }
            }
            at.push(places);
        }
        let ropes: Vec<Option<Vec<[u32; 4]>>> = sessions
            .iter()
            .zip(&at)
            .map(|(s, a)| s.mrope().then(|| a.iter().map(|p| p.rope).collect()))
            .collect();
        let keep: Vec<bool> = sessions.iter().map(|s| s.keep_hidden).collect();
        let pass = {
            let (first, rest) = sessions.split_first_mut().expect("one session or more");
            let (hp, hy) = (&model.hp, &model.hybrid);
            let (mut kv0, mut rs0, mut s) = first.state.views(model, first.max_positions);
            let mut b =
                BatchScratch::new(hp, hy, total, &mut first.batch_floats, &mut first.batch_ids)
                    .expect("batch buffers sized by set_prefill_batch");
            let mut views: Vec<(KvCache<'_>, RecurrentState<'_>)> = rest
                .iter_mut()
                .map(|s| {
                    let (kv, rs, _) = s.state.views(model, s.max_positions);
                    (kv, rs)
                })
                .collect();
            let mut seqs: Vec<Sequence<'_, '_, '_>> = Vec::with_capacity(parts.len());
            let kvs = std::iter::once((&mut kv0, &mut rs0))
                .chain(views.iter_mut().map(|(kv, rs)| (kv, rs)));
            for (((kv, rs), start), (part, rope)) in kvs.zip(&starts).zip(parts.iter().zip(&ropes))
            {
                seqs.push(Sequence {
                    len: part.inputs.len(),
                    pos: *start,
                    rope: rope.as_deref(),
                    kv,
                    rs,
                    every: part.every,
                });
            }
            let flat: Vec<TokenInput<'_>> = parts
                .iter()
                .flat_map(|p| p.inputs.iter().copied())
                .collect();
            forward_sequences(
                hp, hy, model, mv, experts, &flat, &mut seqs, &mut s, &mut b, logits,
            )
            .map(|()| {
                // The rows of the final hidden states of the sessions that
                // keep them.
                let mut from = 0;
                parts
                    .iter()
                    .zip(&keep)
                    .map(|(part, &kept)| {
                        let to = from + part.inputs.len();
                        let row = kept.then(|| b.hidden(to)[from * hp.n_embd..].to_vec());
                        from = to;
                        row
                    })
                    .collect::<Vec<Option<Vec<f32>>>>()
            })
        };
        match pass {
            Ok(rows) => {
                for ((s, places), row) in sessions.iter_mut().zip(at).zip(rows) {
                    if let Some(row) = row {
                        s.hidden = row;
                    }
                    s.places = places;
                }
                Ok(())
            }
            Err(e) => {
                for (s, start) in sessions.iter_mut().zip(starts) {
                    s.set_pos(start);
                }
                Err(e)
            }
        }
    }

    /// Evaluates `tokens` (a sampled token and the draft after it, at most
    /// [`max_draft`](Self::max_draft) + 1) at the next positions in one pass and
    /// writes every position's logits into `logits` (`tokens.len() * n_vocab`).
    /// Follow it with [`keep`](Self::keep) once the samples have said how many
    /// of the positions stand.
    pub fn verify<M: MatVec, X: Experts>(
        &mut self,
        mv: &mut M,
        experts: &mut X,
        tokens: &[TokenInput<'_>],
        logits: &mut [f32],
    ) -> Result<(), ForwardError<X::Error>> {
        self.save_for_keep(tokens.len())
            .map_err(ForwardError::Shape)?;
        match tokens {
            [one] => self.eval(mv, experts, None, *one, logits),
            _ => self.eval_batch(mv, experts, tokens, logits),
        }
    }

    /// Saves what [`keep`](Self::keep) needs to drop some of the next
    /// `positions` (a token and its draft, at most
    /// [`max_draft`](Self::max_draft) + 1) once evaluated: a copy of the
    /// recurrent state (a KV cache needs none). [`verify`](Self::verify) calls
    /// it; call it before a draft of this session is verified in a pass of
    /// several ([`eval_together_placed`](Self::eval_together_placed)).
    pub fn save_for_keep(&mut self, positions: usize) -> Result<(), &'static str> {
        if positions > self.verify_positions() {
            return Err("a draft longer than set_max_draft");
        }
        if !self.saved_conv.is_empty() || !self.saved_ssm.is_empty() {
            self.saved_conv.copy_from_slice(&self.state.conv_state);
            self.saved_ssm.copy_from_slice(&self.state.ssm_state);
        }
        Ok(())
    }

    /// Keeps the first `kept` of the positions the last [`verify`](Self::verify)
    /// of `tokens` (or pass after [`save_for_keep`](Self::save_for_keep))
    /// evaluated and drops the rest, leaving the session as if only
    /// `tokens[..kept]` had been evaluated. The KV cache needs nothing (later
    /// positions are overwritten); a recurrent state is restored from before the
    /// pass and `tokens[..kept]` evaluated again.
    pub fn keep<M: MatVec, X: Experts>(
        &mut self,
        mv: &mut M,
        experts: &mut X,
        tokens: &[TokenInput<'_>],
        kept: usize,
    ) -> Result<(), ForwardError<X::Error>> {
        if kept > tokens.len() || tokens.len() > self.pos {
            return Err(ForwardError::Shape("keeping more positions than verified"));
        }
        if kept == tokens.len() {
            return Ok(());
        }
        let start = self.pos - tokens.len();
        self.set_pos(start + kept);
        if self.saved_conv.is_empty() && self.saved_ssm.is_empty() {
            return Ok(());
        }
        self.state.conv_state.copy_from_slice(&self.saved_conv);
        self.state.ssm_state.copy_from_slice(&self.saved_ssm);
        self.set_pos(start);
        let mut logits = std::mem::take(&mut self.replay_logits);
        let r = match &tokens[..kept] {
            [] => Ok(()),
            [one] => self.eval(mv, experts, None, *one, &mut logits),
            some => self.eval_batch(mv, experts, some, &mut logits),
        };
        self.replay_logits = logits;
        r
    }
}

/// Evaluates `prompt` at the next positions, [`Session::prefill_batch`]
/// positions at a time (a batch of one with [`Session::eval`] and `lookahead`,
/// larger ones with [`Session::eval_batch`]), and writes the last one's
/// next-token logits.
pub fn prefill<M: MatVec, X: Experts>(
    session: &mut Session<'_>,
    mv: &mut M,
    experts: &mut X,
    lookahead: Option<&Lookahead>,
    prompt: &[TokenInput<'_>],
    logits: &mut [f32],
) -> Result<(), ForwardError<X::Error>> {
    prefill_observed(session, mv, experts, lookahead, prompt, &[], logits, None)
}

/// [`prefill`] of inputs placed as `places` (one each, or none: all text;
/// see [`InputPlace`]), showing each pass's positions to `drafter` where it
/// wants the model's hidden states ([`Drafter::observe`]).
#[allow(clippy::too_many_arguments)]
pub fn prefill_observed<M: MatVec, X: Experts>(
    session: &mut Session<'_>,
    mv: &mut M,
    experts: &mut X,
    lookahead: Option<&Lookahead>,
    prompt: &[TokenInput<'_>],
    places: &[InputPlace],
    logits: &mut [f32],
    mut drafter: Option<&mut (dyn Drafter + '_)>,
) -> Result<(), ForwardError<X::Error>> {
    if !places.is_empty() && places.len() != prompt.len() {
        return Err(ForwardError::Shape("one place per prompt input"));
    }
    let watch = drafter.as_ref().is_some_and(|d| d.wants_hidden());
    if watch {
        session.set_keep_hidden(true);
    }
    let batch = session.prefill_batch.max(1);
    for (c, chunk) in prompt.chunks(batch).enumerate() {
        let placed = places
            .get(c * batch..c * batch + chunk.len())
            .unwrap_or(&[]);
        match chunk {
            [input] => {
                let place = placed.first().copied().unwrap_or(InputPlace::Text);
                session.eval_placed(mv, experts, lookahead, *input, place, logits)?
            }
            _ => session.eval_batch_placed(mv, experts, chunk, placed, logits)?,
        }
        if let Some(d) = drafter.as_deref_mut().filter(|_| watch) {
            session.show(d, chunk);
        }
    }
    Ok(())
}

/// What to do after each generated token.
pub enum Control {
    /// Keep generating.
    Continue,
    /// Stop (end of generation token, or the caller is done).
    Stop,
}

/// Evaluates `prompt`, then generates up to `n` tokens with `sample`, calling
/// `on_token(token, logits)` for each. Stops early when `on_token` says so.
#[allow(clippy::too_many_arguments)]
pub fn generate<M: MatVec, X: Experts>(
    session: &mut Session<'_>,
    mv: &mut M,
    experts: &mut X,
    lookahead: Option<&Lookahead>,
    prompt: &[u32],
    n: usize,
    sample: impl FnMut(&[f32]) -> u32,
    on_token: impl FnMut(u32, &[f32]) -> Control,
) -> Result<GenStats, ForwardError<X::Error>> {
    let inputs: Vec<TokenInput<'_>> = prompt.iter().map(|&t| TokenInput::Token(t)).collect();
    generate_from(
        session,
        mv,
        experts,
        lookahead,
        &inputs,
        &[],
        None,
        n,
        sample,
        on_token,
    )
}

/// [`generate`] from a prompt of tokens and given embeddings (image embeddings
/// spliced into the text, placed as `places` says: one each, or none for all
/// text; see [`InputPlace`]), optionally with speculative decoding.
///
/// With `spec`, after each sampled token the drafter guesses up to
/// [`Speculation::max_draft`] tokens after it (at most what `n` and the
/// session's positions leave room for), and the token and its draft are
/// evaluated in one pass ([`Session::verify`]) that gives every position's
/// logits. Tokens are then sampled from those logits in turn, each handed to
/// `on_token`, for as long as each sample equals the draft's token at that
/// place; the first sample that differs is kept (it is the model's own) and
/// the positions after it are dropped ([`Session::keep`]).
///
/// So every token is sampled by `sample`, in order, from the logits plain
/// decoding computes for it (bit-identical: [`Session::eval_batch`]): the
/// tokens, the logits `on_token` sees and the session left behind are those
/// of decoding without `spec`, for any sampler, drafter and expert supplier.
/// The session's [`Session::set_max_draft`] bounds the draft; with
/// [`Speculation::adaptive`], each draft is cut to the length that pays by the
/// acceptance and pass times measured so far.
#[allow(clippy::too_many_arguments)]
pub fn generate_from<M: MatVec, X: Experts>(
    session: &mut Session<'_>,
    mv: &mut M,
    experts: &mut X,
    lookahead: Option<&Lookahead>,
    prompt: &[TokenInput<'_>],
    places: &[InputPlace],
    mut spec: Option<Speculation<'_>>,
    n: usize,
    mut sample: impl FnMut(&[f32]) -> u32,
    mut on_token: impl FnMut(u32, &[f32]) -> Control,
) -> Result<GenStats, ForwardError<X::Error>> {
    let n_vocab = session.model.hp.n_vocab;
    let mut logits = vec![0f32; n_vocab];
    let mut stats = GenStats {
        prompt_tokens: prompt.len(),
        ..GenStats::default()
    };
    let start = Instant::now();
    // A drafter that reads the model's hidden states sees every kept position.
    let watch = spec.as_ref().is_some_and(|s| s.drafter.wants_hidden());
    prefill_observed(
        session,
        mv,
        experts,
        lookahead,
        prompt,
        places,
        &mut logits,
        spec.as_mut().map(|s| &mut *s.drafter),
    )?;
    stats.prefill = start.elapsed();
    let start = Instant::now();
    let max_draft = spec
        .as_ref()
        .map_or(0, |s| s.max_draft.min(session.max_draft));
    let mut drafting = spec.as_ref().map(|sp| {
        let prompt = prompt.iter().map(|i| match i {
            TokenInput::Token(t) => *t,
            TokenInput::Embedding(_) => n_vocab as u32,
        });
        let history = sp.context.iter().copied().chain(prompt).collect();
        Drafting::new(history, max_draft, sp.adaptive, n_vocab)
    });
    let mut verified = vec![
        0f32;
        if max_draft > 0 {
            (max_draft + 1) * n_vocab
        } else {
            0
        }
    ];
    let mut batch: Vec<TokenInput<'_>> = Vec::with_capacity(max_draft + 1);
    // `token` is sampled (and handed out) but not evaluated yet.
    let mut token = None;
    if n > 0 {
        let t = sample(&logits);
        stats.generated += 1;
        if let Control::Continue = on_token(t, &logits) {
            token = Some(t);
        }
    }
    while let Some(t) = token.take() {
        if stats.generated >= n {
            break;
        }
        // Room for the draft: the tokens still wanted after the one its pass
        // samples last, and the session's positions after `t`'s.
        let room = (n - stats.generated - 1)
            .min(session.max_positions.saturating_sub(session.pos + 1))
            .min(max_draft);
        batch.clear();
        batch.push(TokenInput::Token(t));
        if let (Some(d), Some(sp)) = (drafting.as_mut(), spec.as_mut()) {
            let draft = d.draft(&mut *sp.drafter, t, room);
            batch.extend(draft.iter().map(|&g| TokenInput::Token(g)));
        }
        let t0 = Instant::now();
        let rows = if let [one] = batch[..] {
            session.eval(mv, experts, lookahead, one, &mut logits)?;
            &logits[..]
        } else {
            let all = &mut verified[..batch.len() * n_vocab];
            session.verify(mv, experts, &batch, all)?;
            stats.verify_passes += 1;
            stats.drafted += batch.len() - 1;
            &verified[..batch.len() * n_vocab]
        };
        let took = t0.elapsed();
        stats.passes += 1;
        let mut take = |lg: &[f32]| {
            let next = sample(lg);
            stats.generated += 1;
            let go_on = matches!(on_token(next, lg), Control::Continue);
            (next, go_on && stats.generated < n)
        };
        let settled = match drafting.as_mut() {
            Some(d) => d.settle(t, rows, took, &mut take),
            None => Settled::plain(take(rows)),
        };
        stats.accepted += settled.accepted;
        token = settled.next;
        session.keep(mv, experts, &batch, settled.kept)?;
        if let Some(sp) = spec.as_mut().filter(|_| watch) {
            // The pass's rows, or the replay's of the kept ones.
            session.show(&mut *sp.drafter, &batch[..settled.kept]);
        }
    }
    stats.decode = start.elapsed();
    Ok(stats)
}

/// One sequence's speculative decoding as it goes ([`generate_from`]'s, or a
/// completion's of `les serve` side by side with others): the sequence so
/// far (what its drafter sees), the draft of the next pass, and how long a
/// draft pays ([`DraftLength`]).
pub(crate) struct Drafting {
    /// The sequence so far; `n_vocab` stands for an image embedding.
    history: Vec<u32>,
    max_draft: usize,
    adaptive: bool,
    n_vocab: usize,
    control: DraftLength,
    /// The draft after the token the next pass evaluates.
    draft: Vec<u32>,
    /// The first token guessed, judged against the sample where it is not
    /// verified (a probe).
    guess: Option<u32>,
}

/// What a pass over a token and its draft settled ([`Drafting::settle`]).
pub(crate) struct Settled {
    /// How many of the pass's positions stand.
    pub kept: usize,
    /// The token sampled last, to evaluate next (`None`: the sequence ends).
    pub next: Option<u32>,
    /// Draft tokens the samples agreed with.
    pub accepted: usize,
}

impl Settled {
    /// A pass of no draft, whose one sample is `(token, go_on)`.
    pub(crate) fn plain((next, go_on): (u32, bool)) -> Self {
        Settled {
            kept: 1,
            next: go_on.then_some(next),
            accepted: 0,
        }
    }
}

impl Drafting {
    /// Drafts of at most `max_draft` tokens after `history`, cut to what
    /// pays where `adaptive`.
    pub(crate) fn new(history: Vec<u32>, max_draft: usize, adaptive: bool, n_vocab: usize) -> Self {
        Drafting {
            history,
            max_draft,
            adaptive,
            n_vocab,
            control: DraftLength::default(),
            draft: Vec::with_capacity(max_draft),
            guess: None,
        }
    }

    /// The draft to verify after `t` in the next pass (at most `room`
    /// tokens; empty: a pass of `t` alone): asked of `drafter` for as many
    /// tokens as pay (or all there is room for), or for one now and then
    /// while none pays, to keep measuring how often guesses agree.
    pub(crate) fn draft(&mut self, drafter: &mut dyn Drafter, t: u32, room: usize) -> &[u32] {
        let room = room.min(self.max_draft);
        let c = &mut self.control;
        let want = if self.adaptive { c.length(room) } else { room };
        let ask = if want == 0 && room > 0 && c.probe() {
            1
        } else {
            want
        };
        self.draft.clear();
        if ask > 0 {
            self.history.push(t);
            let t0 = Instant::now();
            drafter.draft(&self.history, ask, &mut self.draft);
            self.control.drafting(self.draft.len(), t0.elapsed());
            self.history.pop();
            let n_vocab = self.n_vocab;
            let real = self
                .draft
                .iter()
                .take_while(|&&d| (d as usize) < n_vocab)
                .count();
            self.draft.truncate(real.min(ask));
        }
        self.guess = self.draft.first().copied();
        self.draft.truncate(want);
        &self.draft
    }

    /// Takes what a pass costs from passes shared with other sequences
    /// ([`PassCost`]): `single` seconds for the pass this sequence takes
    /// part in with one position, `extra` for each position more. Drafts are
    /// then as long as pays by these (a sequence's own single and verifying
    /// passes' times mix in the other sequences' positions).
    pub(crate) fn pass_costs(&mut self, (single, extra): (f64, f64)) {
        self.control.single = Some(single);
        self.control.extra = Some(extra);
    }

    /// The draft [`draft`](Self::draft) made last.
    pub(crate) fn drafted(&self) -> &[u32] {
        &self.draft
    }

    /// Settles the pass over `t` and [`draft`](Self::draft)'s tokens, which
    /// took `took` and wrote `logits` (a row a position): `take` samples a
    /// row and hands out its token, saying whether the sequence goes on;
    /// rows are taken in turn while the draft agrees with the samples.
    pub(crate) fn settle(
        &mut self,
        t: u32,
        logits: &[f32],
        took: Duration,
        mut take: impl FnMut(&[f32]) -> (u32, bool),
    ) -> Settled {
        let drafted = self.draft.len();
        if drafted == 0 {
            self.control.single_pass(took);
        } else {
            self.control.verify_pass(drafted, took);
        }
        self.history.push(t);
        let mut settled = Settled {
            kept: drafted + 1,
            next: None,
            accepted: 0,
        };
        // Row j follows `t` and the draft's first j tokens, so it stands
        // while every draft token before it agreed.
        for (j, lg) in logits
            .chunks_exact(self.n_vocab)
            .take(drafted + 1)
            .enumerate()
        {
            let (next, go_on) = take(lg);
            let agreed = self.draft.get(j) == Some(&next);
            if j < drafted {
                self.control.judged(agreed);
            } else if let (0, Some(g)) = (j, self.guess) {
                self.control.judged(g == next);
            }
            if agreed {
                settled.accepted += 1;
                self.history.push(next);
            }
            if !agreed || !go_on {
                settled.kept = j + 1;
                settled.next = (go_on && !agreed).then_some(next);
                break;
            }
        }
        settled
    }
}

/// What a pass over several sequences' positions costs, `a + b * positions`
/// seconds, fitted to the passes so far (least squares, recent passes
/// weighing more), so that sequences side by side judge a draft by what one
/// more position adds to the pass ([`Drafting::pass_costs`]).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PassCost {
    /// Weighted sums: of the weights, positions, positions squared, seconds,
    /// and positions times seconds.
    w: f64,
    p: f64,
    pp: f64,
    t: f64,
    pt: f64,
}

/// How much each older pass's weight in [`PassCost`] keeps a pass.
const PASS_COST_KEEP: f64 = 0.95;

impl PassCost {
    /// A pass of `positions` took `took`.
    pub(crate) fn record(&mut self, positions: usize, took: Duration) {
        let (p, t) = (positions as f64, took.as_secs_f64());
        let k = PASS_COST_KEEP;
        self.w = k * self.w + 1.0;
        self.p = k * self.p + p;
        self.pp = k * self.pp + p * p;
        self.t = k * self.t + t;
        self.pt = k * self.pt + p * t;
    }

    /// `(single, extra)` for a sequence among `sequences` taking part in a
    /// pass with a position each: the pass's seconds, and what each position
    /// more adds; `None` until passes of different sizes fit a line that
    /// rises.
    pub(crate) fn costs(&self, sequences: usize) -> Option<(f64, f64)> {
        let spread = self.w * self.pp - self.p * self.p;
        if self.w < 2.0 || spread <= 1e-9 * self.w * self.w {
            return None;
        }
        let b = (self.w * self.pt - self.p * self.t) / spread;
        let a = (self.t - b * self.p) / self.w;
        let single = a + b * sequences as f64;
        (b > 0.0 && single > 0.0).then_some((single, b))
    }
}

/// How many of a draft's tokens to verify: the length that gives the most
/// tokens per second by the acceptance and pass costs measured so far.
///
/// With each draft token agreeing with probability `a` (as long as the ones
/// before it did), a pass over a token and `k` draft tokens yields
/// `(1 - a^(k+1)) / (1 - a)` tokens, and costs `1 + (c + g) k` single-token
/// passes, `c` being what one more position costs and `g` what guessing a
/// token costs (a draft model's pass; nearly nothing for prompt lookup). All
/// are measured as the generation goes (moving averages): `a` from every draft
/// token a sample judged, including one-token guesses made while no draft
/// pays (compared with the token sampled there; asked every step when
/// guessing is cheap, every [`PROBE_EVERY`] steps otherwise), `c` and `g`
/// from the passes' and the drafter's times. So a drafter that guesses badly,
/// or a model whose passes cost the same per position (all of a layer's
/// positions reading their own experts), falls back to one token a pass, and
/// one that guesses well gets long drafts. The choice only decides speed: the
/// tokens are the same at any length.
#[derive(Clone, Copy, Debug)]
struct DraftLength {
    /// Moving average of draft tokens agreeing.
    accept: f64,
    /// Moving averages of a single-token pass's seconds, of each extra
    /// position's in a verifying pass, and of each draft token's drafting.
    single: Option<f64>,
    extra: Option<f64>,
    draft: Option<f64>,
    /// Steps since the last probe (a one-token guess while none pays).
    since_probe: u32,
}

impl Default for DraftLength {
    fn default() -> Self {
        DraftLength {
            accept: 0.5,
            single: None,
            extra: None,
            draft: None,
            since_probe: 0,
        }
    }
}

/// While no draft pays, a guess of one token is asked for every this many
/// steps when guessing costs more than [`CHEAP_DRAFT`] of a pass (every step
/// when it costs less), to keep measuring how often guesses agree.
const PROBE_EVERY: u32 = 8;

/// A draft token costing less than this share of a pass counts as free.
const CHEAP_DRAFT: f64 = 0.05;

/// Weight of the newest sample in [`DraftLength`]'s moving averages.
const DRAFT_EMA: f64 = 1.0 / 8.0;

/// What one more position costs before it is measured, in single-token passes.
const DRAFT_EXTRA_PRIOR: f64 = 0.5;

impl DraftLength {
    fn ema(old: Option<f64>, new: f64) -> f64 {
        old.map_or(new, |o| o + DRAFT_EMA * (new - o))
    }

    fn judged(&mut self, agreed: bool) {
        self.accept += DRAFT_EMA * (f64::from(u8::from(agreed)) - self.accept);
    }

    fn single_pass(&mut self, took: Duration) {
        self.single = Some(Self::ema(self.single, took.as_secs_f64()));
    }

    /// `n` draft tokens took `took` to guess.
    fn drafting(&mut self, n: usize, took: Duration) {
        if n > 0 {
            self.draft = Some(Self::ema(self.draft, took.as_secs_f64() / n as f64));
        }
    }

    /// What guessing a token costs, in single-token passes (0 before measured).
    fn draft_cost(&self) -> f64 {
        match (self.single, self.draft) {
            (Some(s), Some(d)) if s > 0.0 => d / s,
            _ => 0.0,
        }
    }

    /// Whether to ask for a one-token guess now, while no draft pays: never
    /// once a guessed token costs a whole pass (no acceptance could pay for
    /// it), every step while guessing is cheap, else every [`PROBE_EVERY`].
    fn probe(&mut self) -> bool {
        if self.draft_cost() >= 1.0 {
            return false;
        }
        self.since_probe += 1;
        if self.draft_cost() < CHEAP_DRAFT || self.since_probe >= PROBE_EVERY {
            self.since_probe = 0;
            true
        } else {
            false
        }
    }

    fn verify_pass(&mut self, drafted: usize, took: Duration) {
        if let (Some(single), true) = (self.single, drafted > 0) {
            let extra = (took.as_secs_f64() - single).max(0.0) / drafted as f64;
            self.extra = Some(Self::ema(self.extra, extra));
        }
    }

    /// The number of draft tokens to guess and verify, at most `available`
    /// (0: none).
    fn length(&self, available: usize) -> usize {
        let c = match (self.single, self.extra) {
            (Some(s), Some(e)) if s > 0.0 => e / s,
            _ => DRAFT_EXTRA_PRIOR,
        } + self.draft_cost();
        let a = self.accept.clamp(0.0, 0.999);
        let (mut best, mut best_rate) = (0, 1.0);
        let (mut tokens, mut p) = (1.0, 1.0);
        for k in 1..=available {
            p *= a;
            tokens += p;
            let rate = tokens / (1.0 + c * k as f64);
            if rate > best_rate * 1.02 {
                (best, best_rate) = (k, rate);
            }
        }
        best
    }
}

/// The process's peak resident set size (`VmHWM`), where the OS reports it.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn control(accept: f64, single: f64, extra: f64) -> DraftLength {
        DraftLength {
            accept,
            single: Some(single),
            extra: Some(extra),
            ..DraftLength::default()
        }
    }

    #[test]
    fn pass_costs_fit_a_line_through_the_passes() {
        let mut c = PassCost::default();
        let secs = |p: usize| Duration::from_secs_f64(0.1 + 0.01 * p as f64);
        // Passes of one size say nothing of a position's cost.
        for _ in 0..4 {
            c.record(4, secs(4));
        }
        assert!(c.costs(4).is_none());
        for p in [5, 8, 4, 6, 12] {
            c.record(p, secs(p));
        }
        let (single, extra) = c.costs(4).unwrap();
        assert!((single - 0.14).abs() < 1e-9 && (extra - 0.01).abs() < 1e-9);
        // A line that falls is no cost.
        let mut falling = PassCost::default();
        falling.record(2, Duration::from_millis(300));
        falling.record(8, Duration::from_millis(100));
        assert!(falling.costs(2).is_none());
    }

    #[test]
    fn drafts_are_as_long_as_pays() {
        // Poor guesses, or positions that cost as much as a pass: no draft.
        assert_eq!(control(0.2, 1.0, 0.3).length(8), 0);
        assert_eq!(control(0.9, 1.0, 1.0).length(8), 0);
        // Good guesses and cheap positions: long drafts, within what is there.
        assert_eq!(control(0.95, 1.0, 0.05).length(8), 8);
        assert_eq!(control(0.95, 1.0, 0.05).length(3), 3);
        let mid = control(0.7, 1.0, 0.3).length(8);
        assert!((1..8).contains(&mid), "{mid}");
        // Nothing measured yet: the prior cost, and an even chance, say wait.
        assert_eq!(DraftLength::default().length(8), 0);
    }

    #[test]
    fn measurements_move_the_length() {
        let mut c = DraftLength::default();
        for _ in 0..16 {
            c.judged(true);
        }
        c.single_pass(Duration::from_millis(10));
        c.verify_pass(4, Duration::from_millis(12));
        assert!(c.length(8) >= 4, "{c:?}");
        for _ in 0..32 {
            c.judged(false);
        }
        assert_eq!(c.length(8), 0, "{c:?}");
    }

    #[test]
    fn costly_guesses_are_asked_for_less() {
        let mut c = control(0.9, 1.0, 0.1);
        let free = c.length(8);
        assert!(free >= 4, "{free}");
        // Guessing a token costs half a pass (a draft model's pass).
        c.single_pass(Duration::from_millis(10));
        c.single = Some(0.010);
        c.drafting(4, Duration::from_millis(20));
        let costly = c.length(8);
        assert!(costly < free, "{costly} < {free}");
        // While none pays, costly guesses are probed every PROBE_EVERY steps;
        // cheap ones every step.
        let mut idle = control(0.1, 1.0, 0.1);
        idle.drafting(1, Duration::from_secs(1));
        let probes = (0..2 * PROBE_EVERY).filter(|_| idle.probe()).count();
        assert_eq!(probes, 0, "a guess costing a pass never pays");
        idle.draft = Some(0.5);
        let probes = (0..2 * PROBE_EVERY).filter(|_| idle.probe()).count();
        assert_eq!(probes, 2);
        let mut cheap = control(0.1, 1.0, 0.1);
        assert!((0..4).all(|_| cheap.probe()));
    }
}
