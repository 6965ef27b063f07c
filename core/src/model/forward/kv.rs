//! The KV cache: each attention layer's keys and values over caller memory,
//! in `f32` or `f16`; sliding-window layers optionally in a ring that holds
//! only the positions their window can still see (llama.cpp's SWA cache).
//!
//! A layer without a ring keeps position `p` at row `p`. A windowed layer
//! with a [`KvRing`] of `span` positions keeps position `p` twice, at rows
//! `p % span` and `p % span + span` (a ring mapped twice over `2 * span`
//! rows), so that any `span` consecutive positions lie in consecutive rows:
//! attention reads a window as one contiguous view, with the same kernels and
//! the same arithmetic, in the same order, as over a full cache. The logits
//! are therefore bit-identical with and without rings.
//!
//! What a ring of `span` positions holds after position `p` is written: the
//! positions `p + 1 - span ..= p`. So a pass of `n` positions over a layer of
//! window `w` needs `span >= w + n - 1` (the window of its first position
//! while the last is written), and going back `b` positions (a rejected
//! draft) needs `span >= w + b - 1`; [`KvCache::view`] refuses a range wider
//! than the window, and the caller sizes `span` for its passes and rewinds.

use core::ops::Range;

use super::super::config::{Hparams, HybridParams, SlidingWindow};
use super::super::ops::{KvRows, KvView, MAX_F16_HEAD_DIM};

/// Element type of a KV cache's keys or values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvType {
    /// `f32`: exactly what attention computed.
    F32,
    /// IEEE binary16, rounded to nearest even as ggml rounds its `f16` cache
    /// (llama.cpp's default): half the memory, and half the bytes attention
    /// streams every token.
    #[default]
    F16,
}

impl KvType {
    /// Bytes a value takes.
    pub fn bytes(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
        }
    }

    /// The name llama.cpp's `--cache-type-k` uses for it.
    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
        }
    }

    /// Whether a cache of this type holds heads of `head_dim` values: any for
    /// `f32`; for `f16` at most [`MAX_F16_HEAD_DIM`], since attention widens
    /// its rows a tile at a time.
    pub fn holds_head_dim(self, head_dim: usize) -> bool {
        self == KvType::F32 || head_dim <= MAX_F16_HEAD_DIM
    }
}

/// Caller memory for a KV cache's keys or values, in its element type.
#[derive(Debug)]
pub enum KvBuf<'a> {
    /// `f32` values.
    F32(&'a mut [f32]),
    /// `f16` bits.
    F16(&'a mut [u16]),
}

impl KvBuf<'_> {
    /// Its element type.
    pub fn ty(&self) -> KvType {
        match self {
            KvBuf::F32(_) => KvType::F32,
            KvBuf::F16(_) => KvType::F16,
        }
    }

    fn len(&self) -> usize {
        match self {
            KvBuf::F32(x) => x.len(),
            KvBuf::F16(x) => x.len(),
        }
    }

    /// The values `range` as attention reads them.
    fn rows(&self, range: Range<usize>) -> KvRows<'_> {
        match self {
            KvBuf::F32(x) => KvRows::F32(&x[range]),
            KvBuf::F16(x) => KvRows::F16(&x[range]),
        }
    }

    /// `x` stored from `at` on (rounded to nearest even for `f16`).
    fn store(&mut self, at: usize, x: &[f32]) {
        match self {
            KvBuf::F32(b) => b[at..][..x.len()].copy_from_slice(x),
            KvBuf::F16(b) => {
                for (d, &v) in b[at..][..x.len()].iter_mut().zip(x) {
                    *d = crate::quant::f32_to_f16(v);
                }
            }
        }
    }
}

/// Rings for the sliding-window layers of a KV cache: which cache layers
/// have a window, and how many positions each ring holds. A ring of `span`
/// positions keeps position `p` at rows `p % span` and `p % span + span`, so
/// that any `span` consecutive positions are consecutive rows and attention
/// reads a window as it reads a full cache, with the same logits. After
/// position `p` is written it holds positions `p + 1 - span ..= p`: a pass
/// of `n` positions over a window of `w` needs `span >= w + n - 1`, and so
/// does going back `n` positions. A chunked layer (Llama 4's) sees at most
/// a chunk back, so a ring whose window is the chunk holds it too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvRing {
    /// The windowed layers, by their index among the cache's layers (the
    /// attention layers), and their window.
    pub window: SlidingWindow,
    /// Positions a ring holds: at least the window; `window + n - 1` for
    /// passes of `n` positions and rewinds of `n`.
    pub span: usize,
}

