//! Token choice: each token takes its k best experts; capacity (if any) then drops routes
//! group-wide, and gates may be renormalised over the survivors.

use super::capacity::{capacity, drop_causal, drop_routes};
use super::scores::{Choices, Row};
use super::sinkhorn::sinkhorn;
use super::GroupRouting;
use crate::config::{DropPolicy, RouterConfig, Selection, TokenChoice};
use crate::routing::Route;

/// Routes one group; `rows` are the group's tokens in priority order.
pub(crate) fn route_group(config: &RouterConfig, tc: &TokenChoice, rows: &[Row]) -> GroupRouting {
    let mut choices = Choices::new(config, rows.len());
    match tc.selection {
        Selection::TopK => rows.iter().for_each(|&row| choices.push(config, row)),
        Selection::Sinkhorn => {
            let logits: Vec<&[f32]> = rows.iter().map(|r| r.logits).collect();
            rows.iter().zip(sinkhorn(&logits)).for_each(|(&row, balanced)| choices.push_on(config, row, &balanced));
        }
    }
    let scale = config.routed_scaling;
    let Some(cap) = &config.capacity else {
        // A choice of a null expert (ids from `real_experts()` on) computes nothing: no route.
        let real = config.real_experts();
        let routes = choices
            .iter()
            .map(|(es, gates)| {
                es.iter().zip(gates).filter(|(&e, _)| e < real).map(|(&e, &g)| kept_route(e, g * scale)).collect()
            })
            .collect();
        return GroupRouting { routes, capacity: None, in_force: None };
    };
    let c = capacity(cap, rows.len(), config.k(), config.experts);
    let (dropped, in_force) = match cap.policy {
        DropPolicy::Causal => {
            let (dropped, in_force) = drop_causal(cap, &choices, config.experts);
            (dropped, Some(in_force))
        }
        _ => (drop_routes(cap, c, &choices, config.experts), None),
    };
    let mut routes: Vec<Vec<Route>> = choices
        .iter()
        .zip(dropped.kept.chunks_exact(choices.k()))
        .map(|((es, gates), kept)| {
            let survivors: f32 = gates.iter().zip(kept).filter(|(_, &k)| k).map(|(g, _)| g).sum();
            // DeepSpeed clamps the denominator at float32 eps.
            let denom = if cap.renormalize_after_drop { survivors.max(f32::EPSILON) } else { 1.0 };
            es.iter()
                .zip(gates)
                .zip(kept)
                .map(|((&e, &g), &k)| {
                    let weight = if k { g / denom } else { g };
                    Route { expert: e, weight: weight * scale, kept: k, padded: false }
                })
                .collect()
        })
        .collect();
    for (e, tokens) in dropped.padding.iter().enumerate() {
        for &i in tokens {
            routes[i].push(Route { expert: e, weight: 0.0, kept: true, padded: true });
        }
    }
    GroupRouting { routes, capacity: Some(c), in_force }
}

fn kept_route(expert: usize, weight: f32) -> Route {
    Route { expert, weight, kept: true, padded: false }
}
