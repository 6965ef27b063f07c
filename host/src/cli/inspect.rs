//! `les inspect MODEL.gguf`: what a model file holds, and how its bytes split
//! between experts (streamed from flash) and the rest (resident).

use std::error::Error;
use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use serde_json::{json, Map, Value as Json};

use super::printable;
use crate::gguf::{Gguf, OptionalKey, Value};
use crate::pack::{PackError, PackedIndex};

/// Arguments of `les inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The GGUF file.
    pub model: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Also check every expert of a packed file against its CRC-32 (and its
    /// padding for zeros): reads all the expert bytes.
    #[arg(long)]
    pub verify: bool,
}

/// Arrays longer than this are summarised as type and length.
const MAX_ARRAY_SHOWN: usize = 16;
/// Strings longer than this (in chars) are cut in the text output.
const MAX_STRING_SHOWN: usize = 72;

/// The routed-expert tensors of one layer.
struct ExpertLayer {
    layer: u64,
    bytes: u64,
    /// `{arch}.expert_count`, else the third dimension of the layer's tensors.
    experts: u64,
}

struct Experts {
    count: Option<u64>,
    used: Option<u64>,
    layers: Vec<ExpertLayer>,
    total_bytes: u64,
}

/// `blk.N.ffn_{gate,up,down}_exps.weight` -> (N, the dimension counting
/// experts); `blk.N.ffn_exps_packed.weight` (`les pack`: one extent per expert,
/// rows of the I8 tensor) -> (N, 1).
fn expert_layer(name: &str) -> Option<(u64, usize)> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, kind) = rest.split_once('.')?;
    let dim = match kind {
        "ffn_gate_exps.weight" | "ffn_up_exps.weight" | "ffn_down_exps.weight" => 2,
        "ffn_exps_packed.weight" => 1,
        _ => return None,
    };
    Some((layer.parse().ok()?, dim))
}

fn experts(g: &Gguf, arch: Option<&str>) -> Result<Experts, Box<dyn Error>> {
    let key = |k: &str| arch.map(|a| format!("{a}.{k}"));
    let meta = |k: &str| -> Result<Option<u64>, Box<dyn Error>> {
        Ok(match key(k) {
            Some(k) => g.get_u64(&k).optional()?,
            None => None,
        })
    };
    let count = meta("expert_count")?;
    let used = meta("expert_used_count")?;
    // By layer number (a file may hold any number of tensors: no linear search).
    let mut by_layer: std::collections::BTreeMap<_, ExpertLayer> = Default::default();
    for t in g.tensors() {
        let Some((layer, dim)) = expert_layer(t.name()) else {
            continue;
        };
        let experts = count.unwrap_or_else(|| t.dims().get(dim).copied().unwrap_or(1));
        by_layer
            .entry(layer)
            .or_insert(ExpertLayer {
                layer,
                bytes: 0,
                experts,
            })
            .bytes += t.size();
    }
    let layers: Vec<ExpertLayer> = by_layer.into_values().collect();
    let total_bytes = layers.iter().map(|l| l.bytes).sum();
    Ok(Experts {
        count,
        used,
        layers,
        total_bytes,
    })
}

/// Runs `les inspect`.
pub fn run(args: &InspectArgs, out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let g = Gguf::open(&args.model)?;
    let arch = match g.get("general.architecture") {
        Some(_) => Some(g.architecture()?),
        None => None,
    };
    let experts = experts(&g, arch)?;
    // A file `les pack` wrote: its index checked as `les run` checks it.
    let mut packed = PackedIndex::from_gguf(&g);
    let mut verified = None;
    if args.verify && matches!(packed, Ok(None)) {
        note!("les inspect: not a packed file: no expert checksums to verify");
    }
    if let (true, Ok(Some(ix))) = (args.verify, &packed) {
        let n: usize = ix.layers().iter().map(|l| l.checksums.len()).sum();
        note!("les inspect: verifying {n} experts ...");
        match ix.verify_all(&g) {
            Ok(()) => verified = Some(n),
            Err(e) => packed = Err(e),
        }
    }
    if args.json {
        let mut report = json_report(args, &g, arch, &experts);
        report["packed"] = packed_json(&packed);
        if let Some(n) = verified {
            report["packed"]["verified_experts"] = json!(n);
        }
        serde_json::to_writer_pretty(&mut *out, &report)?;
        writeln!(out)?;
    } else {
        text_report(args, &g, arch, &experts, out)?;
        packed_text(&packed, out)?;
        if let Some(n) = verified {
            writeln!(out, "  all {n} experts match their CRC-32")?;
        }
    }
    // The listing is out; a broken index still fails the command.
    packed.map(|_| ()).map_err(Into::into)
}

