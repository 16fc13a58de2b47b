//! Reading a routing record within `--max-memory`, the steps in the data's order: its bytes read
//! with a bound (`file`), the writer recognised by content (`formats`), then made comparable
//! (`clean`, into a [`Record`]). A record never names another file: nothing in it is followed.

use super::array::{self, Array};
use super::budget::Budget;
use super::config::{LayerKind, Layout};
use super::file::{self, bad};
use super::formats::{self, Dtype, Raw};
use super::ids::{self, Ids};
use super::sides::Sides;
use bytes::Bytes;
use moe_audit_core::error::{Part, RecordError, Result};
use serde_json::Value;
use std::path::Path;

pub use super::clean::Found;
pub use super::formats::{Format, Sequence, ShapeHint, GENERIC};
pub use super::record::Record;
pub use super::text::ranges;

/// Where a record is read from.
#[derive(Debug)]
pub enum Source<'a> {
    /// A record file or a folder of trace files ([`load`]).
    File(&'a Path),
    /// Arrays in memory ([`from_ids`]): the record's name, one array per sequence, the global
    /// layer numbers of axis 1 when known.
    Arrays(&'a str, Vec<IdArray>, Option<Vec<usize>>),
}

impl Source<'_> {
    /// A JSON file: possibly SGLang's payload, which has no shape of its own.
    fn shapeless(&self) -> bool {
        matches!(self, Source::File(p) if p.extension().is_some_and(|e| e.eq_ignore_ascii_case("json")))
    }

    fn load(self, layout: Option<&Layout>, other: Option<&Record>, budget: &mut Budget) -> Result<Record> {
        match self {
            Source::File(p) => load(p, layout, other.map(ShapeHint::of), budget),
            Source::Arrays(name, parts, layers) => from_ids(name, parts, layers, layout, budget),
        }
    }
}

/// Reads the two records of a comparison against `layout` when given. A JSON record (an SGLang
/// payload has no shape) is read after the other, which tells its top-k.
pub fn load_both(sources: Sides<Source<'_>>, layout: Option<&Layout>, budget: &mut Budget) -> Result<Sides<Record>> {
    let Sides { rollout, trainer } = sources;
    if rollout.shapeless() && !trainer.shapeless() {
        let t = trainer.load(layout, None, budget)?;
        Ok(Sides::new(rollout.load(layout, Some(&t), budget)?, t))
    } else {
        let r = rollout.load(layout, None, budget)?;
        let t = trainer.load(layout, Some(&r), budget)?;
        Ok(Sides::new(r, t))
    }
}

/// [`load_both`] with the pair as a tuple, as 0.2.0 had it.
#[deprecated(since = "0.3.0", note = "use `load_both`, which takes and returns `Sides`")]
pub fn load_pair(
    rollout: Source<'_>,
    trainer: Source<'_>,
    layout: Option<&Layout>,
    budget: &mut Budget,
) -> Result<(Record, Record)> {
    let both = load_both(Sides::new(rollout, trainer), layout, budget)?;
    Ok((both.rollout, both.trainer))
}

/// Reads a record, made comparable against `layout` when given. `hint`, the other record's,
/// helps shape a record with no shape of its own (SGLang) when no layout is given; the record's
/// notes say how.
pub fn load(path: &Path, layout: Option<&Layout>, hint: Option<ShapeHint>, budget: &mut Budget) -> Result<Record> {
    let raw = if std::fs::metadata(path).is_ok_and(|m| m.is_dir()) {
        let files = file::trace_folder(path, budget)?;
        formats::megatron::trace(path, &files, layout, budget)?
    } else {
        let file = file::open(path, budget)?;
        let mut raw = dispatch(path, &file.bytes, layout, hint, budget)?;
        if file.mapped {
            raw.experts.mark_mapped(&file.bytes);
        }
        raw
    };
    Record::of(path, raw, layout)
}

/// A record held in memory (an engine's HTTP response as it came), read as [`load`] reads a
/// file named `name`: the writer told from the bytes.
pub fn from_bytes(
    name: &str,
    bytes: Bytes,
    layout: Option<&Layout>,
    hint: Option<ShapeHint>,
    budget: &mut Budget,
) -> Result<Record> {
    let path = Path::new(name);
    let raw = dispatch(path, &bytes, layout, hint, budget)?;
    Record::of(path, raw, layout)
}

