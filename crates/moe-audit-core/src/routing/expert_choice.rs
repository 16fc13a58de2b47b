//! Expert choice (Zhou et al. 2022): each expert takes its C best tokens of the group. Every
//! expert is exactly full; a token gets anywhere from 0 to E experts. Not causal: whether a
//! token is taken depends on how strongly later tokens want the same expert.

use super::capacity::capacity;
use super::scores::{affinities, desc, Row};
use super::GroupRouting;
use crate::config::RouterConfig;
use crate::routing::Route;

/// Routes one group; `rows` are the group's logits in priority order.
pub(crate) fn route_group(config: &RouterConfig, rows: &[Row]) -> GroupRouting {
    let cap = config.capacity.as_ref().expect("validated: expert choice has a capacity");
    let scores: Vec<_> = rows.iter().map(|&row| affinities(config.score, row)).collect();
    let c = capacity(cap, rows.len(), 1, config.experts);
    let mut routes: Vec<Vec<Route>> = vec![Vec::new(); rows.len()];
    let mut order: Vec<usize> = Vec::with_capacity(rows.len());
    // `e` is the expert id, a column of every row of `scores`: a range reads better than zips.
    #[allow(clippy::needless_range_loop)]
    for e in 0..config.experts {
        // The order is total (token index breaks ties), so the c first are a selection; which
        // order they come in does not matter (each token's routes are ordered below).
        order.clear();
        order.extend(0..rows.len());
        let by_score = |&a: &usize, &b: &usize| desc(scores[a][e], scores[b][e]).then(a.cmp(&b));
        if c > 0 && c < order.len() {
            order.select_nth_unstable_by(c - 1, by_score);
        }
        for &i in order.iter().take(c) {
            let weight = scores[i][e] * config.routed_scaling;
            routes[i].push(Route { expert: e, weight, kept: true, padded: false });
        }
    }
    // Choice order for a token: its strongest expert first, ties to the lower id.
    for r in &mut routes {
        r.sort_by(|a, b| desc(a.weight, b.weight).then(a.expert.cmp(&b.expert)));
    }
    GroupRouting { routes, capacity: Some(c), in_force: None }
}
