//! Snapshot tests of routing decisions, for any router.
//!
//! - [`snapshot()`]: stable text of a routing record for `insta::assert_snapshot!` in your crate;
//! - [`SnapshotFile`]: a `.snap` file, a header saying how the routing was made (router, inputs,
//!   sizes, seed, modes, weight precision, content hashes) and, per mode, exactly that text;
//! - [`make`]: makes the file (`moe-audit snapshot`), [`remake`] makes it again from a stored
//!   header, which is data: it runs no command the caller did not give and reads no file outside
//!   the working directory; and [`check`] compares a stored file with a fresh one as values: a printed weight may move by one unit of its last
//!   decimal (float noise rounding across a boundary), anything more is a change;
//! - [`write_plan`]: the inputs for a harness that routes in-process (the Python helper
//!   `moe_audit.snapshot`), whose answers `moe-audit snapshot record --traces DIR` turns into the same
//!   bytes as the CLI and [`snapshot()`].

mod file;
mod make;
mod table_diff;

#[allow(deprecated)]
pub use file::write_atomic;
pub use file::{Header, InputSpec, RouterSource, Rows, SnapshotFile, FORMAT};
pub use make::{make, write_plan};
#[allow(deprecated)]
pub use table_diff::{compare, diff_tables, TableDiff};

use moe_audit_core::error::{quote, Error, Result};
use moe_audit_core::routing::{render_table, Routing};
use moe_audit_core::text;
use moe_audit_core::MemoryBudget;
use std::fmt::Write;
use std::path::Path;

/// Renders `routing` as stable text for `insta::assert_snapshot!`: a header (router, sizes, scope,
/// capacity), one line per token with its routes in choice order (`x` dropped, `p` padding
/// slot), the expert loads and the load figures. Weights have 4 decimals, so float noise far
/// below that cannot churn a snapshot, while any change of expert, order, kept flag or capacity
/// shows. A `.snap` file's sections are exactly this text.
///
/// ```
/// use moe_audit_auditor::snapshot;
/// use moe_audit_core::{assign, RouterConfig};
/// use ndarray::Array3;
///
/// let config = RouterConfig::load("megatron-probs")?;
/// // Fixed logits: a snapshot must not depend on a random draw.
/// let logits = Array3::from_shape_fn((1, 4, 8), |(_, t, e)| ((t * 7 + e * 3) % 5) as f32);
/// let text = snapshot(&assign(&config, logits.view())?);
/// assert!(text.starts_with("router megatron-probs | batch 1 x seq 4 | 8 experts, top-2"));
/// // In your tests: insta::assert_snapshot!(text);
/// # Ok::<(), moe_audit_core::Error>(())
/// ```
pub fn snapshot(routing: &Routing) -> String {
    render_table(routing)
}

/// What a check found.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Whether the routing (or how it is made) changed beyond the weight precision.
    pub changed: bool,
    /// What changed, per mode: a summary line, then each changed token; notes first.
    pub report: String,
}

/// The header without what may differ between two makings of the same snapshot: the version
/// and the content hashes.
fn recipe(h: &Header) -> String {
    let mut h = h.clone();
    h.moe_audit.clear();
    h.format.clear();
    h.header_sha256.clear();
    h.input.sha256.clear();
    match &mut h.router {
        RouterSource::Config { sha256, .. }
        | RouterSource::Gate { sha256, .. }
        | RouterSource::Traces { sha256, .. } => sha256.clear(),
        _ => {}
    }
    toml::to_string(&h).expect("a header always serialises")
}

