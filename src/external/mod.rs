//! Routers that live outside moe-audit, audited through the [`Router`] trait like built-in ones.
//!
//! - [`protocol`]: the `moe-audit/1` messages and their validation (docs/PROTOCOL.md);
//! - [`process`]: a router in a subprocess, over newline-delimited JSON;
//! - [`trace`]: a router that cannot run as a subprocess: `plan` writes every call the audit
//!   will make, the user's harness answers them, and a router replays the answers by content.
//!
//! An external router routes whole rows in its assignment stage: E logits (`input: logits`) or
//! H hidden values (`input: hidden`, the router applies its own gate). The analyzer's score stage
//! is then the identity, and its rows are as wide as [`Router::row_width`] says.

pub mod gate;
pub mod process;
pub mod protocol;
pub mod trace;

pub use process::ExternalRouter;
pub use protocol::{Handshake, InputKind, Mode};
pub use trace::{plan, TraceRouter};

use crate::error::{Error, Result};
use crate::layer::Seeded;
use crate::router::Router;
use crate::routing::Routing;
use candle_core::{Device, Tensor};
use ndarray::{Array3, ArrayView3};
use std::sync::Arc;

/// Pool rows per expert when looking for targeted hidden rows.
const POOL_PER_EXPERT: usize = 16;

/// Where an external router's answers come from: a process, trace files, or `plan`'s recorder.
pub trait Answers: Send + Sync {
    /// Routes `rows` (`[batch, seq_len, width]`, finite, as wide as the handshake says).
    fn answer(&self, hs: &Handshake, mode: Mode, rows: ArrayView3<f32>) -> Result<Routing>;
}

/// A router outside moe-audit as the analyzer sees it: its handshake, its rows, the mode it is
/// asked in, and where the answers come from. Its gate lives on the other side, so the score
/// stage passes rows through; calls are never concurrent (one conversation, a fixed order).
pub struct External<A> {
    hs: Arc<Handshake>,
    rows: ExternalRows,
    mode: Mode,
    answers: Arc<A>,
}

impl<A> External<A> {
    fn new(hs: Handshake, seed: u64, answers: A) -> Self {
        let rows = ExternalRows::new(&hs, seed);
        External {
            hs: Arc::new(hs),
            rows,
            mode: Mode::Train,
            answers: Arc::new(answers),
        }
    }

    /// The router's handshake.
    pub fn handshake(&self) -> &Handshake {
        &self.hs
    }

    fn check_width(&self, width: usize) -> Result<()> {
        if width == self.hs.row_width() {
            return Ok(());
        }
        Err(Error::shape(
            &format!("router `{}`", self.hs.name),
            format!(
                "rows of {width} values, the router takes {}",
                self.hs.row_width()
            ),
        ))
    }
}

impl<A: Answers + 'static> Router for External<A> {
    fn name(&self) -> &str {
        &self.hs.name
    }

    fn experts(&self) -> usize {
        self.hs.experts
    }

    fn row_width(&self) -> usize {
        self.hs.row_width()
    }

    fn targeted_row(&self, e: usize) -> Option<Vec<f32>> {
        self.rows.targeted(e)
    }

    fn concurrent(&self) -> bool {
        false
    }

    fn scores(&self, hidden: &Tensor) -> Result<Tensor> {
        self.check_width(hidden.dims3()?.2)?;
        Ok(hidden.clone())
    }

    fn assign(&self, rows: ArrayView3<f32>) -> Result<Routing> {
        self.check_width(rows.dim().2)?;
        crate::routing::scores::check_finite(&rows)?;
        self.answers.answer(&self.hs, self.mode, rows)
    }

    fn inference(&self) -> Result<Option<Box<dyn Router>>> {
        let (hs, rows, answers) = (
            Arc::clone(&self.hs),
            self.rows.clone(),
            Arc::clone(&self.answers),
        );
        Ok(Some(Box::new(External {
            hs,
            rows,
            mode: Mode::Inference,
            answers,
        })))
    }
}

/// Targeted rows of an `input: hidden` router. Without the gate, the analyzer cannot craft a row
/// that wants expert e; it asks the router to route a seeded pool once and takes, for each
/// expert, the pool row that gives it the largest first-choice weight. Until (or unless) the
/// pool is answered (trace files), expert e's row is pool row e: seeded, but not targeted.
#[derive(Debug, Clone)]
struct ExternalRows {
    seed: u64,
    experts: usize,
    width: usize,
    /// One row per expert for `input: hidden`; `None` for logits (the analyzer's own rows).
    targets: Option<Vec<Vec<f32>>>,
}

impl ExternalRows {
    fn new(hs: &Handshake, seed: u64) -> Self {
        let mut rows = ExternalRows {
            seed,
            experts: hs.experts,
            width: hs.row_width(),
            targets: None,
        };
        if hs.input == InputKind::Hidden {
            let pool = rows.pool();
            rows.targets = Some(
                (0..hs.experts)
                    .map(|e| pool.slice(ndarray::s![0, e % pool.dim().1, ..]).to_vec())
                    .collect(),
            );
        }
        rows
    }

    /// `[1, POOL_PER_EXPERT * E, H]` standard-normal rows from the audit seed.
    fn pool(&self) -> Array3<f32> {
        let n = POOL_PER_EXPERT * self.experts;
        let t = Seeded::new(self.seed ^ 0x9001)
            .normal(&[1, n, self.width], &Device::Cpu)
            .expect("host tensor");
        Array3::from_shape_vec(
            (1, n, self.width),
            t.flatten_all()
                .and_then(|t| t.to_vec1())
                .expect("host tensor"),
        )
        .expect("shape")
    }

    fn pick_targets(&mut self, pool: &Array3<f32>, routing: &Routing) {
        let Some(targets) = &mut self.targets else {
            return;
        };
        for (e, target) in targets.iter_mut().enumerate() {
            let first_choice = |t: &crate::routing::TokenRouting| {
                t.routes.first().filter(|r| r.expert == e).map(|r| r.weight)
            };
            let any_choice = |t: &crate::routing::TokenRouting| {
                t.routes.iter().find(|r| r.expert == e).map(|r| r.weight)
            };
            let best =
                best_token(routing, first_choice).or_else(|| best_token(routing, any_choice));
            if let Some(i) = best {
                *target = pool.slice(ndarray::s![0, i, ..]).to_vec();
            }
        }
    }

    fn targeted(&self, e: usize) -> Option<Vec<f32>> {
        self.targets.as_ref().map(|t| t[e].clone())
    }
}

/// The token with the largest weight under `weight` (ties to the lowest index).
fn best_token(
    routing: &Routing,
    weight: impl Fn(&crate::routing::TokenRouting) -> Option<f32>,
) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, t) in routing.tokens.iter().enumerate() {
        if let Some(w) = weight(t) {
            if best.is_none_or(|(_, b)| w > b) {
                best = Some((i, w));
            }
        }
    }
    best.map(|(i, _)| i)
}