/// One array of expert ids `[tokens, layers, top_k]` in memory (one sequence): little-endian,
/// C-contiguous bytes of a numpy dtype (`uint8`, `int16`, `int32`, ...), read in place.
#[derive(Debug, Clone)]
pub struct IdArray {
    /// The array's data.
    pub bytes: Bytes,
    /// numpy's name of its dtype.
    pub dtype: String,
    /// `[tokens, layers, top_k]`.
    pub shape: [usize; 3],
}

/// A record of arrays in memory, one sequence each (named `name` in the report and errors),
/// its layers numbered `layers` when given, made comparable as a file's is: the bytes are read
/// in place (types wider than i32 are decoded within the budget); those of a file mapped
/// read-only (`np.load(..., mmap_mode="r")`) are given back once read, as a record file's are.
pub fn from_ids(
    name: &str,
    parts: Vec<IdArray>,
    layers: Option<Vec<usize>>,
    layout: Option<&Layout>,
    budget: &mut Budget,
) -> Result<Record> {
    let path = Path::new(name);
    let Some(first) = parts.first() else {
        return Err(bad(path, "no arrays: give one [tokens, layers, top_k] array, or one per sequence"));
    };
    let (dtype, [_, l, k]) = (first.dtype.clone(), first.shape);
    let maps = ids::Maps::of_process();
    let mut raws = Vec::with_capacity(parts.len());
    for (i, p) in parts.into_iter().enumerate() {
        if p.dtype != dtype || p.shape[1..] != [l, k] {
            return Err(bad(
                path,
                format!(
                    "sequence {i} is {} {:?}, sequence 0 {dtype} [_, {l}, {k}]: every sequence has the same layers, top-k and dtype",
                    p.dtype, p.shape
                ),
            ));
        }
        let elem = Dtype::named(&p.dtype)
            .and_then(|d| d.elem)
            .ok_or_else(|| bad(path, format!("dtype {}: expert ids must be integers", p.dtype)))?;
        if Some(p.bytes.len()) != p.shape.iter().try_fold(elem.size(), |a, &d| a.checked_mul(d)) {
            return Err(bad(path, format!("sequence {i}: {} bytes for {} {:?}", p.bytes.len(), p.dtype, p.shape)));
        }
        let array = Array { name: format!("sequence {i}"), shape: p.shape.to_vec(), elem, data: p.bytes.clone() };
        let mut ids = Ids::of_array(&array, path, budget)?;
        if maps.holds_read_only_file(&p.bytes) {
            ids.mark_mapped(&p.bytes);
        }
        raws.push(Raw::bare(Format::Npy, Dtype::of(elem), p.shape, ids));
    }
    let mut raw = if raws.len() == 1 { raws.pop().expect("one") } else { Raw::concat(path, raws, budget)? };
    let declared = layers.is_some();
    raw.layers = layers;
    let mut record = Record::of(path, raw, layout)?;
    if declared {
        record.found.numbering = "declared by the caller".to_string();
    }
    Ok(record)
}

fn dispatch(
    path: &Path,
    bytes: &Bytes,
    layout: Option<&Layout>,
    hint: Option<ShapeHint>,
    budget: &mut Budget,
) -> Result<Raw> {
    if bytes.starts_with(b"\x93NUMPY") {
        return formats::vllm::npy(path, bytes, budget);
    }
    if bytes.starts_with(b"PK\x03\x04") || bytes.starts_with(b"PK\x05\x06") {
        let entries = array::npz(bytes, path, budget)?;
        let arrays = entries.iter().map(|(name, data)| array::npy(data, name, path)).collect::<Result<Vec<_>>>()?;
        return formats::from_arrays(path, arrays, Default::default(), budget);
    }
    if bytes.iter().find(|b| !b.is_ascii_whitespace()).is_some_and(|&b| b == b'{' || b == b'[') {
        // Text is parsed whole: it takes its size from the budget (arrays are read in place).
        budget.take(&format!("reading {}", path.display()), bytes.len() as u64)?;
        if formats::megatron::is_trace(bytes) {
            let name =
                path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
            return formats::megatron::trace(path, &[(name, None, bytes.to_vec())], layout, budget);
        }
        // The parsed tree holds the base64 text once more.
        budget.take(&format!("parsing {}", path.display()), bytes.len() as u64 * 2)?;
        let value: Value =
            serde_json::from_slice(bytes).map_err(|e| RecordError::new(path, Part::Whole, "not JSON").because(e))?;
        let config = layout.map(|l| (l.kinds.iter().filter(|k| **k != LayerKind::Mtp).count(), l.top_k));
        return formats::from_json(path, &value, config, hint, budget);
    }
    let (arrays, meta) = array::safetensors(bytes, path)?;
    formats::from_arrays(path, arrays, meta, budget)
}
