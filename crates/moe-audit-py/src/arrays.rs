//! A routing record from integer arrays in this process's memory: the caller's bytes read in
//! place (no copy before the record's own ids), one sequence per array.
//!
//! Interim: built here through the public `Record` fields, because the readers' cleaning
//! (`routes::clean`: fill and padding rows, unsigned -1, wrapped ids, layer numbering against a
//! config) is private to `moe_audit::routes`. What is done here: ids as stored (negative = no
//! route), rows with no route in any layer are padding, numbering as a bare `.npy` is numbered
//! (0 to L-1) or against the config by the count of its layers, dense layers (by the config)
//! never compared. The wanted entry point, `routes::from_ids`, is described in
//! /work/notes/issue-36-docs.md: with it this file becomes a call.

use moe_audit::error::{Error, Result};
use moe_audit::routes::read::{Format, Found, Record, Sequence};
use moe_audit::routes::{Budget, LayerKind, Layout};
use std::path::PathBuf;

/// One array `[tokens, layers, top_k]` of one sequence.
pub struct Part<'a> {
    /// Its bytes, native (little-endian) order, C-contiguous.
    pub bytes: &'a [u8],
    /// numpy's dtype name (`uint8`, `int32`, ...).
    pub dtype: &'a str,
    pub shape: [usize; 3],
}

fn bad(name: &str, message: String) -> Error {
    Error::input(std::path::Path::new(name), message)
}

/// Reads one little-endian element as an i64.
type ReadId = fn(&[u8]) -> i64;

