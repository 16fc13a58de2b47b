//! Stable text of a routing record, for snapshot tests (insta) in your own crate.
//!
//! The text is [`render_table`](crate::routing::render_table): a header (router, sizes, scope,
//! capacity), one line per token with its routes in choice order (`x` dropped, `p` padding slot),
//! the expert loads and the load figures. Weights have 4 decimals, so float noise far below that
//! cannot churn a snapshot, while any change of expert, order, kept flag or capacity shows.

use crate::routing::{render_table, Routing};

/// Renders `routing` as stable text for `insta::assert_snapshot!`.
///
/// ```
/// use moe_audit::{assign, snapshot, RouterConfig};
/// use ndarray::Array3;
///
/// let config = RouterConfig::load("megatron-probs")?;
/// // Fixed logits: a snapshot must not depend on a random draw.
/// let logits = Array3::from_shape_fn((1, 4, 8), |(_, t, e)| ((t * 7 + e * 3) % 5) as f32);
/// let text = snapshot(&assign(&config, logits.view())?);
/// assert!(text.starts_with("router megatron-probs | batch 1 x seq 4 | 8 experts, top-2"));
/// // In your tests: insta::assert_snapshot!(text);
/// # Ok::<(), moe_audit::Error>(())
/// ```
pub fn snapshot(routing: &Routing) -> String {
    render_table(routing)
}
