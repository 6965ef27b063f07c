//! Read-only memory maps of model files: the crate's single `Mmap::map` call.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::ops::Deref;
use std::path::Path;

use memmap2::Mmap;

/// A file mapped read-only into memory.
///
/// A map is only sound while the file keeps its length and contents: if another
/// process truncates it, reading the lost pages raises `SIGBUS`; if it writes to
/// it, bytes that the GGUF parser already validated change under the views built
/// on them. Model files are read-only inputs to LES, so [`MappedFile::open`] makes
/// that promise on its caller's behalf (as ripgrep does for the files it searches):
/// **do not open a file that anything may modify or truncate while the
/// `MappedFile`, or a [`super::Gguf`] over it, lives.** Where that cannot be
/// promised, read the file into a `Vec<u8>` and use [`super::Gguf::parse`].
#[derive(Debug)]
pub struct MappedFile {
    map: Mmap,
    /// The file, kept for [`MappedFile::populate`]'s reads.
    file: File,
}

impl MappedFile {
    /// Maps `path` read-only. See the type's documentation for the promise this
    /// makes: nothing modifies or truncates the file while it is mapped.
    pub fn open(path: impl AsRef<Path>) -> io::Result<Self> {
        let mut options = std::fs::OpenOptions::new();
        options.read(true);
        // Without a writer, opening a FIFO would block forever; opened
        // non-blocking it is refused below like any other non-regular file.
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32);
        }
        let file: File = options.open(path)?;
        let kind = file.metadata()?.file_type();
        if kind.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "is a directory",
            ));
        }
        if !kind.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a regular file (a model is mapped into memory, so it cannot be a pipe or device)",
            ));
        }
        // SAFETY: memmap2 requires that the mapped file is not modified or
        // truncated while the map lives, which no process can guarantee for a
        // file others may write. LES maps only model files, which it treats as
        // immutable, and makes that promise on its caller's behalf, as the
        // type's documentation says (the accepted limit of mapping files, as in
        // ripgrep); the map is read-only, so LES itself never writes through it.
        let map = unsafe { Mmap::map(&file)? };
        Ok(MappedFile { map, file })
    }

    /// Brings the bytes of `ranges` into memory and maps them, fast: first
    /// the page cache is filled by reads of up to 1 MiB on up to 8 threads (a
    /// few large requests at a time instead of the page faults' readahead:
    /// `a3b`'s 955 MiB in 0.3-0.8 s on this project's VM), then every page
    /// of the ranges is touched, each now a minor fault. Read errors are left
    /// to the touch, which reads what the cache lacks itself.
    pub fn populate(&self, ranges: &[std::ops::Range<usize>]) {
        const CHUNK: usize = 1 << 20;
        let len = self.map.len();
        let chunks: Vec<(usize, usize)> = ranges
            .iter()
            .map(|r| r.start.min(len)..r.end.min(len))
            .flat_map(|r| {
                (r.start..r.end)
                    .step_by(CHUNK)
                    .map(move |at| (at, CHUNK.min(r.end - at)))
            })
            .collect();
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileExt;
            use std::sync::atomic::{AtomicUsize, Ordering};
            let next = AtomicUsize::new(0);
            let threads = std::thread::available_parallelism()
                .map_or(4, |n| n.get() * 2)
                .clamp(1, 8)
                .min(chunks.len());
            std::thread::scope(|s| {
                for _ in 0..threads {
                    s.spawn(|| {
                        let mut buf = vec![0u8; CHUNK];
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some(&(at, n)) = chunks.get(i) else { break };
                            let _ = self.file.read_at(&mut buf[..n], at as u64);
                        }
                    });
                }
            });
        }
        const PAGE: usize = 4096;
        let mut acc = 0u8;
        for &(at, n) in &chunks {
            for i in (at..at + n).step_by(PAGE) {
                acc ^= self.map[i];
            }
        }
        std::hint::black_box(acc);
    }
}

impl Deref for MappedFile {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map
    }
}

impl AsRef<[u8]> for MappedFile {
    fn as_ref(&self) -> &[u8] {
        &self.map
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    /// Opens `path` on a thread; `None` if it has not returned within 5 s.
    fn open_within_5s(path: &Path) -> Option<io::Result<MappedFile>> {
        let (tx, rx) = std::sync::mpsc::channel();
        let path = path.to_path_buf();
        std::thread::spawn(move || tx.send(MappedFile::open(path)));
        rx.recv_timeout(std::time::Duration::from_secs(5)).ok()
    }

    #[test]
    fn a_pipe_or_a_device_is_refused_at_once() {
        let dir = std::env::temp_dir().join(format!("les-mmap-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("model.gguf");
        let _ = std::fs::remove_file(&fifo);
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        for path in [fifo.as_path(), Path::new("/dev/null")] {
            let err = open_within_5s(path)
                .unwrap_or_else(|| panic!("{}: opening it hung", path.display()))
                .unwrap_err();
            assert!(err.to_string().starts_with("not a regular file"), "{err}");
        }
        let err = open_within_5s(&dir).unwrap().unwrap_err();
        assert_eq!(err.to_string(), "is a directory");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
