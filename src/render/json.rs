//! JSON outputs: any serde report (check, route, ep, sweep) pretty-printed with a final newline,
//! and the witness files of a check report.

use crate::analyze::{Probe, Report};
use crate::error::Result;
use crate::files::Staged;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// `value` as pretty JSON and a newline (the reports' JSON contract).
pub fn json<T: Serialize>(value: &T) -> String {
    serde_json::to_string_pretty(value).expect("a report always serialises") + "\n"
}

/// Where the witness of `router` × `probe` goes in `dir`: `<router>-<probe>.json`, the router
/// name made a safe file stem ([`crate::names::file_stem`]).
pub(crate) fn witness_path(dir: &Path, router: &str, probe: Probe) -> PathBuf {
    dir.join(format!("{}-{probe}.json", crate::names::file_stem(router)))
}

/// Stages one witness file per finding that has one into `dir` (created if needed); they land
/// when `staged` is committed, together with the report.
pub(crate) fn write_witnesses(report: &Report, dir: &Path, staged: &mut Staged) -> Result<()> {
    crate::files::create_dir(dir)?;
    for r in &report.routers {
        for f in r.findings.iter().filter(|f| f.witness.is_some()) {
            let path = witness_path(dir, &r.router, f.probe);
            staged.write(&path, json(&f.witness).as_bytes())?;
        }
    }
    Ok(())
}
