//! Partial outputs removed when the process is interrupted (Ctrl-C, `SIGTERM`,
//! `SIGHUP`).
//!
//! Writers that build a file under a temporary name and rename it at the end
//! ([`crate::pack`], [`crate::synth`]) do it through a [`TempFile`], which
//! [`register`]s the temporary path. Once [`install`]ed (by the
//! CLI; a library user keeps its own signal handling), an interrupt deletes every
//! registered path and exits with status 130, so neither a truncated file under
//! the target name nor a stray temporary file is left behind. [`commit`] renames
//! under the same lock the handler takes, so an interrupt lands either before the
//! rename (the temporary file is removed) or after it (the output is complete).

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, Once};

static PATHS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn paths() -> MutexGuard<'static, Vec<PathBuf>> {
    PATHS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Exit status after an interrupt (128 + SIGINT).
pub const EXIT_INTERRUPTED: i32 = 130;

/// Installs the handler (once per process; later calls do nothing).
pub fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The handler runs on a thread of its own, not in signal context.
        let result = ctrlc::set_handler(|| {
            let paths = paths();
            for p in paths.iter() {
                let _ = std::fs::remove_file(p);
            }
            note!("\ninterrupted");
            // Exits with the lock held: no rename can slip in after the removal.
            std::process::exit(EXIT_INTERRUPTED);
        });
        if let Err(e) = result {
            note!("warning: cannot install the interrupt handler: {e}");
        }
    });
}

/// A registered temporary path; unregistered when dropped.
#[derive(Debug)]
pub struct Registered {
    path: PathBuf,
}

/// Registers `path` for removal on interrupt.
pub fn register(path: &Path) -> Registered {
    paths().push(path.to_owned());
    Registered {
        path: path.to_owned(),
    }
}

fn unregister(list: &mut Vec<PathBuf>, path: &Path) {
    if let Some(i) = list.iter().position(|p| p == path) {
        list.swap_remove(i);
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        unregister(&mut paths(), &self.path);
    }
}

/// Renames the registered temporary file to `target`, atomically with respect
/// to the interrupt handler.
pub fn commit(tmp: &Registered, target: &Path) -> io::Result<()> {
    let mut list = paths();
    std::fs::rename(&tmp.path, target)?;
    unregister(&mut list, &tmp.path);
    Ok(())
}

/// A temporary file that becomes its target on [`commit`](TempFile::commit), and
/// is removed otherwise: when dropped uncommitted, and on interrupt (it is
/// registered before it exists).
#[derive(Debug)]
pub struct TempFile {
    registered: Registered,
    committed: bool,
}

impl TempFile {
    /// Creates `path` for writing: with `create_new`, only where no file is there
    /// yet (an existing one is an error and is left alone); else created or
    /// truncated.
    pub fn create(path: &Path, create_new: bool) -> io::Result<(TempFile, File)> {
        let registered = register(path);
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(!create_new)
            .create_new(create_new)
            .open(path)?;
        let tmp = TempFile {
            registered,
            committed: false,
        };
        Ok((tmp, file))
    }

    /// Creates the new temporary file `.NAME.les-TAG-PID.tmp` next to
    /// `target` (`NAME` its file name), for `target` once complete.
    pub fn beside(target: &Path, tag: &str) -> io::Result<(TempFile, File)> {
        let name = target.file_name().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a file name", target.display()),
            )
        })?;
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(".les-{tag}-{}.tmp", std::process::id()));
        TempFile::create(&target.with_file_name(tmp_name), true)
    }

    /// The temporary path.
    pub fn path(&self) -> &Path {
        &self.registered.path
    }

    /// Renames the file to `target` ([`commit`]) and makes the rename durable
    /// where the platform can sync a directory.
    pub fn commit(mut self, target: &Path) -> io::Result<()> {
        commit(&self.registered, target)?;
        self.committed = true;
        if let Ok(d) = File::open(directory_of(target)) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

/// The directory `path` names an entry of (`.` for a bare file name).
pub fn directory_of(path: &Path) -> &Path {
    path.parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(self.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registration_follows_the_guard() {
        let dir = std::env::temp_dir().join(format!("les-interrupt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a.tmp"), dir.join("b"));
        std::fs::write(&a, b"x").unwrap();
        let r = register(&a);
        assert!(paths().contains(&a));
        commit(&r, &b).unwrap();
        assert!(!paths().contains(&a) && b.exists() && !a.exists());
        drop(r);
        let r = register(&a);
        drop(r);
        assert!(!paths().contains(&a));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_temp_file_is_committed_or_removed() {
        let dir = std::env::temp_dir().join(format!("les-tempfile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (t, target) = (dir.join(".t.tmp"), dir.join("t"));
        // Dropped uncommitted: removed, and no longer registered.
        let (tmp, _file) = TempFile::create(&t, false).unwrap();
        assert!(t.exists() && paths().contains(&t));
        drop(tmp);
        assert!(!t.exists() && !paths().contains(&t));
        // `create_new` leaves a file already there alone.
        std::fs::write(&t, b"theirs").unwrap();
        assert!(TempFile::create(&t, true).is_err());
        assert_eq!(std::fs::read(&t).unwrap(), b"theirs");
        // Truncated otherwise; committed, it is the target.
        let (tmp, mut file) = TempFile::create(&t, false).unwrap();
        std::io::Write::write_all(&mut file, b"ours").unwrap();
        drop(file);
        tmp.commit(&target).unwrap();
        assert!(!t.exists() && !paths().contains(&t));
        assert_eq!(std::fs::read(&target).unwrap(), b"ours");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