impl KvRing {
    /// A ring for passes (and rewinds) of up to `passes` positions over the
    /// layers `window` says are windowed: `span = window + passes - 1`.
    pub fn for_passes(window: SlidingWindow, passes: usize) -> KvRing {
        KvRing {
            window,
            span: window.window.saturating_add(passes.max(1) - 1),
        }
    }

    /// Whether cache layer `c` keeps a ring.
    pub fn holds(&self, c: usize) -> bool {
        self.window.of_layer(c).is_some()
    }

    /// Cache layers before `c` that keep a ring.
    fn before(&self, c: usize) -> usize {
        let p = self.window.pattern.max(1);
        (c / p) * (p - 1) + (c % p).min(p - 1)
    }

    /// Largest pass (or rewind) the ring holds: `span - window + 1`.
    pub fn passes(&self) -> usize {
        (self.span + 1).saturating_sub(self.window.window)
    }

    fn valid(&self) -> bool {
        self.window.window > 0 && self.window.pattern > 0 && self.span >= self.window.window
    }
}

/// Where a KV cache keeps each layer's positions: `[layer][row][kv_dim]`
/// for keys and values each, one layer per attention layer (linear-attention
/// layers have none); a row per position, or a ring of rows for windowed
/// layers ([`KvRing`]). A host reads and writes a cache's memory through it
/// (saving a session, growing its rings).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    n_layers: usize,
    max_positions: usize,
    kv_dim: usize,
    ring: Option<KvRing>,
}

impl KvLayout {
    /// The layout of a cache of `max_positions` positions for the attention
    /// layers of `hy`, with the windowed layers in `ring` where given; `None`
    /// where the ring does not hold its window (a window and span of at least
    /// one position, the span at least the window).
    pub fn new(
        hp: &Hparams,
        hy: &HybridParams,
        max_positions: usize,
        ring: Option<KvRing>,
    ) -> Option<KvLayout> {
        ring.is_none_or(|r| r.valid()).then_some(KvLayout {
            n_layers: hy.n_attn_layers,
            max_positions,
            kv_dim: hp.kv_dim(),
            ring,
        })
    }

    /// Values each of the keys and the values take.
    pub fn len(&self) -> usize {
        self.base(self.n_layers)
    }

    /// Whether it holds nothing (no attention layers, or no positions).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Cache layers (attention layers).
    pub fn n_layers(&self) -> usize {
        self.n_layers
    }

    /// Positions it holds at most.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Values of one position of one layer.
    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// Its rings, if its windowed layers have them.
    pub fn ring(&self) -> Option<KvRing> {
        self.ring
    }

    /// The ring of cache layer `c`, if it has one.
    pub fn ring_of(&self, c: usize) -> Option<KvRing> {
        self.ring.filter(|r| r.holds(c))
    }

    /// The first value of cache layer `c` (the end of the last for
    /// `c = n_layers`).
    fn base(&self, c: usize) -> usize {
        let rows = match self.ring {
            None => c * self.max_positions,
            Some(r) => {
                let w = r.before(c);
                (c - w) * self.max_positions + w * 2 * r.span
            }
        };
        rows * self.kv_dim
    }

    /// Where position `pos` of cache layer `c` is stored: the first value of
    /// each of its copies (one; two in a ring).
    pub fn slots(&self, c: usize, pos: usize) -> ([usize; 2], usize) {
        let base = self.base(c);
        match self.ring_of(c) {
            None => ([base + pos * self.kv_dim, 0], 1),
            Some(r) => {
                let row = pos % r.span;
                let at = |row: usize| base + row * self.kv_dim;
                ([at(row), at(row + r.span)], 2)
            }
        }
    }

    /// The positions of cache layer `c` it still holds once positions
    /// `..end` are written: all of them, or a ring's last `span`.
    pub fn held(&self, c: usize, end: usize) -> Range<usize> {
        match self.ring_of(c) {
            None => 0..end,
            Some(r) => end.saturating_sub(r.span)..end,
        }
    }
}

/// Per-layer KV cache over caller memory, laid out as its [`KvLayout`] says.
pub struct KvCache<'a> {
    pub(super) k: KvBuf<'a>,
    pub(super) v: KvBuf<'a>,
    layout: KvLayout,
}

