//! The comparison: both records' diagnoses, their alignment, the measures on the aligned pairs,
//! and the gate's verdict; [`compare_sources`] reads the pair first, as `routes compare` and
//! `moe_audit.routes.compare` do.

use super::align::{self, Alignment};
use super::budget::Budget;
use super::clean::Found;
use super::config::Layout;
use super::defects;
use super::diagnosis::Diagnosis;
use super::formats::Format;
use super::measure::{self, Measures};
use super::read::{self, Source};
use super::record::Record;
use super::sides::{Role, Sides};
use crate::settings::MAX_DISAGREEMENT;
use moe_audit_core::error::{Error, Result};
use moe_audit_core::text;
use moe_audit_core::MemoryBudget;
use serde::{Serialize, Serializer};

/// A record as the report names it: one side of a comparison, or the record `routes show`
/// summarises.
#[derive(Debug, Clone, Serialize)]
pub struct Side {
    /// Its side of a comparison; `None` for a record shown alone (the report says `record`).
    #[serde(serialize_with = "role_or_record")]
    pub role: Option<Role>,
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

fn role_or_record<S: Serializer>(role: &Option<Role>, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(role.map_or("record", Role::name))
}

impl Side {
    /// `r` as the report names it, on side `role` (`None`: shown alone).
    pub(crate) fn of(role: Option<Role>, r: &Record) -> Self {
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

    /// How the report names it: `rollout`, `trainer`, or `record` when shown alone.
    pub fn name(&self) -> &'static str {
        self.role.map_or("record", Role::name)
    }
}

/// Options of a comparison.
#[derive(Debug, Clone, Default)]
pub struct CompareOptions {
    /// Fail when more than this share of router decisions differ; `Some(0.0)` is a replay check.
    pub max_disagreement: Option<f64>,
}

impl CompareOptions {
    /// The options, the threshold checked to be a share (0 to 1).
    pub fn new(max_disagreement: Option<f64>) -> Result<Self> {
        if let Some(m) = max_disagreement.filter(|m| !(0.0..=1.0).contains(m)) {
            return Err(Error::usage(text!(MAX_DISAGREEMENT, format!(" must be a share between 0 and 1, got {m}"))));
        }
        Ok(CompareOptions { max_disagreement })
    }
}

/// Reads both records (against `layout` when given) and compares them, all within `memory`.
pub fn compare_sources(
    sources: Sides<Source<'_>>,
    layout: Option<&Layout>,
    options: &CompareOptions,
    memory: MemoryBudget,
) -> Result<Comparison> {
    let mut budget = Budget::new(memory);
    let records = read::load_both(sources, layout, &mut budget)?;
    compare(&records.rollout, &records.trainer, layout, options, &mut budget)
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
    let records = Sides::new(rollout, trainer);
    let mut diagnoses: Vec<Diagnosis> =
        records.iter().flat_map(|(role, r)| defects::of_record(role, r, layout)).collect();
    if rollout.is_empty() || trainer.is_empty() {
        // Nothing to align: the capture-never-ran defect says why.
        let alignment = Alignment { segments: Vec::new(), layers: Vec::new(), tokens: 0 };
        return Ok(verdict(records, layout, options, alignment, diagnoses, Measures::none()));
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
    diagnoses.extend(defects::missing_note(&measures));
    Ok(verdict(records, layout, options, alignment, diagnoses, measures))
}

/// The comparison, defects first, and whether the gate fails: a defect, disagreement over the
/// threshold, or nothing compared.
fn verdict(
    records: Sides<&Record>,
    layout: Option<&Layout>,
    options: &CompareOptions,
    alignment: Alignment,
    mut diagnoses: Vec<Diagnosis>,
    measures: Measures,
) -> Comparison {
    diagnoses.sort_by_key(|d| !d.defect);
    let over = options.max_disagreement.is_some_and(|max| measures.decisions_differ > max);
    let failed = alignment.tokens == 0 || over || diagnoses.iter().any(|d| d.defect);
    Comparison {
        rollout: Side::of(Some(Role::Rollout), records.rollout),
        trainer: Side::of(Some(Role::Trainer), records.trainer),
        layout: layout.cloned(),
        alignment,
        diagnoses,
        measures,
        max_disagreement: options.max_disagreement,
        failed,
    }
}
