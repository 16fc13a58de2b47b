//! Arrays inside routing record files: `.npy`, `.npz` and `.safetensors`, parsed from the file's
//! bytes (a mapping of it, or read with a bound by `files::read_bounded`), each checked before
//! it is read: header, dtype, shape, and that the data is exactly as long as the shape says. An
//! array's data is a slice of those bytes (copied only out of an archive or to swap its order).

use super::budget::Budget;
use bytes::Bytes;
use moe_audit_core::error::{excerpt, Error, Part, RecordError, Result};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

/// Element types a record may hold (little-endian in memory; big-endian npy data is swapped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Elem {
    Bool,
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
    F16,
    Bf16,
    F32,
    F64,
}

impl Elem {
    pub(crate) fn size(self) -> usize {
        match self {
            Elem::Bool | Elem::I8 | Elem::U8 => 1,
            Elem::I16 | Elem::U16 | Elem::F16 | Elem::Bf16 => 2,
            Elem::I32 | Elem::U32 | Elem::F32 => 4,
            Elem::I64 | Elem::U64 | Elem::F64 => 8,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Elem::Bool => "bool",
            Elem::I8 => "int8",
            Elem::I16 => "int16",
            Elem::I32 => "int32",
            Elem::I64 => "int64",
            Elem::U8 => "uint8",
            Elem::U16 => "uint16",
            Elem::U32 => "uint32",
            Elem::U64 => "uint64",
            Elem::F16 => "float16",
            Elem::Bf16 => "bfloat16",
            Elem::F32 => "float32",
            Elem::F64 => "float64",
        }
    }

    fn is_int(self) -> bool {
        !matches!(self, Elem::Bool | Elem::F16 | Elem::Bf16 | Elem::F32 | Elem::F64)
    }
}

/// One named array: its shape, element type and little-endian bytes (a slice of the file's, or
/// its own when they had to be copied out of an archive or byte-swapped).
#[derive(Debug)]
pub(crate) struct Array {
    pub name: String,
    pub shape: Vec<usize>,
    pub elem: Elem,
    pub data: Bytes,
}

impl Array {
    pub(crate) fn len(&self) -> usize {
        self.data.len() / self.elem.size()
    }

    pub(crate) fn bad(&self, path: &Path, message: impl std::fmt::Display) -> Error {
        RecordError::new(path, Part::Array(self.name.clone()), message.to_string()).into()
    }

    /// The values as i64, for any integer type (`what` says what they are, for errors).
    pub(crate) fn int_at(&self, i: usize) -> i64 {
        let b = &self.data[i * self.elem.size()..(i + 1) * self.elem.size()];
        match self.elem {
            Elem::I8 => b[0] as i8 as i64,
            Elem::U8 => b[0] as i64,
            Elem::I16 => i16::from_le_bytes([b[0], b[1]]) as i64,
            Elem::U16 => u16::from_le_bytes([b[0], b[1]]) as i64,
            Elem::I32 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
            Elem::U32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
            Elem::I64 => i64::from_le_bytes(b.try_into().expect("8 bytes")),
            // Beyond i64::MAX is out of every range checked later.
            Elem::U64 => i64::try_from(u64::from_le_bytes(b.try_into().expect("8 bytes"))).unwrap_or(i64::MAX),
            _ => unreachable!("checked integer"),
        }
    }

    pub(crate) fn ensure_int(&self, path: &Path) -> Result<()> {
        if self.elem.is_int() {
            Ok(())
        } else {
            Err(self.bad(path, format!("dtype {} is not an integer type", self.elem.name())))
        }
    }

    /// The values as expert ids as stored (a uint8 255 stays 255, an int8 -56 stays -56: what a
    /// wrapped value means is decided with the expert count, in `clean`): types that fit an i32
    /// kept in place, wider ones decoded (values outside i32 refused).
    pub(crate) fn ints(&self, path: &Path, budget: &mut Budget) -> Result<Vec<i64>> {
        self.ensure_int(path)?;
        budget.take(&format!("reading {}", path.display()), self.len() as u64 * 8)?;
        Ok((0..self.len()).map(|i| self.int_at(i)).collect())
    }

    /// The values as f32 (router logits), from any float type.
    pub(crate) fn floats(&self, path: &Path, budget: &mut Budget) -> Result<Vec<f32>> {
        budget.take(&format!("reading {}", path.display()), self.len() as u64 * 4)?;
        let d = &self.data;
        Ok(match self.elem {
            Elem::F32 => d.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            Elem::F64 => d.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().expect("8")) as f32).collect(),
            Elem::F16 => d.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            Elem::Bf16 => d.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            other => return Err(self.bad(path, format!("dtype {} is not a float type", other.name()))),
        })
    }
}

