//! Expert gating and the lookahead predictor.
//!
//! The caller computes a layer's router *logits* (a GEMV of `ffn_gate_inp` with the
//! hidden state); this module turns them into a [`Routing`], with the semantics
//! llama.cpp's `build_moe_ffn` gives each architecture:
//!
//! 1. gating probabilities: [`Gating::Softmax`] over all experts, or
//!    [`Gating::Sigmoid`] per expert (ranked by the raw logits for
//!    [`Gating::SoftmaxWeight`] and [`Gating::SigmoidOfLogits`]);
//! 2. an optional per-expert *selection bias* (DeepSeek-V3's `exp_probs_b`) added to
//!    the probabilities for selection only;
//! 3. with [`ExpertGroups`] (DeepSeek-V3's group-limited routing), only the
//!    experts of the best groups compete, a group scoring the sum of its two
//!    best (biased) scores;
//! 4. top-k selection on the (biased) scores, highest first;
//! 5. the weights are the *unbiased* probabilities of the selected experts,
//!    optionally renormalised to sum to 1 (the sum clamped below at
//!    [`WEIGHT_SUM_MIN`]), then multiplied by `expert_weights_scale`.
//!
//! The **lookahead predictor** ([`predict`]) ranks experts exactly as [`RouterConfig::route`]
//! does, but is fed layer `l+1`'s router logits computed from layer `l`'s hidden
//! state: the experts it returns are prefetched while layer `l` computes. Because the
//! ranking is the same, a prediction fed the real logits reproduces the routing, so
//! [`PredictionScore`] measures only how far the hidden state moved between layers.
//!
//! # Determinism
//! Ranking is a total order: higher score first, and on equal scores the **lower
//! expert id first**. A NaN logit (or a NaN selection score) is treated as `-inf`:
//! probability 0, ranked last. Softmax over logits that are all `-inf`/NaN gives the
//! uniform distribution (the limit of equal logits); `+inf` logits share the whole
//! mass equally. Nothing here panics on any input.

use core::fmt;
use core::ops::AddAssign;

use heapless::Vec;

/// Largest number of experts one token may use per layer (`top_k`).
///
/// 32 covers every MoE in llama.cpp today (most use 2-10); it bounds the stack
/// buffers used by [`RouterConfig::route`].
pub const MAX_TOP_K: usize = 32;

/// Largest number of experts one [`predict`] call may return.
pub const MAX_PREDICTED: usize = 64;

/// Largest expert count: expert ids are `u16`.
pub const MAX_EXPERTS: usize = 1 << 16;

/// Lower clamp of the selected-weight sum when renormalising: 2^-14 =
/// 6.103515625e-5, the smallest normal f16, as llama.cpp uses to avoid dividing by
/// zero.
pub const WEIGHT_SUM_MIN: f32 = 1.0 / 16384.0;

/// Most expert groups [`ExpertGroups`] may have (DeepSeek-V3 has 8).
pub const MAX_EXPERT_GROUPS: usize = 64;

/// Group-limited routing (GGUF `expert_group_count` and
/// `expert_group_used_count`, DeepSeek-V3's `n_group` and `topk_group`): the
/// experts are `count` groups of consecutive ids; each group scores the sum of
/// its two best selection scores (probability plus selection bias), and only
/// the experts of the `used` best groups are picked or predicted, as
/// llama.cpp's `build_moe_ffn` masks the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertGroups {
    /// Groups of experts (divides the expert count).
    pub count: usize,
    /// Groups whose experts may be picked.
    pub used: usize,
}

/// How router logits become gating probabilities (GGUF `expert_gating_func`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Gating {
    /// Softmax over all experts (qwen3moe, qwen2moe, olmoe, mixtral, DeepSeek-V2).
    Softmax,
    /// Independent sigmoid per expert (DeepSeek-V3 style).
    Sigmoid,
    /// Top-k of the raw logits, then a softmax over the picked logits only
    /// (gpt-oss; llama.cpp's `SOFTMAX_WEIGHT`). Predictions and their
    /// thresholds use the softmax over all experts, which ranks them the same.
    SoftmaxWeight,
    /// Top-k of the raw logits, then each pick's own sigmoid (llama4, whose
    /// llama.cpp graph ranks the logits: probabilities that round to the same
    /// value near 0 or 1 still rank by logit). No GGUF id: the architecture
    /// fixes it.
    SigmoidOfLogits,
}

impl Gating {
    /// The gating for a GGUF `{arch}.expert_gating_func` value (1 softmax,
    /// 2 sigmoid, 3 softmax of the picks); `None` for the values LES does not
    /// support.
    pub const fn from_gguf(id: u32) -> Option<Gating> {
        match id {
            1 => Some(Gating::Softmax),
            2 => Some(Gating::Sigmoid),
            3 => Some(Gating::SoftmaxWeight),
            _ => None,
        }
    }
}

/// One selected expert and the weight its output is multiplied by.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertWeight {
    /// Expert id, `< n_experts`.
    pub expert: u16,
    /// Combine weight (after renormalisation and scaling).
    pub weight: f32,
}

/// The routing of one token in one layer, in **selection order** (descending
/// selection score, ties by lower id).
///
/// This order is the fixed combine order: expert outputs are summed in it, as
/// llama.cpp does, whatever order the experts are loaded or computed in, so the
/// result does not depend on I/O timing.
pub type Routing = Vec<ExpertWeight, MAX_TOP_K>;

/// One predicted expert with its (unbiased) gating probability.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Predicted {
    /// Expert id, `< n_experts`.
    pub expert: u16,
    /// Gating probability (softmax or sigmoid, before bias and renormalisation).
    pub prob: f32,
}

/// A lookahead prediction, most confident first.
pub type Prediction = Vec<Predicted, MAX_PREDICTED>;

/// Errors of router configuration and use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterError {
    /// `top_k` is 0.
    ZeroTopK,
    /// `top_k` exceeds the number of experts.
    TopKAboveExperts {
        /// Requested k.
        top_k: usize,
        /// Experts in the layer.
        n_experts: usize,
    },
    /// `top_k` exceeds [`MAX_TOP_K`].
    TopKAboveMax {
        /// Requested k.
        top_k: usize,
    },
    /// More experts than [`MAX_EXPERTS`].
    TooManyExperts {
        /// Requested expert count.
        n_experts: usize,
    },
    /// `weights_scale` is NaN or infinite.
    NonFiniteScale,
    /// The logits slice does not have one entry per expert.
    LogitsLength {
        /// `n_experts`.
        expected: usize,
        /// Length given.
        actual: usize,
    },
    /// The selection-bias slice does not have one entry per expert.
    BiasLength {
        /// `n_experts`.
        expected: usize,
        /// Length given.
        actual: usize,
    },
    /// A prediction asks for more than [`MAX_PREDICTED`] experts.
    PredictionAboveMax {
        /// Requested count.
        requested: usize,
    },
    /// A layer index at or beyond [`LayerMask::CAPACITY`].
    LayerOutOfRange {
        /// The layer index.
        layer: usize,
    },
    /// [`ExpertGroups`] that do not fit the router: the count must divide the
    /// experts into groups of two or more, at most [`MAX_EXPERT_GROUPS`]; the
    /// used groups must be fewer than all and hold at least `top_k` experts.
    BadGroups {
        /// The groups asked for.
        groups: ExpertGroups,
        /// Experts in the layer.
        n_experts: usize,
        /// Experts used per token.
        top_k: usize,
    },
}

