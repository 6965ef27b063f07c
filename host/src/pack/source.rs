//! The routed experts of a plain (unpacked) MoE GGUF, found and validated.

use std::collections::BTreeMap;

use les_core::quant::GgmlType;

use super::PackError;
use crate::gguf::{Gguf, OptionalKey};

/// Gate, up and down, the order of the matrices in a packed expert (an
/// ungated expert has up and down alone).
pub(crate) const MATRICES: [&str; 3] = ["gate", "up", "down"];

/// `blk.N.ffn_{gate,up,down}_exps.weight` -> (N, matrix index).
pub(crate) fn expert_tensor(name: &str) -> Option<(usize, usize)> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, kind) = rest.split_once('.')?;
    let m = match kind {
        "ffn_gate_exps.weight" => 0,
        "ffn_up_exps.weight" => 1,
        "ffn_down_exps.weight" => 2,
        _ => return None,
    };
    // Reject "+1", "01" and the like: the name must be the canonical number.
    let n: usize = layer.parse().ok()?;
    (n.to_string() == layer).then_some((n, m))
}

/// The name of matrix `m` of layer `layer` in a plain GGUF.
pub(crate) fn expert_tensor_name(layer: usize, m: usize) -> String {
    format!("blk.{layer}.ffn_{}_exps.weight", MATRICES[m])
}

/// One stacked expert matrix (`ne = {cols, rows, n_experts}`) in the file.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Matrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    /// Absolute file offset of expert 0.
    pub offset: usize,
    /// Bytes of one expert's matrix.
    pub expert_bytes: usize,
}

impl Matrix {
    /// Expert `e`'s bytes of this matrix.
    pub fn expert<'f>(&self, file: &'f [u8], e: usize) -> &'f [u8] {
        let start = self.offset + e * self.expert_bytes;
        &file[start..start + self.expert_bytes]
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.expert_bytes / self.rows
    }
}

/// The expert matrices of one MoE layer: gate, up and down, or up and down
/// where the experts have no gate (Nemotron-H's ReLU² experts).
#[derive(Clone, Debug)]
pub(crate) struct SourceLayer {
    pub layer: usize,
    pub mats: Vec<Matrix>,
}

impl SourceLayer {
    /// The source types, in slot order.
    pub fn types(&self) -> Vec<GgmlType> {
        self.mats.iter().map(|m| m.ty).collect()
    }

    /// The names of the matrices, in slot order.
    pub fn names(&self) -> &'static [&'static str] {
        &MATRICES[MATRICES.len() - self.mats.len()..]
    }

    /// Weights (elements) of one expert.
    pub fn expert_weights(&self) -> u64 {
        self.mats.iter().map(|m| (m.rows * m.cols) as u64).sum()
    }
}

/// A plain MoE model's routed experts.
#[derive(Clone, Debug)]
pub(crate) struct MoeSource {
    pub n_experts: usize,
    /// MoE layers, ascending.
    pub layers: Vec<SourceLayer>,
}

/// The model width and expert hidden size the metadata of `g` declares, as the
/// packed reader finds them: `{arch}.embedding_length` and
/// `{arch}.expert_feed_forward_length` (else `{arch}.feed_forward_length`).
pub(crate) fn declared_dims<B: AsRef<[u8]>>(
    g: &Gguf<B>,
    arch: &str,
) -> Result<(usize, usize, usize), PackError> {
    let k = |s: &str| format!("{arch}.{s}");
    let n_experts = g.get_u64(&k("expert_count"))?;
    let n_embd = g.get_u64(&k("embedding_length"))?;
    let n_ff = match g.get_u64(&k("expert_feed_forward_length")).optional()? {
        Some(n) => n,
        None => g.get_u64(&k("feed_forward_length"))?,
    };
    let size = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
    Ok((size(n_experts), size(n_embd), size(n_ff)))
}

impl MoeSource {
    /// Finds every layer's `blk.N.ffn_{gate,up,down}_exps.weight` and checks their
    /// shapes against each other and the metadata.
    pub fn from_gguf<B: AsRef<[u8]>>(g: &Gguf<B>) -> Result<Self, PackError> {
        if g.metadata().any(|(k, _)| k.starts_with("les.pack.")) {
            return Err(PackError::AlreadyPacked);
        }
        let mut found: BTreeMap<usize, [Option<_>; 3]> = BTreeMap::new();
        for t in g.tensors() {
            if let Some((layer, m)) = expert_tensor(t.name()) {
                found.entry(layer).or_insert([None; 3])[m] = Some(t);
            }
        }
        if found.is_empty() {
            return Err(PackError::NotMoe(
                "no blk.N.ffn_{gate,up,down}_exps.weight tensors".into(),
            ));
        }
        let arch = g.architecture()?;
        let (n_experts, n_embd, n_ff) = declared_dims(g, arch)?;
        if n_experts == 0 {
            return Err(PackError::NotMoe(format!("{arch}.expert_count is 0")));
        }
        // As the model loader: expert ids are 16-bit, and an expert has bytes
        // (zero-width experts would leave the expert count unbounded by the file).
        if n_experts > u16::MAX as usize {
            return Err(PackError::Model(format!(
                "{arch}.expert_count is {n_experts}, above {}",
                u16::MAX
            )));
        }
        if n_embd == 0 || n_ff == 0 {
            return Err(PackError::Model(format!(
                "experts of {n_ff} x {n_embd}: {arch}.embedding_length and \
                 expert_feed_forward_length must not be 0"
            )));
        }
        let mut layers = Vec::with_capacity(found.len());
        for (layer, ts) in found {
            let mut mats = Vec::with_capacity(3);
            // Without a gate (up and down there): ReLU² experts.
            let ungated = ts[0].is_none() && ts[1].is_some() && ts[2].is_some();
            for (m, t) in ts.iter().enumerate().skip(usize::from(ungated)) {
                let name = expert_tensor_name(layer, m);
                let Some(t) = t else {
                    return Err(PackError::Model(format!(
                        "layer {layer} has expert tensors but no {name}"
                    )));
                };
                let (rows, cols) = if m == 2 {
                    (n_embd, n_ff)
                } else {
                    (n_ff, n_embd)
                };
                let want = [cols as u64, rows as u64, n_experts as u64];
                if t.dims() != want {
                    return Err(PackError::Model(format!(
                        "{name} has shape {:?}, expected {want:?} from {arch}.embedding_length, \
                         expert_feed_forward_length and expert_count",
                        t.dims()
                    )));
                }
                let ty = t.ggml_type();
                if ty.is_activation_only() {
                    return Err(PackError::Model(format!(
                        "{name} has type {ty}, not a weight type"
                    )));
                }
                // The parser checked the row is whole blocks and the size fits.
                let expert_bytes = t.row_bytes() * rows;
                mats.push(Matrix {
                    ty,
                    rows,
                    cols,
                    offset: t.offset() as usize,
                    expert_bytes,
                });
            }
            layers.push(SourceLayer { layer, mats });
        }
        Ok(MoeSource { n_experts, layers })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_tensor_names() {
        assert_eq!(expert_tensor("blk.12.ffn_down_exps.weight"), Some((12, 2)));
        assert_eq!(expert_tensor("blk.0.ffn_gate_exps.weight"), Some((0, 0)));
        assert_eq!(expert_tensor("blk.01.ffn_up_exps.weight"), None);
        assert_eq!(expert_tensor("blk.1.ffn_up_shexp.weight"), None);
        assert_eq!(expert_tensor("blk.1.ffn_up_exps.bias"), None);
        assert_eq!(expert_tensor_name(3, 1), "blk.3.ffn_up_exps.weight");
    }
}