/// `a * b * ...` checked: a shape whose size overflows is refused.
fn elements(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// Parses one `.npy` file's bytes (`name` is the array's name; `path` for errors).
pub(crate) fn npy(bytes: &Bytes, name: &str, path: &Path) -> Result<Array> {
    let bad = |m: String| -> Error { RecordError::new(path, Part::Array(name.to_string()), m).into() };
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad("not an .npy array (no \\x93NUMPY magic)".into()));
    }
    let (header_len, start): (usize, usize) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        v => return Err(bad(format!(".npy version {v} is not supported (1, 2 or 3)"))),
    };
    let header = bytes
        .get(start..start.saturating_add(header_len))
        .ok_or_else(|| bad(format!("truncated: the header says {header_len} bytes, the file has fewer")))?;
    let header = std::str::from_utf8(header).map_err(|_| bad("the header is not text".into()))?;
    let field = |key: &str| -> Option<&str> {
        let at = header.find(&format!("'{key}'"))? + key.len() + 2;
        let rest = header[at..].trim_start().strip_prefix(':')?.trim_start();
        Some(rest)
    };
    let descr = field("descr")
        .and_then(|r| r.strip_prefix('\''))
        .and_then(|r| r.split('\'').next())
        .ok_or_else(|| bad("the header has no 'descr'".into()))?;
    if field("fortran_order").is_some_and(|r| r.starts_with("True")) {
        return Err(bad("Fortran order is not supported: save np.ascontiguousarray(a)".into()));
    }
    let shape_text = field("shape")
        .and_then(|r| r.strip_prefix('('))
        .and_then(|r| r.split(')').next())
        .ok_or_else(|| bad("the header has no 'shape'".into()))?;
    let (shape_shown, descr_shown) = (excerpt(shape_text), excerpt(descr));
    let shape = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.trim_end_matches('L').parse::<usize>())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| bad(format!("shape ({shape_shown}) is not a tuple of sizes")))?;
    let (order, code) = descr.split_at(descr.len().min(1));
    let elem = match code {
        "b1" => Elem::Bool,
        "i1" => Elem::I8,
        "u1" => Elem::U8,
        "i2" => Elem::I16,
        "u2" => Elem::U16,
        "i4" => Elem::I32,
        "u4" => Elem::U32,
        "i8" => Elem::I64,
        "u8" => Elem::U64,
        "f2" => Elem::F16,
        "f4" => Elem::F32,
        "f8" => Elem::F64,
        _ => return Err(bad(format!("dtype '{descr_shown}' is not supported (integers, bool, float16/32/64)"))),
    };
    let count = elements(&shape).ok_or_else(|| bad(format!("shape ({shape_shown}) overflows")))?;
    let data_start = start + header_len;
    let want = count.checked_mul(elem.size()).ok_or_else(|| bad(format!("shape ({shape_shown}) overflows")))?;
    let have = bytes.len() - data_start;
    if have != want {
        let what = if have < want { "truncated" } else { "trailing bytes" };
        return Err(bad(format!(
            "{what}: shape ({shape_shown}) of {} needs {want} bytes of data, the file has {have}",
            elem.name()
        )));
    }
    let data = match order {
        ">" if elem.size() > 1 => Bytes::from(
            bytes[data_start..]
                .chunks_exact(elem.size())
                .flat_map(|c| c.iter().rev().copied().collect::<Vec<_>>())
                .collect::<Vec<u8>>(),
        ),
        "<" | "|" | "=" | ">" => bytes.slice(data_start..),
        _ => return Err(bad(format!("dtype '{descr_shown}' has no byte order"))),
    };
    Ok(Array { name: name.to_string(), shape, elem, data })
}

