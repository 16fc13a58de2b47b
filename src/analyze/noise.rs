//! A random router (D fails: the same call routed twice differs) makes every probe see changes,
//! whatever the router's causality. Its other leaks are then *inconclusive* unless their rate
//! exceeds what the randomness explains: one D finding that says the router is random, never
//! eight leaks for one cause.
//!
//! The test: on a random router, a probe compares tokens that a causal router keeps alike, so
//! each token changes with D's probability p₀ (two routings of one call), and more only if the
//! probe's change reaches it. A probe's leak stands when the lower end of the Wilson score
//! interval of its rate lies above the upper end of D's, both at 99.9% confidence (z = 3.2905).
//! Two disjoint intervals are a conservative two-proportion test (tokens are taken as
//! independent trials); the confidence is fixed, not tuned to any router.

use super::{Finding, Probe, Verdict};

/// The normal quantile of a two-sided 99.9% interval.
const Z: f64 = 3.2905;

/// The Wilson score interval `(low, high)` of `k` successes in `n` trials at [`Z`].
fn wilson(k: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let (k, n) = (k as f64, n as f64);
    let p = k / n;
    let z2 = Z * Z;
    let centre = (p + z2 / (2.0 * n)) / (1.0 + z2 / n);
    let half = Z / (1.0 + z2 / n) * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt();
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

/// Whether `affected` of `compared` tokens is more than a rate of `noise_affected` of
/// `noise_compared` explains.
pub(crate) fn exceeds(affected: usize, compared: usize, noise_affected: usize, noise_compared: usize) -> bool {
    wilson(affected, compared).0 > wilson(noise_affected, noise_compared).1
}

/// The fix a random router's messages offer.
pub fn fix() -> String {
    format!(
        "seed every request (moe-audit/2 sends a `seed`; moe_audit applies it, keyed per token, with seed_calls=True) or audit {} inference",
        crate::error::Setting::Mode
    )
}

/// The fix a random router's messages offer.
#[deprecated(note = "use analyze::random_router_fix(), which names the setting as the front end does")]
pub const FIX: &str =
    "seed every request (moe-audit/2 sends a `seed`; moe_audit applies it with seed_calls=True) or audit --mode inference";

/// Marks the findings of a router whose repeat (D's comparison: `noise` = affected of compared
/// tokens) differs: D's note says the router is random, and every other leak within what the
/// randomness explains becomes [`Verdict::Inconclusive`]. Nothing changes for a deterministic
/// router.
pub(crate) fn separate(findings: &mut [Finding], noise: (usize, usize), random: bool) {
    if !random {
        return;
    }
    let (k, n) = noise;
    let rate = if n > 0 { k as f64 / n as f64 } else { 0.0 };
    let d = format!("{k} of {n} tokens ({:.1}%) route differently when the same call is routed twice", rate * 100.0);
    for f in findings {
        if f.probe == Probe::D {
            f.note = format!("random router (or one that every call changes): {d}; fix: {}", fix());
        } else if f.verdict == Verdict::Leak && !exceeds(f.affected, f.compared, k, n) {
            f.verdict = Verdict::Inconclusive;
            f.note = format!(
                "inconclusive: random router ({:.1}% changed here, within D's {:.1}% at 99.9% confidence)",
                f.rate * 100.0,
                rate * 100.0
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wilson_intervals_hold_the_rate_and_narrow_with_more_trials() {
        let (lo, hi) = wilson(10, 100);
        assert!(lo < 0.1 && 0.1 < hi && lo > 0.0, "{lo} {hi}");
        let (lo2, hi2) = wilson(100, 1000);
        assert!(lo < lo2 && hi2 < hi);
        assert!(wilson(0, 50).0 < 1e-12);
        assert!(wilson(0, 50).1 > 0.0);
        assert_eq!(wilson(0, 0), (0.0, 1.0));
    }

    #[test]
    fn a_rate_near_the_noise_is_explained_and_a_far_larger_one_is_not() {
        // D: 20 of 64 tokens. A probe at the same rate over many tokens is noise; one at 90% is not.
        assert!(!exceeds(640, 2048, 20, 64));
        assert!(!exceeds(800, 2048, 20, 64));
        assert!(exceeds(1843, 2048, 20, 64));
        // Little noise measured on few tokens still explains some: 1 in 64 covers 10% of 2048
        // (D's interval reaches 17%), not 30%.
        assert!(!exceeds(205, 2048, 1, 64));
        assert!(exceeds(614, 2048, 1, 64));
    }

    #[test]
    fn only_a_random_router_has_leaks_made_inconclusive() {
        let leak = |probe, affected, compared| Finding {
            verdict: Verdict::Leak,
            affected,
            compared,
            rate: affected as f64 / compared as f64,
            ..Finding::empty(probe)
        };
        let mut findings = vec![leak(Probe::P, 300, 1000), leak(Probe::F, 950, 1000), leak(Probe::D, 20, 64)];
        let before = findings.clone();
        separate(&mut findings, (20, 64), false);
        assert_eq!(findings, before);
        separate(&mut findings, (20, 64), true);
        let verdicts: Vec<_> = findings.iter().map(|f| f.verdict).collect();
        assert_eq!(verdicts, [Verdict::Inconclusive, Verdict::Leak, Verdict::Leak]);
        assert!(findings[0].note.starts_with("inconclusive: random router"), "{}", findings[0].note);
        assert!(
            findings[2].note.starts_with("random router (or one that every call changes): 20 of 64"),
            "{}",
            findings[2].note
        );
    }
}
