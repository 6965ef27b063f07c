//! Per-layer expert types: the `--expert-types` plan syntax, and the allocation
//! that meets a bits-per-weight budget at the least measured error.

use std::fmt;
use std::str::FromStr;

use les_core::quant::GgmlType;

use super::PackError;

/// What one layer's experts become.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Choice {
    /// The source types, bytes copied verbatim.
    Keep,
    /// Gate, up and down all of this type (matrices already of it are copied).
    Type(GgmlType),
}

impl fmt::Display for Choice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Choice::Keep => f.write_str("keep"),
            Choice::Type(t) => f.write_str(t.name()),
        }
    }
}

impl FromStr for Choice {
    type Err = PackError;

    /// A ggml type name (`q4_k`, case-insensitive) or `keep`.
    fn from_str(s: &str) -> Result<Self, PackError> {
        if s.eq_ignore_ascii_case("keep") {
            return Ok(Choice::Keep);
        }
        let ty = GgmlType::from_name(s).ok_or_else(|| PackError::UnknownType(s.into()))?;
        if ty.is_activation_only() {
            return Err(PackError::Plan(format!(
                "{ty} is an activation or byte type, not a weight type"
            )));
        }
        Ok(Choice::Type(ty))
    }
}

/// One `RANGE:TYPE` entry of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanEntry {
    /// First layer of the range.
    pub first: usize,
    /// Last layer (inclusive), `None` for an open range `a-`.
    pub last: Option<usize>,
    /// What the layers become.
    pub choice: Choice,
}

impl PlanEntry {
    /// Whether the entry covers `layer`.
    pub fn covers(&self, layer: usize) -> bool {
        layer >= self.first && self.last.is_none_or(|l| layer <= l)
    }
}

impl fmt::Display for PlanEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.last {
            Some(l) if l == self.first => write!(f, "{}:{}", self.first, self.choice),
            Some(l) => write!(f, "{}-{l}:{}", self.first, self.choice),
            None => write!(f, "{}-:{}", self.first, self.choice),
        }
    }
}

/// A per-layer type plan: `0-3:q6_k,4-:q4_k`.
///
/// Entries are `a-b:TYPE` (layers a to b), `a-:TYPE` (a and above) or `a:TYPE`;
/// later entries override earlier ones; `TYPE` is a ggml type name or `keep`.
/// Layers no entry covers keep their source types.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// The entries, in order (later ones win).
    pub entries: Vec<PlanEntry>,
}

impl Plan {
    /// The choice for `layer`: the last entry covering it, else `None` (keep).
    pub fn choice(&self, layer: usize) -> Option<Choice> {
        self.entries
            .iter()
            .rev()
            .find(|e| e.covers(layer))
            .map(|e| e.choice)
    }

    /// The compact plan that gives each of `layers` (ascending) its choice:
    /// runs of consecutive layers with one choice become one range.
    pub fn from_choices(layers: &[(usize, Choice)]) -> Plan {
        let mut entries: Vec<PlanEntry> = Vec::new();
        for &(layer, choice) in layers {
            if let Some(last) = entries.last_mut() {
                if last.choice == choice && last.last.is_some_and(|l| l + 1 == layer) {
                    last.last = Some(layer);
                    continue;
                }
            }
            entries.push(PlanEntry {
                first: layer,
                last: Some(layer),
                choice,
            });
        }
        Plan { entries }
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.entries.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            e.fmt(f)?;
        }
        Ok(())
    }
}

fn layer_number(s: &str, entry: &str) -> Result<usize, PackError> {
    s.trim().parse().map_err(|_| {
        PackError::Plan(format!(
            "bad layer number '{}' in '{entry}' (expected a-b:TYPE, a-:TYPE or a:TYPE)",
            s.trim()
        ))
    })
}

impl FromStr for Plan {
    type Err = PackError;

    fn from_str(s: &str) -> Result<Self, PackError> {
        let mut entries = Vec::new();
        for entry in s.split(',') {
            let entry = entry.trim();
            let Some((range, ty)) = entry.split_once(':') else {
                return Err(PackError::Plan(format!(
                    "'{entry}' has no ':TYPE' (expected a-b:TYPE, a-:TYPE or a:TYPE)"
                )));
            };
            let choice: Choice = ty.trim().parse()?;
            let (first, last) = match range.split_once('-') {
                Some((a, b)) if b.trim().is_empty() => (layer_number(a, entry)?, None),
                Some((a, b)) => (layer_number(a, entry)?, Some(layer_number(b, entry)?)),
                None => {
                    let a = layer_number(range, entry)?;
                    (a, Some(a))
                }
            };
            if last.is_some_and(|l| l < first) {
                return Err(PackError::Plan(format!(
                    "empty layer range in '{entry}' (the end is before the start)"
                )));
            }
            entries.push(PlanEntry {
                first,
                last,
                choice,
            });
        }
        Ok(Plan { entries })
    }
}

