//! What `moe-audit check` audits, as values: [`Target`]s (router configs on a seeded layer or
//! on a checkpoint's gate, router commands, trace directories) audited together by one
//! [`Check`] into one [`Report`]. The command line builds its targets from flags; a Rust caller
//! (or the Python extension) builds them directly and gets the same report.

use crate::analyze::{audit, audit_configs, AuditOptions, Launch, Report, RouterReport, Subject};
use crate::external::trace::planned_options;
use crate::external::{ExternalRouter, Mode, TraceRouter};
use crate::hints::HintsOf;
use crate::progress::Progress;
use moe_audit_core::config::RouterConfig;
use moe_audit_core::error::{Error, Result};
use moe_audit_core::layer::gate::GateSource;
use moe_audit_core::router::Router;
use moe_audit_core::MemoryBudget;
use moe_audit_parallel::{split_batch, Communicator};
use std::path::PathBuf;
use std::time::Duration;

/// One kind of router a check audits.
#[derive(Debug, Clone)]
pub enum Target {
    /// Router configs (presets or TOML files), each in a seeded layer of `hidden` × `ffn`.
    Configs {
        /// The routers.
        configs: Vec<RouterConfig>,
        /// Hidden size of the seeded layer.
        hidden: usize,
        /// Expert FFN size of the seeded layer.
        ffn: usize,
    },
    /// Router configs routing with the gate of a checkpoint instead of a seeded one.
    Gate {
        /// The routers.
        configs: Vec<RouterConfig>,
        /// Where the gate is.
        gate: CheckpointGate,
    },
    /// A router in a command speaking the moe-audit/1 or /2 protocol.
    Command(RouterCommand),
    /// A trace directory (`moe-audit plan`, answered by a harness): the check runs with the
    /// plan's options.
    Traces(PathBuf),
}

/// The gate of a checkpoint: a safetensors file and the tensors in it.
#[derive(Debug, Clone)]
pub struct CheckpointGate {
    /// The safetensors file.
    pub weights: PathBuf,
    /// The gate matrix `[experts, hidden]`.
    pub gate: String,
    /// A selection-only expert bias `[experts]` replacing the config's `expert_bias`.
    pub bias: Option<String>,
    /// Real hidden states `[..., hidden]` to sample the tokens from: a safetensors file and the
    /// tensor in it (`None`: its only one); seeded standard normal when `None`.
    pub hidden_states: Option<(PathBuf, Option<String>)>,
}

/// A router command, run with `sh -c`.
#[derive(Debug, Clone)]
pub struct RouterCommand {
    /// The command.
    pub command: String,
    /// Other launches of its layer at other expert-parallel sizes, which the layout probe (L)
    /// compares it with.
    pub layouts: Vec<String>,
    /// How long it may take to answer.
    pub timeout: Duration,
    /// The mode it is audited in.
    pub mode: Mode,
}

impl Target {
    /// How many routers it audits.
    pub fn routers(&self) -> usize {
        match self {
            Target::Configs { configs, .. } | Target::Gate { configs, .. } => configs.len(),
            Target::Command(_) | Target::Traces(_) => 1,
        }
    }
}

/// Targets audited with one set of options, into one report.
#[derive(Debug)]
pub struct Check {
    targets: Vec<Target>,
    options: AuditOptions,
}

impl Check {
    /// A check of `targets` with `options`, or with the plan's options when a target is a trace
    /// directory (its manifest is read within `budget`; the traces themselves are read once, by
    /// the audit). Fails when two configs share a name.
    pub fn new(targets: Vec<Target>, options: AuditOptions, budget: MemoryBudget) -> Result<Check> {
        let options = match targets.iter().find_map(|t| if let Target::Traces(dir) = t { Some(dir) } else { None }) {
            Some(dir) => planned_options(dir, budget)?,
            None => options,
        };
        let configs = targets.iter().flat_map(|t| match t {
            Target::Configs { configs, .. } | Target::Gate { configs, .. } => configs.as_slice(),
            Target::Command(_) | Target::Traces(_) => &[],
        });
        moe_audit_core::names::check_unique(configs.map(|c| c.name.as_str()))
            .map_err(|e| Error::usage(e.to_string()))?;
        Ok(Check { targets, options })
    }

    /// The options it runs with.
    pub fn options(&self) -> &AuditOptions {
        &self.options
    }

    /// How many probes it runs in all (routers × probes), for a progress bar.
    pub fn probe_runs(&self) -> usize {
        self.targets.iter().map(Target::routers).sum::<usize>() * self.options.probes.len()
    }

