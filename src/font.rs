//! The bundled chart font, registered with plotters once: every chart (sweep, exploit,
//! collectives) draws its text with it, so no system font libraries are needed.

use plotters::style::FontStyle;
use std::sync::Once;

/// The family name the charts ask plotters for.
pub(crate) const FONT: &str = "sans-serif";

/// Registers DejaVu Sans Mono as [`FONT`] (once per process).
pub(crate) fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, include_bytes!("../assets/fonts/DejaVuSansMono.ttf"))
            .unwrap_or_else(|_| panic!("the bundled font is a valid TrueType file"));
    });
}
