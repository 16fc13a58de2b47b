//! A record's expert ids as the writer stored them, read in chunks: decoded ids in memory (what
//! JSON and traces hold), or the stored bytes themselves (a memory-mapped `.npy`, a caller's
//! numpy array) in their own dtype, never widened whole. A 1M-token record of uint8 is 480 MiB
//! on disk and would be 1.9 GiB as i32; read this way it costs a chunk at a time.

use super::array::{Array, Elem};
use super::budget::Budget;
use bytes::Bytes;
use moe_audit_core::error::Result;
use std::ops::Range;
use std::path::Path;

/// Expert ids `[tokens, layers, top_k]` as stored (a uint8 255 is 255 here: `clean` decides).
#[derive(Debug, Clone)]
pub(crate) enum Ids {
    /// Decoded in memory.
    Owned(Vec<i32>),
    /// Little-endian bytes of `elem` (i8, u8, i16, u16 or i32): every value fits an i32.
    /// `mapped`: the bytes are pages of a file mapped read-only, given back once read.
    Stored { bytes: Bytes, elem: Elem, mapped: bool },
}

impl From<Vec<i32>> for Ids {
    fn from(v: Vec<i32>) -> Self {
        Ids::Owned(v)
    }
}

impl Ids {
    /// The expert ids of an integer array: its bytes as stored when they fit an i32 (read in
    /// place), else decoded within `budget` (a value that is no i32 is refused).
    pub(crate) fn of_array(a: &Array, path: &Path, budget: &mut Budget) -> Result<Ids> {
        a.ensure_int(path)?;
        if Ids::storable(a.elem) {
            return Ok(Ids::Stored { bytes: a.data.clone(), elem: a.elem, mapped: false });
        }
        budget.take(&format!("reading {}", path.display()), a.len() as u64 * 4)?;
        let ids = (0..a.len())
            .map(|i| {
                let v = a.int_at(i);
                i32::try_from(v)
                    .map_err(|_| a.bad(path, format!("value {v} at flat index {i} is not an expert id or -1")))
            })
            .collect::<Result<Vec<i32>>>()?;
        Ok(Ids::Owned(ids))
    }

    /// Ids held.
    pub(crate) fn len(&self) -> usize {
        match self {
            Ids::Owned(v) => v.len(),
            Ids::Stored { bytes, elem, .. } => bytes.len() / elem.size(),
        }
    }

    /// Whether `elem`'s values are kept as stored (all fit an i32).
    pub(crate) fn storable(elem: Elem) -> bool {
        matches!(elem, Elem::I8 | Elem::U8 | Elem::I16 | Elem::U16 | Elem::I32)
    }