/// One candidate of a layer for [`allocate`]: its total bytes and weighted error.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Candidate {
    pub bytes: u64,
    pub error: f64,
}

/// Resolution of the dynamic program's byte axis.
const DP_UNITS: u64 = 8192;

/// Picks one candidate per layer so that the total bytes stay within `budget`
/// and the total error is least: a dynamic program over the budget in
/// [`DP_UNITS`] steps (costs rounded up, so its answer always fits), then a
/// greedy pass that spends what the rounding left on the upgrades with the best
/// error reduction per byte. `None` if even the cheapest choices exceed `budget`.
pub(crate) fn allocate(layers: &[Vec<Candidate>], budget: u64) -> Option<Vec<usize>> {
    let cheapest: Vec<usize> = layers
        .iter()
        .map(|c| {
            (0..c.len()).min_by(|&a, &b| {
                c[a].bytes
                    .cmp(&c[b].bytes)
                    .then(c[a].error.total_cmp(&c[b].error))
            })
        })
        .collect::<Option<_>>()?;
    let total = |pick: &[usize]| -> u64 { pick.iter().zip(layers).map(|(&i, c)| c[i].bytes).sum() };
    if total(&cheapest) > budget {
        return None;
    }
    let unit = budget.div_ceil(DP_UNITS).max(1);
    let cap = (budget / unit) as usize;
    let mut pick = dp(layers, unit, cap).unwrap_or(cheapest);
    // Spend the rest on the best upgrades per byte (a free improvement first).
    let mut left = budget - total(&pick);
    loop {
        let mut best: Option<(usize, usize, f64)> = None;
        for (l, cands) in layers.iter().enumerate() {
            let cur = cands[pick[l]];
            for (i, c) in cands.iter().enumerate() {
                if c.error >= cur.error || c.bytes > cur.bytes + left {
                    continue;
                }
                let gain = cur.error - c.error;
                let extra = c.bytes.saturating_sub(cur.bytes);
                let score = if extra == 0 {
                    f64::INFINITY
                } else {
                    gain / extra as f64
                };
                if best.is_none_or(|(_, _, s)| score > s) {
                    best = Some((l, i, score));
                }
            }
        }
        let Some((l, i, _)) = best else { break };
        left = left + layers[l][pick[l]].bytes - layers[l][i].bytes;
        pick[l] = i;
    }
    Some(pick)
}