/// The packed layout's section of the text report (nothing for a plain file).
fn packed_text(
    packed: &Result<Option<PackedIndex>, PackError>,
    out: &mut dyn Write,
) -> Result<(), Box<dyn Error>> {
    match packed {
        Ok(None) => {}
        Ok(Some(ix)) => {
            writeln!(
                out,
                "\npacked by les pack: {} layers, each expert one extent aligned to {} bytes, \
                 with its CRC-32; plan {}",
                ix.layers().len(),
                ix.alignment,
                printable(&ix.plan)
            )?;
            for run in type_runs(ix) {
                writeln!(
                    out,
                    "  {} {}: {} ({}), {} bytes an expert",
                    if run.layers.contains('-') {
                        "layers"
                    } else {
                        "layer"
                    },
                    run.layers,
                    run.types.join(" / "),
                    run.matrices,
                    run.expert_bytes
                )?;
            }
        }
        Err(e) => writeln!(
            out,
            "\npacked by les pack: INVALID: {}",
            printable(&e.to_string())
        )?,
    }
    Ok(())
}

/// Consecutive packed layers whose experts have the same types and size.
struct TypeRun {
    /// `"a-b"`, or `"a"` for one layer.
    layers: String,
    /// `"gate / up / down"`, or `"up / down"` for experts without a gate.
    matrices: &'static str,
    /// The matrices' ggml type names, in that order.
    types: Vec<&'static str>,
    /// Bytes of one expert, without padding.
    expert_bytes: u64,
}

/// The packed layers' types, consecutive layers alike as one run.
fn type_runs(ix: &PackedIndex) -> Vec<TypeRun> {
    let mut runs: Vec<(usize, usize, Vec<&'static str>, u64)> = Vec::new();
    for l in ix.layers() {
        let types: Vec<&'static str> = l.types().iter().map(|t| t.name()).collect();
        match runs.last_mut() {
            Some((_, last, t, b))
                if *last + 1 == l.layer && *t == types && *b == l.expert_bytes =>
            {
                *last = l.layer
            }
            _ => runs.push((l.layer, l.layer, types, l.expert_bytes)),
        }
    }
    runs.into_iter()
        .map(|(first, last, types, expert_bytes)| TypeRun {
            layers: if first == last {
                first.to_string()
            } else {
                format!("{first}-{last}")
            },
            matrices: if types.len() == 3 {
                "gate / up / down"
            } else {
                "up / down"
            },
            types,
            expert_bytes,
        })
        .collect()
}

/// The packed layout as JSON: `null` for a plain file, else whether its index
/// is valid, and its layers, alignment and plan or the error.
fn packed_json(packed: &Result<Option<PackedIndex>, PackError>) -> Json {
    match packed {
        Ok(None) => Json::Null,
        Ok(Some(ix)) => json!({
            "valid": true,
            "layers": ix.layers().len(),
            "alignment": ix.alignment,
            "plan": ix.plan,
            "types": type_runs(ix)
                .iter()
                .map(|r| json!({
                    "layers": r.layers,
                    "matrices": r.matrices,
                    "types": r.types,
                    "expert_bytes": r.expert_bytes,
                }))
                .collect::<Vec<_>>(),
        }),
        Err(e) => json!({"valid": false, "error": e.to_string()}),
    }
}

fn hyperparameters<'g>(g: &'g Gguf, arch: Option<&str>) -> Vec<(&'g str, Value<'g>)> {
    let Some(arch) = arch else {
        return Vec::new();
    };
    g.metadata()
        .filter_map(|(k, v)| {
            let suffix = k.strip_prefix(arch)?.strip_prefix('.')?;
            Some((suffix, v))
        })
        .collect()
}

fn is_hyperparameter(key: &str, arch: Option<&str>) -> bool {
    arch.and_then(|a| key.strip_prefix(a))
        .is_some_and(|rest| rest.starts_with('.'))
}

fn total_tensor_bytes(g: &Gguf) -> u64 {
    g.tensors().map(|t| t.size()).sum()
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[unit])
    }
}

