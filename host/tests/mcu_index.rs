//! `les mcu-index` read back by the firmware's own index reader
//! (`tests/firmware/src/index.rs`, compiled here for the host): hyperparameters,
//! every matrix's place in the file, the vectors and the expert extents agree
//! with the model as the host loads it.

use std::path::{Path, PathBuf};
use std::process::Command;

use les::model::Model;
use les_core::gemv::MatrixView;
use les_core::model::forward::{Ffn, Mixer, Weights};
use les_core::slots::ExpertKey;

mod common;
#[allow(dead_code)]
#[path = "../../tests/firmware/src/index.rs"]
mod index;

fn les(args: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_les"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn model(arch: &str, pack: bool) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let plain = dir.join(format!("mcu-{arch}.gguf"));
    les(&[
        "synth",
        "--arch",
        arch,
        "--preset",
        "tiny",
        "-o",
        plain.to_str().unwrap(),
    ]);
    if !pack {
        return plain;
    }
    let packed = dir.join(format!("mcu-{arch}.packed.gguf"));
    les(&[
        "pack",
        "--quiet",
        plain.to_str().unwrap(),
        "-o",
        packed.to_str().unwrap(),
    ]);
    packed
}

fn same_matrix(file: &[u8], t: &index::Tensor, m: &MatrixView<'_>) {
    assert_eq!((t.ty, t.rows, t.cols), (m.ty(), m.rows(), m.cols()));
    let bytes = &file[t.offset..t.offset + t.len];
    assert_eq!(bytes.len(), m.rows() * m.row_bytes());
    assert_eq!(&bytes[..m.row_bytes()], m.row(0).unwrap());
}

fn same_vector(idx: &[u8], v: &index::Vector, want: &[f32]) {
    let got: Vec<f32> = idx[v.at..v.at + 4 * v.len]
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(got, want);
}

fn check(path: &Path) {
    let model = Model::open(path).unwrap();
    let bytes = les::mcu::write_index(&model).unwrap();
    let file = model.gguf().bytes();
    let idx = index::Index::<64>::parse(&bytes).unwrap();
    assert_eq!(idx.hp, model.hp);
    assert_eq!(idx.model_len, file.len());
    assert_eq!(idx.slot_bytes, model.max_expert_bytes());
    same_matrix(file, &idx.embedding, &model.embedding());
    same_matrix(file, &idx.output, &model.output());
    same_vector(&bytes, &idx.output_norm, model.output_norm());
    for (l, d) in idx.layers.iter().enumerate() {
        let b = model.block(l);
        let Mixer::Attention(lw) = b.mixer else {
            panic!("layer {l}: not attention");
        };
        same_vector(&bytes, &d.attn_norm, b.attn_norm);
        same_vector(&bytes, &d.ffn_norm, b.ffn_norm);
        for (t, m) in [
            (&d.wq, &lw.wq),
            (&d.wk, &lw.wk),
            (&d.wv, &lw.wv),
            (&d.wo, &lw.wo),
        ] {
            same_matrix(file, t, m);
        }
        for (v, w) in [(&d.bq, lw.bq), (&d.bk, lw.bk), (&d.bv, lw.bv)] {
            assert_eq!(v.is_some(), w.is_some());
        }
        for (v, w) in [(&d.q_norm, lw.q_norm), (&d.k_norm, lw.k_norm)] {
            match (v, w) {
                (Some(v), Some(w)) => same_vector(&bytes, v, w),
                (None, None) => {}
                _ => panic!("layer {l}: q/k norm presence differs"),
            }
        }
        match (d.ffn, b.ffn) {
            (
                index::FfnDesc::Moe {
                    router,
                    shared,
                    types,
                    ..
                },
                Ffn::Moe {
                    router: r,
                    shared: s,
                    ..
                },
            ) => {
                same_matrix(file, &router, &r);
                assert_eq!(shared.is_some(), s.is_some());
                if let (Some(a), Some(b)) = (shared, s) {
                    same_matrix(file, &a.gate, &b.gate.unwrap());
                    same_matrix(file, &a.up, &b.up);
                    same_matrix(file, &a.down, &b.down);
                    assert_eq!(a.gate_inp.is_some(), b.gate_inp.is_some());
                }
                let f = model.expert_format(l).unwrap();
                assert_eq!(types[..], f.types().collect::<Vec<_>>()[..]);
                for e in 0..model.hp.moe.unwrap().n_experts {
                    let key = ExpertKey {
                        layer: l as u16,
                        expert: e as u16,
                    };
                    let x = idx.expert(l, e).unwrap().unwrap();
                    let ext = model.expert_extents(key);
                    assert_eq!(x.n_parts, ext.len());
                    let mut slot = Vec::new();
                    for (i, p) in ext.iter().enumerate() {
                        assert_eq!(x.parts[i], (p.offset as usize, p.len as usize));
                        slot.extend_from_slice(&file[x.parts[i].0..][..x.parts[i].1]);
                    }
                    assert!(model.verify_expert(key, &slot));
                    if model.is_packed() {
                        assert_eq!(les_core::layout::checksum(&slot[..x.crc_len]), x.crc);
                    } else {
                        assert_eq!(x.crc_len, 0);
                    }
                }
            }
            (
                index::FfnDesc::Dense { gate, up, down },
                Ffn::Dense {
                    gate: g,
                    up: u,
                    down: dn,
                },
            ) => {
                same_matrix(file, &gate, &g.unwrap());
                same_matrix(file, &up, &u);
                same_matrix(file, &down, &dn);
            }
            _ => panic!("layer {l}: FFN kind differs"),
        }
    }
    // Damaged indexes are refused, not misread.
    assert!(index::Index::<64>::parse(&bytes[..bytes.len() - 4]).is_err());
    let mut bad = bytes.clone();
    bad[0] ^= 1;
    assert!(index::Index::<64>::parse(&bad).is_err());
}

#[test]
fn index_round_trips_through_the_firmware_reader() {
    check(&model("qwen3moe", true));
    check(&model("qwen2moe", true)); // shared expert with a gate, biases
    check(&model("olmoe", false)); // plain GGUF: three extents, no checksums
}

#[test]
fn hybrid_models_are_refused_with_a_clear_error() {
    let model = Model::open(model("qwen35moe", false)).unwrap();
    let err = les::mcu::write_index(&model).unwrap_err().to_string();
    assert!(err.contains("not an attention layer"), "{err}");
}

/// What the firmware does not run is refused by name: gpt-oss's gating,
/// glm4moe's selection bias, group-limited routing.
#[test]
fn unsupported_routing_is_refused_with_a_clear_error() {
    for (arch, why) in [
        ("gpt-oss", "softmax of the picks"),
        ("glm4moe", "expert selection bias"),
    ] {
        let model = Model::open(model(arch, false)).unwrap();
        let err = les::mcu::write_index(&model).unwrap_err().to_string();
        assert!(err.contains(why), "{arch}: {err}");
    }
    let grouped = common::tmp("mcu-qwen3moe-groups.gguf");
    common::rewrite_gguf(
        &model("qwen3moe", false),
        &grouped,
        |_, v| Some(v),
        vec![
            ("qwen3moe.expert_group_count", les::gguf::MetaValue::U32(4)),
            (
                "qwen3moe.expert_group_used_count",
                les::gguf::MetaValue::U32(2),
            ),
        ],
    );
    let model = Model::open(&grouped).unwrap();
    let err = les::mcu::write_index(&model).unwrap_err().to_string();
    assert!(err.contains("group-limited"), "{err}");
}
