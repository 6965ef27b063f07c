//! The reader side: where each packed expert is, validated against the metadata.

use std::collections::BTreeSet;

use les_core::layout::{self, keys};
use les_core::model::experts::ExpertFormat;
use les_core::quant::GgmlType;

use super::source::{declared_dims, expert_tensor, expert_tensor_name};
use super::PackError;
use crate::gguf::{Gguf, OptionalKey, ValueType};

/// One expert's place in the file: a single aligned extent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Absolute file offset, a multiple of [`PackedIndex::alignment`].
    pub offset: u64,
    /// Bytes of the expert (gate, up, down), the range its checksum covers.
    pub len: u64,
    /// `len` rounded up to the alignment (the layer's stride): the length of an
    /// O_DIRECT read; the bytes past `len` are zero.
    pub padded_len: u64,
}

/// One packed MoE layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedLayer {
    /// The layer number.
    pub layer: usize,
    /// Types and shapes of gate, up and down (the slot layout).
    pub format: ExpertFormat,
    /// Bytes of one expert, without padding.
    pub expert_bytes: u64,
    /// Bytes between consecutive experts.
    pub stride: u64,
    /// Absolute file offset of expert 0 (the packed tensor's data).
    pub offset: u64,
    /// CRC-32 of each expert's `expert_bytes` ([`layout::checksum`]).
    pub checksums: Vec<u32>,
}

impl PackedLayer {
    /// The types of gate (where the experts have one), up and down.
    pub fn types(&self) -> Vec<GgmlType> {
        self.format.types().collect()
    }

    /// Where expert `expert` is, or `None` past the last expert.
    pub fn extent(&self, expert: usize) -> Option<Extent> {
        (expert < self.checksums.len()).then(|| Extent {
            offset: self.offset + expert as u64 * self.stride,
            len: self.expert_bytes,
            padded_len: self.stride,
        })
    }

    /// Whether `bytes` (at least the expert's unpadded bytes, e.g. a whole slot)
    /// hold expert `expert` intact.
    pub fn verify(&self, expert: usize, bytes: &[u8]) -> bool {
        let Some(&want) = self.checksums.get(expert) else {
            return false;
        };
        bytes
            .get(..self.expert_bytes as usize)
            .is_some_and(|b| layout::checksum(b) == want)
    }
}

/// Every packed layer of a file written by `les pack`.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedIndex {
    /// `les.pack.alignment`: every extent's offset and stride are multiples of it.
    pub alignment: u64,
    /// `{arch}.expert_count`.
    pub n_experts: usize,
    /// The plan that chose the types (`les.pack.plan`).
    pub plan: String,
    layers: Vec<PackedLayer>,
}

/// `blk.N.ffn_exps_packed.weight` -> N.
fn packed_tensor(name: &str) -> Option<usize> {
    let n = name
        .strip_prefix("blk.")?
        .strip_suffix(".ffn_exps_packed.weight")?;
    let layer: usize = n.parse().ok()?;
    (layer.to_string() == n).then_some(layer)
}

/// `les.pack.blk.N.<anything>` -> N.
fn packed_key_layer(key: &str) -> Option<usize> {
    let rest = key.strip_prefix("les.pack.blk.")?;
    rest.split_once('.')?.0.parse().ok()
}

fn bad(detail: impl Into<String>) -> PackError {
    PackError::Index(detail.into())
}

/// An array of unsigned integers that fit `u32`.
fn u32_array<B: AsRef<[u8]>>(g: &Gguf<B>, key: &str) -> Result<Vec<u32>, PackError> {
    let a = match g.get_array(key) {
        Ok(a) => a,
        Err(crate::gguf::GgufError::MissingKey { .. }) => {
            return Err(bad(format!("{key} is missing")))
        }
        Err(e) => return Err(bad(format!("{key}: {e}"))),
    };
    if matches!(a.elem_type(), ValueType::Array | ValueType::String) {
        return Err(bad(format!("{key} must be an array of integers")));
    }
    a.iter()
        .map(|v| {
            v.as_integer()
                .and_then(|i| u32::try_from(i).ok())
                .ok_or_else(|| bad(format!("{key} holds a value that is not a u32")))
        })
        .collect()
}

