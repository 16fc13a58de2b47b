//! Files in and out, the one home of both directions.
//!
//! Reading is bounded: a file that never ends (`/dev/zero`, a FIFO) or one larger than the memory
//! limit fails with its size instead of growing the process until it is killed. Writing is
//! atomic: every output goes to a temporary name in its own directory and is renamed into place,
//! and a set of outputs (a sweep's JSON, CSV, table and charts) is renamed together, so a reader
//! (or a run interrupted by a signal) sees the previous set or the new one, never a torn file.

use crate::error::{ensure_positive, Error, Result, Text};
use crate::settings::{BATCH, MAX_MEMORY, SEQ_LEN};
use crate::text;
use crate::MemoryBudget;
use bytesize::ByteSize;
use ndarray::Array3;
use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// The most a small text input (a router config, a sweep grid) may hold: far beyond any real
/// one, and small enough that parsing it is harmless.
pub const TEXT_LIMIT: u64 = 16 << 20;

/// Reads at most `limit` bytes of `path`; a longer file (or one that never ends) is an error
/// naming the limit. `why` says what the limit is (e.g. the memory limit, [`MAX_MEMORY`]).
pub fn read_bounded(path: &Path, limit: u64, why: impl Into<Text>) -> Result<Vec<u8>> {
    let file = open_unblocked(path, false).map_err(|e| Error::io(path, "cannot read", e))?;
    if file.metadata().is_ok_and(|m| m.is_dir()) {
        return Err(Error::input(path, "cannot read: is a directory"));
    }
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes).map_err(|e| Error::io(path, "cannot read", e))?;
    if bytes.len() as u64 > limit {
        let limit = ByteSize(limit).display().iec();
        return Err(Error::input(path, text!(format!("larger than {limit} ("), why, "); it may never end")));
    }
    Ok(bytes)
}

/// `name` inside `dir`, for a path that a data file names (a snapshot header's router or rows
/// file, a trace folder's own files): refused when it is absolute, climbs with `..`, or leads out
/// of `dir` through a symlink, so data cannot make moe-audit read (and echo in an error, or hash)
/// a file outside the folder it was pointed at. `what` names the field in the error. A path
/// that does not exist is returned as is: reading it fails naming it.
pub fn inside(dir: &Path, name: &Path, what: &str) -> Result<PathBuf> {
    use std::path::Component;
    if name.components().any(|c| !matches!(c, Component::Normal(_) | Component::CurDir)) {
        return Err(Error::input(
            name,
            format!("{what}: an absolute path or `..` leads out of {}; data names files inside it", shown(dir)),
        ));
    }
    let path = dir.join(name);
    if let (Ok(real), Ok(base)) = (path.canonicalize(), dir.canonicalize()) {
        if !real.starts_with(&base) {
            return Err(Error::input(
                &path,
                format!("{what}: a symlink leads out of {} (to {})", shown(dir), real.display()),
            ));
        }
    }
    Ok(if dir == Path::new(".") { name.to_path_buf() } else { path })
}

fn shown(dir: &Path) -> String {
    if dir == Path::new(".") {
        "the working directory".into()
    } else {
        dir.display().to_string()
    }
}

/// Opens `path` without waiting on it: a FIFO with no writer opens at once (and reads as empty),
/// one with no reader fails (ENXIO) instead of hanging; reads and writes then block as usual.
pub fn open_unblocked(path: &Path, write: bool) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::io::AsRawFd;
    let file = std::fs::OpenOptions::new().read(!write).write(write).custom_flags(libc::O_NONBLOCK).open(path)?;
    // SAFETY: fcntl on a descriptor this function owns, with flags it just read.
    unsafe {
        let flags = libc::fcntl(file.as_raw_fd(), libc::F_GETFL);
        if flags < 0 || libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(file)
}

/// [`read_bounded`] as UTF-8 text.
pub fn read_text(path: &Path, limit: u64, why: impl Into<Text>) -> Result<String> {
    String::from_utf8(read_bounded(path, limit, why)?).map_err(|e| {
        Error::input(path, format!("not UTF-8 text: invalid byte at offset {}", e.utf8_error().valid_up_to()))
    })
}

/// Reads `path` as text within `budget`'s share for a file read whole and parsed
/// ([`MemoryBudget::text`]).
pub fn read_text_within(path: &Path, budget: MemoryBudget) -> Result<String> {
    read_text(path, budget.text(), budget.text_why())
}

/// A line over the limit of [`read_line_bounded`], which follows from the memory limit.
#[derive(Debug, thiserror::Error)]
#[error("a line longer than {} ({})", ByteSize(*limit as u64).display().iec(), Text::from(MAX_MEMORY))]
pub(crate) struct LineTooLong {
    /// The most a line may hold, in bytes.
    pub limit: usize,
}