impl<'a> KvCache<'a> {
    /// Floats each of `k` and `v` must hold (every layer with attention).
    pub fn len(hp: &Hparams, max_positions: usize) -> usize {
        hp.n_layers * max_positions * hp.kv_dim()
    }

    /// A cache of `max_positions` positions; `k` and `v` hold [`len`](Self::len) floats.
    pub fn new(
        hp: &Hparams,
        k: &'a mut [f32],
        v: &'a mut [f32],
        max_positions: usize,
    ) -> Option<Self> {
        Self::new_for(hp, &HybridParams::plain(hp), k, v, max_positions)
    }

    /// Floats each of `k` and `v` must hold for the attention layers of `hy`.
    pub fn len_for(hp: &Hparams, hy: &HybridParams, max_positions: usize) -> usize {
        hy.n_attn_layers * max_positions * hp.kv_dim()
    }

    /// A cache for the attention layers of `hy`; `k` and `v` hold
    /// [`len_for`](Self::len_for) floats.
    pub fn new_for(
        hp: &Hparams,
        hy: &HybridParams,
        k: &'a mut [f32],
        v: &'a mut [f32],
        max_positions: usize,
    ) -> Option<Self> {
        Self::new_typed(hp, hy, KvBuf::F32(k), KvBuf::F32(v), max_positions)
    }

    /// [`new_for`](Self::new_for) with keys and values of any [`KvType`],
    /// each holding [`len_for`](Self::len_for) values, whose types hold the
    /// model's heads ([`KvType::holds_head_dim`]).
    pub fn new_typed(
        hp: &Hparams,
        hy: &HybridParams,
        k: KvBuf<'a>,
        v: KvBuf<'a>,
        max_positions: usize,
    ) -> Option<Self> {
        Self::with_layout(hp, KvLayout::new(hp, hy, max_positions, None)?, k, v)
    }

    /// A cache laid out as `layout` (of the model `hp`), whose keys and
    /// values each hold [`KvLayout::len`] values of types that hold the
    /// model's heads.
    pub fn with_layout(hp: &Hparams, layout: KvLayout, k: KvBuf<'a>, v: KvBuf<'a>) -> Option<Self> {
        let n = layout.len();
        let fits = k.ty().holds_head_dim(hp.head_dim) && v.ty().holds_head_dim(hp.head_dim);
        (k.len() == n && v.len() == n && fits && layout.kv_dim == hp.kv_dim()).then_some(KvCache {
            k,
            v,
            layout,
        })
    }

    /// Positions it holds at most.
    pub fn max_positions(&self) -> usize {
        self.layout.max_positions
    }

    /// Cache layers (attention layers).
    pub(super) fn n_layers(&self) -> usize {
        self.layout.n_layers
    }

    /// How it is laid out.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Whether cache layer `c` holds a pass of `n` positions: always for a
    /// layer without a ring, else where its span is at least the window plus
    /// `n - 1`.
    pub fn holds_pass(&self, c: usize, n: usize) -> bool {
        self.layout.ring_of(c).is_none_or(|r| n <= r.passes())
    }

    /// Stores the key `k` and value `v` of position `pos` (below
    /// [`max_positions`](Self::max_positions)) in cache layer `c`, each
    /// `kv_dim` values.
    pub(super) fn store(&mut self, c: usize, pos: usize, k: &[f32], v: &[f32]) {
        let d = self.layout.kv_dim;
        let (at, copies) = self.layout.slots(c, pos);
        for &at in &at[..copies] {
            self.k.store(at, &k[..d]);
            self.v.store(at, &v[..d]);
        }
    }

