//! D, repeat (determinism): the same call twice must route alike, bit for bit.

use super::{run_repeat, Ctx, Rule};
use crate::analyze::case::{Call, Case};
use crate::analyze::layer_check::{SampleCase, SampleInput};
use crate::analyze::witness::route_with;
use crate::analyze::{Finding, Layer, Probe, Property};
use crate::config::RouterConfig;
use crate::error::Result;
use crate::routing::Routing;

/// Probe D.
pub(crate) struct Repeat;

impl Rule for Repeat {
    fn name(&self) -> &'static str {
        "repeat"
    }

    fn property(&self) -> Property {
        Property::D
    }

    fn run(&self, ctx: &Ctx, _layer: Option<&dyn Layer>) -> Result<Finding> {
        let case = Case::aligned(&ctx.base, Call::clone(&ctx.base));
        let again = ctx.base.routes(ctx.router)?;
        run_repeat(ctx, Probe::D, &case, &ctx.base_routing, &again, "the same call twice")
    }

    /// The sample itself, run again: outputs must be equal bit for bit.
    fn sample(&self, input: &SampleInput) -> Result<Option<SampleCase>> {
        Ok(Some(input.again()?))
    }

    fn changes_input(&self) -> bool {
        false
    }

    fn replay(&self, config: &RouterConfig, a: &Call, _: &Call) -> Result<(Routing, Routing)> {
        Ok((route_with(config, a)?, route_with(config, a)?))
    }
}