fn text_value(v: &Value) -> String {
    match v {
        Value::String(b) => {
            let s = String::from_utf8_lossy(b);
            if s.chars().count() > MAX_STRING_SHOWN {
                let cut: String = s.chars().take(MAX_STRING_SHOWN).collect();
                format!("{cut:?}... ({} bytes)", b.len())
            } else {
                format!("{s:?}")
            }
        }
        Value::Array(a)
            if a.len() > MAX_ARRAY_SHOWN || a.elem_type() == crate::gguf::ValueType::Array =>
        {
            format!("[{}; {}]", a.elem_type(), a.len())
        }
        Value::Array(a) => {
            let items: Vec<String> = a.iter().map(|v| text_value(&v)).collect();
            format!("[{}]", items.join(", "))
        }
        Value::U8(x) => x.to_string(),
        Value::I8(x) => x.to_string(),
        Value::U16(x) => x.to_string(),
        Value::I16(x) => x.to_string(),
        Value::U32(x) => x.to_string(),
        Value::I32(x) => x.to_string(),
        Value::U64(x) => x.to_string(),
        Value::I64(x) => x.to_string(),
        Value::F32(x) => format!("{x:?}"),
        Value::F64(x) => format!("{x:?}"),
        Value::Bool(x) => x.to_string(),
    }
}

fn dims_text(dims: &[u64]) -> String {
    let parts: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
    parts.join(" x ")
}

fn text_report(
    args: &InspectArgs,
    g: &Gguf,
    arch: Option<&str>,
    experts: &Experts,
    out: &mut dyn Write,
) -> Result<(), Box<dyn Error>> {
    let total = total_tensor_bytes(g);
    writeln!(out, "file          {}", args.model.display())?;
    writeln!(out, "gguf version  {}", g.version())?;
    writeln!(out, "alignment     {}", g.alignment())?;
    writeln!(out, "data offset   {}", g.data_offset())?;
    writeln!(
        out,
        "architecture  {}",
        arch.map_or("(none)".into(), printable)
    )?;
    writeln!(out, "metadata      {} keys", g.metadata_len())?;
    writeln!(out, "tensors       {} ({})", g.tensor_count(), human(total))?;

    let hp = hyperparameters(g, arch);
    if let Some(arch) = arch {
        writeln!(out, "\nhyperparameters ({}.*)", printable(arch))?;
        let hp: Vec<(String, &Value)> = hp.iter().map(|(k, v)| (printable(k), v)).collect();
        let width = hp.iter().map(|(k, _)| k.chars().count()).max().unwrap_or(0);
        for (k, v) in &hp {
            writeln!(out, "  {k:<width$}  {}", text_value(v))?;
        }
    }

    writeln!(out, "\nmetadata")?;
    let other: Vec<_> = g
        .metadata()
        .filter(|(k, _)| !is_hyperparameter(k, arch))
        .map(|(k, v)| (printable(k), v))
        .collect();
    let width = other
        .iter()
        .map(|(k, _)| k.chars().count())
        .max()
        .unwrap_or(0);
    for (k, v) in &other {
        writeln!(out, "  {k:<width$}  {}", text_value(v))?;
    }

    writeln!(out, "\ntensors")?;
    let names: Vec<String> = g.tensors().map(|t| printable(t.name())).collect();
    let name_w = names
        .iter()
        .map(|n| n.chars().count())
        .max()
        .unwrap_or(0)
        .max(4);
    let dims: Vec<String> = g.tensors().map(|t| dims_text(t.dims())).collect();
    let dims_w = dims.iter().map(|d| d.len()).max().unwrap_or(0).max(4);
    writeln!(
        out,
        "  {:<name_w$}  {:<6}  {:<dims_w$}  {:>12}",
        "name", "type", "dims", "bytes"
    )?;
    for ((t, d), name) in g.tensors().zip(&dims).zip(&names) {
        writeln!(
            out,
            "  {:<name_w$}  {:<6}  {d:<dims_w$}  {:>12}",
            name,
            t.ggml_type().name(),
            t.size()
        )?;
    }

    if !experts.layers.is_empty() || experts.count.is_some() {
        let opt = |v: Option<u64>| v.map_or_else(|| "?".to_owned(), |v| v.to_string());
        writeln!(
            out,
            "\nexperts (expert_count {}, expert_used_count {})",
            opt(experts.count),
            opt(experts.used)
        )?;
        writeln!(
            out,
            "  {:>5}  {:>14}  {:>14}",
            "layer", "expert bytes", "per expert"
        )?;
        for l in &experts.layers {
            writeln!(
                out,
                "  {:>5}  {:>14}  {:>14}",
                l.layer,
                l.bytes,
                l.bytes.checked_div(l.experts).unwrap_or(0)
            )?;
        }
        let pct = |b: u64| {
            if total == 0 {
                0.0
            } else {
                100.0 * b as f64 / total as f64
            }
        };
        let non = total - experts.total_bytes;
        writeln!(
            out,
            "  total expert bytes      {:>14} ({}, {:.1}%)",
            experts.total_bytes,
            human(experts.total_bytes),
            pct(experts.total_bytes)
        )?;
        writeln!(
            out,
            "  non-expert bytes        {:>14} ({}, {:.1}%)",
            non,
            human(non),
            pct(non)
        )?;
    }
    Ok(())
}