    /// Audits every target, in order, telling `progress` each probe. Fails before starting a
    /// router whose audit is estimated to need more than `budget`, and when two routers of the
    /// report share a name. With `comm`, the layout probe runs seeded layers expert-parallel
    /// over it (every rank audits alike).
    pub fn run(
        &self,
        budget: MemoryBudget,
        comm: Option<&dyn Communicator>,
        progress: &dyn Progress,
    ) -> Result<Report> {
        let mut options = self.options.clone();
        if let Some(comm) = comm {
            options.ranks = comm.size();
            split_batch(options.batch, comm.size())?;
        }
        let mut routers = Vec::new();
        for target in &self.targets {
            match target {
                Target::Configs { configs, hidden, ffn } => {
                    let report = audit_configs(configs.clone(), &options, (*hidden, *ffn), budget, comm, progress)?;
                    routers.extend(report.routers);
                }
                Target::Gate { configs, gate } => {
                    let hidden_states =
                        gate.hidden_states.as_ref().map(|(file, tensor)| (file.as_path(), tensor.as_deref()));
                    let source = GateSource {
                        weights: &gate.weights,
                        gate: &gate.gate,
                        bias: gate.bias.as_deref(),
                        hidden_states,
                        budget,
                    };
                    for config in configs {
                        let router = source.router(config.clone())?;
                        routers.push(audit_alone(&Subject::router(&router), &options, budget, progress)?);
                    }
                }
                Target::Command(c) => {
                    let router = ExternalRouter::spawn(&c.command, c.timeout, options.seed, c.mode, budget)?;
                    // Every launch is up (and agrees with the router) before any probe runs.
                    let launched = (c.layouts.iter())
                        .map(|l| Ok((l.as_str(), router.spawn_layout(l, c.timeout, budget)?)))
                        .collect::<Result<Vec<_>>>()?;
                    let layouts: Vec<Launch> = (launched.iter())
                        .map(|(command, router)| Launch { command, router: router as &dyn Router })
                        .collect();
                    let subject = Subject { router: &router, layer: None, layouts: &layouts };
                    routers.push(audit_alone(&subject, &options, budget, progress)?);
                }
                Target::Traces(dir) => {
                    let router = TraceRouter::open(dir, budget)?;
                    routers.push(audit_alone(&Subject::router(&router), &options, budget, progress)?);
                }
            }
        }
        // Routers named in their handshake or manifest too, before anyone writes a file.
        moe_audit_core::names::check_unique(routers.iter().map(|r| r.router.as_str()))
            .map_err(|e| Error::usage(e.to_string()))?;
        Ok(Report { options, routers })
    }
}

/// Audits a router without a layer of moe-audit's; its routes per token are unknown before it
/// answers, so the memory estimate counts one.
fn audit_alone(
    subject: &Subject,
    options: &AuditOptions,
    budget: MemoryBudget,
    progress: &dyn Progress,
) -> Result<RouterReport> {
    let router = subject.router;
    let estimate = options.memory_estimate(router.row_width(), 1, 0, 0);
    budget.ensure_fits(&format!("the audit of `{}`", router.name()), estimate)?;
    audit(subject, options, progress)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analyze::{Probe, Verdict};
    use crate::progress::Silent;

    fn config(name: &str) -> RouterConfig {
        RouterConfig::load(name).unwrap()
    }

    fn options() -> AuditOptions {
        AuditOptions { probes: vec![Probe::P, Probe::F], batch: 2, seq_len: 16, trials: 4, ..AuditOptions::default() }
    }

    /// Configs are audited in order, each with the verdicts of its router: megatron-probs drops
    /// by a score later tokens change (P, F leak), mixtral is dropless.
    #[test]
    fn a_check_of_configs_reports_each_router_in_order() {
        let targets =
            vec![Target::Configs { configs: vec![config("mixtral"), config("megatron-probs")], hidden: 16, ffn: 32 }];
        let check = Check::new(targets, options(), MemoryBudget::new(1 << 30)).unwrap();
        assert_eq!(check.probe_runs(), 4);
        let report = check.run(MemoryBudget::new(1 << 30), None, &Silent).unwrap();
        let verdicts: Vec<(&str, Vec<Verdict>)> = (report.routers.iter())
            .map(|r| (r.router.as_str(), r.findings.iter().map(|f| f.verdict).collect()))
            .collect();
        assert_eq!(
            verdicts,
            [("mixtral", vec![Verdict::Pass, Verdict::Pass]), ("megatron-probs", vec![Verdict::Leak, Verdict::Leak])]
        );
    }

    /// Two targets that name one router twice fail, naming it, before any audit runs.
    #[test]
    fn routers_of_a_check_have_distinct_names() {
        let seeded = || Target::Configs { configs: vec![config("mixtral")], hidden: 16, ffn: 32 };
        let err = Check::new(vec![seeded(), seeded()], options(), MemoryBudget::new(1 << 30)).unwrap_err().to_string();
        assert!(err.contains("two routers are named `mixtral`"), "{err}");
    }

    /// A trace directory's options are its plan's, read when the check is made.
    #[test]
    fn a_trace_directory_sets_the_options_from_its_plan() {
        let err = Check::new(vec![Target::Traces("no-such-plan".into())], options(), MemoryBudget::new(1 << 30))
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("no-such-plan/manifest.json: cannot read"), "{err}");
    }
}