/// Makes again the snapshot `header` (read from `path`) describes, taking from the header only
/// data. A router command is never run from it: `router_cmd` (the caller's) must be given and
/// be the header's, else nothing runs. The files it names (router TOML, weights, rows, trace
/// folder) must lie inside the working directory: no absolute path, no `..`, no symlink out.
/// `traces` answers a `traces` or `harness` router instead of the recorded folder.
pub fn remake(
    path: &Path,
    header: &Header,
    router_cmd: Option<&str>,
    traces: Option<&Path>,
    budget: MemoryBudget,
) -> Result<SnapshotFile> {
    let here = Path::new(".");
    let inside = |name: &str, what: &str| {
        let file = moe_audit_core::files::inside(here, Path::new(name), what)?;
        // Named from the snapshot that refers to it: checked from another folder, the bare
        // "cannot read" would not say which snapshot or where the name is looked up.
        if file.symlink_metadata().is_err() {
            return Err(Error::input(
                path,
                format!(
                    "{what} = {} is not in the working directory (paths in a snapshot header are relative to the directory it is checked from: run there)",
                    quote(name)
                ),
            ));
        }
        Ok(())
    };
    match (&header.router, router_cmd) {
        (RouterSource::Command { command, .. }, None) => {
            return Err(Error::input(
                path,
                text!(format!("[router] command = {} is a record for the reader, never run from the file: give the router's command with ", quote(command)), crate::settings::ROUTER_CMD),
            ))
        }
        (RouterSource::Command { command, .. }, Some(given)) if given != command => {
            return Err(Error::input(
                path,
                text!(crate::settings::ROUTER_CMD, format!(" {} is not the header's [router] command = {}: neither is run", quote(given), quote(command))),
            ))
        }
        (RouterSource::Command { .. }, Some(_)) => {}
        (_, Some(_)) => {
            return Err(Error::usage(text!(crate::settings::ROUTER_CMD, ": this snapshot's router is not a command")))
        }
        (RouterSource::Harness { .. }, None) if traces.is_none() => {
            return Err(Error::input(
                path,
                text!("answered by a harness (the Python helper): re-run its test, or pass ", crate::settings::TRACES, " DIR that ", crate::settings::PLAN, " wrote and the router answered"),
            ))
        }
        (RouterSource::Preset { name }, None) if moe_audit_core::config::preset(name).is_none() => {
            return Err(Error::input(path, format!("[router] name = {} is not a preset", quote(name))))
        }
        (RouterSource::Config { path, .. }, None) => inside(path, "[router] path")?,
        (RouterSource::Gate { router, weights, .. }, None) => {
            if moe_audit_core::config::preset(router).is_none() {
                inside(router, "[router] router")?;
            }
            inside(weights, "[router] weights")?;
        }
        (RouterSource::Traces { dir, .. }, None) if traces.is_none() => inside(dir, "[router] dir")?,
        _ => {}
    }
    // A harness's rows come from the plan it answered, not from the recorded file.
    match (&header.router, &header.input.file) {
        (RouterSource::Harness { .. }, _) | (_, None) => {}
        (_, Some(file)) => inside(file, "[input] file")?,
    }
    make(&header.router, &header.input, traces, budget)
}

fn router_hash(h: &Header) -> Option<&str> {
    match &h.router {
        RouterSource::Config { sha256, .. }
        | RouterSource::Gate { sha256, .. }
        | RouterSource::Traces { sha256, .. } => Some(sha256),
        _ => None,
    }
}

/// Compares the stored snapshot `stored` (read from `path`) with `fresh`, made again from its
/// header. Fails (an input error) when the inputs differ, as routings of other inputs cannot be
/// compared, or when a stored section cannot be read.
pub fn check(path: &Path, stored: &SnapshotFile, fresh: &SnapshotFile) -> Result<Outcome> {
    let mut report = String::new();
    let (old, new) = (recipe(&stored.header), recipe(&fresh.header));
    if old != new {
        let _ = writeln!(report, "the snapshot is made differently:");
        let (a, b): (Vec<&str>, Vec<&str>) = (old.lines().collect(), new.lines().collect());
        for l in a.iter().filter(|l| !b.contains(l)) {
            let _ = writeln!(report, "  - {l}");
        }
        for l in b.iter().filter(|l| !a.contains(l)) {
            let _ = writeln!(report, "  + {l}");
        }
    } else if stored.header.input.sha256 != fresh.header.input.sha256 {
        return Err(Error::input(
            path,
            text!(format!("the inputs are not those the snapshot was made from (sha256 {} now {}): routings of other inputs cannot be compared; remake it with ", short(&stored.header.input.sha256), short(&fresh.header.input.sha256)), crate::settings::UPDATE),
        ));
    }
    if let (Some(a), Some(b)) = (router_hash(&stored.header), router_hash(&fresh.header)) {
        if a != b {
            let _ = writeln!(
                report,
                "note: the router's file changed since the snapshot (sha256 {} now {})",
                short(a),
                short(b)
            );
        }
    }
    let mut changed = old != new;
    for (mode, text) in &stored.sections {
        let Some((_, now)) = fresh.sections.iter().find(|(m, _)| m == mode) else {
            let _ = writeln!(report, "{mode}: no longer routed");
            changed = true;
            continue;
        };
        let diff = diff_tables(text, now, stored.header.weight_decimals)
            .map_err(|e| Error::input(path, format!("section `{mode}`: {e}")))?;
        if diff.changed() {
            changed = true;
            let _ = writeln!(report, "{mode}: {}", diff.summary());
            report.push_str(&diff.details());
        } else {
            let _ = writeln!(report, "{mode}: unchanged");
        }
    }
    for (mode, _) in fresh.sections.iter().filter(|(m, _)| !stored.sections.iter().any(|(s, _)| s == m)) {
        let _ = writeln!(report, "{mode}: routed now, not in the snapshot");
        changed = true;
    }
    Ok(Outcome { changed, report })
}

fn short(hash: &str) -> &str {
    &hash[..hash.len().min(12)]
}