    /// The keys and values of positions `range` of cache layer `c`, written
    /// last (the range ends at the position stored last), as attention reads
    /// them; `None` where the layer does not hold them all: beyond
    /// [`max_positions`](Self::max_positions), or wider than a ring's window.
    pub(super) fn view(&self, c: usize, range: Range<usize>) -> Option<KvView<'_>> {
        let n = range.end.checked_sub(range.start)?;
        if c >= self.layout.n_layers || range.end > self.layout.max_positions {
            return None;
        }
        if self.layout.ring_of(c).is_some_and(|r| n > r.window.window) {
            return None;
        }
        let (at, _) = self.layout.slots(c, range.start);
        let values = at[0]..at[0] + n * self.layout.kv_dim;
        Some(KvView {
            k: self.k.rows(values.clone()),
            v: self.v.rows(values),
            positions: n,
            sinks: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::Hparams;
    use crate::model::ops::RopeStyle;
    use std::{vec, vec::Vec};

    fn hp(n_layers: usize) -> Hparams {
        Hparams {
            n_layers,
            n_embd: 8,
            n_head: 2,
            n_head_kv: 1,
            head_dim: 3,
            n_rot: 2,
            n_vocab: 4,
            n_ff: 8,
            rope_base: 1e4,
            rope_style: RopeStyle::Neox,
            norm_eps: 1e-6,
            moe: None,
            rope_yarn: None,
            scales: crate::model::config::Scales::NONE,
        }
    }

    /// Rows per layer add up to the layout's length, and each layer starts where the
    /// one before it ends, for several patterns.
    #[test]
    fn layers_tile_the_buffer() {
        for (layers, pattern, window, span) in
            [(6, 2, 4, 7), (7, 3, 2, 2), (5, 1, 3, 9), (4, 4, 1, 1)]
        {
            let hp = hp(layers);
            let hy = HybridParams::plain(&hp);
            let ring = KvRing {
                window: SlidingWindow { window, pattern },
                span,
            };
            let (max, d) = (32, hp.kv_dim());
            let layout = KvLayout::new(&hp, &hy, max, Some(ring)).unwrap();
            let n = layout.len();
            let mut at = 0;
            for c in 0..layers {
                assert_eq!(layout.base(c), at, "layer {c}");
                at += d * if ring.holds(c) { 2 * span } else { max };
            }
            assert_eq!(at, n);
        }
    }

    /// Every window of a ring reads the positions it would read in a full
    /// cache, whatever the order of the writes' wrapping.
    #[test]
    fn ring_windows_read_what_a_full_cache_reads() {
        let hp = hp(2);
        let hy = HybridParams::plain(&hp);
        let d = hp.kv_dim();
        let (max, window, span) = (40, 5, 8);
        let ring = KvRing {
            window: SlidingWindow { window, pattern: 2 },
            span,
        };
        let layout = KvLayout::new(&hp, &hy, max, Some(ring)).unwrap();
        let n = layout.len();
        let (mut k, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        let mut kv =
            KvCache::with_layout(&hp, layout, KvBuf::F32(&mut k), KvBuf::F32(&mut v)).unwrap();
        let row = |p: usize, s: f32| (0..d).map(|i| s * (p * d + i) as f32).collect::<Vec<_>>();
        for p in 0..max {
            for c in 0..2 {
                kv.store(c, p, &row(p, 1.0), &row(p, -1.0));
            }
            for lo in (p + 1).saturating_sub(window)..=p {
                let view = kv.view(0, lo..p + 1).expect("within the window");
                let (KvRows::F32(ks), KvRows::F32(vs)) = (view.k, view.v) else {
                    unreachable!()
                };
                let want: Vec<f32> = (lo..=p).flat_map(|q| row(q, 1.0)).collect();
                assert_eq!(ks, &want[..], "keys {lo}..={p}");
                assert_eq!(vs.len(), want.len());
            }
            // The full layer reads any range; the ring none wider than its window.
            assert!(kv.view(1, 0..p + 1).is_some());
            assert_eq!(kv.view(0, 0..p + 1).is_some(), p < window);
            assert_eq!(layout.held(0, p + 1), (p + 1).saturating_sub(span)..p + 1);
            assert_eq!(layout.held(1, p + 1), 0..p + 1);
        }
        assert!(kv.view(1, 0..max + 1).is_none());
        assert!(kv.view(2, 0..1).is_none());
        assert!(kv.holds_pass(0, 4) && !kv.holds_pass(0, 5) && kv.holds_pass(1, 40));
    }

    #[test]
    fn rings_must_hold_their_window() {
        let hp = hp(2);
        let hy = HybridParams::plain(&hp);
        let ring = KvRing {
            window: SlidingWindow {
                window: 4,
                pattern: 2,
            },
            span: 3,
        };
        assert!(KvLayout::new(&hp, &hy, 16, Some(ring)).is_none());
        let fits = KvRing { span: 4, ..ring };
        assert!(KvLayout::new(&hp, &hy, 16, Some(fits)).is_some());
        assert_eq!(KvRing::for_passes(ring.window, 3).span, 6);
        assert_eq!(KvRing::for_passes(ring.window, 3).passes(), 3);
    }
}
