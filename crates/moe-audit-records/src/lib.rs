//! Rollout against trainer: routing records from an inference engine (SGLang, vLLM) and from a
//! trainer (Megatron, FSDP, a Hugging Face model recorded by `moe_audit.routes`), aligned,
//! diagnosed for the silent bugs of routing replay (R3), then measured.
//!
//! The data flows through one file per step: [`read`] (every record format, read in place
//! within bounds) and
//! [`config`] (a Hugging Face layer layout) → `align` (token and layer alignment, the
//! diagnoses) → `measure` (disagreement per layer, per token, overall; margins at flips) →
//! [`Comparison`], rendered by `render::routes`. docs/ROUTES.md explains every diagnosis.

mod align;
mod array;
mod clean;
pub mod config;
mod defects;
mod formats;
mod ids;
mod measure;
mod pipeline;
pub mod read;
mod record;
mod show;

pub use align::{Alignment, Diagnosis, DiagnosisKind, LayerPair, Segment};
pub use config::{LayerKind, Layout};
pub use measure::{Flip, Lane, LayerMeasure, Margins, Measures, LANES};
pub use read::{from_ids, load, load_pair, Format, Found, IdArray, Record, Source};
pub use show::{show, LayerLoad, Summary};

use moe_audit_core::error::Result;
use serde::Serialize;

/// What is left of `--max-memory` for one run: every reader and step takes its share before it
/// allocates, so the whole comparison stays within the limit.
#[derive(Debug, Clone)]
pub struct Budget {
    left: u64,
    whole: moe_audit_core::MemoryBudget,
}

impl Budget {
    /// The whole of `budget`, less what the process itself takes (32 MiB), to be spent by
    /// the records read.
    pub fn new(whole: moe_audit_core::MemoryBudget) -> Self {
        Budget { left: whole.bytes().saturating_sub(32 << 20), whole }
    }

    /// Takes `bytes` for `what`, or fails naming the limit (nothing taken).
    pub fn take(&mut self, what: &str, bytes: u64) -> Result<()> {
        if bytes > self.left {
            // Said as the whole run's need against the limit.
            self.whole.ensure_fits(what, (self.whole.bytes() - self.left).saturating_add(bytes))?;
        }
        self.left = self.left.saturating_sub(bytes);
        Ok(())
    }

    /// Bytes not yet taken.
    pub fn left(&self) -> u64 {
        self.left
    }
}

/// The two records compared, as the report names them.
#[derive(Debug, Clone, Serialize)]
pub struct Side {
    /// `rollout` or `trainer`.
    pub role: &'static str,
    /// The file.
    pub path: String,
    /// Its format.
    pub format: Format,
    /// Tokens (rows) in the record.
    pub tokens: usize,
    /// Global layer numbers of its layer axis.
    pub layers: Vec<usize>,
    /// Whether those numbers were written in the file (else assumed, see the alignment notes).
    pub layers_declared: bool,
    /// Experts per token.
    pub top_k: usize,
    /// Whether it carries router logits.
    pub logits: bool,
    /// What reading it found and inferred.
    pub found: Found,
}

impl Side {
    fn of(role: &'static str, r: &Record) -> Self {
        Side {
            role,
            path: r.path.display().to_string(),
            format: r.format,
            tokens: r.tokens,
            layers: r.layers.clone(),
            layers_declared: r.layers_declared,
            top_k: r.top_k,
            logits: r.logits.is_some(),
            found: r.found.clone(),
        }
    }
}

/// Options of a comparison.
#[derive(Debug, Clone, Default)]
pub struct CompareOptions {
    /// Fail when more than this share of router decisions differ; `Some(0.0)` is a replay check.
    pub max_disagreement: Option<f64>,
}

/// A comparison of a rollout record against a trainer record: the alignment with its
/// diagnoses, then the measures taken on the aligned pairs.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// The rollout (engine) record.
    pub rollout: Side,
    /// The trainer record.
    pub trainer: Side,
    /// The layout from `config.json`, when given.
    pub layout: Option<Layout>,
    /// How tokens and layers were paired.
    pub alignment: Alignment,
    /// What alignment found, defects first.
    pub diagnoses: Vec<Diagnosis>,
    /// The measures on the aligned pairs.
    pub measures: Measures,
    /// The threshold given, if any.
    pub max_disagreement: Option<f64>,
    /// Whether the gate fails: a defect, or disagreement over the threshold.
    pub failed: bool,
}

/// Aligns `rollout` against `trainer` (with the model's `layout` when known), diagnoses, measures.
pub fn compare(
    rollout: &Record,
    trainer: &Record,
    layout: Option<&Layout>,
    options: &CompareOptions,
    budget: &mut Budget,
) -> Result<Comparison> {
    let mut diagnoses = defects::of_record("rollout", rollout, layout);
    diagnoses.extend(defects::of_record("trainer", trainer, layout));
    if rollout.is_empty() || trainer.is_empty() {
        // Nothing to align: the capture-never-ran defect says why.
        diagnoses.sort_by_key(|d| !d.defect);
        return Ok(Comparison {
            rollout: Side::of("rollout", rollout),
            trainer: Side::of("trainer", trainer),
            layout: layout.cloned(),
            alignment: Alignment { segments: Vec::new(), layers: Vec::new(), tokens: 0 },
            diagnoses,
            measures: Measures::none(),
            max_disagreement: options.max_disagreement,
            failed: true,
        });
    }
    let (alignment, found) = align::align(rollout, trainer, budget)?;
    diagnoses.extend(found);
    let measures = measure::measure(rollout, trainer, &alignment, budget)?;
    let pair = defects::of_pair(rollout, trainer, &alignment, &measures, diagnoses.iter().any(|d| d.defect))?;
    if options.max_disagreement == Some(0.0) && pair.is_empty() {
        diagnoses.extend(defects::replay_check(&measures));
    }
    diagnoses.extend(pair);
    diagnoses.extend(defects::order_note(&measures));
    if measures.missing > 0 {
        diagnoses.push(Diagnosis {
            kind: DiagnosisKind::Missing,
            defect: false,
            found: format!(
                "{} aligned (token, layer) pairs have a route on one side only: counted apart, not as decisions",
                measures.missing
            ),
            change: String::new(),
        });
    }
    diagnoses.sort_by_key(|d| !d.defect);
    let over = options.max_disagreement.is_some_and(|max| measures.decisions_differ > max);
    let failed = over || diagnoses.iter().any(|d| d.defect);
    Ok(Comparison {
        rollout: Side::of("rollout", rollout),
        trainer: Side::of("trainer", trainer),
        layout: layout.cloned(),
        alignment,
        diagnoses,
        measures,
        max_disagreement: options.max_disagreement,
        failed,
    })
}