impl PackedIndex {
    /// Reads and checks the packed layout of `g`: `None` if `g` is not packed
    /// (no `les.pack.version`). Every layer's metadata must agree with its
    /// tensor: as many checksums as `{arch}.expert_count`, weight types whose
    /// blocks divide the rows, a stride that holds an expert and is a multiple of
    /// the alignment, a tensor of `I8` with exactly `n_experts * stride` bytes
    /// starting at an aligned file offset.
    pub fn from_gguf<B: AsRef<[u8]>>(g: &Gguf<B>) -> Result<Option<PackedIndex>, PackError> {
        let version = match g.get_u32(keys::VERSION).optional() {
            Ok(None) => return Ok(None),
            Ok(Some(v)) => v,
            Err(e) => return Err(bad(e.to_string())),
        };
        if version != layout::VERSION {
            return Err(bad(format!(
                "{} is {version}, this build reads version {}",
                keys::VERSION,
                layout::VERSION
            )));
        }
        let alignment = g.get_u32(keys::ALIGNMENT).map_err(|e| bad(e.to_string()))?;
        if !alignment.is_power_of_two() {
            return Err(bad(format!(
                "{} = {alignment} is not a power of two",
                keys::ALIGNMENT
            )));
        }
        // A power of two: `n & (alignment - 1) == 0` tests for a multiple.
        let alignment = u64::from(alignment);
        let plan = match g.get_str(keys::PLAN).optional() {
            Ok(p) => p.unwrap_or_default().to_owned(),
            Err(e) => return Err(bad(e.to_string())),
        };
        let arch = g.architecture().map_err(|e| bad(e.to_string()))?;
        let (n_experts, n_embd, n_ff) = declared_dims(g, arch).map_err(|e| bad(e.to_string()))?;
        if n_experts == 0 {
            return Err(bad(format!("{arch}.expert_count is 0")));
        }

        let mut layers = Vec::new();
        let mut plain = BTreeSet::new();
        for t in g.tensors() {
            if let Some((l, _)) = expert_tensor(t.name()) {
                plain.insert(l);
            }
            let Some(layer) = packed_tensor(t.name()) else {
                continue;
            };
            let name = t.name();
            let types_key = keys::types(layer);
            let ids = u32_array(g, &types_key)?;
            let weight_type = |id: u32| {
                let ty = GgmlType::from_id(id)
                    .map_err(|e| bad(format!("{}: {e}", types_key.as_str())))?;
                if ty.is_activation_only() {
                    return Err(bad(format!(
                        "{}: {ty} is not a weight type",
                        types_key.as_str()
                    )));
                }
                Ok(ty)
            };
            // Experts without a gate (ReLU^2) store up and down alone.
            let (gate, up, down) = match ids[..] {
                [g, u, d] => (Some(weight_type(g)?), weight_type(u)?, weight_type(d)?),
                [u, d] => (None, weight_type(u)?, weight_type(d)?),
                _ => {
                    return Err(bad(format!(
                        "{} has {} entries, expected 3 (gate, up, down) or 2 (up, down)",
                        types_key.as_str(),
                        ids.len()
                    )))
                }
            };
            let format = ExpertFormat {
                gate,
                up,
                down,
                n_embd,
                n_ff,
            };
            let expert_bytes = format.bytes().ok_or_else(|| {
                let names: Vec<String> = format.types().map(|t| t.to_string()).collect();
                bad(format!(
                    "{}: types {} do not divide rows of {n_embd} and {n_ff} elements",
                    types_key.as_str(),
                    names.join("/")
                ))
            })? as u64;
            let stride_key = keys::stride(layer);
            let stride = g.get_u64(&stride_key).map_err(|e| bad(e.to_string()))?;
            if stride < expert_bytes {
                return Err(bad(format!(
                    "{} = {stride} is less than the {expert_bytes} bytes of an expert",
                    stride_key.as_str()
                )));
            }
            if stride & (alignment - 1) != 0 {
                return Err(bad(format!(
                    "{} = {stride} is not a multiple of the alignment {alignment}",
                    stride_key.as_str()
                )));
            }
            let sums_key = keys::checksums(layer);
            let checksums = u32_array(g, &sums_key)?;
            if checksums.len() != n_experts {
                return Err(bad(format!(
                    "{} has {} entries, expected {n_experts} ({arch}.expert_count)",
                    sums_key.as_str(),
                    checksums.len()
                )));
            }
            if t.ggml_type() != GgmlType::I8 {
                return Err(bad(format!(
                    "{name} has type {}, expected i8",
                    t.ggml_type()
                )));
            }
            let size = stride.checked_mul(n_experts as u64);
            if t.dims().len() != 1 || Some(t.size()) != size {
                return Err(bad(format!(
                    "{name} has shape {:?}, expected [{n_experts} * {stride}]",
                    t.dims()
                )));
            }
            if t.offset() & (alignment - 1) != 0 {
                return Err(bad(format!(
                    "{name} starts at file offset {}, not a multiple of {alignment}",
                    t.offset()
                )));
            }
            layers.push(PackedLayer {
                layer,
                format,
                expert_bytes,
                stride,
                offset: t.offset(),
                checksums,
            });
        }
        if layers.is_empty() {
            return Err(bad(format!(
                "{} is set but there is no blk.N.ffn_exps_packed.weight tensor",
                keys::VERSION
            )));
        }
        layers.sort_by_key(|l| l.layer);
        for l in &layers {
            if plain.contains(&l.layer) {
                return Err(bad(format!(
                    "layer {} has both a packed tensor and {}",
                    l.layer,
                    expert_tensor_name(l.layer, 0)
                )));
            }
        }
        for (key, _) in g.metadata() {
            if let Some(l) = packed_key_layer(key) {
                if layers.binary_search_by_key(&l, |p| p.layer).is_err() {
                    return Err(bad(format!(
                        "{key} describes layer {l}, which has no {}",
                        keys::tensor(l).as_str()
                    )));
                }
            }
        }
        Ok(Some(PackedIndex {
            alignment,
            n_experts,
            plan,
            layers,
        }))
    }

