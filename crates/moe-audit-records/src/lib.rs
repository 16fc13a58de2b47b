//! Rollout against trainer: routing records from an inference engine (SGLang, vLLM) and from a
//! trainer (Megatron, FSDP, a Hugging Face model recorded by `moe_audit.routes`), aligned,
//! diagnosed for the silent bugs of routing replay (R3), then measured.
//!
//! The data flows one way through one file per step, and a module uses only those before it:
//! `file` (a record's bytes, within bounds) → `array`, `ids` (arrays in place, expert ids as
//! stored) → `formats` (one reader per writer) → `clean` (what the stored values mean) →
//! `record` ([`Record`]) → [`read`] (a record from a file or arrays, the pair) → `align` (token
//! and layer alignment, its diagnoses) → `measure` (disagreement per layer, per token, overall;
//! margins at flips) → `defects` (the diagnoses of each record and of the pair) → `compare`
//! ([`Comparison`], rendered by `render::routes`); `show` summarises one record. [`config`] (a
//! Hugging Face layer layout, Megatron's pipeline split), `budget`, `sides` and `text` sit
//! beside the flow. docs/ROUTES.md explains every diagnosis.

#![warn(missing_docs)]

mod align;
mod array;
mod budget;
mod clean;
mod compare;
pub mod config;
mod defects;
mod diagnosis;
mod file;
mod formats;
mod ids;
mod measure;
mod pipeline;
pub mod read;
mod record;
pub mod settings;
mod show;
mod sides;
mod text;

pub use align::{Alignment, LayerPair, Segment};
pub use budget::Budget;
pub use compare::{compare, compare_sources, CompareOptions, Comparison, Side};
pub use config::{LayerKind, Layout};
pub use diagnosis::{Diagnosis, DiagnosisKind};
pub use measure::{expert_set, shared_experts, Flip, Lane, LayerMeasure, Margins, Measures, LANES};
#[allow(deprecated)]
pub use read::load_pair;
pub use read::{from_bytes, from_ids, load, load_both, Format, Found, IdArray, Record, ShapeHint, Source};
pub use show::{show, LayerLoad, Summary};
pub use sides::{Role, Sides};