/// One line of at most `limit` bytes from `reader`, without its newline; `None` at the end.
/// A longer line is an `InvalidData` error: a peer that never ends a line cannot grow memory.
pub fn read_line_bounded(reader: &mut impl BufRead, limit: usize) -> std::io::Result<Option<String>> {
    let mut line = Vec::new();
    loop {
        let buf = reader.fill_buf()?;
        if buf.is_empty() {
            if line.is_empty() {
                return Ok(None);
            }
            break;
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        if line.len() + take > limit.saturating_add(1) {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, LineTooLong { limit }));
        }
        line.extend_from_slice(&buf[..take]);
        reader.consume(take);
        if done {
            line.pop();
            break;
        }
    }
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    String::from_utf8(line).map(Some).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Temporary files not yet renamed into place, removed when a signal ends the run.
static PARTIAL: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static COUNTER: AtomicU64 = AtomicU64::new(0);

fn partial() -> MutexGuard<'static, Vec<PathBuf>> {
    PARTIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Removes every temporary output and keeps them from being renamed: called once, when a signal
/// ends the process (the lock stays held until it exits).
pub fn abandon_partial_files() {
    let guard = partial();
    for path in guard.iter() {
        let _ = std::fs::remove_file(path);
    }
    std::mem::forget(guard);
}

/// Outputs written to temporary names, renamed into place together by [`Staged::commit`].
/// Dropped uncommitted (an error on the way), the temporary files are removed.
#[derive(Debug, Default)]
pub struct Staged {
    /// (temporary, final) paths.
    files: Vec<(PathBuf, PathBuf)>,
}

impl Staged {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// A temporary path in `target`'s directory (same extension, so writers that pick the format
    /// by extension still do), renamed to `target` on commit. The caller writes it.
    pub fn path_for(&mut self, target: &Path) -> PathBuf {
        let name = target.file_stem().map_or_else(String::new, |s| s.to_string_lossy().into_owned());
        let ext = target.extension().map_or_else(String::new, |e| format!(".{}", e.to_string_lossy()));
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = target.with_file_name(format!(".{name}.partial-{}-{n}{ext}", std::process::id()));
        partial().push(tmp.clone());
        self.files.push((tmp.clone(), target.to_path_buf()));
        tmp
    }

    /// Writes `bytes` to a temporary file for `target`.
    pub fn write(&mut self, target: &Path, bytes: &[u8]) -> Result<()> {
        let tmp = self.path_for(target);
        std::fs::write(&tmp, bytes).map_err(|e| Error::io(target, "cannot write", e))
    }

    /// Renames every file into place, under the lock a signal takes: all of them or none.
    pub fn commit(mut self) -> Result<()> {
        let mut pending = partial();
        for (tmp, target) in &self.files {
            // A device or FIFO (`/dev/null`, `/dev/stdout`) is written through: a rename would
            // replace the node itself with a regular file.
            let special = std::fs::metadata(target).is_ok_and(|m| !m.is_file() && !m.is_dir());
            let done = if special {
                let copied = std::fs::File::open(tmp)
                    .and_then(|mut from| std::io::copy(&mut from, &mut open_unblocked(target, true)?).map(drop));
                let _ = std::fs::remove_file(tmp);
                copied
            } else {
                std::fs::rename(tmp, target)
            };
            done.map_err(|e| Error::io(target, "cannot write", e))?;
            pending.retain(|p| p != tmp);
        }
        self.files.clear();
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if self.files.is_empty() {
            return;
        }
        let mut pending = partial();
        for (tmp, _) in self.files.drain(..) {
            let _ = std::fs::remove_file(&tmp);
            pending.retain(|p| p != &tmp);
        }
    }
}

/// Writes one file atomically (a temporary name, then a rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut staged = Staged::new();
    staged.write(path, bytes)?;
    staged.commit()
}

/// `tensors` as a safetensors file's bytes (`path` names the file in errors). Written with
/// [`Staged::write`] or [`write_atomic`], the file gets the mode every other output gets (0666
/// less the umask); `safetensors`' own file writer would make it 0600.
pub fn safetensors_bytes(
    tensors: &std::collections::HashMap<String, candle_core::Tensor>,
    path: &Path,
) -> Result<Vec<u8>> {
    safetensors::serialize(tensors, None).map_err(|e| Error::parse(path, "cannot write", e))
}

/// Creates `dir` (and its parents) for outputs.
pub fn create_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, "cannot create", e))
}

