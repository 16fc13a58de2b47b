//! Moved: the routing diff is a pure function of two routing records, so it lives with the record
//! in [`crate::routing`] now. These deprecated aliases keep the old paths compiling for a release
//! (a `#[deprecated]` on a `pub use` warns nobody, hence an alias, a constant and two wrappers).

use crate::routing::{Routing, TokenRouting};

/// Moved to [`crate::routing::WEIGHT_TOLERANCE`], the value's one home.
#[deprecated(note = "moved to moe_audit::routing::WEIGHT_TOLERANCE")]
pub const WEIGHT_TOLERANCE: f32 = crate::routing::WEIGHT_TOLERANCE;

/// Moved to [`crate::routing::TokenDiff`].
#[deprecated(note = "moved to moe_audit::routing::TokenDiff")]
pub type TokenDiff = crate::routing::TokenDiff;

/// Moved to [`crate::routing::capacity_of`].
#[deprecated(note = "moved to moe_audit::routing::capacity_of")]
pub fn capacity_of(r: &Routing, t: &TokenRouting) -> Option<usize> {
    crate::routing::capacity_of(r, t)
}

/// Moved to [`crate::routing::diff_token`].
#[deprecated(note = "moved to moe_audit::routing::diff_token")]
pub fn diff_token(a: &Routing, ta: (usize, usize), b: &Routing, tb: (usize, usize)) -> crate::routing::TokenDiff {
    crate::routing::diff_token(a, ta, b, tb)
}
