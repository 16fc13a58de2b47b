//! S, replay (statelessness): the same call before and after another call must route alike.

use super::{run_repeat, Ctx, Rule};
use crate::analyze::case::{Call, Case};
use crate::analyze::layer_check::{SampleCase, SampleInput};
use crate::analyze::witness::route_with;
use crate::analyze::{Finding, Layer, Probe, Property};
use crate::config::RouterConfig;
use crate::error::Result;
use crate::routing::Routing;
use candle_core::Tensor;

/// Probe S.
pub(crate) struct Replay;

impl Rule for Replay {
    fn name(&self) -> &'static str {
        "replay"
    }

    fn property(&self) -> Property {
        Property::S
    }

    fn run(&self, ctx: &Ctx, _layer: Option<&dyn Layer>) -> Result<Finding> {
        let (b, s) = ctx.base.dims();
        let mut rng = rand::SeedableRng::seed_from_u64(ctx.seed ^ 0x5);
        let other = Call::new(
            ctx.fresh(s.max(2) * b, &mut rng)?
                .into_shape_with_order((b, s.max(2), ctx.router.row_width()))
                .expect("shape"),
        );
        let first = ctx.base.routes(ctx.router)?;
        other.routes(ctx.router)?;
        let after = ctx.base.routes(ctx.router)?;
        // The witness keeps the call made in between as its call b.
        let case = Case { b: other, ..Case::aligned(&ctx.base, Call::clone(&ctx.base)) };
        run_repeat(ctx, Probe::S, &case, &first, &after, "the same call before and after another call")
    }

    /// The sample again after the layer ran on other input: outputs must be equal bit for bit.
    fn sample(&self, input: &SampleInput) -> Result<Option<SampleCase>> {
        let (b, s, h) = input.x.dims3()?;
        let other: Tensor = input.fresh(s, 0x5)?.broadcast_as((b, s, h))?.contiguous()?;
        input.layer.forward(&other)?;
        Ok(Some(input.again()?))
    }

    fn changes_input(&self) -> bool {
        false
    }

    fn replay(&self, config: &RouterConfig, a: &Call, b: &Call) -> Result<(Routing, Routing)> {
        let first = route_with(config, a)?;
        route_with(config, b)?;
        Ok((first, route_with(config, a)?))
    }
}
