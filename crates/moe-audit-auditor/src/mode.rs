//! The mode a router routes in, train or inference: what the probes compare (analyze), the
//! protocol sends (external) and witnesses store.

use crate::hints::HintsOf;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The mode a router routes in: its training configuration or its inference one (`[inference]`
/// of a config, `mode: inference` over the protocol, `--mode`). A call of a probe case names the
/// mode relative to the router audited: `Train` is the router itself, `Inference` its
/// [`Router::inference`](moe_audit_core::router::Router::inference) router.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Training (every probe but M's second call; the default a witness leaves out).
    #[default]
    Train,
    /// Serving (the M probe).
    Inference,
}

impl Mode {
    /// Whether this is the training mode (the default a witness leaves out).
    pub(crate) fn is_train(&self) -> bool {
        *self == Mode::Train
    }

    /// The mode `router` is audited in: inference for a router audited serving
    /// (`check --mode inference`), else training.
    pub fn audited(router: &dyn moe_audit_core::router::Router) -> Mode {
        if router.serving() {
            Mode::Inference
        } else {
            Mode::Train
        }
    }

    /// The other mode.
    pub fn other(self) -> Mode {
        match self {
            Mode::Train => Mode::Inference,
            Mode::Inference => Mode::Train,
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Train => "train",
            Mode::Inference => "inference",
        })
    }
}