    /// The ids of `range` as i32, into `out` (cleared first).
    pub(crate) fn decode(&self, range: Range<usize>, out: &mut Vec<i32>) {
        out.clear();
        let (bytes, elem) = match self {
            Ids::Owned(v) => return out.extend_from_slice(&v[range]),
            Ids::Stored { bytes, elem, .. } => (bytes, *elem),
        };
        let d = &bytes[range.start * elem.size()..range.end * elem.size()];
        match elem {
            Elem::U8 => out.extend(d.iter().map(|&b| b as i32)),
            Elem::I8 => out.extend(d.iter().map(|&b| b as i8 as i32)),
            Elem::I16 => out.extend(d.chunks_exact(2).map(|b| i16::from_le_bytes([b[0], b[1]]) as i32)),
            Elem::U16 => out.extend(d.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]]) as i32)),
            Elem::I32 => out.extend(d.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
            _ => unreachable!("only storable types are stored"),
        }
    }

    /// `f` on every chunk of `chunk` token rows (`width` ids each) as stored, decoded into a
    /// buffer of its thread, in parallel, each chunk's mapped pages given back once decoded;
    /// the results in token order, whatever the thread count.
    pub(crate) fn par_chunks<'a, T: Send + 'a>(
        &'a self,
        tokens: usize,
        width: usize,
        chunk: usize,
        f: impl Fn(Range<usize>, &mut [i32]) -> T + Sync + Send + 'a,
    ) -> impl rayon::iter::IndexedParallelIterator<Item = T> + 'a {
        use rayon::prelude::*;
        (0..tokens.div_ceil(chunk)).into_par_iter().map_init(Vec::new, move |buf, c| {
            let rows = c * chunk..((c + 1) * chunk).min(tokens);
            self.decode(rows.start * width..rows.end * width, buf);
            self.release(rows.start * width..rows.end * width);
            f(rows, buf)
        })
    }

    /// The largest id other than `skip`, over all ids (a pass over stored bytes without
    /// decoding them, in parallel chunks given back once read).
    pub(crate) fn max_except(&self, skip: i32) -> Option<i32> {
        use rayon::prelude::*;
        const CHUNK: usize = 1 << 20;
        let max = |v: &mut dyn Iterator<Item = i32>| v.filter(|&x| x != skip).max();
        match self {
            Ids::Owned(v) => max(&mut v.iter().copied()),
            Ids::Stored { bytes, elem, .. } => (0..self.len().div_ceil(CHUNK))
                .into_par_iter()
                .filter_map(|c| {
                    let range = c * CHUNK..((c + 1) * CHUNK).min(self.len());
                    let d = &bytes[range.start * elem.size()..range.end * elem.size()];
                    let m = match elem {
                        // The common case (uint8 records), kept branch-free for the vector unit.
                        Elem::U8 => {
                            Some(d.iter().fold(-1, |m, &b| if i32::from(b) == skip { m } else { m.max(i32::from(b)) }))
                                .filter(|&m| m >= 0)
                        }
                        _ => {
                            let mut buf = Vec::new();
                            self.decode(range.clone(), &mut buf);
                            max(&mut buf.into_iter())
                        }
                    };
                    self.release(range);
                    m
                })
                .max(),
        }
    }

    /// Gives back the mapped pages of `range` once read (the file keeps them): the process's
    /// resident memory stays a few chunks, whatever the record's size. Rounded out to the
    /// kernel's fault-around window (64 KiB), which a read of one row maps whole.
    pub(crate) fn release(&self, range: Range<usize>) {
        #[cfg(unix)]
        if let Ids::Stored { bytes, elem, mapped: true } = self {
            const PAGE: usize = 4096;
            const AROUND: usize = 64 << 10;
            let base = bytes.as_ptr() as usize;
            let start = (base + range.start * elem.size()) / AROUND * AROUND;
            let end = (base + range.end * elem.size()).div_ceil(AROUND) * AROUND;
            let (lo, hi) = (start.max(base.div_ceil(PAGE) * PAGE), end.min((base + bytes.len()) / PAGE * PAGE));
            if hi > lo {
                // SAFETY: whole pages inside a read-only shared file mapping that `bytes` keeps
                // alive; dropping them only means the next read (this thread's or another's)
                // faults them in again from the file.
                unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_DONTNEED) };
            }
        }
    }

    /// Marks stored bytes that lie inside `file`, a mapped file, as mapped pages.
    pub(crate) fn mark_mapped(&mut self, file: &Bytes) {
        if let Ids::Stored { bytes, mapped, .. } = self {
            let (f, b) = (file.as_ptr() as usize, bytes.as_ptr() as usize);
            *mapped = b >= f && b + bytes.len() <= f + file.len();
        }
    }

    /// The ids of `parts` one after the other: stored bytes of one type copied as they are,
    /// else decoded (within `budget`).
    pub(crate) fn concat(parts: Vec<Ids>, budget: &mut Budget, what: &str) -> Result<Ids> {
        let elem = match parts.first() {
            Some(Ids::Stored { elem, .. }) => Some(*elem),
            _ => None,
        };
        let total: usize = parts.iter().map(Ids::len).sum();
        if let Some(elem) = elem.filter(|&e| parts.iter().all(|p| matches!(p, Ids::Stored { elem, .. } if *elem == e)))
        {
            budget.take(what, (total * elem.size()) as u64)?;
            let mut all = Vec::with_capacity(total * elem.size());
            for p in &parts {
                if let Ids::Stored { bytes, .. } = p {
                    all.extend_from_slice(bytes);
                }
            }
            return Ok(Ids::Stored { bytes: Bytes::from(all), elem, mapped: false });
        }
        budget.take(what, total as u64 * 4)?;
        let mut all = Vec::with_capacity(total);
        let mut buf = Vec::new();
        for p in &parts {
            p.decode(0..p.len(), &mut buf);
            all.extend_from_slice(&buf);
        }
        Ok(Ids::Owned(all))
    }
}

/// The process's own memory map (`/proc/self/maps`; empty elsewhere than Linux).
pub(crate) struct Maps(String);

impl Maps {
    pub(crate) fn of_process() -> Maps {
        Maps(std::fs::read_to_string("/proc/self/maps").unwrap_or_default())
    }

    /// Whether `bytes` lie in one read-only shared mapping of a file (an `np.memmap` opened with
    /// mode "r"): only such pages may be given back after reading, since the file holds them
    /// unchanged; anonymous or writable memory never is.
    pub(crate) fn holds_read_only_file(&self, bytes: &[u8]) -> bool {
        let (start, end) = (bytes.as_ptr() as usize, bytes.as_ptr() as usize + bytes.len());
        !bytes.is_empty()
            && self.0.lines().any(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                let Some((lo, hi)) = f.first().and_then(|r| r.split_once('-')) else { return false };
                let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) else {
                    return false;
                };
                lo <= start && end <= hi && f.get(1) == Some(&"r--s") && f.get(4).is_some_and(|inode| *inode != "0")
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    #[test]
    fn only_a_read_only_file_mapping_is_given_back() {
        let path = std::env::temp_dir().join(format!("moe-audit-ids-{}", std::process::id()));
        std::fs::write(&path, vec![7u8; 1 << 16]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let heap = vec![7u8; 1 << 16];
        let maps = Maps::of_process();
        assert!(maps.holds_read_only_file(&map[100..200]));
        assert!(!maps.holds_read_only_file(&heap));
        assert!(!maps.holds_read_only_file(&map[..0]));
        // Given back and read again: the same bytes.
        let mut ids = Ids::Stored { bytes: Bytes::from_owner(map), elem: Elem::U8, mapped: false };
        if let Ids::Stored { bytes, .. } = &ids {
            let whole = bytes.clone();
            ids.mark_mapped(&whole);
        }
        let mut out = Vec::new();
        ids.decode(0..1 << 16, &mut out);
        ids.release(0..1 << 16);
        ids.decode(0..1 << 16, &mut out);
        assert!(out.iter().all(|&v| v == 7));
        std::fs::remove_file(path).unwrap();
    }
}
