//! Every output format in one place: the check report as text, markdown, JSON, JUnit XML and
//! GitHub annotations; the zoo table; a witness replay; the sweep's CSV, markdown and charts
//! (SVG, PNG); the `ep` traffic table. (The routing table, [`crate::routing::render_table`],
//! stays beside the record it draws.) Renderers take the library's report types and return
//! strings; the CLI picks one by its flag and writes it. Adding a format is a function here and
//! the flag that selects it.

pub(crate) mod chart;
mod ci;
mod ep;
mod json;
mod sweep;
mod text;

pub use ci::{render_github, render_junit};
pub use ep::{render_ep, CombineFigures, EpReport};
pub use json::{json, witness_path, write_witnesses};
pub use sweep::{csv as sweep_csv, markdown as sweep_markdown, write_sweep};
pub use text::{render_markdown, render_replay, render_text, render_zoo};
