//! What alignment and the diagnoses find: a kind, defect or note, what was found in numbers and
//! what to change. docs/ROUTES.md explains every kind.

use moe_audit_core::error::Text;
use serde::Serialize;

/// What a diagnosis is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DiagnosisKind {
    /// A trainer layer matches another rollout layer than its own number says.
    LayerMapping,
    /// The trainer's routes match the rollout's shifted by a fixed number of tokens.
    TokenOffset,
    /// Packed sequences match at different shifts (padding between them was not accounted for).
    Packing,
    /// Rows that route nowhere at a sequence's start or end (padding), aligned past.
    Padding,
    /// The records cover different positions of a sequence (SGLang's `seqlen - 1`, a start length).
    Length,
    /// Two layers of one record route identically (one took the other's routes).
    Aliasing,
    /// Layers present in one record only (dense placeholders, MTP), left out.
    Unpaired,
    /// Layer numbers the file did not give, inferred.
    LayerNumbers,
    /// The same expert sets in another order: not counted as a disagreement.
    Order,
    /// A replay check in which routes still differ: the replay did not reach those layers.
    ReplayNotApplied,
    /// A record, or a MoE layer of it, holding only zeros (or no route at all).
    CaptureNeverRan,
    /// A block of MoE layers at one end missing or zero: a pipeline stage never merged.
    PipelineNotMerged,
    /// Ids relabelled one-to-one against the other record: physical (EPLB) slots.
    PhysicalIds,
    /// A -1 stored unsigned, ids wrapped negative, or ids equal modulo 256.
    NarrowingCast,
    /// The rollout starts at a later position than its rows say (a prompt start not recorded).
    PromptStart,
    /// The rollout ends one row before the trainer per request (or two: one beyond the convention).
    OneRowShort,
    /// Nothing two routers of one model would show: the records are probably not paired right.
    NotPaired,
    /// Routed-layer slots with no route, counted apart.
    Missing,
    /// What a reader did to read a record (steps, ranks merged, a shape from the other record).
    Reading,
}

impl DiagnosisKind {
    /// The name the report prints.
    pub fn name(self) -> &'static str {
        match self {
            DiagnosisKind::LayerMapping => "layer mapping",
            DiagnosisKind::TokenOffset => "token offset",
            DiagnosisKind::Packing => "packed sequences",
            DiagnosisKind::Padding => "padding",
            DiagnosisKind::Length => "length",
            DiagnosisKind::Aliasing => "aliasing",
            DiagnosisKind::Unpaired => "unpaired layers",
            DiagnosisKind::LayerNumbers => "layer numbers",
            DiagnosisKind::Order => "order",
            DiagnosisKind::ReplayNotApplied => "replay not applied",
            DiagnosisKind::CaptureNeverRan => "capture never ran",
            DiagnosisKind::PipelineNotMerged => "pipeline stage never merged",
            DiagnosisKind::PhysicalIds => "physical expert ids",
            DiagnosisKind::NarrowingCast => "narrowing cast",
            DiagnosisKind::PromptStart => "prompt start offset",
            DiagnosisKind::OneRowShort => "one row short",
            DiagnosisKind::NotPaired => "not paired",
            DiagnosisKind::Missing => "missing routes",
            DiagnosisKind::Reading => "reading",
        }
    }
}

/// One finding of the alignment: what it found, in numbers, and what to change.
#[derive(Debug, Clone, Serialize)]
pub struct Diagnosis {
    /// What it is about.
    pub kind: DiagnosisKind,
    /// Whether it is a defect (the gate fails) or a note on how the records were aligned.
    pub defect: bool,
    /// What was found, with numbers.
    pub found: Text,
    /// What to change (empty for a note that needs nothing).
    pub change: Text,
}

/// A note: how the records were aligned, not a failure.
pub(crate) fn note(kind: DiagnosisKind, found: impl Into<Text>, change: impl Into<Text>) -> Diagnosis {
    Diagnosis { kind, defect: false, found: found.into(), change: change.into() }
}

/// A defect: the gate fails.
pub(crate) fn defect(kind: DiagnosisKind, found: impl Into<Text>, change: impl Into<Text>) -> Diagnosis {
    Diagnosis { kind, defect: true, found: found.into(), change: change.into() }
}