/// Every array of an `.npz` archive (stored, as `np.savez` writes it), by name without `.npy`. Each entry
/// is decompressed at most to the size its own header declares, within `budget`.
pub(crate) fn npz(bytes: &[u8], path: &Path, budget: &mut Budget) -> Result<BTreeMap<String, Bytes>> {
    let bad = |m: String| -> Error { RecordError::new(path, Part::Whole, m).into() };
    let entry = |i: usize| move |e: zip::result::ZipError| RecordError::new(path, Part::Entry(i), "").because(e);
    let mut zip = zip::ZipArchive::new(std::io::Cursor::new(bytes))
        .map_err(|e| RecordError::new(path, Part::Whole, "not an .npz archive").because(e))?;
    let mut out = BTreeMap::new();
    for i in 0..zip.len() {
        let method = zip.by_index_raw(i).map_err(entry(i))?.compression();
        if method != zip::CompressionMethod::Stored {
            return Err(bad(format!(
                "entry {i} is compressed ({method}): write the archive with np.savez, not np.savez_compressed"
            )));
        }
        let mut entry = zip.by_index(i).map_err(entry(i))?;
        let name = String::from_utf8_lossy(entry.name_raw()).into_owned();
        let Some(stem) = name.strip_suffix(".npy") else { continue };
        let size = entry.size();
        budget.take(&format!("reading {}", path.display()), size)?;
        let mut data = Vec::with_capacity(size as usize);
        // A declared size that lies cannot grow the buffer past it.
        (&mut entry)
            .take(size.saturating_add(1))
            .read_to_end(&mut data)
            .map_err(|e| RecordError::new(path, Part::EntryNamed(name.clone()), "").because(e))?;
        if data.len() as u64 != size {
            let held = if data.len() as u64 > size { "more".into() } else { format!("only {}", data.len()) };
            return Err(bad(format!("entry `{}` declares {size} bytes but holds {held}", excerpt(&name))));
        }
        out.insert(stem.to_string(), Bytes::from(data));
    }
    Ok(out)
}

/// A safetensors dtype as an element type.
fn elem_of(dtype: safetensors::Dtype) -> Option<Elem> {
    use safetensors::Dtype as D;
    Some(match dtype {
        D::BOOL => Elem::Bool,
        D::I8 => Elem::I8,
        D::U8 => Elem::U8,
        D::I16 => Elem::I16,
        D::U16 => Elem::U16,
        D::I32 => Elem::I32,
        D::U32 => Elem::U32,
        D::I64 => Elem::I64,
        D::U64 => Elem::U64,
        D::F16 => Elem::F16,
        D::BF16 => Elem::Bf16,
        D::F32 => Elem::F32,
        D::F64 => Elem::F64,
        _ => return None,
    })
}

/// Every tensor of a safetensors file (validated by the `safetensors` crate: header, offsets,
/// sizes), and its `__metadata__`.
pub(crate) fn safetensors(bytes: &Bytes, path: &Path) -> Result<(Vec<Array>, BTreeMap<String, String>)> {
    let not_safetensors =
        |e: safetensors::SafeTensorError| RecordError::new(path, Part::Whole, "not a safetensors file").because(e);
    let file = safetensors::SafeTensors::deserialize(bytes).map_err(not_safetensors)?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(bytes).map_err(not_safetensors)?;
    let metadata = meta.metadata().clone().unwrap_or_default().into_iter().collect();
    let mut arrays = Vec::new();
    for (name, view) in file.iter() {
        let elem = elem_of(view.dtype()).ok_or_else(|| {
            RecordError::new(path, Part::Tensor(name.to_string()), format!("dtype {:?} is not supported", view.dtype()))
        })?;
        arrays.push(Array {
            name: name.to_string(),
            shape: view.shape().to_vec(),
            elem,
            data: bytes.slice_ref(view.data()),
        });
    }
    arrays.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((arrays, metadata))
}

#[cfg(test)]
mod tests {
    use super::*;
    use moe_audit_core::error::chain;
    use std::error::Error as _;

    #[test]
    fn a_reader_error_is_kept_as_the_source_of_a_record_error() {
        let path = Path::new("r.npz");
        let mut budget = Budget::new(moe_audit_core::MemoryBudget::new(1 << 20));
        let e = npz(b"not a zip", path, &mut budget).unwrap_err();
        let Error::Record(r) = &e else { panic!("{e:?}") };
        assert_eq!((r.path.as_path(), &r.part), (path, &Part::Whole));
        assert!(e.source().and_then(|s| s.downcast_ref::<zip::result::ZipError>()).is_some(), "{e:?}");
        assert!(chain(&e).starts_with("r.npz: not an .npz archive: "), "{}", chain(&e));
        let e = npy(&Bytes::from_static(b"\x93NUMPY\x01\x00\x04\x00{'x}"), "ids", Path::new("r.npy")).unwrap_err();
        let Error::Record(r) = &e else { panic!("{e:?}") };
        assert_eq!(r.part, Part::Array("ids".into()));
        assert_eq!(e.to_string(), "r.npy: array `ids`: the header has no 'descr'");
    }
}
