//! What every fuzz target asserts of a routing: the invariants hold whatever the input.

use moe_audit::Routing;

/// Panics (a fuzz finding) when `r` breaks an invariant of its router.
pub fn check_routing(r: &Routing) {
    assert_eq!(r.tokens.len(), r.batch * r.seq_len, "one entry per token");
    for t in &r.tokens {
        if let Some(k) = r.top_k {
            assert!(t.routes.iter().filter(|x| !x.padded).count() <= k, "more than k routes");
        }
        for x in &t.routes {
            assert!(x.expert < r.experts, "expert out of range");
            assert!(x.weight.is_finite() && (0.0..=1.0).contains(&x.weight), "weight {} outside [0, 1]", x.weight);
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