    /// The packed layers, ascending.
    pub fn layers(&self) -> &[PackedLayer] {
        &self.layers
    }

    /// Layer `layer`, if it is packed.
    pub fn layer(&self, layer: usize) -> Option<&PackedLayer> {
        self.layers
            .binary_search_by_key(&layer, |l| l.layer)
            .ok()
            .map(|i| &self.layers[i])
    }

    /// Where expert `expert` of layer `layer` is.
    pub fn extent(&self, layer: usize, expert: usize) -> Option<Extent> {
        self.layer(layer)?.extent(expert)
    }

    /// Checks every expert's bytes in `g` (the file this index was read from)
    /// against its checksum, and that the padding is zero.
    pub fn verify_all<B: AsRef<[u8]>>(&self, g: &Gguf<B>) -> Result<(), PackError> {
        let file = g.bytes();
        for l in &self.layers {
            for e in 0..l.checksums.len() {
                let x = l.extent(e).expect("e < n_experts");
                let bytes = &file[x.offset as usize..(x.offset + x.padded_len) as usize];
                if !l.verify(e, bytes) {
                    return Err(bad(format!(
                        "checksum mismatch in expert {e} of layer {}",
                        l.layer
                    )));
                }
                if bytes[x.len as usize..].iter().any(|&b| b != 0) {
                    return Err(bad(format!(
                        "non-zero padding after expert {e} of layer {}",
                        l.layer
                    )));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(packed_tensor("blk.7.ffn_exps_packed.weight"), Some(7));
        assert_eq!(packed_tensor("blk.07.ffn_exps_packed.weight"), None);
        assert_eq!(packed_tensor("blk.7.ffn_up_exps.weight"), None);
        assert_eq!(packed_key_layer("les.pack.blk.12.stride"), Some(12));
        assert_eq!(packed_key_layer("les.pack.plan"), None);
    }
}
