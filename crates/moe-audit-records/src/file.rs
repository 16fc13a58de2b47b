//! A record's bytes within `--max-memory`: a regular file mapped (its arrays are read in place,
//! a chunk at a time), anything else read whole within the budget, a folder read only for
//! Megatron's per-rank `router_trace_rank{r}.jsonl` files directly inside it (symlinks refused).
//! A record never names another file: nothing in it is followed.

use super::budget::Budget;
use bytes::Bytes;
use moe_audit_core::error::{Error, Part, RecordError, Result, Text};
use moe_audit_core::files::{open_unblocked, read_bounded};
use moe_audit_core::settings::MAX_MEMORY;
use std::path::Path;

/// A trace file to read: its name, its rank when a folder's file name says it, its bytes.
pub(crate) type TraceFile = (String, Option<u64>, Vec<u8>);

/// The record at `path` is wrong as a whole: `message` ([`RecordError`], [`Part::Whole`]).
pub(crate) fn bad(path: &Path, message: impl Into<Text>) -> Error {
    RecordError::new(path, Part::Whole, message).into()
}

/// A record file's bytes: a regular file is mapped (its arrays are read in place, a chunk at a
/// time, see `ids`), anything else read whole within the budget.
pub(crate) fn open(path: &Path, budget: &mut Budget) -> Result<File> {
    let file = open_unblocked(path, false).map_err(|e| Error::io(path, "cannot read", e))?;
    let meta = file.metadata().map_err(|e| Error::io(path, "cannot read", e))?;
    if meta.is_file() && meta.len() > 0 {
        // SAFETY: mapped read-only; a record changed while it is compared is the caller's race,
        // as with any reader of a file that changes under it.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, "cannot read", e))?;
        return Ok(File { bytes: Bytes::from_owner(map), mapped: true });
    }
    Ok(File { bytes: Bytes::from(read_whole(path, budget)?), mapped: false })
}

/// A record file's bytes, and whether they are a mapping of it.
pub(crate) struct File {
    pub bytes: Bytes,
    pub mapped: bool,
}

fn read_whole(path: &Path, budget: &mut Budget) -> Result<Vec<u8>> {
    let what = format!("reading {}", path.display());
    if let Some(size) = std::fs::metadata(path).ok().filter(|m| m.is_file()).map(|m| m.len()) {
        Budget::clone(budget).take(&what, size)?;
    }
    let bytes = read_bounded(path, budget.left(), MAX_MEMORY)?;
    budget.take(&what, bytes.len() as u64)?;
    Ok(bytes)
}

/// The `router_trace_rank{r}.jsonl` files of a folder, in rank order, each with its rank.
pub(crate) fn trace_folder(dir: &Path, budget: &mut Budget) -> Result<Vec<TraceFile>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, "cannot read", e))?;
    let mut ranks = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let rank = name
            .strip_prefix("router_trace_rank")
            .and_then(|r| r.strip_suffix(".jsonl"))
            .and_then(|r| r.parse::<u64>().ok());
        if let Some(r) = rank {
            if e.file_type().is_ok_and(|t| t.is_symlink()) {
                return Err(bad(&e.path(), "a symlink in a trace folder is not followed"));
            }
            ranks.push((r, name, e.path()));
        }
    }
    if ranks.is_empty() {
        return Err(bad(dir, "a folder holds a record only as Megatron's router_trace_rank{r}.jsonl files: none here"));
    }
    ranks.sort();
    ranks.into_iter().map(|(r, name, p)| Ok((name, Some(r), read_whole(&p, budget)?))).collect()
}
