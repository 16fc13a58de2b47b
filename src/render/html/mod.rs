//! The HTML reports: one self-contained file per router audit, whole-model audit, records
//! comparison and engine audit. Static HTML with inline CSS and SVG: no script, no font or image fetched, so a
//! report reads the same offline, in a mail attachment or with JavaScript off. Each report kind
//! has its file; the page, its escaping and the drawings they share are in `page` and `svg`.

mod check;
mod engine;
mod model;
mod page;
mod routes;
mod svg;

pub(crate) use check::check_html;
pub(crate) use engine::engine_html;
pub(crate) use model::model_html;
pub(crate) use routes::routes_html;
