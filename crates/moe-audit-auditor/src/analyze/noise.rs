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
//!
//! Every mode a probe calls counts: D runs in the audited mode and in the other one
//! ([`super::repeats::Repeats::other_repeat`]), and a probe comparing calls of a mode weighs its
//! changes against that mode's D. A router random only in training (jitter) audited in inference
//! mode is deterministic there, and random in the training calls S and M make.

use super::repeats::{Observed, Repeats};
use super::{Finding, Probe, Verdict};
use crate::mode::Mode;

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

fn percent(k: usize, n: usize) -> f64 {
    if n > 0 {
        k as f64 / n as f64 * 100.0
    } else {
        0.0
    }
}

/// What each mode's randomness explains: D's comparison (affected, compared tokens of the same
/// call routed twice in a row) in the audited mode and in the other one, where it differed.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Noise {
    /// D in the audited mode (`Mode::Train`), when it differed.
    audited: Option<(usize, usize)>,
    /// D in the other mode (`Mode::Inference`), when the router has one and it differed.
    other: Option<(usize, usize)>,
    /// The router's mode the audit calls (its `Mode::Train` calls): names the modes.
    audited_in: Mode,
}

impl Noise {
    /// The noise of an audit's repeats.
    pub(crate) fn of(repeats: &Repeats, audited_in: Mode) -> Noise {
        let random = |mode| {
            let t = repeats.repeat_in(mode).map(Observed::tally)?;
            // Randomness is decisions that change; a capacity alone is latent, not noise.
            (t.affected > 0).then(|| (t.affected, t.compared()))
        };
        Noise { audited: random(Mode::Train), other: random(Mode::Inference), audited_in }
    }

    fn of_mode(&self, mode: Mode) -> Option<(usize, usize)> {
        match mode {
            Mode::Train => self.audited,
            Mode::Inference => self.other,
        }
    }

    /// The name of a call mode (`Train` is the audited one): "training" or "inference".
    pub(crate) fn name(&self, mode: Mode) -> &'static str {
        if mode.is_train() == self.audited_in.is_train() {
            "training"
        } else {
            "inference"
        }
    }

    /// Why `affected` of `compared` tokens changed in calls of `modes` is inconclusive: some
    /// of those modes is random, and the noisiest of them explains the change. `None`: the
    /// change stands (or nothing random was called).
    pub(crate) fn explains(&self, modes: &[Mode], affected: usize, compared: usize) -> Option<String> {
        let high = |&(_, (k, n)): &(Mode, (usize, usize))| wilson(k, n).1;
        let (mode, (k, n)) =
            (modes.iter().filter_map(|&m| Some((m, self.of_mode(m)?)))).max_by(|a, b| high(a).total_cmp(&high(b)))?;
        if exceeds(affected, compared, k, n) {
            return None;
        }
        let (here, there) = (percent(affected, compared), percent(k, n));
        Some(if mode.is_train() {
            format!("inconclusive: random router ({here:.1}% changed here, within D's {there:.1}% at 99.9% confidence)")
        } else {
            format!(
                "inconclusive: random in {} mode ({here:.1}% changed here, within the {there:.1}% that mode changes when the same call is routed twice, at 99.9% confidence)",
                self.name(mode)
            )
        })
    }

    /// Whether the router is random in training mode, and in inference mode.
    fn random_modes(&self) -> (bool, bool) {
        let (audited, other) = (self.audited.is_some(), self.other.is_some());
        if !self.audited_in.is_train() {
            (other, audited)
        } else {
            (audited, other)
        }
    }
}

/// The fix a random router's messages offer when nothing is known of the router (the report's
/// summary line): D's note has the one that fits it.
pub fn fix() -> String {
    "seed every request's random draws from the `seed` moe-audit/2 sends (D's note says which mode is random and what the router's adapter offers)".into()
}

/// The fix for a router random in (training, inference) mode, naming only what its adapter
/// offers (`seed_calls`, as its handshake declares it), for a router audited in `audited_in`
/// (audited in inference mode, auditing in inference mode is no advice).
pub(crate) fn fix_for(seed_calls: Option<bool>, (training, inference): (bool, bool), audited_in: Mode) -> String {
    let seed = match seed_calls {
        None => "seed every request's random draws from the `seed` moe-audit/2 sends".to_string(),
        Some(false) => {
            "seed every request (moe-audit/2 sends a `seed`; this adapter applies it, keyed per token, with seed_calls=True)"
                .into()
        }
        Some(true) => "seed_calls=True is on, yet the same call routes differently: some random draw does not come from the generator it seeds".into(),
    };
    match (training, inference, audited_in) {
        (true, false, Mode::Train) => format!(
            "random in training: {seed}, or audit in inference mode (S and M call training mode too: inconclusive there unless it is seeded)"
        ),
        (true, false, Mode::Inference) => format!("random in training: {seed}"),
        (false, _, _) => format!("random when serving: no random selection or sampling at inference, or {seed}"),
        (true, true, _) => format!("random in both modes: {seed}, or route without random selection or sampling"),
    }
}

