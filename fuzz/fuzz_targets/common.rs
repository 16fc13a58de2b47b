//! What every fuzz target asserts of a routing: the invariants hold whatever the input.

use moe_audit::Routing;

/// Panics (a fuzz finding) when `r` breaks an invariant of its router; `scale` is the router's
/// `routed_scaling`, the largest a gate can be.
pub fn check_routing(r: &Routing, scale: f32) {
    assert_eq!(r.tokens.len(), r.batch * r.seq_len, "one entry per token");
    for t in &r.tokens {
        if let Some(k) = r.top_k {
            assert!(t.routes.iter().filter(|x| !x.padded).count() <= k, "more than k routes");
        }
        for x in &t.routes {
            assert!(x.expert < r.experts, "expert out of range");
            let ok = x.weight.is_finite() && (0.0..=scale).contains(&x.weight);
            assert!(ok, "weight {} outside [0, {scale}]", x.weight);
        }
    }
    for (g, group) in r.scope.groups.iter().enumerate() {
        let Some(c) = group.capacity else { continue };
        let mut kept = vec![0usize; r.experts];
        for t in r.tokens.iter().filter(|t| t.group == g) {
            t.routes.iter().filter(|x| x.kept).for_each(|x| kept[x.expert] += 1);
        }
        assert!(kept.iter().all(|&k| k <= c), "group {g}: kept {kept:?} over capacity {c}");
    }
}
