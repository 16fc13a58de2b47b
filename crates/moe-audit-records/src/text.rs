//! How the report writes numbers: layer lists as runs, shares as percentages.

/// `3 to 61` style list of layer numbers: runs joined.
pub fn ranges(layers: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let mut j = i;
        while j + 1 < layers.len() && layers[j + 1] == layers[j] + 1 {
            j += 1;
        }
        out.push(if j > i { format!("{} to {}", layers[i], layers[j]) } else { layers[i].to_string() });
        i = j + 1;
    }
    out.join(", ")
}

/// A share as a percentage with one decimal (`12.5%`).
pub(crate) fn pct(share: f64) -> String {
    format!("{:.1}%", share * 100.0)
}