/// Reads a rows file (logits, or hidden states): a JSON array of rows, each `width` numbers
/// (`expected` says why, for errors), split into `batch` sequences (of `seq_len` tokens when
/// given). The file and what parsing it takes must fit
/// in `budget` bytes, checked before parsing.
pub fn read_rows(
    path: &Path,
    batch: usize,
    seq_len: Option<usize>,
    width: usize,
    expected: &str,
    budget: MemoryBudget,
) -> Result<Array3<f32>> {
    let text = read_text(path, budget.bytes(), MAX_MEMORY)?;
    // Parsed, every value is an f64 in a row vector (twice over while they grow) and every row
    // a vector: count them in the text before allocating them.
    let values = text.bytes().filter(|&b| b == b',').count() as u64 + 1;
    let rows = text.bytes().filter(|&b| b == b'[').count() as u64;
    let parsed = (text.len() as u64).saturating_add(values.saturating_mul(20)).saturating_add(rows.saturating_mul(48));
    budget.ensure_fits(&format!("reading {}", path.display()), parsed)?;
    // Read as f64 and narrow: a value beyond f32 becomes inf, which routing rejects naming the
    // batch, position and expert (more useful than a parse error).
    let rows: Vec<Vec<f64>> =
        serde_json::from_str(&text).map_err(|e| Error::parse(path, "expected a JSON array of rows of numbers", e))?;
    ensure_positive(&[(BATCH, batch)])?;
    if rows.is_empty() || !rows.len().is_multiple_of(batch) {
        return Err(Error::input(
            path,
            text!(format!("{} rows cannot be split into ", rows.len()), BATCH, format!(" {batch} sequences")),
        ));
    }
    let s = rows.len() / batch;
    if let Some(want) = seq_len.filter(|&want| want != s) {
        return Err(Error::input(
            path,
            text!(
                format!("{} rows at ", rows.len()),
                BATCH,
                format!(" {batch} give seq_len {s}, not "),
                SEQ_LEN,
                format!(" {want}")
            ),
        ));
    }
    if let Some((i, row)) = rows.iter().enumerate().find(|(_, r)| r.len() != width) {
        return Err(Error::input(path, format!("row {i} has {} values, {expected}", row.len())));
    }
    let flat = rows.iter().flatten().map(|&v| v as f32).collect();
    Ok(Array3::from_shape_vec((batch, s, width), flat).expect("rows checked"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("moe-audit-files-{name}-{}", std::process::id()));
        // Fresh: a directory left by an earlier run with the same process id would be counted.
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn reads_stop_at_the_limit() {
        let err = read_bounded(Path::new("/dev/zero"), 1000, "test").unwrap_err().to_string();
        assert!(err.contains("larger than 1000 B (test)"), "{err}");
        let d = dir("read");
        std::fs::write(d.join("f"), "hello").unwrap();
        assert_eq!(read_text(&d.join("f"), 5, "test").unwrap(), "hello");
        assert!(read_text(&d.join("f"), 4, "test").is_err());
        assert!(read_text(&d, 100, "test").unwrap_err().to_string().contains("is a directory"));
    }

    #[test]
    fn named_files_stay_inside_their_folder() {
        let d = dir("inside");
        std::fs::create_dir_all(d.join("sub")).unwrap();
        std::fs::write(d.join("sub/f"), "x").unwrap();
        let _ = std::fs::remove_file(d.join("out"));
        std::os::unix::fs::symlink("/etc/hostname", d.join("out")).unwrap();
        let _ = std::fs::remove_file(d.join("sub/up"));
        std::os::unix::fs::symlink("../sub/f", d.join("sub/up")).unwrap();
        assert_eq!(inside(&d, Path::new("sub/f"), "f").unwrap(), d.join("sub/f"));
        assert_eq!(inside(&d, Path::new("sub/up"), "f").unwrap(), d.join("sub/up"));
        assert_eq!(inside(&d, Path::new("missing"), "f").unwrap(), d.join("missing"));
        for bad in ["/etc/hostname", "../x", "sub/../../x"] {
            let e = inside(&d, Path::new(bad), "[input] file").unwrap_err().to_string();
            assert!(e.contains("[input] file: an absolute path or `..` leads out of"), "{bad}: {e}");
        }
        let e = inside(&d, Path::new("out"), "f").unwrap_err().to_string();
        assert!(e.contains("f: a symlink leads out of"), "{e}");
    }

    #[test]
    fn lines_stop_at_the_limit() {
        let mut r = std::io::Cursor::new(b"ab\r\ncdef\nxyz".to_vec());
        assert_eq!(read_line_bounded(&mut r, 4).unwrap().as_deref(), Some("ab"));
        assert_eq!(read_line_bounded(&mut r, 4).unwrap().as_deref(), Some("cdef"));
        assert_eq!(read_line_bounded(&mut r, 4).unwrap().as_deref(), Some("xyz"));
        assert_eq!(read_line_bounded(&mut r, 4).unwrap(), None);
        let mut long = std::io::Cursor::new(vec![b'x'; 100]);
        assert!(read_line_bounded(&mut long, 10).is_err());
    }

    #[test]
    fn a_set_is_renamed_together_or_not_at_all() {
        let d = dir("set");
        std::fs::write(d.join("a.txt"), "old").unwrap();
        {
            let mut s = Staged::new();
            s.write(&d.join("a.txt"), b"new").unwrap();
            s.write(&d.join("b.png"), b"new").unwrap();
            // Dropped without commit: nothing changes, no temporary file is left.
        }
        assert_eq!(std::fs::read_to_string(d.join("a.txt")).unwrap(), "old");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
        let mut s = Staged::new();
        s.write(&d.join("a.txt"), b"new").unwrap();
        assert!(s.path_for(&d.join("b.png")).extension().is_some_and(|e| e == "png"));
        std::fs::write(&s.files[1].0, b"png").unwrap();
        s.commit().unwrap();
        assert_eq!(std::fs::read_to_string(d.join("a.txt")).unwrap(), "new");
        assert_eq!(std::fs::read_to_string(d.join("b.png")).unwrap(), "png");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 2);
    }
}
