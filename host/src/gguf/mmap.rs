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
}

impl MappedFile {
    /// Maps `path` read-only. See the type's documentation for the promise this
    /// makes: nothing modifies or truncates the file while it is mapped.
    pub fn open(path: impl AsRef<Path>) -> io::Result<Self> {
        let file = File::open(path)?;
        if file.metadata()?.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "is a directory",
            ));
        }
        // SAFETY: memmap2 requires that the mapped file is not modified or
        // truncated while the map lives. LES only maps model files it treats as
        // immutable, and this constructor's documentation puts that promise on the
        // caller; the map is read-only, so LES itself never writes through it.
        let map = unsafe { Mmap::map(&file)? };
        Ok(MappedFile { map })
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
