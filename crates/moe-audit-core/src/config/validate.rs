//! Semantic checks on a built [`RouterConfig`], each error naming the field and the value: the
//! shared fields here, a kind's own settings in `kind.rs`. Which keys a kind may have at all is
//! settled earlier, when the file becomes a config (`file.rs`).

use super::{CapacityConfig, DropPolicy, RouterConfig, ScopeGroup, ScoreFn};
use crate::error::FieldError;

pub(super) type Check = Result<(), FieldError>;

/// The largest capacity factor accepted.
pub const MAX_CAPACITY_FACTOR: f64 = 1e6;

pub(super) fn ensure(ok: bool, field: &'static str, message: impl FnOnce() -> String) -> Check {
    if ok {
        Ok(())
    } else {
        Err(FieldError::new(field, message()))
    }
}

impl RouterConfig {
    /// Checks the rules the schema cannot express, in a fixed order (the first broken rule is
    /// the error): the router's identity and size, its kind's settings, the scores, the capacity.
    /// Errors are `(field, message)`.
    pub fn validate(&self) -> Check {
        self.check_identity()?;
        self.kind.validate(self)?;
        self.check_score()?;
        if let Some(cap) = &self.capacity {
            self.check_capacity(cap)?;
        }
        Ok(())
    }

    /// A valid name, at least one expert, a positive finite gate scale.
    fn check_identity(&self) -> Check {
        let e = self.experts;
        crate::names::check(&self.name).map_err(|e| FieldError::new("name", e.to_string()))?;
        ensure(e > 0, "experts", || format!("must be at least 1, got {e}"))?;
        ensure(self.routed_scaling.is_finite() && self.routed_scaling > 0.0, "routed_scaling", || {
            format!("must be finite and > 0, got {}", self.routed_scaling)
        })
    }

    /// `softmax-post` gates are normalised by construction.
    fn check_score(&self) -> Check {
        ensure(self.score != ScoreFn::SoftmaxPost || self.normalize != Some(false), "normalize", || {
            "softmax-post is normalised by construction; remove `normalize = false`".into()
        })
    }

    /// Capacity: either a factor (finite, in (0, MAX]) or a fixed size; causal only per sequence.
    fn check_capacity(&self, cap: &CapacityConfig) -> Check {
        if cap.policy == DropPolicy::Causal {
            self.check_causal(cap)?;
        }
        match (cap.factor, cap.fixed) {
            (Some(f), None) => {
                ensure(f.is_finite() && f > 0.0, "capacity.factor", || format!("must be finite and > 0, got {f}"))?;
                // Beyond this the capacity is past every route anyway; far beyond, past usize.
                ensure(f <= MAX_CAPACITY_FACTOR, "capacity.factor", || {
                    format!("{f:?} is over {MAX_CAPACITY_FACTOR:?}: no token is dropped long before; use a fixed capacity or a smaller factor")
                })
            }
            (None, Some(_)) => Ok(()),
            (Some(_), Some(_)) => Err(FieldError::new("capacity", "set either `factor` or `fixed`, not both")),
            (None, None) => {
                Err(FieldError::new("capacity", "needs `factor` (derived capacity) or `fixed` (constant capacity)"))
            }
        }
    }

    /// Causal capacity counts earlier tokens of one sequence, and never knows its final size.
    fn check_causal(&self, cap: &CapacityConfig) -> Check {
        ensure(self.scope.group == ScopeGroup::Sequence, "capacity.policy", || {
            format!(
                "causal counts earlier tokens of the same sequence; needs scope.group = \"sequence\", got \"{}\"",
                self.scope.group
            )
        })?;
        ensure(!cap.pad, "capacity.pad", || {
            "pad-to-capacity needs the final capacity, which a causal capacity never knows in advance".into()
        })
    }
}
