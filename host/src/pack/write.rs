//! Writing the packed file: header, tensors in source order with each layer's
//! experts streamed into one packed tensor, checksums patched into the header,
//! then an atomic rename.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::Path;

use les_core::layout::{self, keys};
use les_core::quant::GgmlType;

use super::convert::build_expert;
use super::index::PackedIndex;
use super::source::{expert_tensor, MoeSource, SourceLayer};
use super::{PackError, PackReport};
use crate::gguf::{Gguf, GgufError, GgufWriter, MappedFile};
use crate::interrupt::TempFile;

const ALIGNMENT_KEY: &str = "general.alignment";

fn io_err(path: &Path, source: io::Error) -> PackError {
    PackError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Refuses an `output` that is `input` (same canonical path, or the same inode
/// under another name).
pub fn check_output(input: &Path, output: &Path) -> Result<(), PackError> {
    let same = || PackError::SameFile {
        path: output.to_owned(),
    };
    let Ok(out_meta) = fs::metadata(output) else {
        // Nothing there yet, so it cannot be the input.
        return Ok(());
    };
    // The output replaces what is there by a rename: never a directory, a
    // device (`-o /dev/null` would become a regular file) or a pipe.
    if !out_meta.is_file() {
        return Err(PackError::BadOption(format!(
            "{} exists and is not a regular file: refusing to replace it",
            output.display()
        )));
    }
    let in_canon = fs::canonicalize(input).map_err(|e| io_err(input, e))?;
    if fs::canonicalize(output).is_ok_and(|o| o == in_canon) {
        return Err(same());
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let in_meta = fs::metadata(input).map_err(|e| io_err(input, e))?;
        if in_meta.dev() == out_meta.dev() && in_meta.ino() == out_meta.ino() {
            return Err(same());
        }
    }
    #[cfg(not(unix))]
    let _ = out_meta;
    Ok(())
}

/// Creates the temporary file `output` is written under (`.NAME.les-pack-PID.tmp`
/// next to it, a new file), removed unless committed (also on interrupt).
fn temp_file(output: &Path) -> Result<(TempFile, File), PackError> {
    TempFile::beside(output, "pack").map_err(|e| io_err(output, e))
}

/// Counts the bytes that reach the file and reports them.
struct Counting<W, F> {
    inner: W,
    done: u64,
    total: u64,
    progress: F,
}

impl<W: Write, F: FnMut(u64, u64)> Write for Counting<W, F> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.done += n as u64;
        (self.progress)(self.done, self.total);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// One layer's experts as a byte stream, built one expert at a time.
struct ExpertStream<'a> {
    file: &'a [u8],
    layer: &'a SourceLayer,
    types: &'a [GgmlType],
    n_experts: usize,
    threads: usize,
    next: usize,
    buf: Vec<u8>,
    stride: usize,
    pos: usize,
    checksums: Vec<u32>,
    error: Option<PackError>,
}

impl Read for ExpertStream<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.pos == self.buf.len() {
            if self.next == self.n_experts {
                return Ok(0);
            }
            self.buf.resize(self.stride, 0);
            match build_expert(
                self.file,
                self.layer,
                self.types,
                self.next,
                &mut self.buf,
                self.threads,
            ) {
                Ok(sum) => self.checksums.push(sum),
                Err(e) => {
                    let msg = format!("layer {}: {e}", self.layer.layer);
                    self.error = Some(PackError::Model(msg.clone()));
                    return Err(io::Error::other(msg));
                }
            }
            self.next += 1;
            self.pos = 0;
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// Writes the packed file for `report` (whose layers match `src.layers`) to
/// `output` through a temporary file; returns the file's length.
pub(crate) fn write_packed(
    g: &Gguf<MappedFile>,
    src: &MoeSource,
    report: &PackReport,
    threads: usize,
    output: &Path,
    progress: impl FnMut(u64, u64),
) -> Result<u64, PackError> {
    let align = report.alignment;
    let align32 =
        u32::try_from(align).map_err(|_| PackError::BadOption("alignment too large".into()))?;
    let mut w = GgufWriter::new();
    let mut has_alignment = false;
    for (key, value) in g.metadata() {
        if key == ALIGNMENT_KEY {
            w.add_kv(key, align32)?;
            has_alignment = true;
        } else {
            w.add_kv(key, value.to_meta())?;
        }
    }
    if !has_alignment {
        w.add_kv(ALIGNMENT_KEY, align32)?;
    }
    w.add_kv(keys::VERSION, layout::VERSION)?;
    w.add_kv(keys::ALIGNMENT, align32)?;
    w.add_kv(keys::PLAN, report.plan.as_str())?;
    for l in &report.layers {
        w.add_kv(
            keys::types(l.layer).as_str(),
            l.types.iter().map(|t| t.id()).collect::<Vec<u32>>(),
        )?;
        w.add_kv(keys::stride(l.layer).as_str(), l.stride)?;
    }
    // The checksums come last among the metadata, with placeholders: their
    // values are known only once the experts are written. `file_len` of a
    // writer without tensors is the length of its metadata so far.
    let n = src.n_experts;
    let mut at = w.file_len();
    let mut patches = Vec::with_capacity(report.layers.len());
    for l in &report.layers {
        let key = keys::checksums(l.layer);
        // key (u64 length + bytes), value type (u32), element type (u32), count (u64)
        let data = at + 8 + key.len() as u64 + 4 + 4 + 8;
        patches.push(data);
        at = data + 4 * n as u64;
        w.add_kv(key.as_str(), vec![0u32; n])?;
    }

    // Tensors in source order; a layer's packed tensor replaces its first
    // expert tensor, the other two are dropped.
    let mut carrier: BTreeMap<usize, &str> = BTreeMap::new();
    for t in g.tensors() {
        match expert_tensor(t.name()) {
            Some((layer, _)) => {
                if carrier.contains_key(&layer) {
                    continue;
                }
                carrier.insert(layer, t.name());
                let l = report
                    .layer_report(layer)
                    .expect("every MoE layer is planned");
                w.add_tensor(
                    keys::tensor(layer).as_str(),
                    &[l.stride * n as u64],
                    GgmlType::I8,
                )?;
            }
            None => {
                w.add_tensor(t.name(), t.dims(), t.ggml_type())?;
            }
        }
    }
    let total = w.file_len();

    let (tmp, file) = temp_file(output)?;
    let out = BufWriter::with_capacity(
        4 << 20,
        Counting {
            inner: file,
            done: 0,
            total,
            progress,
        },
    );
    let werr = |e: GgufError| -> PackError {
        match e {
            GgufError::Io { source, .. } => io_err(tmp.path(), source),
            e => e.into(),
        }
    };
    let mut data = w.write_header(out).map_err(werr)?;
    let mut sums: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
    for t in g.tensors() {
        let Some((layer, _)) = expert_tensor(t.name()) else {
            data.copy_tensor(t.name(), t.data()).map_err(werr)?;
            continue;
        };
        if carrier.get(&layer) != Some(&t.name()) {
            continue;
        }
        let i = report
            .layers
            .iter()
            .position(|l| l.layer == layer)
            .expect("every MoE layer is planned");
        let l = &report.layers[i];
        let mut stream = ExpertStream {
            file: g.bytes(),
            layer: &src.layers[i],
            types: &l.types,
            n_experts: n,
            threads,
            next: 0,
            buf: Vec::new(),
            stride: l.stride as usize,
            pos: 0,
            checksums: Vec::with_capacity(n),
            error: None,
        };
        let r = data.copy_tensor(keys::tensor(layer).as_str(), &mut stream);
        if let Some(e) = stream.error.take() {
            return Err(e);
        }
        r.map_err(werr)?;
        sums.insert(layer, stream.checksums);
    }
    let out = data.finish().map_err(werr)?;
    let counting = out
        .into_inner()
        .map_err(|e| io_err(tmp.path(), e.into_error()))?;
    let mut file = counting.inner;

    // Patch the checksums into the header.
    for (l, &pos) in report.layers.iter().zip(&patches) {
        let bytes: Vec<u8> = sums[&l.layer]
            .iter()
            .flat_map(|s| s.to_le_bytes())
            .collect();
        file.seek(SeekFrom::Start(pos))
            .and_then(|_| file.write_all(&bytes))
            .map_err(|e| io_err(tmp.path(), e))?;
    }
    file.sync_all().map_err(|e| io_err(tmp.path(), e))?;
    drop(file);

    // Read the result back as a reader would before it replaces the target.
    let written = Gguf::open(tmp.path())?;
    let index = PackedIndex::from_gguf(&written)?
        .ok_or_else(|| PackError::Index("the written file has no packed layout".into()))?;
    for l in &report.layers {
        let got = index.layer(l.layer);
        if got.map(|p| (&p.checksums, p.types(), p.stride))
            != Some((&sums[&l.layer], l.types.clone(), l.stride))
        {
            return Err(PackError::Index(format!(
                "layer {} reads back differently from what was written",
                l.layer
            )));
        }
    }
    drop(written);
    tmp.commit(output).map_err(|e| io_err(output, e))?;
    Ok(total)
}
