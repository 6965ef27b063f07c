//! Where a fuzz target writes each input that is opened from a file (models,
//! projectors): one file per process, in `/dev/shm` where there is one.

use std::path::PathBuf;
use std::sync::OnceLock;

use les::gguf::Gguf;

/// `data` written to this process's input file for `kind`, where it parses
/// as GGUF (most fuzzer inputs do not: no file for them).
pub fn gguf(kind: &str, data: &[u8]) -> Option<&'static PathBuf> {
    Gguf::parse(data).ok()?;
    let path = path(kind);
    std::fs::write(path, data).expect("the fuzzer writes its input");
    Some(path)
}

/// This process's input file for `kind` (`les-fuzz-{kind}-{pid}.gguf`).
fn path(kind: &str) -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let shm = std::path::Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        dir.join(format!("les-fuzz-{kind}-{}.gguf", std::process::id()))
    })
}