/// The modes whose calls a probe compares (`Train`: the audited mode): M compares the two; S
/// judges its comparisons one by one itself (`probe/replay.rs`), each against its mode's noise.
fn modes_of(probe: Probe) -> &'static [Mode] {
    match probe {
        Probe::M => &[Mode::Train, Mode::Inference],
        _ => &[Mode::Train],
    }
}

/// Marks the findings of a router random in some mode: D's note says which mode and how much,
/// and every other leak within what the randomness of the modes it called explains becomes
/// [`Verdict::Inconclusive`] (a latent finding stands: randomness changes decisions, not the
/// capacity in force). Returns the fix (`seed_calls` as the router's adapter offers it),
/// which D's explanation carries when D leaks and D's note when it passes; `None` for a
/// deterministic router, whose findings are left as they are.
pub(crate) fn separate(findings: &mut [Finding], noise: &Noise, seed_calls: Option<bool>) -> Option<String> {
    if noise.audited.is_none() && noise.other.is_none() {
        return None;
    }
    let fix = fix_for(seed_calls, noise.random_modes(), noise.audited_in);
    let twice = |(k, n): (usize, usize)| {
        format!("{k} of {n} tokens ({:.1}%) route differently when the same call is routed twice", percent(k, n))
    };
    for f in findings {
        match f.probe {
            Probe::D => {
                let mut says = match noise.audited {
                    Some(d) => format!("random router (or one that every call changes): {}", twice(d)),
                    None => f.note.clone(),
                };
                if let Some(d) = noise.other {
                    let mode = noise.name(Mode::Inference);
                    says =
                        format!("{says}; in {mode} mode, {} (S and M weigh their {mode} calls against it)", twice(d));
                }
                f.note = match f.verdict {
                    Verdict::Leak => says,
                    _ => format!("{says}; fix: {fix}"),
                };
            }
            Probe::S => {}
            _ if f.verdict == Verdict::Leak => {
                if let Some(note) = noise.explains(modes_of(f.probe), f.affected, f.compared) {
                    f.verdict = Verdict::Inconclusive;
                    f.note = note;
                }
            }
            _ => {}
        }
    }
    Some(fix)
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
        separate(&mut findings, &Noise::default(), None);
        assert_eq!(findings, before);
        separate(&mut findings, &Noise { audited: Some((20, 64)), ..Noise::default() }, None);
        let verdicts: Vec<_> = findings.iter().map(|f| f.verdict).collect();
        assert_eq!(verdicts, [Verdict::Inconclusive, Verdict::Leak, Verdict::Leak]);
        assert!(findings[0].note.starts_with("inconclusive: random router"), "{}", findings[0].note);
        assert!(
            findings[2].note.starts_with("random router (or one that every call changes): 20 of 64"),
            "{}",
            findings[2].note
        );
    }

    #[test]
    fn a_mode_random_only_in_the_other_mode_makes_only_the_probes_calling_it_inconclusive() {
        // Audited in inference mode, random in training only (Mixtral's router jitter): P and F
        // call inference mode only and keep their leaks; M compares with training calls.
        let noise = Noise { other: Some((16, 64)), audited_in: Mode::Inference, ..Noise::default() };
        let leak = |probe| Finding {
            verdict: Verdict::Leak,
            affected: 21,
            compared: 64,
            rate: 21.0 / 64.0,
            ..Finding::empty(probe)
        };
        let mut findings = vec![leak(Probe::P), leak(Probe::M), Finding::empty(Probe::D)];
        separate(&mut findings, &noise, None);
        let verdicts: Vec<_> = findings.iter().map(|f| f.verdict).collect();
        assert_eq!(verdicts, [Verdict::Leak, Verdict::Inconclusive, Verdict::Pass]);
        assert!(
            findings[1].note.starts_with("inconclusive: random in training mode (32.8% changed here"),
            "{}",
            findings[1].note
        );
        let d = &findings[2].note;
        assert!(d.contains("; in training mode, 16 of 64 tokens (25.0%) route differently"), "{d}");
        assert!(
            d.ends_with(
                "; fix: random in training: seed every request's random draws from the `seed` moe-audit/2 sends"
            ),
            "{d}"
        );
        assert!(!d.contains("seed_calls") && !d.contains("inference mode"), "{d}");
    }

    #[test]
    fn the_fix_names_seed_calls_only_where_the_adapter_offers_it() {
        let training = (true, false);
        assert!(!fix_for(None, training, Mode::Train).contains("seed_calls"));
        assert!(fix_for(Some(false), training, Mode::Train).contains("with seed_calls=True"));
        assert!(fix_for(Some(true), training, Mode::Train).contains("seed_calls=True is on, yet"));
        assert!(fix_for(None, (false, true), Mode::Inference).starts_with("random when serving: no random selection"));
    }
}