/// The exact optimum over costs rounded up to `unit` bytes, within `cap` units.
fn dp(layers: &[Vec<Candidate>], unit: u64, cap: usize) -> Option<Vec<usize>> {
    // best[b]: least error of the layers so far within b units.
    let mut best = vec![0f64; cap + 1];
    let mut choice: Vec<Vec<u8>> = Vec::with_capacity(layers.len());
    for cands in layers {
        let cost: Vec<usize> = cands
            .iter()
            .map(|c| usize::try_from(c.bytes.div_ceil(unit)).unwrap_or(usize::MAX))
            .collect();
        let mut next = vec![f64::INFINITY; cap + 1];
        let mut pick = vec![u8::MAX; cap + 1];
        for b in 0..=cap {
            for (i, c) in cands.iter().enumerate() {
                if cost[i] > b {
                    continue;
                }
                let e = best[b - cost[i]] + c.error;
                if e < next[b] {
                    next[b] = e;
                    pick[b] = i as u8;
                }
            }
        }
        best = next;
        choice.push(pick);
    }
    // The fewest units that reach the least error.
    let least = best.iter().copied().fold(f64::INFINITY, f64::min);
    if !least.is_finite() {
        return None;
    }
    let mut b = best.iter().position(|&e| e == least)?;
    let mut out = vec![0; layers.len()];
    for (l, cands) in layers.iter().enumerate().rev() {
        let i = choice[l][b];
        if i == u8::MAX {
            return None;
        }
        out[l] = i as usize;
        b -= usize::try_from(cands[i as usize].bytes.div_ceil(unit)).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_syntax() {
        let p: Plan = "0-3:q6_k, 4-:Q4_K,7:keep".parse().unwrap();
        assert_eq!(p.to_string(), "0-3:q6_k,4-:q4_k,7:keep");
        assert_eq!(p.choice(0), Some(Choice::Type(GgmlType::Q6K)));
        assert_eq!(p.choice(3), Some(Choice::Type(GgmlType::Q6K)));
        assert_eq!(p.choice(4), Some(Choice::Type(GgmlType::Q4K)));
        assert_eq!(p.choice(7), Some(Choice::Keep));
        assert_eq!(p.choice(1000), Some(Choice::Type(GgmlType::Q4K)));
        let p: Plan = "2-5:q8_0,3:q4_0".parse().unwrap();
        assert_eq!(p.choice(1), None);
        assert_eq!(p.choice(3), Some(Choice::Type(GgmlType::Q4_0)));
        assert_eq!(p.choice(4), Some(Choice::Type(GgmlType::Q8_0)));
    }

    #[test]
    fn plan_errors() {
        let err = |s: &str| s.parse::<Plan>().unwrap_err().to_string();
        assert!(err("0-3").contains("no ':TYPE'"), "{}", err("0-3"));
        assert!(err("x-3:q4_k").contains("bad layer number 'x'"));
        assert!(err("5-3:q4_k").contains("empty layer range"));
        assert!(err("0-:q9_k").contains("unknown ggml type 'q9_k'"));
        assert!(err("0-:q8_k").contains("not a weight type"));
        assert!(err("").contains("no ':TYPE'"));
    }

    #[test]
    fn plan_from_choices_is_compact() {
        let q4 = Choice::Type(GgmlType::Q4K);
        let q6 = Choice::Type(GgmlType::Q6K);
        let p = Plan::from_choices(&[(1, q6), (2, q6), (3, q4), (5, q4), (6, Choice::Keep)]);
        assert_eq!(p.to_string(), "1-2:q6_k,3:q4_k,5:q4_k,6:keep");
    }

    fn cands(list: &[(u64, f64)]) -> Vec<Candidate> {
        list.iter()
            .map(|&(bytes, error)| Candidate { bytes, error })
            .collect()
    }

    /// Exhaustive optimum for small instances.
    fn brute(layers: &[Vec<Candidate>], budget: u64) -> Option<f64> {
        let mut best: Option<f64> = None;
        let mut idx = vec![0usize; layers.len()];
        loop {
            let bytes: u64 = idx.iter().zip(layers).map(|(&i, c)| c[i].bytes).sum();
            let err: f64 = idx.iter().zip(layers).map(|(&i, c)| c[i].error).sum();
            if bytes <= budget && best.is_none_or(|b| err < b) {
                best = Some(err);
            }
            let mut l = 0;
            loop {
                if l == layers.len() {
                    return best;
                }
                idx[l] += 1;
                if idx[l] < layers[l].len() {
                    break;
                }
                idx[l] = 0;
                l += 1;
            }
        }
    }

    #[test]
    fn allocation_matches_brute_force() {
        // Deterministic pseudo-random instances.
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for _ in 0..2000 {
            let n = 1 + (rnd() % 4) as usize;
            let layers: Vec<Vec<Candidate>> = (0..n)
                .map(|_| {
                    let k = 1 + (rnd() % 4) as usize;
                    (0..k)
                        .map(|_| Candidate {
                            bytes: 1000 + rnd() % 9000,
                            error: (rnd() % 1000) as f64,
                        })
                        .collect()
                })
                .collect();
            let budget = 1000 * n as u64 + rnd() % (9000 * n as u64);
            let got = allocate(&layers, budget);
            let want = brute(&layers, budget);
            match (got, want) {
                (None, None) => {}
                (Some(pick), Some(w)) => {
                    let bytes: u64 = pick.iter().zip(&layers).map(|(&i, c)| c[i].bytes).sum();
                    let err: f64 = pick.iter().zip(&layers).map(|(&i, c)| c[i].error).sum();
                    assert!(bytes <= budget);
                    // Here a DP unit is a few bytes, so the answer is the optimum.
                    assert!(err <= w + 1e-9, "{err} vs {w}");
                }
                (g, w) => panic!("feasibility differs: {g:?} vs {w:?}"),
            }
        }
    }

    #[test]
    fn allocation_prefers_cheaper_at_equal_error() {
        let layers = vec![cands(&[(100, 0.0), (200, 0.0), (50, 5.0)])];
        assert_eq!(allocate(&layers, 1000), Some(vec![0]));
        assert_eq!(allocate(&layers, 99), Some(vec![2]));
        assert_eq!(allocate(&layers, 49), None);
    }
}