impl fmt::Display for RouterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            RouterError::ZeroTopK => f.write_str("top_k must be at least 1"),
            RouterError::TopKAboveExperts { top_k, n_experts } => {
                write!(f, "top_k {top_k} exceeds the {n_experts} experts")
            }
            RouterError::TopKAboveMax { top_k } => {
                write!(f, "top_k {top_k} exceeds the maximum {MAX_TOP_K}")
            }
            RouterError::TooManyExperts { n_experts } => {
                write!(f, "{n_experts} experts exceed the maximum {MAX_EXPERTS}")
            }
            RouterError::NonFiniteScale => f.write_str("expert weights scale is not finite"),
            RouterError::LogitsLength { expected, actual } => {
                write!(f, "expected {expected} router logits, got {actual}")
            }
            RouterError::BiasLength { expected, actual } => {
                write!(f, "expected {expected} selection biases, got {actual}")
            }
            RouterError::PredictionAboveMax { requested } => {
                write!(
                    f,
                    "prediction of {requested} experts exceeds the maximum {MAX_PREDICTED}"
                )
            }
            RouterError::LayerOutOfRange { layer } => {
                write!(
                    f,
                    "layer {layer} is beyond the layer mask capacity {}",
                    LayerMask::CAPACITY
                )
            }
            RouterError::BadGroups {
                groups,
                n_experts,
                top_k,
            } => write!(
                f,
                "{} expert groups, {} used, do not fit {n_experts} experts and top_k {top_k} \
                 (groups of 2 or more experts, at most {MAX_EXPERT_GROUPS}, fewer used than \
                 all, holding top_k experts)",
                groups.count, groups.used
            ),
        }
    }
}

impl core::error::Error for RouterError {}

/// The logistic function `1 / (1 + e^-x)`, as ggml computes it (NaN propagates).
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + libm::expf(-x))
}

/// The shared-expert gate of qwen2moe / qwen35moe: the shared experts' output is
/// multiplied by `sigmoid(ffn_gate_inp_shexp . x)`; `logit` is that dot product.
#[inline]
pub fn shared_expert_gate(logit: f32) -> f32 {
    sigmoid(logit)
}

/// One MoE layer's router: expert count, k, gating, renormalisation and scale.
///
/// Built with [`RouterConfig::new`], which checks the invariants `route` relies on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterConfig {
    n_experts: usize,
    top_k: usize,
    gating: Gating,
    normalize: bool,
    weights_scale: f32,
    groups: Option<ExpertGroups>,
}

impl RouterConfig {
    /// A checked router configuration.
    ///
    /// `normalize` is GGUF `expert_weights_norm`; `weights_scale` is
    /// `expert_weights_scale`, where **0.0 means "no scaling"** (stored as 1.0), as in
    /// llama.cpp, since a GGUF without the key reads as 0.
    pub fn new(
        n_experts: usize,
        top_k: usize,
        gating: Gating,
        normalize: bool,
        weights_scale: f32,
    ) -> Result<Self, RouterError> {
        if n_experts > MAX_EXPERTS {
            return Err(RouterError::TooManyExperts { n_experts });
        }
        if top_k == 0 {
            return Err(RouterError::ZeroTopK);
        }
        if top_k > MAX_TOP_K {
            return Err(RouterError::TopKAboveMax { top_k });
        }
        if top_k > n_experts {
            return Err(RouterError::TopKAboveExperts { top_k, n_experts });
        }
        if !weights_scale.is_finite() {
            return Err(RouterError::NonFiniteScale);
        }
        let weights_scale = if weights_scale == 0.0 {
            1.0
        } else {
            weights_scale
        };
        Ok(RouterConfig {
            n_experts,
            top_k,
            gating,
            normalize,
            weights_scale,
            groups: None,
        })
    }

    /// This router with group-limited routing ([`ExpertGroups`]), checked.
    pub fn with_groups(self, groups: ExpertGroups) -> Result<Self, RouterError> {
        let ExpertGroups { count, used } = groups;
        let fits = count > 1
            && count <= MAX_EXPERT_GROUPS
            && count < self.n_experts
            && self.n_experts.is_multiple_of(count)
            && used > 0
            && used < count
            && self.top_k <= used * (self.n_experts / count);
        if !fits {
            return Err(RouterError::BadGroups {
                groups,
                n_experts: self.n_experts,
                top_k: self.top_k,
            });
        }
        Ok(RouterConfig {
            groups: Some(groups),
            ..self
        })
    }

    /// Group-limited routing, if any.
    pub const fn groups(&self) -> Option<ExpertGroups> {
        self.groups
    }

    /// Number of experts (length of the logits).
    pub const fn n_experts(&self) -> usize {
        self.n_experts
    }

    /// Experts used per token.
    pub const fn top_k(&self) -> usize {
        self.top_k
    }

    /// Gating function.
    pub const fn gating(&self) -> Gating {
        self.gating
    }

    /// Whether selected weights are renormalised to sum to 1.
    pub const fn normalize(&self) -> bool {
        self.normalize
    }

    /// Factor applied to the final weights (1.0 when none).
    pub const fn weights_scale(&self) -> f32 {
        self.weights_scale
    }

    fn check(&self, logits: &[f32], bias: Option<&[f32]>) -> Result<(), RouterError> {
        if logits.len() != self.n_experts {
            return Err(RouterError::LogitsLength {
                expected: self.n_experts,
                actual: logits.len(),
            });
        }
        if let Some(b) = bias {
            if b.len() != self.n_experts {
                return Err(RouterError::BiasLength {
                    expected: self.n_experts,
                    actual: b.len(),
                });
            }
        }
        Ok(())
    }

    /// Writes every expert's gating probability (no bias, no renormalisation) to
    /// `out`, for statistics and tests. Both slices must have `n_experts` entries.
    pub fn probabilities(&self, logits: &[f32], out: &mut [f32]) -> Result<(), RouterError> {
        self.check(logits, None)?;
        if out.len() != self.n_experts {
            return Err(RouterError::LogitsLength {
                expected: self.n_experts,
                actual: out.len(),
            });
        }
        let probs = Probs::new(logits, self.gating);
        for (i, p) in out.iter_mut().enumerate() {
            *p = probs.prob(i);
        }
        Ok(())
    }

    /// Routes one token: selects `top_k` experts from `logits` (one per expert) and
    /// writes them with their weights to `out`, in selection order.
    ///
    /// `bias` is the optional per-expert selection bias (`exp_probs_b`): added to the
    /// probabilities to rank, never to the weights. `out` is cleared first and left
    /// empty on error; a length mismatch is an error, never a panic.
    pub fn route(
        &self,
        logits: &[f32],
        bias: Option<&[f32]>,
        out: &mut Routing,
    ) -> Result<(), RouterError> {
        out.clear();
        self.check(logits, bias)?;
        let probs = Probs::new(logits, self.gating);
        let mut sel: Vec<Candidate, MAX_TOP_K> = Vec::new();
        select(&probs, bias, self.groups, self.top_k, None, &mut sel);
        if self.gating == Gating::SoftmaxWeight {
            // The picks' logits through a softmax of their own, as ggml's
            // `soft_max` over the selected rows.
            let logit = |c: &Candidate| sanitize(logits[c.expert as usize]);
            let max = sel.iter().fold(f32::NEG_INFINITY, |m, c| m.max(logit(c)));
            for c in sel.iter_mut() {
                c.prob = shifted_exp(logit(c), max);
            }
            let sum: f64 = sel.iter().map(|c| f64::from(c.prob)).sum();
            let inv = if sum > 0.0 { (1.0 / sum) as f32 } else { 1.0 };
            for c in sel.iter_mut() {
                c.prob *= inv;
            }
        }

        let sum = if self.normalize {
            let s = sel.iter().fold(0.0f32, |s, c| s + c.prob);
            if s < WEIGHT_SUM_MIN {
                WEIGHT_SUM_MIN
            } else {
                s
            }
        } else {
            1.0
        };
        for c in &sel {
            let mut weight = c.prob;
            if self.normalize {
                weight /= sum;
            }
            weight *= self.weights_scale;
            // Cannot fail: `sel` and `out` have the same capacity.
            let _ = out.push(ExpertWeight {
                expert: c.expert,
                weight,
            });
        }
        Ok(())
    }
}

