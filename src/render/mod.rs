//! Every output format in one place: the check report as text, markdown, JSON, JUnit XML and
//! GitHub annotations; the zoo table; a witness replay; the sweep's CSV, markdown and charts
//! (SVG, PNG); the `ep` traffic table; the `collectives` tables and charts; the `exploit` text,
//! markdown and learning curve; the `routes` comparison and its per-layer chart; the `engine` audit; self-contained
//! HTML pages of a check (routers or a whole model) and of a records comparison. (The routing table, [`crate::routing::render_table`],
//! stays beside the record it draws.) Renderers take the library's report types and return
//! strings; the CLI picks one by its flag and writes it. Adding a format is a function here and
//! the flag that selects it.

pub(crate) mod chart;
mod ci;
mod collectives;
mod engine;
mod ep;
mod exploit;
mod html;
mod json;
mod model;
mod routes;
mod sweep;
mod text;

pub(crate) use crate::parallel::EpReport;
pub(crate) use ci::{render_github, render_junit};
pub(crate) use collectives::{collectives_chart, render_collectives};
pub(crate) use engine::{engine_replay_text, engine_text};
pub(crate) use ep::render_ep;
pub(crate) use exploit::{exploit_markdown, exploit_text, write_exploit};
pub(crate) use html::{check_html, engine_html, model_html, routes_html};
pub use json::json;
pub(crate) use json::{witness_path, write_witnesses};
pub(crate) use model::{render_model_replay, render_model_text};
pub(crate) use routes::{routes_chart, routes_github, routes_junit, routes_markdown, routes_text, show_text};
pub(crate) use sweep::{markdown as sweep_markdown, write_sweep};
pub(crate) use text::{render_markdown, render_replay, render_text, render_zoo};
