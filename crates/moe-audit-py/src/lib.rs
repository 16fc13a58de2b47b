//! `moe_audit._native`: the Rust side of the Python package.
//!
//! - [`compare`]: `moe_audit.routes.compare`, a rollout record against a trainer record in
//!   this process: each side a file, or integer arrays `[tokens, layers, top_k]` read in place
//!   through the buffer protocol; the comparison runs without the GIL and returns the document
//!   `moe-audit routes compare --format json` prints;
//! - [`main`]: the wheel's `moe-audit` command, the binary's command line.

use moe_audit::records::{self, CompareOptions, Layout, Sides};
use moe_audit::MemoryBudget;
use pyo3::prelude::*;
use std::path::Path;

/// One array's data: address, bytes, dtype name, shape `(tokens, layers, top_k)`.
type RawPart = (usize, usize, String, (usize, usize, usize));

/// One side of a comparison as the Python wrapper hands it over.
#[derive(FromPyObject)]
enum Side {
    /// A record file (any format `routes compare` reads).
    Path(std::path::PathBuf),
    /// `(name, [(address, bytes, dtype, (tokens, layers, top_k)), ...], layers)`: one array per
    /// sequence, each the data of a C-contiguous little-endian integer array that the caller
    /// keeps alive and unchanged for the call (read in place: numpy's `__array_interface__`;
    /// the buffer protocol is not in the stable ABI before Python 3.11), and the global layer
    /// numbers of axis 1 when the caller knows them.
    Arrays(String, Vec<RawPart>, Option<Vec<usize>>),
}

impl Side {
    /// Where the records library reads it from.
    fn source(&self) -> records::Source<'_> {
        match self {
            Side::Path(p) => records::Source::File(p),
            Side::Arrays(name, parts, layers) => records::Source::Arrays(name, id_arrays(parts), layers.clone()),
        }
    }
}

/// An array's data in the caller's memory, as the bytes of a record.
struct Buffer {
    address: usize,
    len: usize,
}

impl AsRef<[u8]> for Buffer {
    fn as_ref(&self) -> &[u8] {
        match self.len {
            0 => &[],
            // SAFETY: `address` and `len` are the data of a C-contiguous numpy array that
            // `moe_audit.routes.compare` holds, unchanged, for the whole call (the only caller
            // of this private module); the record reading it is dropped before the call returns
            // and nothing here writes to it.
            _ => unsafe { std::slice::from_raw_parts(self.address as *const u8, self.len) },
        }
    }
}

/// The arrays of a side as the record's in-memory parts (their bytes read in place).
fn id_arrays(parts: &[RawPart]) -> Vec<records::IdArray> {
    parts
        .iter()
        .map(|&(address, len, ref dtype, (t, l, k))| records::IdArray {
            bytes: bytes::Bytes::from_owner(Buffer { address, len }),
            dtype: dtype.clone(),
            shape: [t, l, k],
        })
        .collect()
}

/// `moe-audit routes compare` in process: `(True, json)` as `--format json` prints it, or
/// `(False, message)` with the command's one-line error message (raised by the wrapper as
/// `moe_audit.RoutesError`). `config` is a config.json path, `config_json` its text.
#[pyfunction]
#[pyo3(signature = (rollout, trainer, config=None, config_json=None, max_disagreement=None, max_memory=None))]
fn compare(
    py: Python<'_>,
    rollout: Side,
    trainer: Side,
    config: Option<std::path::PathBuf>,
    config_json: Option<String>,
    max_disagreement: Option<f64>,
    max_memory: Option<String>,
) -> PyResult<(bool, String)> {
    // What Python is told (the report, an error) names settings as `compare`'s keyword arguments.
    Ok(py.detach(|| {
        moe_audit::error::with_names(keyword, || {
            match run(
                &rollout,
                &trainer,
                config.as_deref(),
                config_json.as_deref(),
                max_disagreement,
                max_memory.as_deref(),
            ) {
                Ok(text) => (true, text),
                Err(e) => (false, moe_audit::error::present(&e, keyword)),
            }
        })
    }))
}

/// A setting as `compare` names it: its keyword argument (`max_memory`), which is the library's
/// name of the setting.
fn keyword(setting: moe_audit::error::Setting) -> std::borrow::Cow<'static, str> {
    setting.name().into()
}

fn run(
    rollout: &Side,
    trainer: &Side,
    config: Option<&Path>,
    config_json: Option<&str>,
    max_disagreement: Option<f64>,
    max_memory: Option<&str>,
) -> moe_audit::Result<String> {
    use moe_audit::error::{excerpt_long, Error};
    use moe_audit::settings::{CONFIG, MAX_MEMORY};
    use moe_audit::text;
    let options = CompareOptions::new(max_disagreement)?;
    let limit =
        max_memory.map(|m| moe_audit::memory::parse_size(m).map_err(|e| Error::setting(MAX_MEMORY, e))).transpose()?;
    let layout = match (config, config_json) {
        (Some(path), _) => Some(Layout::load(path)?),
        (None, Some(text)) => {
            let value: serde_json::Value = serde_json::from_str(text)
                .map_err(|e| Error::usage(text!(CONFIG, format!(": not JSON: {}", excerpt_long(&e)))))?;
            Some(Layout::from_json(&value).map_err(|m| Error::usage(text!(CONFIG, format!(": {m}"))))?)
        }
        (None, None) => None,
    };
    let sources = Sides::new(rollout.source(), trainer.source());
    let c = records::compare_sources(sources, layout.as_ref(), &options, MemoryBudget::from_request(limit))?;
    Ok(moe_audit::command::json(&c))
}

/// The wheel's `moe-audit` command: the binary's command line on `sys.argv`. Never returns:
/// the process exits with the command's code, as the binary does.
#[pyfunction]
fn main(py: Python<'_>) -> PyResult<()> {
    let argv: Vec<std::ffi::OsString> = py.import("sys")?.getattr("argv")?.extract()?;
    // Python buffers what it printed (nothing, for a console script); flushed before Rust writes.
    let sys = py.import("sys")?;
    for stream in ["stdout", "stderr"] {
        let _ = sys.getattr(stream).and_then(|s| s.call_method0("flush"));
    }
    let code = py.detach(|| moe_audit::command::main(argv));
    std::process::exit(i32::from(code))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(compare, m)?)?;
    m.add_function(wrap_pyfunction!(main, m)?)?;
    Ok(())
}