/// How many experts the lookahead predictor returns.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PredictMode {
    /// The `k` highest-ranked experts (clamped to the expert count). With `k` equal
    /// to the router's `top_k` this is the router's own selection.
    TopK(usize),
    /// Every expert whose selection score is at least `min_prob`, at most `max` of
    /// them, highest first. The selection score is the gating probability, plus the
    /// selection bias when the model has one. A NaN `min_prob` selects nothing.
    Threshold {
        /// Confidence threshold on the selection score.
        min_prob: f32,
        /// Upper bound on the number of experts returned.
        max: usize,
    },
}

/// Lookahead predictor settings (per-layer enable is a separate [`LayerMask`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PredictorConfig {
    /// How many experts to predict.
    pub mode: PredictMode,
}

impl PredictorConfig {
    /// Predict the `k` most likely experts.
    pub const fn top_k(k: usize) -> Self {
        PredictorConfig {
            mode: PredictMode::TopK(k),
        }
    }

    /// Predict every expert scoring at least `min_prob`, at most `max` of them.
    pub const fn threshold(min_prob: f32, max: usize) -> Self {
        PredictorConfig {
            mode: PredictMode::Threshold { min_prob, max },
        }
    }

    /// Predict as many experts as `router` selects: the "perfect predictor" shape.
    pub const fn matching(router: &RouterConfig) -> Self {
        Self::top_k(router.top_k)
    }
}

/// Predicts a layer's experts from its router logits computed on an *earlier*
/// hidden state (LES applies layer `l+1`'s router to layer `l`'s output).
///
/// Experts are ranked exactly as [`RouterConfig::route`] ranks them (same gating,
/// same `bias`, same tie rule), and written to `out` most confident first with their
/// unbiased gating probabilities. `out` is cleared first and left empty on error.
pub fn predict(
    logits: &[f32],
    bias: Option<&[f32]>,
    router: &RouterConfig,
    predictor: &PredictorConfig,
    out: &mut Prediction,
) -> Result<(), RouterError> {
    out.clear();
    let (limit, min_key) = match predictor.mode {
        PredictMode::TopK(k) => (k, None),
        PredictMode::Threshold { min_prob, max } => (max, Some(min_prob)),
    };
    if limit > MAX_PREDICTED {
        return Err(RouterError::PredictionAboveMax { requested: limit });
    }
    router.check(logits, bias)?;
    let probs = Probs::new(logits, router.gating);
    let mut sel: Vec<Candidate, MAX_PREDICTED> = Vec::new();
    select(&probs, bias, router.groups, limit, min_key, &mut sel);
    for c in &sel {
        // Cannot fail: same capacity.
        let _ = out.push(Predicted {
            expert: c.expert,
            prob: c.prob,
        });
    }
    Ok(())
}

/// Per-layer enable bits for the lookahead predictor, for up to
/// [`LayerMask::CAPACITY`] layers; all disabled by default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LayerMask {
    bits: [u64; 4],
}

impl LayerMask {
    /// Number of layers a mask can describe.
    pub const CAPACITY: usize = 256;

    /// A mask with every layer disabled.
    pub const fn new() -> Self {
        LayerMask { bits: [0; 4] }
    }

    /// A mask with layers `0..n` enabled.
    pub fn first(n: usize) -> Result<Self, RouterError> {
        if n > Self::CAPACITY {
            return Err(RouterError::LayerOutOfRange { layer: n - 1 });
        }
        let mut m = Self::new();
        for layer in 0..n {
            m.bits[layer / 64] |= 1 << (layer % 64);
        }
        Ok(m)
    }

    /// Enables or disables `layer`.
    pub fn set(&mut self, layer: usize, enabled: bool) -> Result<(), RouterError> {
        if layer >= Self::CAPACITY {
            return Err(RouterError::LayerOutOfRange { layer });
        }
        let bit = 1u64 << (layer % 64);
        if enabled {
            self.bits[layer / 64] |= bit;
        } else {
            self.bits[layer / 64] &= !bit;
        }
        Ok(())
    }

    /// Enables prediction for `layer`.
    pub fn enable(&mut self, layer: usize) -> Result<(), RouterError> {
        self.set(layer, true)
    }

    /// Disables prediction for `layer` (e.g. when its measured precision is poor).
    pub fn disable(&mut self, layer: usize) -> Result<(), RouterError> {
        self.set(layer, false)
    }

    /// Whether prediction is enabled for `layer`; `false` beyond the capacity.
    pub const fn is_enabled(&self, layer: usize) -> bool {
        layer < Self::CAPACITY && self.bits[layer / 64] & (1 << (layer % 64)) != 0
    }

    /// Number of enabled layers.
    pub const fn count(&self) -> usize {
        (self.bits[0].count_ones()
            + self.bits[1].count_ones()
            + self.bits[2].count_ones()
            + self.bits[3].count_ones()) as usize
    }
}

/// Prediction quality counts: how many predicted experts the router really picked.
///
/// Counts are over *sets*: a duplicated id counts once. Scores of many tokens and
/// layers add up with `+=`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PredictionScore {
    /// Experts both predicted and picked.
    pub true_positives: u64,
    /// Experts predicted.
    pub predicted: u64,
    /// Experts the router picked.
    pub picked: u64,
}

impl PredictionScore {
    /// Scores a prediction against the routing of the same layer and token.
    pub fn of(predicted: &[Predicted], routing: &[ExpertWeight]) -> Self {
        let mut s = PredictionScore::default();
        for (i, p) in predicted.iter().enumerate() {
            if predicted[..i].iter().all(|q| q.expert != p.expert) {
                s.predicted += 1;
            }
        }
        for (i, r) in routing.iter().enumerate() {
            if routing[..i].iter().any(|q| q.expert == r.expert) {
                continue;
            }
            s.picked += 1;
            if predicted.iter().any(|p| p.expert == r.expert) {
                s.true_positives += 1;
            }
        }
        s
    }

    /// Fraction of predicted experts that were picked (useful prefetches).
    /// 1.0 when nothing was predicted: no prefetch was wasted.
    pub fn precision(&self) -> f32 {
        if self.predicted == 0 {
            1.0
        } else {
            self.true_positives as f32 / self.predicted as f32
        }
    }

    /// Fraction of picked experts that were predicted (demand reads avoided).
    /// 1.0 when nothing was picked: nothing was missed.
    pub fn recall(&self) -> f32 {
        if self.picked == 0 {
            1.0
        } else {
            self.true_positives as f32 / self.picked as f32
        }
    }
}

impl AddAssign for PredictionScore {
    fn add_assign(&mut self, rhs: Self) {
        self.true_positives = self.true_positives.saturating_add(rhs.true_positives);
        self.predicted = self.predicted.saturating_add(rhs.predicted);
        self.picked = self.picked.saturating_add(rhs.picked);
    }
}

