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
        Ok(MappedFile { map })
    }
}

impl MappedFile {
    /// Tells the kernel the bytes `offset..offset + len` will be read soon
    /// (`madvise(MADV_WILLNEED)`: it starts reading them in). Only a hint;
    /// errors (an unsupported platform, a range past the end) are returned for
    /// the caller to ignore.
    pub fn will_need(&self, offset: usize, len: usize) -> io::Result<()> {
        #[cfg(unix)]
        {
            self.map
                .advise_range(memmap2::Advice::WillNeed, offset, len)
        }
        #[cfg(not(unix))]
        {
            let _ = (offset, len);
            Ok(())
        }
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
