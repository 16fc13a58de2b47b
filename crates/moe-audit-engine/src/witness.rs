//! A change's witness: the servers, the axis and the script of the pair that changed, replayed
//! against the same (or a named) server by `moe-audit replay`.

use crate::audit::{self, AxisReport, Run};
use crate::plan::{Axis, Script};
use crate::server::ServerInfo;
use crate::EngineError;
use serde::{Deserialize, Serialize};

/// The format of a witness file.
pub const WITNESS_VERSION: &str = "moe-audit engine witness 1";

/// What replays a change: the servers as they were, the axis, the requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Witness {
    /// [`WITNESS_VERSION`].
    pub format: String,
    /// The servers, the audited first.
    pub servers: Vec<ServerInfo>,
    /// The axis that changed.
    pub axis: Axis,
    /// The requests, in order, and the pairing compared.
    pub script: Script,
    /// What was found, one line.
    pub found: String,
    /// The model's config.json, when the audit had it (SGLang's routes are shaped by it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<serde_json::Value>,
}

impl Witness {
    /// The witness of `report`'s first change, if it has one.
    pub fn of(report: &AxisReport, servers: &[ServerInfo], config: Option<serde_json::Value>) -> Option<Witness> {
        let script = report.witness.clone()?;
        Some(Witness {
            format: WITNESS_VERSION.into(),
            servers: servers.to_vec(),
            axis: report.axis,
            script,
            found: format!(
                "{} of {} decisions changed, {} pairs diverged",
                report.changed,
                report.decisions,
                report.diverged.len()
            ),
            config,
        })
    }
}

/// Sends the witness's requests again to `run`'s servers and compares its pairing: the axis as
/// measured now (held when the change is gone).
pub fn replay(witness: &Witness, run: &Run) -> Result<AxisReport, EngineError> {
    if witness.format != WITNESS_VERSION {
        return Err(EngineError::Settings {
            why: format!("witness format `{}`, this moe-audit reads `{WITNESS_VERSION}`", witness.format),
        });
    }
    for (then, now) in witness.servers.iter().zip(&run.servers) {
        if (then.engine, &then.model) != (now.info.engine, &now.info.model) {
            return Err(EngineError::Server {
                url: now.url().to_string(),
                why: format!(
                    "it serves {} on {}; the witness was found with {} on {}",
                    now.info.model,
                    now.info.engine.name(),
                    then.model,
                    then.engine.name()
                ),
            });
        }
    }
    let replies = audit::execute(run, &witness.script, &mut |_| {})?;
    audit::measure(witness.axis, std::slice::from_ref(&witness.script), &[replies], true, run)
}