/// NaN becomes `-inf`, so every comparison below is a total order.
#[inline]
fn sanitize(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x
    }
}

/// Gating probabilities computed one expert at a time, so no scratch buffer of
/// `n_experts` floats is needed (softmax costs two `expf` per expert instead of one).
struct Probs<'a> {
    logits: &'a [f32],
    gating: Gating,
    max: f32,
    inv_sum: f32,
}

impl<'a> Probs<'a> {
    fn new(logits: &'a [f32], gating: Gating) -> Self {
        let mut max = f32::NEG_INFINITY;
        let mut inv_sum = 1.0;
        if matches!(gating, Gating::Softmax | Gating::SoftmaxWeight) {
            for &x in logits {
                let x = sanitize(x);
                if x > max {
                    max = x;
                }
            }
            // The max term contributes exactly 1, so the sum is >= 1 (when there
            // are logits at all). Summed in f64 and applied as a reciprocal, as ggml does.
            let sum: f64 = logits
                .iter()
                .map(|&x| f64::from(shifted_exp(sanitize(x), max)))
                .sum();
            if sum > 0.0 {
                inv_sum = (1.0 / sum) as f32;
            }
        }
        Probs {
            logits,
            gating,
            max,
            inv_sum,
        }
    }

    #[inline]
    fn prob(&self, i: usize) -> f32 {
        let x = sanitize(self.logits[i]);
        match self.gating {
            Gating::Softmax | Gating::SoftmaxWeight => shifted_exp(x, self.max) * self.inv_sum,
            Gating::Sigmoid | Gating::SigmoidOfLogits => sigmoid(x),
        }
    }

    /// What experts are ranked by: the raw logit for [`Gating::SoftmaxWeight`]
    /// and [`Gating::SigmoidOfLogits`] (ggml takes its top-k of the logits),
    /// the probability otherwise.
    #[inline]
    fn rank(&self, i: usize, prob: f32) -> f32 {
        match self.gating {
            Gating::SoftmaxWeight | Gating::SigmoidOfLogits => sanitize(self.logits[i]),
            _ => prob,
        }
    }
}

/// `exp(x - max)`, defined as 1 / 0 when `max` is infinite (where the difference
/// would be NaN): the experts equal to an infinite max share the mass.
#[inline]
fn shifted_exp(x: f32, max: f32) -> f32 {
    if max.is_infinite() {
        if x == max {
            1.0
        } else {
            0.0
        }
    } else {
        libm::expf(x - max)
    }
}

#[derive(Clone, Copy)]
struct Candidate {
    expert: u16,
    key: f32,
    prob: f32,
}

/// Expert `i`'s gating probability and selection key (its rank plus the
/// selection bias; never NaN).
fn key_of(probs: &Probs<'_>, bias: Option<&[f32]>, i: usize) -> (f32, f32) {
    let prob = probs.prob(i);
    let rank = probs.rank(i, prob);
    let key = sanitize(match bias {
        Some(b) => rank + b[i],
        None => rank,
    });
    (prob, key)
}

/// The groups whose experts may be picked, as a bit mask: the `used` best by
/// the sum of each group's two best keys (the best first, as ggml sums the
/// top two), higher first and, on equal sums, the lower group first.
fn allowed_groups(probs: &Probs<'_>, bias: Option<&[f32]>, g: ExpertGroups) -> u64 {
    let per = probs.logits.len() / g.count.max(1);
    let mut best: Vec<(f32, usize), MAX_EXPERT_GROUPS> = Vec::new();
    for group in 0..g.count.min(MAX_EXPERT_GROUPS) {
        let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
        for i in group * per..(group + 1) * per {
            let (_, key) = key_of(probs, bias, i);
            if key > a {
                (a, b) = (key, a);
            } else if key > b {
                b = key;
            }
        }
        let score = sanitize(a + b);
        let mut pos = best.len();
        while pos > 0 && best[pos - 1].0 < score {
            pos -= 1;
        }
        // Cannot fail: at most MAX_EXPERT_GROUPS groups.
        let _ = best.insert(pos, (score, group));
    }
    best.iter()
        .take(g.used)
        .fold(0u64, |mask, &(_, group)| mask | 1 << group)
}

