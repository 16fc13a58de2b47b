//! Routers that live outside moe-audit, audited through the [`Router`] trait like built-in ones.
//!
//! - [`protocol`]: the `moe-audit/1` and `/2` messages and their validation (docs/PROTOCOL.md);
//! - [`process`]: a router in a subprocess, over JSON lines (`/1`) or binary frames (`/2`);
//! - [`trace`]: a router that cannot run as a subprocess: `plan` writes every call the audit
//!   will make, the user's harness answers them, and a router replays the answers by content.
//!
//! An external router routes whole rows in its assignment stage: E logits (`input: logits`) or
//! H hidden values (`input: hidden`, the router applies its own gate). The analyzer's score stage
//! is then the identity, and its rows are as wide as [`moe_audit_core::router::Hints::row_width`] says.

pub mod process;
pub mod protocol;
pub mod trace;

pub use crate::mode::Mode;
pub use process::{ExternalRouter, Subprocess};
pub use protocol::{Handshake, InputKind};
#[allow(deprecated)]
pub use trace::{plan, Replay, TraceAnswers, TraceRouter};

use crate::hints::HintsOf;
use candle_core::{Device, Tensor};
use moe_audit_core::error::{Error, Result};
use moe_audit_core::layer::Seeded;
use moe_audit_core::router::{Hints, Router};
use moe_audit_core::routing::Routing;
use moe_audit_core::MemoryBudget;
use ndarray::{Array3, ArrayView2, ArrayView3};
use std::sync::Arc;

/// Where an external router's answers come from: a subprocess, trace files, or the recorder
/// `plan` runs the audit against.
pub trait Answers: Send + Sync + 'static {
    /// The router as its handshake describes it.
    fn handshake(&self) -> &Handshake;
    /// The routing of `rows` (`[batch, seq_len, row_width]`) in `mode`, with a padding mask
    /// (`[batch, seq_len]`, `true` = padding) when the handshake takes one.
    fn answer(&self, mode: Mode, rows: ArrayView3<f32>, padding: Option<ArrayView2<bool>>) -> Result<Routing>;
    /// [`Answers::answer`] with sequence `b` on rank `placement[b]` (a router with `ranks`).
    fn answer_placed(
        &self,
        mode: Mode,
        rows: ArrayView3<f32>,
        padding: Option<ArrayView2<bool>>,
        placement: &[usize],
    ) -> Result<Routing> {
        let _ = (mode, rows, padding, placement);
        Err(Error::usage(format!("router `{}`: its answers carry no placement", self.handshake().name)))
    }
}

/// A router outside moe-audit, in one mode: the analyzer sees it through [`Router`] like a
/// built-in one. Its score stage passes rows through; the router M compares it with
/// ([`Router::inference`]) is the same source asked in the other mode.
pub struct External<A> {
    source: Arc<A>,
    mode: Mode,
    rows: ExternalRows,
}

impl<A: Answers> External<A> {
    /// The router in `mode`; for `input: hidden`, asks `source` once (in `mode`) to route a
    /// seeded pool and keeps the targeted rows it finds (see [`ExternalRows`]) when `target` is
    /// set. Fails first when that pool would take more than `budget` bytes.
    fn new(source: A, seed: u64, mode: Mode, target: bool, budget: MemoryBudget) -> Result<Self> {
        let hs = source.handshake();
        if hs.input == InputKind::Hidden {
            let pool = (POOL_PER_EXPERT * hs.experts * hs.ranks()) as u64 * hs.row_width() as u64 * 4;
            budget.ensure_fits(&format!("the targeted-row pool of router `{}`", hs.name), pool)?;
        }
        let mut rows = ExternalRows::new(hs, seed);
        if target && hs.input == InputKind::Hidden {
            let pool = rows.pool();
            let routing = source.answer(mode, pool.view(), None)?;
            rows.pick_targets(&pool, &routing);
        }
        Ok(External { source: Arc::new(source), mode, rows })
    }

    /// The handshake the router sent.
    pub fn handshake(&self) -> &Handshake {
        self.source.handshake()
    }

    /// Where the answers come from.
    pub fn source(&self) -> &A {
        &self.source
    }
}

impl<A: Answers> Router for External<A> {
    fn name(&self) -> &str {
        &self.handshake().name
    }

    fn experts(&self) -> usize {
        self.handshake().experts
    }

    fn hints(&self) -> Option<&dyn Hints> {
        Some(self)
    }

    /// The router's gate lives elsewhere: its rows pass through unchanged.
    fn scores(&self, hidden: &Tensor) -> Result<Tensor> {
        pass_through(self, hidden)
    }

    fn assign(&self, rows: ArrayView3<f32>) -> Result<Routing> {
        self.source.answer(self.mode, rows, None)
    }

    fn accepts_padding_mask(&self) -> bool {
        self.handshake().padding_mask
    }

    fn assign_masked(&self, rows: ArrayView3<f32>, padding: ArrayView2<bool>) -> Result<Routing> {
        if !self.accepts_padding_mask() {
            return Err(Error::shape(&format!("router `{}`", self.name()), "the router takes no padding mask"));
        }
        self.source.answer(self.mode, rows, Some(padding))
    }

