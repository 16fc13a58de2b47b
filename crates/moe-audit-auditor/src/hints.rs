//! A router's [`Hints`] as the audit reads them: what the router gives, else what a built-in
//! router needs. Routing never reads them, so they live with the audit, not on `dyn Router`.

use candle_core::Tensor;
use moe_audit_core::error::{Error, Result};
use moe_audit_core::router::{Hints, Router};
use moe_audit_core::routing::Routing;
use ndarray::{ArrayView2, ArrayView3};

/// The [`Hints`] of any router, with the built-in defaults when it gives none.
pub(crate) trait HintsOf {
    /// Width of a row the assignment stage takes ([`Hints::row_width`]; E by default).
    fn row_width(&self) -> usize;
    /// A row that wants expert `e` above all others ([`Hints::targeted_row`]).
    fn targeted_row(&self, e: usize) -> Option<Vec<f32>>;
    /// The audit's hidden states, when the router draws its own ([`Hints::draw_hidden`]).
    fn draw_hidden(&self, shape: (usize, usize), seed: u64) -> Result<Option<Tensor>>;
    /// Whether calls may run concurrently ([`Hints::concurrent`]).
    fn concurrent(&self) -> bool;
    /// Whether the router is audited in its serving mode ([`Hints::serving`]).
    fn serving(&self) -> bool;
    /// Whether its adapter offers `seed_calls` ([`Hints::seed_calls`]).
    fn seed_calls(&self) -> Option<bool>;
    /// The ranks a layer places sequences over ([`Hints::ranks`]).
    fn ranks(&self) -> Option<usize>;
    /// The routes of a call under a placement ([`Hints::assign_placed`]).
    fn assign_placed(
        &self,
        logits: ArrayView3<f32>,
        padding: Option<ArrayView2<bool>>,
        placement: &[usize],
    ) -> Result<Routing>;
    /// How a router outside moe-audit introduced itself ([`Hints::handshake`]).
    fn handshake(&self) -> Option<serde_json::Value>;
}

impl HintsOf for dyn Router + '_ {
    fn row_width(&self) -> usize {
        self.hints().and_then(Hints::row_width).unwrap_or_else(|| self.experts())
    }
    fn targeted_row(&self, e: usize) -> Option<Vec<f32>> {
        self.hints().and_then(|h| h.targeted_row(e))
    }
    fn draw_hidden(&self, shape: (usize, usize), seed: u64) -> Result<Option<Tensor>> {
        self.hints().map_or(Ok(None), |h| h.draw_hidden(shape, seed))
    }
    fn concurrent(&self) -> bool {
        self.hints().is_none_or(Hints::concurrent)
    }
    fn serving(&self) -> bool {
        self.hints().is_some_and(Hints::serving)
    }
    fn seed_calls(&self) -> Option<bool> {
        self.hints().and_then(Hints::seed_calls)
    }
    fn ranks(&self) -> Option<usize> {
        self.hints().and_then(Hints::ranks)
    }
    fn assign_placed(
        &self,
        logits: ArrayView3<f32>,
        padding: Option<ArrayView2<bool>>,
        placement: &[usize],
    ) -> Result<Routing> {
        match self.hints() {
            Some(h) => h.assign_placed(logits, padding, placement),
            None => Err(Error::shape(&format!("router `{}`", self.name()), "the router places no sequences on ranks")),
        }
    }
    fn handshake(&self) -> Option<serde_json::Value> {
        self.hints().and_then(Hints::handshake)
    }
}