/// Keeps in `sel` the `limit` best experts by (key descending, id ascending),
/// considering only keys `>= min_key` when given and, with `groups`, only the
/// experts of the allowed groups. Insertion into a sorted buffer: O(n) for the
/// usual small k, as most experts fail the first comparison.
fn select<const N: usize>(
    probs: &Probs<'_>,
    bias: Option<&[f32]>,
    groups: Option<ExpertGroups>,
    limit: usize,
    min_key: Option<f32>,
    sel: &mut Vec<Candidate, N>,
) {
    sel.clear();
    let limit = limit.min(N);
    if limit == 0 {
        return;
    }
    let allowed = groups.map(|g| {
        let per = probs.logits.len() / g.count.max(1);
        (allowed_groups(probs, bias, g), per.max(1))
    });
    for i in 0..probs.logits.len() {
        if let Some((mask, per)) = allowed {
            if mask >> (i / per) & 1 == 0 {
                continue;
            }
        }
        let (prob, key) = key_of(probs, bias, i);
        if let Some(t) = min_key {
            // The threshold is on the probability (plus the selection bias).
            let score = match probs.gating {
                Gating::SoftmaxWeight | Gating::SigmoidOfLogits => {
                    sanitize(prob + bias.map_or(0.0, |b| b[i]))
                }
                _ => key,
            };
            // `score` is never NaN; a NaN threshold admits nothing.
            if t.is_nan() || score < t {
                continue;
            }
        }
        // Experts come in ascending id order, so an equal key goes after the
        // entries already there (lower ids first).
        let mut pos = sel.len();
        while pos > 0 && sel[pos - 1].key < key {
            pos -= 1;
        }
        if pos >= limit {
            continue;
        }
        if sel.len() >= limit {
            sel.pop();
        }
        // Cannot fail: len < limit <= N; i < MAX_EXPERTS fits u16 (checked in new).
        let _ = sel.insert(
            pos,
            Candidate {
                expert: i as u16,
                key,
                prob,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::vec::Vec as StdVec;

    fn cfg(n: usize, k: usize, gating: Gating, normalize: bool, scale: f32) -> RouterConfig {
        RouterConfig::new(n, k, gating, normalize, scale).unwrap()
    }

    fn route(c: &RouterConfig, logits: &[f32], bias: Option<&[f32]>) -> Routing {
        let mut out = Routing::new();
        c.route(logits, bias, &mut out).unwrap();
        out
    }

    /// gpt-oss: the top-k of the logits, weighted by a softmax over theirs
    /// alone (not renormalised probabilities of all experts, which differ in
    /// the last bits); predictions rank the same and threshold on the full
    /// softmax.
    #[test]
    fn softmax_weight_is_a_softmax_of_the_picks() {
        let c = cfg(5, 2, Gating::SoftmaxWeight, false, 1.0);
        let logits = [0.5f32, 3.0, -1.0, 2.0, 2.0];
        let r = route(&c, &logits, None);
        assert_eq!(experts(&r), [1, 3]);
        let (a, b) = (libm::expf(0.0), libm::expf(2.0 - 3.0));
        let inv = (1.0 / (f64::from(a) + f64::from(b))) as f32;
        assert_eq!(weights(&r), [a * inv, b * inv]);
        // Ties keep the lower id, as for every gating.
        let r = route(&cfg(5, 3, Gating::SoftmaxWeight, false, 1.0), &logits, None);
        assert_eq!(experts(&r), [1, 3, 4]);
        let mut p = Prediction::new();
        let pc = PredictorConfig {
            mode: PredictMode::Threshold {
                min_prob: 0.25,
                max: 5,
            },
        };
        predict(&logits, None, &c, &pc, &mut p).unwrap();
        let ids: std::vec::Vec<u16> = p.iter().map(|x| x.expert).collect();
        // Full softmax: 3.0 -> 0.545, 2.0 -> 0.200 each; only expert 1 passes 0.25.
        assert_eq!(ids, [1]);
        assert!(p.iter().all(|x| x.prob > 0.5 && x.prob < 0.6));
    }

    fn experts(r: &[ExpertWeight]) -> StdVec<u16> {
        r.iter().map(|e| e.expert).collect()
    }

    fn weights(r: &[ExpertWeight]) -> StdVec<f32> {
        r.iter().map(|e| e.weight).collect()
    }

    fn assert_close(got: &[f32], want: &[f32], tol: f32) {
        assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= tol, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn softmax_known_vector() {
        let logits = [1.0, 2.0, 3.0, 4.0];
        let r = route(&cfg(4, 2, Gating::Softmax, false, 1.0), &logits, None);
        assert_eq!(experts(&r), [3, 2]);
        // e^4 / sum and e^3 / sum, sum = e + e^2 + e^3 + e^4.
        assert_close(&weights(&r), &[0.643_914_2, 0.236_882_8], 1e-6);

        let mut p = [0.0; 4];
        cfg(4, 2, Gating::Softmax, false, 1.0)
            .probabilities(&logits, &mut p)
            .unwrap();
        assert_close(
            &p,
            &[0.032_058_6, 0.087_144_3, 0.236_882_8, 0.643_914_2],
            1e-6,
        );
    }

    #[test]
    fn softmax_renormalised() {
        let r = route(
            &cfg(4, 2, Gating::Softmax, true, 1.0),
            &[1.0, 2.0, 3.0, 4.0],
            None,
        );
        assert_eq!(experts(&r), [3, 2]);
        // Renormalised top-2 of a softmax is the softmax of the two logits.
        assert_close(&weights(&r), &[0.731_058_6, 0.268_941_4], 1e-6);
    }

    /// llama4's gating ranks the logits: where the sigmoid saturates to 1.0
    /// for several experts, the higher logit still wins (plain sigmoid gating
    /// would take the lower id), and the weight is the pick's sigmoid.
    #[test]
    fn sigmoid_of_logits_ranks_the_logits() {
        let logits = [20.0, 30.0, -1.0, 25.0];
        assert_eq!(sigmoid(20.0), sigmoid(30.0));
        let plain = route(&cfg(4, 1, Gating::Sigmoid, false, 1.0), &logits, None);
        assert_eq!(experts(&plain), [0]);
        let r = route(
            &cfg(4, 2, Gating::SigmoidOfLogits, false, 1.0),
            &logits,
            None,
        );
        assert_eq!(experts(&r), [1, 3]);
        assert_eq!(weights(&r), [sigmoid(30.0), sigmoid(25.0)]);
        let logits = [0.0, 2.0, -1.0, 1.0];
        let r = route(
            &cfg(4, 2, Gating::SigmoidOfLogits, false, 1.0),
            &logits,
            None,
        );
        assert_eq!(experts(&r), [1, 3]);
        assert_close(&weights(&r), &[0.880_797_1, 0.731_058_6], 1e-6);
    }

    #[test]
    fn sigmoid_known_vector() {
        let logits = [0.0, 2.0, -1.0, 1.0];
        let r = route(&cfg(4, 2, Gating::Sigmoid, false, 1.0), &logits, None);
        assert_eq!(experts(&r), [1, 3]);
        assert_close(&weights(&r), &[0.880_797_1, 0.731_058_6], 1e-6);

        let r = route(&cfg(4, 2, Gating::Sigmoid, true, 1.0), &logits, None);
        let s = 0.880_797_1 + 0.731_058_6;
        assert_close(&weights(&r), &[0.880_797_1 / s, 0.731_058_6 / s], 1e-6);
    }

    #[test]
    fn scale_applies_after_renormalisation() {
        let logits = [1.0, 2.0, 3.0, 4.0];
        let r = route(&cfg(4, 2, Gating::Softmax, true, 2.5), &logits, None);
        assert_close(&weights(&r), &[0.731_058_6 * 2.5, 0.268_941_4 * 2.5], 1e-6);
        let r = route(&cfg(4, 2, Gating::Softmax, false, 2.5), &logits, None);
        assert_close(&weights(&r), &[0.643_914_2 * 2.5, 0.236_882_8 * 2.5], 1e-6);
        // 0.0 reads as "no scale", like llama.cpp.
        let c = cfg(4, 2, Gating::Softmax, true, 0.0);
        assert_eq!(c.weights_scale(), 1.0);
        assert_close(
            &weights(&route(&c, &logits, None)),
            &[0.731_058_6, 0.268_941_4],
            1e-6,
        );
    }

    #[test]
    fn bias_changes_selection_not_weights() {
        let c = cfg(4, 2, Gating::Sigmoid, false, 1.0);
        let logits = [2.0, 1.0, 0.0, -1.0];
        assert_eq!(experts(&route(&c, &logits, None)), [0, 1]);
        let bias = [0.0, 0.0, 1.0, 0.0];
        let r = route(&c, &logits, Some(&bias));
        // Expert 2 scores 0.5 + 1.0 and ranks first, but weighs its probability.
        assert_eq!(experts(&r), [2, 0]);
        assert_close(&weights(&r), &[0.5, 0.880_797_1], 1e-6);

        let c = cfg(4, 2, Gating::Sigmoid, true, 1.0);
        let r = route(&c, &logits, Some(&bias));
        let s = 0.5 + 0.880_797_1;
        assert_close(&weights(&r), &[0.5 / s, 0.880_797_1 / s], 1e-6);
    }

    #[test]
    fn ties_go_to_the_lower_id() {
        let c = cfg(6, 3, Gating::Softmax, true, 1.0);
        let r = route(&c, &[0.5; 6], None);
        assert_eq!(experts(&r), [0, 1, 2]);
        assert_close(&weights(&r), &[1.0 / 3.0; 3], 1e-6);

        let logits = [1.0, 3.0, 3.0, 1.0, 3.0];
        let r = route(&cfg(5, 2, Gating::Sigmoid, false, 1.0), &logits, None);
        assert_eq!(experts(&r), [1, 2]);
        let r = route(&cfg(5, 4, Gating::Sigmoid, false, 1.0), &logits, None);
        assert_eq!(experts(&r), [1, 2, 4, 0]);
    }

    #[test]
    fn nan_and_infinite_logits() {
        let nan = f32::NAN;
        let inf = f32::INFINITY;
        let c = cfg(4, 2, Gating::Softmax, false, 1.0);
        // NaN counts as -inf: probability 0, ranked last.
        let r = route(&c, &[nan, 1.0, nan, 0.0], None);
        assert_eq!(experts(&r), [1, 3]);
        assert_close(&weights(&r), &[0.731_058_6, 0.268_941_4], 1e-6);
        // All NaN: uniform, lower ids first.
        let r = route(&c, &[nan; 4], None);
        assert_eq!(experts(&r), [0, 1]);
        assert_close(&weights(&r), &[0.25, 0.25], 0.0);
        // +inf logits share the mass.
        let r = route(
            &cfg(3, 2, Gating::Softmax, false, 1.0),
            &[inf, 0.0, inf],
            None,
        );
        assert_eq!(experts(&r), [0, 2]);
        assert_close(&weights(&r), &[0.5, 0.5], 0.0);

        let c = cfg(4, 2, Gating::Sigmoid, true, 1.0);
        let r = route(&c, &[nan, -inf, inf, 0.0], None);
        assert_eq!(experts(&r), [2, 3]);
        assert_close(&weights(&r), &[1.0 / 1.5, 0.5 / 1.5], 1e-6);
        // NaN bias ranks that expert last too.
        let r = route(&c, &[3.0, 0.0, 1.0, 2.0], Some(&[nan, 0.0, 0.0, 0.0]));
        assert_eq!(experts(&r), [3, 2]);
    }

    #[test]
    fn tiny_sum_is_clamped() {
        let c = cfg(3, 2, Gating::Sigmoid, true, 1.0);
        let r = route(&c, &[-20.0, -20.0, -30.0], None);
        let p = sigmoid(-20.0);
        assert!(2.0 * p < WEIGHT_SUM_MIN);
        assert_eq!(weights(&r), [p / WEIGHT_SUM_MIN, p / WEIGHT_SUM_MIN]);
    }

    #[test]
    fn config_errors() {
        use RouterError::*;
        let new = |n, k, s| RouterConfig::new(n, k, Gating::Softmax, true, s);
        assert_eq!(new(8, 0, 1.0), Err(ZeroTopK));
        assert_eq!(
            new(8, 9, 1.0),
            Err(TopKAboveExperts {
                top_k: 9,
                n_experts: 8
            })
        );
        assert_eq!(
            new(0, 1, 1.0).unwrap_err(),
            TopKAboveExperts {
                top_k: 1,
                n_experts: 0
            }
        );
        assert_eq!(new(64, 33, 1.0), Err(TopKAboveMax { top_k: 33 }));
        assert!(new(64, MAX_TOP_K, 1.0).is_ok());
        assert_eq!(new(8, 2, f32::NAN), Err(NonFiniteScale));
        assert_eq!(new(8, 2, f32::INFINITY), Err(NonFiniteScale));
        assert_eq!(
            new(MAX_EXPERTS + 1, 2, 1.0),
            Err(TooManyExperts {
                n_experts: MAX_EXPERTS + 1
            })
        );
        assert!(new(MAX_EXPERTS, 2, 1.0).is_ok());
    }

    #[test]
    fn route_errors_leave_output_empty() {
        let c = cfg(4, 2, Gating::Softmax, true, 1.0);
        let mut out = Routing::new();
        c.route(&[0.0; 4], None, &mut out).unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!(
            c.route(&[0.0; 5], None, &mut out),
            Err(RouterError::LogitsLength {
                expected: 4,
                actual: 5
            })
        );
        assert!(out.is_empty());
        assert_eq!(
            c.route(&[0.0; 4], Some(&[0.0; 3]), &mut out),
            Err(RouterError::BiasLength {
                expected: 4,
                actual: 3
            })
        );
        let mut p = [0.0; 3];
        assert!(c.probabilities(&[0.0; 4], &mut p).is_err());
        let mut pred = Prediction::new();
        assert!(predict(&[0.0; 3], None, &c, &PredictorConfig::top_k(2), &mut pred).is_err());
        assert_eq!(
            predict(&[0.0; 4], None, &c, &PredictorConfig::top_k(65), &mut pred),
            Err(RouterError::PredictionAboveMax { requested: 65 })
        );
    }

    #[test]
    fn errors_display() {
        use std::string::ToString;
        let errs = [
            RouterError::ZeroTopK,
            RouterError::TopKAboveExperts {
                top_k: 3,
                n_experts: 2,
            },
            RouterError::TopKAboveMax { top_k: 40 },
            RouterError::TooManyExperts { n_experts: 70000 },
            RouterError::NonFiniteScale,
            RouterError::LogitsLength {
                expected: 1,
                actual: 2,
            },
            RouterError::BiasLength {
                expected: 1,
                actual: 2,
            },
            RouterError::PredictionAboveMax { requested: 99 },
            RouterError::LayerOutOfRange { layer: 300 },
        ];
        for e in errs {
            let _: &dyn core::error::Error = &e;
            assert!(!e.to_string().is_empty());
        }
        assert_eq!(
            RouterError::LogitsLength {
                expected: 128,
                actual: 64
            }
            .to_string(),
            "expected 128 router logits, got 64"
        );
    }

    #[test]
    fn shared_gate_and_gguf_ids() {
        assert_eq!(shared_expert_gate(0.0), 0.5);
        assert_eq!(shared_expert_gate(100.0), 1.0);
        assert_eq!(shared_expert_gate(-200.0), 0.0);
        assert!((shared_expert_gate(2.0) - 0.880_797_1).abs() < 1e-6);
        assert_eq!(Gating::from_gguf(1), Some(Gating::Softmax));
        assert_eq!(Gating::from_gguf(2), Some(Gating::Sigmoid));
        assert_eq!(Gating::from_gguf(3), Some(Gating::SoftmaxWeight));
        assert_eq!(Gating::from_gguf(0), None);
        assert_eq!(Gating::from_gguf(4), None);
    }

    #[test]
    fn predictor_modes() {
        let c = cfg(6, 2, Gating::Softmax, true, 1.0);
        let logits = [0.0, 3.0, 1.0, 2.5, -1.0, 2.0];
        let mut probs = [0.0; 6];
        c.probabilities(&logits, &mut probs).unwrap();
        let mut out = Prediction::new();

        predict(&logits, None, &c, &PredictorConfig::matching(&c), &mut out).unwrap();
        let ids: StdVec<u16> = out.iter().map(|p| p.expert).collect();
        assert_eq!(ids, [1, 3]);
        assert_eq!(out[0].prob, probs[1]);

        predict(&logits, None, &c, &PredictorConfig::top_k(4), &mut out).unwrap();
        let ids: StdVec<u16> = out.iter().map(|p| p.expert).collect();
        assert_eq!(ids, [1, 3, 5, 2]);
        // k beyond the expert count predicts every expert.
        predict(&logits, None, &c, &PredictorConfig::top_k(10), &mut out).unwrap();
        assert_eq!(out.len(), 6);
        predict(&logits, None, &c, &PredictorConfig::top_k(0), &mut out).unwrap();
        assert!(out.is_empty());

        let t = probs[5]; // exactly expert 5's probability: included (>=)
        predict(
            &logits,
            None,
            &c,
            &PredictorConfig::threshold(t, 8),
            &mut out,
        )
        .unwrap();
        let ids: StdVec<u16> = out.iter().map(|p| p.expert).collect();
        assert_eq!(ids, [1, 3, 5]);
        predict(
            &logits,
            None,
            &c,
            &PredictorConfig::threshold(t, 2),
            &mut out,
        )
        .unwrap();
        let ids: StdVec<u16> = out.iter().map(|p| p.expert).collect();
        assert_eq!(ids, [1, 3]);
        predict(
            &logits,
            None,
            &c,
            &PredictorConfig::threshold(0.99, 8),
            &mut out,
        )
        .unwrap();
        assert!(out.is_empty());
        let nan = PredictorConfig::threshold(f32::NAN, 8);
        predict(&logits, None, &c, &nan, &mut out).unwrap();
        assert!(out.is_empty());
        assert_eq!(
            predict(
                &logits,
                None,
                &c,
                &PredictorConfig::threshold(0.1, MAX_PREDICTED + 1),
                &mut out
            ),
            Err(RouterError::PredictionAboveMax {
                requested: MAX_PREDICTED + 1
            })
        );
    }

    #[test]
    fn predictor_uses_selection_bias() {
        let c = cfg(4, 2, Gating::Sigmoid, true, 1.0);
        let logits = [2.0, 1.0, 0.0, -1.0];
        let bias = [0.0, 0.0, 1.0, 0.0];
        let mut out = Prediction::new();
        predict(
            &logits,
            Some(&bias),
            &c,
            &PredictorConfig::matching(&c),
            &mut out,
        )
        .unwrap();
        let ids: StdVec<u16> = out.iter().map(|p| p.expert).collect();
        assert_eq!(ids, experts(&route(&c, &logits, Some(&bias))));
        assert_eq!(out[0].prob, 0.5);
        // The threshold compares the biased score (1.5 for expert 2).
        let th = PredictorConfig::threshold(1.2, 4);
        predict(&logits, Some(&bias), &c, &th, &mut out).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].expert, 2);
    }

    #[test]
    fn layer_mask() {
        let mut m = LayerMask::new();
        assert_eq!(m.count(), 0);
        assert!(!m.is_enabled(0));
        m.enable(0).unwrap();
        m.enable(63).unwrap();
        m.enable(64).unwrap();
        m.enable(255).unwrap();
        assert!(m.is_enabled(0) && m.is_enabled(63) && m.is_enabled(64) && m.is_enabled(255));
        assert!(!m.is_enabled(1) && !m.is_enabled(65));
        assert_eq!(m.count(), 4);
        m.disable(63).unwrap();
        assert!(!m.is_enabled(63));
        assert_eq!(m.count(), 3);
        assert_eq!(
            m.enable(256),
            Err(RouterError::LayerOutOfRange { layer: 256 })
        );
        assert!(m.disable(1000).is_err());
        assert!(!m.is_enabled(256) && !m.is_enabled(usize::MAX));

        let f = LayerMask::first(47).unwrap();
        assert_eq!(f.count(), 47);
        assert!(f.is_enabled(46) && !f.is_enabled(47));
        assert_eq!(LayerMask::first(256).unwrap().count(), 256);
        assert_eq!(LayerMask::first(0).unwrap(), LayerMask::default());
        assert!(LayerMask::first(257).is_err());
    }

    fn p(ids: &[u16]) -> StdVec<Predicted> {
        ids.iter()
            .map(|&expert| Predicted { expert, prob: 0.1 })
            .collect()
    }

    fn w(ids: &[u16]) -> StdVec<ExpertWeight> {
        ids.iter()
            .map(|&expert| ExpertWeight {
                expert,
                weight: 0.1,
            })
            .collect()
    }

    #[test]
    fn prediction_score() {
        let s = PredictionScore::of(&p(&[1, 2, 3, 4]), &w(&[2, 4, 7]));
        assert_eq!(
            s,
            PredictionScore {
                true_positives: 2,
                predicted: 4,
                picked: 3
            }
        );
        assert_eq!(s.precision(), 0.5);
        assert!((s.recall() - 2.0 / 3.0).abs() < 1e-7);

        // Empty prediction: nothing wasted, everything missed.
        let s = PredictionScore::of(&[], &w(&[2, 4]));
        assert_eq!((s.true_positives, s.predicted, s.picked), (0, 0, 2));
        assert_eq!((s.precision(), s.recall()), (1.0, 0.0));
        // Empty routing: everything wasted, nothing missed.
        let s = PredictionScore::of(&p(&[1, 2]), &[]);
        assert_eq!((s.true_positives, s.predicted, s.picked), (0, 2, 0));
        assert_eq!((s.precision(), s.recall()), (0.0, 1.0));
        // Both empty.
        let s = PredictionScore::of(&[], &[]);
        assert_eq!((s.precision(), s.recall()), (1.0, 1.0));
        // Perfect, and duplicates count once.
        let s = PredictionScore::of(&p(&[5, 3, 5]), &w(&[3, 5, 3]));
        assert_eq!((s.true_positives, s.predicted, s.picked), (2, 2, 2));
        assert_eq!((s.precision(), s.recall()), (1.0, 1.0));

        let mut total = PredictionScore::default();
        total += PredictionScore::of(&p(&[1, 2]), &w(&[1, 3]));
        total += PredictionScore::of(&p(&[4]), &w(&[4, 5]));
        assert_eq!(
            total,
            PredictionScore {
                true_positives: 2,
                predicted: 3,
                picked: 4
            }
        );
    }

    /// Finite logits: mostly moderate, some with exact ties, some of any magnitude.
    fn logit() -> impl Strategy<Value = f32> {
        prop_oneof![
            4 => -20.0f32..20.0,
            2 => (-3i8..=3).prop_map(f32::from),
            1 => proptest::num::f32::NORMAL
                | proptest::num::f32::SUBNORMAL
                | proptest::num::f32::ZERO,
        ]
    }

    fn gating() -> impl Strategy<Value = Gating> {
        prop_oneof![
            Just(Gating::Softmax),
            Just(Gating::Sigmoid),
            Just(Gating::SigmoidOfLogits),
        ]
    }

    /// (config, logits, optional bias; none for [`Gating::SigmoidOfLogits`],
    /// whose architecture has none, so that its score is one scale).
    fn case() -> impl Strategy<Value = (RouterConfig, StdVec<f32>, Option<StdVec<f32>>)> {
        (1usize..=160)
            .prop_flat_map(|n| {
                (
                    Just(n),
                    1..=n.min(MAX_TOP_K),
                    gating(),
                    any::<bool>(),
                    prop_oneof![Just(1.0f32), 0.1f32..4.0],
                    proptest::collection::vec(logit(), n),
                    proptest::option::of(proptest::collection::vec(-1.0f32..1.0, n)),
                )
            })
            .prop_map(|(n, k, g, norm, scale, logits, bias)| {
                let bias = bias.filter(|_| g != Gating::SigmoidOfLogits);
                (cfg(n, k, g, norm, scale), logits, bias)
            })
    }

    /// Top-k by a full sort on (score desc, id asc): the reference.
    fn naive_top_k(
        c: &RouterConfig,
        logits: &[f32],
        bias: Option<&[f32]>,
        k: usize,
    ) -> StdVec<u16> {
        let mut probs = std::vec![0.0; c.n_experts()];
        c.probabilities(logits, &mut probs).unwrap();
        let mut idx: StdVec<usize> = (0..c.n_experts()).collect();
        let score = |i: usize| match c.gating() {
            Gating::SigmoidOfLogits if logits[i].is_nan() => f32::NEG_INFINITY,
            Gating::SigmoidOfLogits => logits[i],
            _ => probs[i] + bias.map_or(0.0, |b| b[i]),
        };
        idx.sort_by(|&a, &b| score(b).partial_cmp(&score(a)).unwrap().then(a.cmp(&b)));
        idx.truncate(k);
        idx.into_iter().map(|i| i as u16).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn routing_properties((c, logits, bias) in case()) {
            let bias = bias.as_deref();
            let r = route(&c, &logits, bias);
            let ids = experts(&r);
            prop_assert_eq!(ids.len(), c.top_k());
            let mut sorted = ids.clone();
            sorted.sort_unstable();
            sorted.dedup();
            prop_assert_eq!(sorted.len(), c.top_k());
            prop_assert!(ids.iter().all(|&e| usize::from(e) < c.n_experts()));
            prop_assert_eq!(&ids, &naive_top_k(&c, &logits, bias, c.top_k()));

            let mut probs = std::vec![0.0; c.n_experts()];
            c.probabilities(&logits, &mut probs).unwrap();
            prop_assert!(probs.iter().all(|p| (0.0..=1.0).contains(p)));
            if bias.is_none() {
                prop_assert!(r.windows(2).all(|w| w[0].weight >= w[1].weight), "{:?}", r);
            }
            if !c.normalize() {
                // Weights are the unbiased probabilities, scaled.
                for e in &r {
                    prop_assert_eq!(e.weight, probs[usize::from(e.expert)] * c.weights_scale());
                }
            } else {
                let raw: f32 = r.iter().map(|e| probs[usize::from(e.expert)]).sum();
                if raw >= WEIGHT_SUM_MIN {
                    let sum: f32 = r.iter().map(|e| e.weight).sum();
                    let scale = c.weights_scale();
                    prop_assert!((sum - scale).abs() <= 1e-5 * scale, "sum {} scale {}", sum, scale);
                }
            }
        }

        #[test]
        fn predictor_top_k_matches_routing((c, logits, bias) in case(), j in 0usize..=MAX_TOP_K) {
            let bias = bias.as_deref();
            let r = route(&c, &logits, bias);
            let j = j.min(c.top_k());
            let mut out = Prediction::new();
            predict(&logits, bias, &c, &PredictorConfig::top_k(j), &mut out).unwrap();
            let ids: StdVec<u16> = out.iter().map(|p| p.expert).collect();
            prop_assert_eq!(&ids[..], &experts(&r)[..j]);
            predict(&logits, bias, &c, &PredictorConfig::matching(&c), &mut out).unwrap();
            let s = PredictionScore::of(&out, &r);
            prop_assert_eq!((s.precision(), s.recall()), (1.0, 1.0));
        }

        #[test]
        fn threshold_is_monotone(
            (c, logits, bias) in case(),
            t1 in 0.0f32..1.0,
            t2 in 0.0f32..1.0,
            max in 0usize..=MAX_PREDICTED,
        ) {
            let bias = bias.as_deref();
            let (lo, hi) = if t1 <= t2 { (t1, t2) } else { (t2, t1) };
            let mut a = Prediction::new();
            let mut b = Prediction::new();
            predict(&logits, bias, &c, &PredictorConfig::threshold(lo, max), &mut a).unwrap();
            predict(&logits, bias, &c, &PredictorConfig::threshold(hi, max), &mut b).unwrap();
            prop_assert!(a.len() <= max && b.len() <= max);
            prop_assert!(b.iter().all(|x| a.iter().any(|y| y.expert == x.expert)), "{:?} not in {:?}", b, a);
            if bias.is_none() {
                prop_assert!(a.iter().all(|x| x.prob >= lo));
                prop_assert!(a.windows(2).all(|w| w[0].prob >= w[1].prob));
                // Everything above the threshold is there unless capped.
                let mut probs = std::vec![0.0; c.n_experts()];
                c.probabilities(&logits, &mut probs).unwrap();
                let above = probs.iter().filter(|&&p| p >= lo).count();
                prop_assert_eq!(a.len(), above.min(max));
            }
        }
    }

    /// Group-limited routing as llama.cpp's `build_moe_ffn` computes it, the
    /// slow way: every key, each group's two best summed, the best groups
    /// kept, the others' keys `-inf`, then the top k of what is left.
    fn grouped_reference(
        c: &RouterConfig,
        g: ExpertGroups,
        logits: &[f32],
        bias: Option<&[f32]>,
    ) -> StdVec<u16> {
        let mut probs = std::vec![0.0; c.n_experts()];
        c.probabilities(logits, &mut probs).unwrap();
        let keys: StdVec<f32> = (0..c.n_experts())
            .map(|i| sanitize(probs[i] + bias.map_or(0.0, |b| b[i])))
            .collect();
        let per = c.n_experts() / g.count;
        let mut scores: StdVec<(f32, usize)> = (0..g.count)
            .map(|gi| {
                let mut k: StdVec<f32> = keys[gi * per..(gi + 1) * per].to_vec();
                k.sort_by(|a, b| b.partial_cmp(a).unwrap());
                (sanitize(k[0] + k[1]), gi)
            })
            .collect();
        scores.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
        let kept: StdVec<usize> = scores[..g.used].iter().map(|s| s.1).collect();
        let mut idx: StdVec<usize> = (0..c.n_experts())
            .filter(|i| kept.contains(&(i / per)))
            .collect();
        idx.sort_by(|a, b| keys[*b].partial_cmp(&keys[*a]).unwrap().then(a.cmp(b)));
        idx[..c.top_k()].iter().map(|&i| i as u16).collect()
    }

    #[test]
    fn groups_limit_the_picks_to_the_best_groups() {
        // 8 experts in 4 groups of 2; expert 0 alone is the best, but group 0's
        // pair of probabilities sums less than groups 2's and 3's.
        let logits = [3.0, -5.0, 1.0, 0.5, 2.6, 2.6, 2.5, 2.5];
        let plain = cfg(8, 2, Gating::Softmax, true, 1.0);
        assert_eq!(route(&plain, &logits, None)[0].expert, 0);
        let g = ExpertGroups { count: 4, used: 2 };
        let grouped = plain.with_groups(g).unwrap();
        let r = route(&grouped, &logits, None);
        let ids: StdVec<u16> = r.iter().map(|x| x.expert).collect();
        assert_eq!(ids, [4, 5]);
        assert_eq!(ids, grouped_reference(&grouped, g, &logits, None));
        // Renormalised over the picks, as without groups.
        assert!((r[0].weight + r[1].weight - 1.0).abs() < 1e-6);
        // Predictions keep to the same groups.
        let mut p = Prediction::new();
        predict(&logits, None, &grouped, &PredictorConfig::top_k(4), &mut p).unwrap();
        let predicted: StdVec<u16> = p.iter().map(|x| x.expert).collect();
        assert_eq!(predicted, [4, 5, 6, 7]);
    }

    #[test]
    fn groups_that_do_not_fit_are_refused() {
        let c = cfg(8, 3, Gating::Sigmoid, true, 1.0);
        for (count, used) in [(3, 1), (1, 1), (8, 2), (4, 0), (4, 4), (4, 1), (128, 2)] {
            let g = ExpertGroups { count, used };
            let e = c.with_groups(g).unwrap_err();
            assert!(matches!(e, RouterError::BadGroups { .. }), "{count}/{used}");
            assert!(std::format!("{e}").contains("expert groups"), "{e}");
        }
        assert!(c.with_groups(ExpertGroups { count: 4, used: 2 }).is_ok());
    }

    proptest! {
        #[test]
        fn grouped_routing_equals_the_reference(
            logits in proptest::collection::vec(-8.0f32..8.0, 16),
            bias in proptest::option::of(proptest::collection::vec(-0.5f32..0.5, 16)),
            sigmoid: bool,
            (count, used, k) in prop_oneof![
                Just((2usize, 1usize, 4usize)),
                Just((4, 2, 3)),
                Just((4, 3, 6)),
                Just((8, 2, 4)),
                Just((8, 5, 2)),
            ],
        ) {
            let gating = if sigmoid { Gating::Sigmoid } else { Gating::Softmax };
            let g = ExpertGroups { count, used };
            let c = cfg(16, k, gating, true, 2.5).with_groups(g).unwrap();
            let r = route(&c, &logits, bias.as_deref());
            let ids: StdVec<u16> = r.iter().map(|x| x.expert).collect();
            prop_assert_eq!(ids, grouped_reference(&c, g, &logits, bias.as_deref()));
        }
    }
}