/// A value as JSON; arrays longer than `max_items` become `null`.
fn json_value(v: &Value, max_items: usize) -> Json {
    match v {
        Value::String(b) => Json::String(String::from_utf8_lossy(b).into_owned()),
        Value::Array(a) if a.len() > max_items => Json::Null,
        Value::Array(a) => Json::Array(a.iter().map(|v| json_value(&v, max_items)).collect()),
        Value::U8(x) => json!(x),
        Value::I8(x) => json!(x),
        Value::U16(x) => json!(x),
        Value::I16(x) => json!(x),
        Value::U32(x) => json!(x),
        Value::I32(x) => json!(x),
        Value::U64(x) => json!(x),
        Value::I64(x) => json!(x),
        // Non-finite floats have no JSON form: null. An f32 goes through its
        // shortest decimal form, so 1e-6 prints as 1e-6, not 9.99999997e-7.
        Value::F32(x) => json!(x.to_string().parse::<f64>().ok()),
        Value::F64(x) => json!(x),
        Value::Bool(x) => json!(x),
    }
}

/// `{"type": ..., "value": ...}`, arrays with `"elem"` and `"len"` and a value
/// only when short.
fn json_entry(v: &Value) -> Json {
    let mut m = Map::new();
    m.insert("type".into(), json!(v.value_type().name()));
    if let Value::Array(a) = v {
        m.insert("elem".into(), json!(a.elem_type().name()));
        m.insert("len".into(), json!(a.len()));
        if a.len() <= MAX_ARRAY_SHOWN {
            m.insert("value".into(), json_value(v, MAX_ARRAY_SHOWN));
        }
    } else {
        m.insert("value".into(), json_value(v, 0));
    }
    Json::Object(m)
}

fn json_report(args: &InspectArgs, g: &Gguf, arch: Option<&str>, experts: &Experts) -> Json {
    let total = total_tensor_bytes(g);
    let hyperparameters: Map<String, Json> = hyperparameters(g, arch)
        .iter()
        .map(|(k, v)| ((*k).to_owned(), json_value(v, usize::MAX)))
        .collect();
    let metadata: Map<String, Json> = g
        .metadata()
        .filter(|(k, _)| !is_hyperparameter(k, arch))
        .map(|(k, v)| (k.to_owned(), json_entry(&v)))
        .collect();
    let tensors: Vec<Json> = g
        .tensors()
        .map(|t| {
            json!({
                "name": t.name(),
                "type": t.ggml_type().name(),
                "dims": t.dims(),
                "offset": t.offset(),
                "bytes": t.size(),
            })
        })
        .collect();
    let layers: Vec<Json> = experts
        .layers
        .iter()
        .map(|l| {
            json!({
                "layer": l.layer,
                "bytes": l.bytes,
                "bytes_per_expert": l.bytes.checked_div(l.experts),
            })
        })
        .collect();
    json!({
        "file": args.model.display().to_string(),
        "version": g.version(),
        "alignment": g.alignment(),
        "data_offset": g.data_offset(),
        "architecture": arch,
        "hyperparameters": hyperparameters,
        "metadata": metadata,
        "tensors": tensors,
        "total_tensor_bytes": total,
        "experts": {
            "expert_count": experts.count,
            "expert_used_count": experts.used,
            "layers": layers,
            "total_expert_bytes": experts.total_bytes,
            "non_expert_bytes": total - experts.total_bytes,
        },
    })
}
