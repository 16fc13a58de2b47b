//! Aux-loss-free load balancing (DeepSeek-V3, Wang et al. 2024): after each training step, every
//! expert's selection-only bias moves by `rate * sign(mean_load - load_e)`. The update is an
//! explicit step between batches: a forward never changes the bias, so routing stays
//! deterministic and stateless within a step (the D and S probes check it).

use super::ExpertLoad;
use crate::config::{RouterConfig, TokenChoice};
use crate::error::{Error, Result};

/// Moves `bias` toward balance given one step's loads (routes chosen before any dropping).
/// An expert exactly at the mean keeps its bias (`sign(0) = 0`).
pub fn update_bias(bias: &mut [f32], loads: &[ExpertLoad], rate: f32) {
    let mean = loads.iter().map(|l| l.routed as f64).sum::<f64>() / loads.len().max(1) as f64;
    for (b, l) in bias.iter_mut().zip(loads) {
        let gap = mean - l.routed as f64;
        if gap != 0.0 {
            *b += rate * gap.signum() as f32;
        }
    }
}

/// One balancing step between training batches: the settings after [`update_bias`] with the
/// router's `bias_update_rate` moved its `expert_bias` (zero when absent), given the loads of the
/// batch; unchanged without a rate.
pub(crate) fn step(config: &RouterConfig, tc: &TokenChoice, loads: &[ExpertLoad]) -> Result<TokenChoice> {
    let mut tc = tc.clone();
    let Some(rate) = tc.bias_update_rate else { return Ok(tc) };
    if loads.len() != config.experts {
        return Err(Error::shape(
            &format!("router `{}`", config.name),
            format!("{} expert loads for {} experts", loads.len(), config.experts),
        ));
    }
    update_bias(tc.expert_bias.get_or_insert_with(|| vec![0.0; config.experts]), loads, rate);
    Ok(tc)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(expert: usize, routed: usize) -> ExpertLoad {
        ExpertLoad { expert, routed, kept: routed, padded: 0 }
    }

    #[test]
    fn overloaded_experts_go_down_underloaded_up_the_mean_stays() {
        let mut bias = vec![0.0, 0.5, 0.0, 0.0];
        update_bias(&mut bias, &[load(0, 10), load(1, 2), load(2, 4), load(3, 4)], 0.25);
        // mean 5: 0 over, 1 under, 2 and 3 under.
        assert_eq!(bias, vec![-0.25, 0.75, 0.25, 0.25]);
        let mut flat = vec![0.0; 2];
        update_bias(&mut flat, &[load(0, 3), load(1, 3)], 1.0);
        assert_eq!(flat, vec![0.0, 0.0]);
    }
}