/// Size in bytes and reader of one element of `dtype`.
fn element(dtype: &str) -> Option<(usize, ReadId)> {
    Some(match dtype {
        "int8" => (1, |b| i64::from(b[0] as i8)),
        "uint8" => (1, |b| i64::from(b[0])),
        "int16" => (2, |b| i64::from(i16::from_le_bytes([b[0], b[1]]))),
        "uint16" => (2, |b| i64::from(u16::from_le_bytes([b[0], b[1]]))),
        "int32" => (4, |b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        "uint32" => (4, |b| i64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        "int64" => (8, |b| i64::from_le_bytes(b.try_into().unwrap_or_default())),
        "uint64" => (8, |b| u64::from_le_bytes(b.try_into().unwrap_or_default()).min(i64::MAX as u64) as i64),
        _ => return None,
    })
}

/// The record of `parts` (named `name` in the report), its layers numbered `layers` when
/// given, against `layout` when given.
pub fn record(
    name: &str,
    parts: &[Part<'_>],
    layers: Option<&[usize]>,
    layout: Option<&Layout>,
    budget: &mut Budget,
) -> Result<Record> {
    let Some(first) = parts.first() else {
        return Err(bad(name, "no arrays: give one [tokens, layers, top_k] array, or one per sequence".into()));
    };
    let [_, n_layers, k] = first.shape;
    let dtype = first.dtype;
    let Some((size, read)) = element(dtype) else {
        return Err(bad(name, format!("dtype {dtype}: expert ids must be integers")));
    };
    let mut tokens = 0;
    for (i, p) in parts.iter().enumerate() {
        if p.dtype != dtype || p.shape[1..] != first.shape[1..] {
            return Err(bad(
                name,
                format!(
                    "sequence {i} is {} {:?}, sequence 0 {dtype} [_, {n_layers}, {k}]: every sequence has the same layers, top-k and dtype",
                    p.dtype, p.shape
                ),
            ));
        }
        if p.bytes.len() != p.shape.iter().product::<usize>() * size {
            return Err(bad(name, format!("sequence {i}: {} bytes for {dtype} {:?}", p.bytes.len(), p.shape)));
        }
        tokens += p.shape[0];
    }
    if tokens == 0 || n_layers == 0 || k == 0 {
        return Err(bad(name, format!("[{tokens}, {n_layers}, {k}] routes: no routes")));
    }
    if let Some(l) = layout.filter(|l| l.top_k != k) {
        return Err(bad(
            name,
            format!("the config contradicts the record: top-k {} in the config, {k} in the record", l.top_k),
        ));
    }
    budget.take(&format!("reading {name}"), (tokens * n_layers * k * 4) as u64)?;
    let mut experts = Vec::with_capacity(tokens * n_layers * k);
    for p in parts {
        for (i, b) in p.bytes.chunks_exact(size).enumerate() {
            let id = read(b);
            if id > i64::from(i32::MAX) {
                let (t, l) = (i / (n_layers * k), i / k % n_layers);
                return Err(bad(name, format!("expert id {id} at token {t}, layer index {l} is not an expert id")));
            }
            experts.push(id.max(-1) as i32);
        }
    }
    let mut found = Found { dtype: dtype.to_string(), ..Found::default() };
    let (layers, declared) = match layers {
        Some(numbers) => {
            if numbers.len() != n_layers {
                return Err(bad(name, format!("{} layer numbers for a layer axis of {n_layers}", numbers.len())));
            }
            let mut seen = numbers.to_vec();
            seen.sort_unstable();
            if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
                return Err(bad(name, format!("layer {} appears twice in its layer numbers", w[0])));
            }
            if let Some(&g) = layout.and_then(|l| numbers.iter().find(|&&g| g >= l.kinds.len())) {
                return Err(bad(
                    name,
                    format!(
                        "the config contradicts the record: layer {g} in the record; the config has {} layers",
                        layout.map_or(0, |l| l.kinds.len())
                    ),
                ));
            }
            found.numbering = "declared by the caller".into();
            (numbers.to_vec(), true)
        }
        None => numbers(name, n_layers, layout, &mut found)?,
    };
    // Dense layers (by the config) are never compared, whatever they hold.
    if let Some(l) = layout {
        for (i, &g) in layers.iter().enumerate() {
            if l.kinds[g] == LayerKind::Dense {
                let mut held = false;
                for t in 0..tokens {
                    let row = &mut experts[(t * n_layers + i) * k..][..k];
                    held |= row.iter().any(|&e| e >= 0);
                    row.fill(-1);
                }
                if held {
                    found.dense_filled.push(g);
                }
            }
        }
    }
    let w = n_layers * k;
    let pad = (0..tokens).filter(|&t| experts[t * w..(t + 1) * w].iter().all(|&e| e < 0)).count();
    if pad > 0 {
        found.padding.insert("no route (-1) in any layer".into(), pad);
    }
    let mut sequences = Vec::with_capacity(parts.len());
    let mut row = 0;
    for p in parts {
        sequences.push(Sequence { rows: row..row + p.shape[0], first_position: 0 });
        row += p.shape[0];
    }
    Ok(Record {
        path: PathBuf::from(name),
        format: Format::Npy,
        tokens,
        top_k: k,
        layers,
        layers_declared: declared,
        experts,
        logits: None,
        num_experts: layout.map(|l| l.experts),
        input_ids: None,
        sequences,
        meta: Default::default(),
        found,
    })
}

/// The global number of each layer index: 0 to L-1, or against the config by its count of
/// layers (every layer, the backbone, or the routed layers only).
fn numbers(name: &str, n: usize, layout: Option<&Layout>, found: &mut Found) -> Result<(Vec<usize>, bool)> {
    let Some(l) = layout else {
        found.numbering = format!("its {n} layers are taken as 0 to {}", n - 1);
        return Ok(((0..n).collect(), false));
    };
    let backbone = l.kinds.iter().filter(|k| **k != LayerKind::Mtp).count();
    let routed: Vec<usize> = (0..l.kinds.len()).filter(|&g| l.kinds[g].routed()).collect();
    let (numbers, how) = if n == l.kinds.len() || n == backbone {
        ((0..n).collect(), format!("its {n} layers are the config's layers 0 to {}", n - 1))
    } else if n == routed.len() {
        (routed, format!("its {n} layers are the config's routed layers"))
    } else {
        return Err(bad(
            name,
            format!(
                "the config contradicts the record: {n} layers in the record; the config has {} layers, {} of them routed",
                l.kinds.len(),
                routed.len()
            ),
        ));
    };
    found.numbering = how;
    Ok((numbers, true))
}
