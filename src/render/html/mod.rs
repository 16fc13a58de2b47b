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

pub use check::check_html;
pub use engine::engine_html;
pub use model::model_html;
pub use routes::routes_html;