    /// The other mode: M compares the audited mode (`check --mode`) with it.
    fn inference(&self) -> Result<Option<Box<dyn Router>>> {
        let source = Arc::clone(&self.source);
        Ok(Some(Box::new(External { source, mode: self.mode.other(), rows: self.rows.clone() })))
    }
}

impl<A: Answers> Hints for External<A> {
    /// The router's identity for its witnesses: the handshake without its transport (protocol
    /// version, response encoding, padding mask) and its adapter's options (`seed_calls`), so a
    /// witness replays over either protocol.
    fn handshake(&self) -> Option<serde_json::Value> {
        let mut value = serde_json::to_value(External::handshake(self)).ok()?;
        if let Some(fields) = value.as_object_mut() {
            // `ranks`, `output` and `weights` stay: they say what the layer is.
            for transport in ["protocol", "responses", "padding_mask", "seed_calls"] {
                fields.remove(transport);
            }
        }
        Some(value)
    }
    fn row_width(&self) -> Option<usize> {
        Some(self.handshake().row_width())
    }

    fn targeted_row(&self, e: usize) -> Option<Vec<f32>> {
        self.rows.targeted(e)
    }

    /// One conversation (or one replay order): calls must come one at a time, in order.
    fn concurrent(&self) -> bool {
        false
    }

    fn serving(&self) -> bool {
        self.mode == Mode::Inference
    }

    fn seed_calls(&self) -> Option<bool> {
        self.handshake().seed_calls
    }

    fn ranks(&self) -> Option<usize> {
        self.handshake().ranks
    }

    fn assign_placed(
        &self,
        rows: ArrayView3<f32>,
        padding: Option<ArrayView2<bool>>,
        placement: &[usize],
    ) -> Result<Routing> {
        self.source.answer_placed(self.mode, rows, padding, placement)
    }
}

/// Pool rows per expert when looking for targeted hidden rows.
const POOL_PER_EXPERT: usize = 16;

/// The score stage of an external router: rows pass through, checked for width.
fn pass_through(router: &dyn Router, hidden: &Tensor) -> Result<Tensor> {
    let (_, _, w) = hidden.dims3()?;
    if w != router.row_width() {
        return Err(Error::shape(
            &format!("router `{}`", router.name()),
            format!("rows of {w} values, the router takes {}", router.row_width()),
        ));
    }
    Ok(hidden.clone())
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
    /// Sequences of the pool: the router's ranks.
    ranks: usize,
    /// One row per expert for `input: hidden`; `None` for logits (the analyzer's own rows).
    targets: Option<Vec<Vec<f32>>>,
}

impl ExternalRows {
    fn new(hs: &Handshake, seed: u64) -> Self {
        let mut rows =
            ExternalRows { seed, experts: hs.experts, width: hs.row_width(), ranks: hs.ranks(), targets: None };
        if hs.input == InputKind::Hidden {
            let pool = rows.pool();
            rows.targets =
                Some((0..hs.experts).map(|e| pool.slice(ndarray::s![0, e % pool.dim().1, ..]).to_vec()).collect());
        }
        rows
    }

    /// `[ranks, POOL_PER_EXPERT * E, H]` standard-normal rows from the audit seed: one
    /// sequence per rank, as a layer over ranks takes only a multiple of them.
    fn pool(&self) -> Array3<f32> {
        let (r, n) = (self.ranks, POOL_PER_EXPERT * self.experts);
        let t = Seeded::new(self.seed ^ crate::seeds::EXTERNAL_HIDDEN)
            .normal(&[r, n, self.width], &Device::Cpu)
            .expect("host tensor");
        Array3::from_shape_vec((r, n, self.width), t.flatten_all().and_then(|t| t.to_vec1()).expect("host tensor"))
            .expect("shape")
    }

    fn pick_targets(&mut self, pool: &Array3<f32>, routing: &Routing) {
        let Some(targets) = &mut self.targets else {
            return;
        };
        for (e, target) in targets.iter_mut().enumerate() {
            let first_choice = |t: &moe_audit_core::routing::TokenRouting| {
                t.routes.first().filter(|r| r.expert == e).map(|r| r.weight)
            };
            let any_choice =
                |t: &moe_audit_core::routing::TokenRouting| t.routes.iter().find(|r| r.expert == e).map(|r| r.weight);
            let best = best_token(routing, first_choice).or_else(|| best_token(routing, any_choice));
            if let Some(i) = best {
                let (b, s) = (i / pool.dim().1, i % pool.dim().1);
                *target = pool.slice(ndarray::s![b, s, ..]).to_vec();
            }
        }
    }

    fn targeted(&self, e: usize) -> Option<Vec<f32>> {
        self.targets.as_ref().and_then(|t| t.get(e).cloned())
    }
}

/// The token with the largest weight under `weight` (ties to the lowest index).
fn best_token(
    routing: &Routing,
    weight: impl Fn(&moe_audit_core::routing::TokenRouting) -> Option<f32>,
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
