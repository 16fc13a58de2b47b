//! The probes (docs/PROPERTIES.md, "Probes"). Each file owns one probe's rule ([`Rule`]): the cases it builds
//! on logits, how it changes the layer sample, and how its witness replays. The `probes!` table
//! below is the registry: adding a probe is its file plus one entry there.
//!
//! Random changes rarely make a capacity bind, so every probe that can also makes *targeted*
//! changes: later or neighbouring tokens pushed hard toward the experts a token uses.

use super::case::{Affected, Call, Case};
use super::layer_check::{Sample, SampleCase, SampleInput};
use super::repeats::Repeats;
use super::tally::{pick_witness_token, witness_hit, Tally};
use super::witness::{self, Replayer, Witness};
use super::{AuditOptions, Finding, Property, Verdict};
use crate::hints::HintsOf;
use crate::mode::Mode;
use candle_core::{Device, Tensor};
use moe_audit_core::error::{Error, Result};
use moe_audit_core::layer::Seeded;
use moe_audit_core::router::{logits_to_host, Router};
use moe_audit_core::routing::Routing;
use moe_audit_core::text;
use ndarray::{s, Array2, Array3, Axis};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;

mod future;
mod layout;
mod mode;
mod neighbour;
pub mod numerics;
mod prefix;
mod rebatch;
mod repeat;
mod replay;

/// The audits a probe serves (flags of a registry entry).
mod serves {
    /// A router audit runs it by default.
    pub const ROUTER: u8 = 1;
    /// A router audit runs it when asked (`--probes`).
    pub(crate) const OPT_IN: u8 = 2;
    /// A whole-model audit runs it (its cases: `model/audit/plan.rs`).
    pub const MODEL: u8 = 4;
}

/// One probe as the registry describes it.
#[derive(Debug, Clone, Copy)]
struct Entry {
    probe: Probe,
    name: &'static str,
    property: Property,
    serves: u8,
    /// What the help text adds after the name (opt-in probes).
    note: &'static str,
}

/// The registry: the [`Probe`] enum (report order, serde names), each probe's long name,
/// property, the audits it serves, and its router [`Rule`]. Every list of probes (the defaults,
/// the names `--probes` accepts, the help text, a whole model's probes) is read from here. Entry
/// order is the report order and seeds the probes' random streams, so new entries go last.
macro_rules! probes {
    ( $(
        $(#[doc = $doc:literal])*
        $letter:ident $name:literal $property:ident [$($serves:ident)|+] $(($note:literal))? $(=> $module:ident::$rule:ident)?,
    )* ) => {
        /// A probe: one way of changing the input that must not change a token's routing.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        pub enum Probe {
            $( $(#[doc = $doc])* $letter, )*
        }

        const REGISTRY: &[Entry] = &[$(
            Entry {
                probe: Probe::$letter,
                name: $name,
                property: Property::$property,
                serves: 0 $(| serves::$serves)+,
                note: probes!(@note $($note)?),
            },
        )*];

        impl Probe {
            /// What the probe does to a router, in its own file; `None` for a probe of whole
            /// models only.
            fn router_rule(self) -> Option<&'static dyn Rule> {
                match self {
                    $( Probe::$letter => probes!(@rule $($module::$rule)?), )*
                }
            }
        }
    };
    (@note) => { "" };
    (@note $note:literal) => { $note };
    (@rule) => { None };
    (@rule $module:ident::$rule:ident) => { Some(&$module::$rule) };
}

probes! {
    /// Prefix: truncate after t.
    P "prefix" CLength [ROUTER | MODEL] => prefix::Prefix,
    /// Future: change tokens after t.
    F "future" CContent [ROUTER | MODEL] => future::Future,
    /// Neighbour: change another sequence.
    N "neighbour" B [ROUTER | MODEL] => neighbour::Neighbour,
    /// Re-batch: permute, resize, pad.
    R "re-batch" B [ROUTER | MODEL] => rebatch::Rebatch,
    /// Repeat: the same call twice.
    D "repeat" D [ROUTER | MODEL] => repeat::Repeat,
    /// Replay: the same call after a different call.
    S "replay" S [ROUTER | MODEL] => replay::Replay,
    /// Mode: training versus inference configuration.
    M "mode" TI [ROUTER | MODEL] => mode::Mode,
    /// Layout: 1 versus R expert-parallel ranks, `[S,B]` versus `[B,S]` flattening.
    L "layout" L [ROUTER] => layout::Layout,
    /// Numerics: routing in bf16/f16 versus f32, and low-precision accumulation (off by default).
    X "numerics" TI [OPT_IN] ("bf16/f16 routing flips, accumulator swamping") => numerics::NumericsProbe,
    /// Generation (whole models): the generation path (prefill, then one token at a time
    /// through the KV cache) against one full forward.
    G "generation" TI [MODEL],
}

/// How many registry entries have any of the `serves` flags.
const fn count(flags: u8) -> usize {
    let (mut i, mut n) = (0, 0);
    while i < REGISTRY.len() {
        if REGISTRY[i].serves & flags != 0 {
            n += 1;
        }
        i += 1;
    }
    n
}

/// The probes with any of the `serves` flags, in registry order.
const fn select<const N: usize>(flags: u8) -> [Probe; N] {
    let mut out = [Probe::P; N];
    let (mut i, mut n) = (0, 0);
    while i < REGISTRY.len() {
        if REGISTRY[i].serves & flags != 0 {
            out[n] = REGISTRY[i].probe;
            n += 1;
        }
        i += 1;
    }
    out
}

/// Which audit a list of probes is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Audit {
    /// A router (a layer, or a router outside moe-audit).
    Router,
    /// A whole model answering token ids.
    Model,
}

/// Where a router's two modes come from, for the words of M's calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Modes {
    /// A configuration: its training rule and its `[inference]` table.
    Config,
    /// A router outside moe-audit, audited in this mode (`check --mode`); M calls the other second.
    External(Mode),
}

/// One probe's rule: what it changes, on logits and in the layer sample, and how its witness
/// replays.
pub(crate) trait Rule: Sync {
    /// The two calls the probe compares, in words, reference first: sized from the witness when
    /// there is one; `modes`: where the router's training and serving modes come from.
    fn calls(&self, w: Option<&Witness>, options: &AuditOptions, modes: Modes) -> [String; 2];

    /// Where a leak's cause was, in words.
    fn cause(&self, f: &Finding) -> String;

    /// How to fix a leak when that does not depend on the router's design; `None`: the design
    /// family's fix (`analyze/explain.rs`).
    fn fix(&self) -> Option<String> {
        None
    }

    /// Runs the probe on the audit's base call: its finding, with a witness when it leaks.
    /// `sample` is the layer sample, when a layer is audited (the layout probe runs it
    /// expert-parallel); it stays out of [`Ctx`], which cases share across threads.
    fn run(&self, ctx: &Ctx, sample: Option<&Sample>) -> Result<Finding>;

    /// The layer sample changed as the probe prescribes; `None`: the layer is not sampled.
    fn sample(&self, input: &SampleInput) -> Result<Option<SampleCase>> {
        let _ = input;
        Ok(None)
    }

    /// Whether a case's call `b` is a changed copy of call `a` (its tokens aligned with a's, its
    /// changed rows revertible); `false` when `b` is only another call (D, S, M).
    fn changes_input(&self) -> bool {
        true
    }

    /// The two routings a witness compares, from the witness's own router config or the live
    /// router; `modes` are the witness's calls' modes (S: around a call of the other mode).
    fn replay(&self, with: &dyn Replayer, a: &Call, b: &Call, modes: (Mode, Mode)) -> Result<(Routing, Routing)> {
        let _ = modes;
        if !with.concurrent() {
            return Ok((with.route(a, Mode::Train)?, with.route(b, Mode::Train)?));
        }
        // Shrinking is sequential and most of a leaking probe's time at long sequences: the two
        // sides route on two threads (a config's routing is a pure function).
        let (ra, rb) = rayon::join(|| with.route(a, Mode::Train), || with.route(b, Mode::Train));
        Ok((ra?, rb?))
    }
}

impl Probe {
    /// The default probes of a router audit, in report order (the opt-in ones are left out).
    pub const DEFAULT: &'static [Probe] = &select::<{ count(serves::ROUTER) }>(serves::ROUTER);
    /// The old name of [`Probe::DEFAULT`]: not every probe (X is opt-in), the defaults.
    #[deprecated(since = "0.3.0", note = "the default probes: use `Probe::DEFAULT`")]
    pub const ALL: &'static [Probe] = Probe::DEFAULT;
    /// Every probe a router audit knows, in report order.
    pub const KNOWN: &'static [Probe] =
        &select::<{ count(serves::ROUTER | serves::OPT_IN) }>(serves::ROUTER | serves::OPT_IN);
    /// Every probe of a whole-model audit (its default), in report order.
    pub const MODEL: &'static [Probe] = &select::<{ count(serves::MODEL) }>(serves::MODEL);

    /// What the probe does to a router. Router audits run router probes only: the lists they
    /// take are checked ([`Probe::check_router`]).
    pub(crate) fn rule(self) -> &'static dyn Rule {
        self.router_rule().expect("a router audit runs router probes only")
    }

    /// `Ok` when a router audit knows the probe.
    pub(crate) fn check_router(self) -> std::result::Result<(), String> {
        match self.router_rule() {
            Some(_) => Ok(()),
            None => Err(format!("probe {self} ({}) audits whole models, not routers", self.name())),
        }
    }

    fn entry(self) -> &'static Entry {
        REGISTRY.iter().find(|e| e.probe == self).expect("every probe has an entry")
    }

    /// The property the probe tests.
    pub fn property(self) -> Property {
        self.entry().property
    }

    /// Its long name.
    pub fn name(self) -> &'static str {
        self.entry().name
    }

    /// The probes `audit` knows.
    pub fn known(audit: Audit) -> &'static [Probe] {
        match audit {
            Audit::Router => Probe::KNOWN,
            Audit::Model => Probe::MODEL,
        }
    }

    /// The default probes as a comma-separated list (`P,F,N,R,D,S,M,L`): the probe flags'
    /// default.
    pub fn default_list() -> String {
        Probe::DEFAULT.iter().map(Probe::to_string).collect::<Vec<_>>().join(",")
    }

    /// The `--probes` help of `audit`: every probe it runs by default, named, then (a router's)
    /// the opt-in ones with their note.
    pub fn help(audit: Audit) -> String {
        let named = |p: &Probe| format!("{p} {}", p.name());
        let (defaults, known) = match audit {
            Audit::Router => (Probe::DEFAULT, Probe::KNOWN),
            Audit::Model => (Probe::MODEL, Probe::MODEL),
        };
        let list: Vec<String> = defaults.iter().map(named).collect();
        let mut help = format!("Probes to run, comma separated: {}", list.join(", "));
        let opt_in: Vec<String> = known
            .iter()
            .filter(|p| !defaults.contains(p))
            .map(|p| format!("{} ({})", named(p), p.entry().note))
            .collect();
        if !opt_in.is_empty() {
            help += &format!("; {} is opt-in", opt_in.join(", "));
        }
        help
    }

    /// Parses a comma-separated list such as `P,F,N` of the probes a router audit knows:
    /// sorted, without repeats.
    pub fn parse_list(list: &str) -> Result<Vec<Probe>> {
        Probe::parse_list_for(list, Audit::Router)
    }

    /// [`Probe::parse_list`] for `audit`: a letter it does not know is refused.
    pub fn parse_list_for(list: &str, audit: Audit) -> Result<Vec<Probe>> {
        let known = Probe::known(audit);
        let letters = || known.iter().map(Probe::to_string).collect::<Vec<_>>().join(",");
        let mut probes = Vec::new();
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let probe = known.iter().copied().find(|p| p.to_string().eq_ignore_ascii_case(item));
            let Some(probe) = probe else {
                let (setting, item) = (crate::settings::PROBES, moe_audit_core::error::excerpt(item));
                return Err(Error::usage(match audit {
                    Audit::Router => {
                        text!(setting, format!(": unknown probe `{item}`, expected some of {}", letters()))
                    }
                    Audit::Model => {
                        text!(
                            setting,
                            format!(": unknown probe `{item}` for a whole model: expected letters of {}", letters())
                        )
                    }
                }));
            };
            if !probes.contains(&probe) {
                probes.push(probe);
            }
        }
        if probes.is_empty() {
            let setting = crate::settings::PROBES;
            return Err(Error::usage(match audit {
                Audit::Router => text!(setting, ": no probe given"),
                Audit::Model => text!(setting, " is empty: an audit that runs no probe cannot pass"),
            }));
        }
        probes.sort();
        Ok(probes)
    }
}

impl fmt::Display for Probe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

/// Logit given to the targeted expert of a crafted token (the others get 0): strong enough to win
/// every gate comparison (softmax gate ≈ 0.999 over 8 experts).
pub(crate) const TARGET_LOGIT: f32 = 8.0;

/// What the probes share: the router, the base call and its routing, seeded randomness, and
/// what the layout probe runs on.
pub(crate) struct Ctx<'a> {
    pub router: &'a dyn Router,
    pub base: Arc<Call>,
    pub base_routing: Routing,
    pub trials: usize,
    pub seed: u64,
    /// Whether cases may run in parallel (see `looks_pure`).
    pub pure: bool,
    /// The hidden states behind `base`, for a router with a score stage.
    pub hidden: Option<Tensor>,
    /// Expert-parallel ranks the layout probe compares with one.
    pub ranks: usize,
    /// The same layer launched at other expert-parallel sizes, which L compares with it.
    pub layouts: &'a [super::Launch<'a>],
    /// Whether P routes every prefix instead of searching them (`AuditOptions::exhaustive`).
    pub exhaustive: bool,
    /// The audit's first calls (D and S read them), made once the context exists.
    pub repeats: Option<Repeats>,
    /// Told the cases planned and done.
    pub progress: &'a dyn crate::progress::Progress,
}

impl Ctx<'_> {
    /// The audit's first calls.
    pub fn repeats(&self) -> &Repeats {
        self.repeats.as_ref().expect("made before any probe runs")
    }

    /// The random stream of `probe`.
    pub fn rng(&self, probe: Probe) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(self.seed ^ (crate::seeds::PROBE + probe as u64))
    }

    /// Width of an input row: E logits, or H hidden values (see [`moe_audit_core::router::Hints::row_width`]).
    pub fn width(&self) -> usize {
        self.router.row_width()
    }

    /// `n` fresh token rows from the same distribution as the base call: seeded hidden states
    /// through the router's score stage, or standard-normal logits for a logits-only router.
    pub fn fresh(&self, n: usize, rng: &mut ChaCha8Rng) -> Result<Array2<f32>> {
        self.fresh_from(n, rng.random())
    }

    /// [`Ctx::fresh`] from the seed it draws, so that trials can draw their seeds in order and
    /// their rows in parallel (at H = 512 the seeded normals are most of what F and N build).
    fn fresh_from(&self, n: usize, seed: u64) -> Result<Array2<f32>> {
        let mut seeded = Seeded::new(seed);
        let logits = match self.router.hidden_size() {
            Some(h) => logits_to_host(&self.router.scores(&hidden_states(self.router, (1, n), h, seed)?)?)?,
            None => {
                let t = seeded.normal(&[1, n, self.width()], &Device::Cpu)?;
                Array3::from_shape_vec((1, n, self.width()), t.flatten_all()?.to_vec1()?).expect("shape")
            }
        };
        Ok(logits.index_axis_move(Axis(0), 0))
    }

    /// `n` copies of a crafted token row that wants expert `e` above all others.
    pub(crate) fn targeted_rows(&self, n: usize, e: usize) -> Array2<f32> {
        let row = self.router.targeted_row(e).unwrap_or_else(|| {
            let mut row = vec![0.0; self.width()];
            row[e] = TARGET_LOGIT;
            row
        });
        Array2::from_shape_fn((n, self.width()), |(_, j)| row[j])
    }

    /// The expert a token is pushed toward in trial `trial`: its routes in turn (1st choice, 2nd
    /// choice, ...), or its strongest logit when it has no route (expert choice); for a router
    /// fed hidden rows (no logits to read), the experts in turn.
    pub(crate) fn target_of(&self, batch: usize, pos: usize, trial: usize) -> usize {
        let routes = &self.base_routing.token(batch, pos).routes;
        let real: Vec<usize> = routes.iter().filter(|r| !r.padded).map(|r| r.expert).collect();
        let experts = self.router.experts();
        if real.is_empty() && self.width() != experts {
            (pos + trial) % experts.max(1)
        } else if real.is_empty() {
            let row = self.base.logits.slice(s![batch, pos, ..]);
            moe_audit_core::routing::scores::top_k(row.as_slice().expect("contiguous row"), 1)[0]
        } else {
            real[trial % real.len()]
        }
    }
}

/// A trial's new rows (F and N): fresh from a seed, or targeted at the experts of token
/// (batch, pos).
#[derive(Clone, Copy)]
enum Rows {
    Fresh(u64),
    Toward(usize, usize),
}

impl Rows {
    fn make(self, ctx: &Ctx, n: usize, trial: usize) -> Result<Array2<f32>> {
        match self {
            Rows::Fresh(seed) => ctx.fresh_from(n, seed),
            Rows::Toward(batch, pos) => Ok(ctx.targeted_rows(n, ctx.target_of(batch, pos, trial / 2))),
        }
    }
}

/// The call S makes in between: fresh rows of the base call's sizes (at least 2 positions).
pub(crate) fn other_call(ctx: &Ctx) -> Result<Call> {
    let (b, s) = ctx.base.dims();
    let mut rng = ChaCha8Rng::seed_from_u64(ctx.seed ^ crate::seeds::REPLAY_OTHER_CALL);
    let rows = ctx.fresh(s.max(2) * b, &mut rng)?;
    Ok(Call::new(rows.into_shape_with_order((b, s.max(2), ctx.width())).expect("shape")))
}

/// Hidden states `[batch, seq_len, h]` from `seed`: the router's own draw, or standard normal.
pub(crate) fn hidden_states(router: &dyn Router, (b, s): (usize, usize), h: usize, seed: u64) -> Result<Tensor> {
    match router.draw_hidden((b, s), seed)? {
        Some(x) => Ok(x),
        None => Seeded::new(seed).normal(&[b, s, h], &Device::Cpu),
    }
}

/// A probe's cases: built up front, or made on demand one index at a time (P: one per position;
/// F and N: one per trial), so memory stays O(T·E) whatever their number.
pub(crate) enum Cases<'a> {
    /// `count` cases, case `i` made by the function when needed.
    OnDemand(usize, &'a (dyn Fn(usize) -> Result<Case> + Sync)),
    /// Cases built up front.
    Built(Vec<Case>),
}

impl<'a> Cases<'a> {
    /// The cases of `count` trials, each made by `make` from its plan (the trials' random choices
    /// drawn in order beforehand): on demand for a router that looks pure (each worker holds the
    /// case it routes; a case is made again for its witness), else every case up front, in trial
    /// order, so a stateful router sees every case's score calls before any routing, as always.
    fn of_trials(ctx: &Ctx, count: usize, make: &'a (dyn Fn(usize) -> Result<Case> + Sync)) -> Result<Self> {
        if ctx.pure {
            return Ok(Cases::OnDemand(count, make));
        }
        (0..count).map(make).collect::<Result<_>>().map(Cases::Built)
    }

    fn len(&self) -> usize {
        match self {
            Cases::OnDemand(count, _) => *count,
            Cases::Built(cases) => cases.len(),
        }
    }

    fn get(&self, i: usize) -> Result<std::borrow::Cow<'_, Case>> {
        Ok(match self {
            Cases::OnDemand(_, make) => std::borrow::Cow::Owned(make(i)?),
            Cases::Built(cases) => std::borrow::Cow::Borrowed(&cases[i]),
        })
    }
}

/// What one case showed: its tally, and its witness token with (for a router without a config)
/// the routing of its call `b`.
type CaseSeen = (Tally, Option<(Affected, Option<Routing>)>);

/// Runs every case of `probe` and folds them into its finding; `not_applicable` is the note
/// when there are none. Cases are independent, so they run in parallel for a router that looks
/// pure; a stateful one sees its calls in case order, so the audit stays deterministic either way.
fn run_cases(ctx: &Ctx, probe: Probe, cases: Cases, not_applicable: &str) -> Result<Finding> {
    let mut finding = Finding::empty(probe);
    let count = cases.len();
    if count == 0 {
        finding.verdict = Verdict::NotApplicable;
        finding.note = not_applicable.into();
        return Ok(finding);
    }
    let (router, base_routing) = (ctx.router, &ctx.base_routing);
    // The first leaking case keeps its routing when the router has no config: its witness is
    // the calls as routed (routing them again would be another call to a stateful router).
    let keep = router.config().is_none();
    ctx.progress.plan(count);
    let run = |i: usize| -> Result<CaseSeen> {
        let case = cases.get(i)?;
        let routed = case.b.routes(router)?;
        let outcome = case.outcome(base_routing, &routed);
        ctx.progress.done(1);
        Ok((Tally::of(&outcome), pick_witness_token(&outcome).map(|hit| (hit, keep.then_some(routed)))))
    };
    let mut tally = Tally::default();
    let mut first_leak = None;
    let mut fold = |i: usize, result: Result<CaseSeen>| -> Result<()> {
        let (t, hit) = result?;
        tally.merge(&t);
        first_leak = witness_hit(first_leak.take(), hit.map(|hit| (i, hit)), |(_, (hit, _))| hit);
        Ok(())
    };
    if ctx.pure {
        let results: Vec<_> = (0..count).into_par_iter().map(run).collect();
        results.into_iter().enumerate().try_for_each(|(i, r)| fold(i, r))?;
    } else {
        (0..count).try_for_each(|i| fold(i, run(i)))?;
    }
    finding.note = crate::analyze::explain::plural(count, "case");
    tally.finish(&mut finding);
    if let Some((i, (hit, routed))) = first_leak {
        let case = cases.get(i)?;
        let routed = routed.as_ref().unwrap_or(base_routing);
        let modes = (Mode::Train, Mode::Train);
        let routed = Some((base_routing, routed));
        finding.witness = witness::build_routed(ctx.router, probe, &case, (hit.batch, hit.pos), routed, modes)?;
    }
    Ok(finding)
}

/// D and M: one case, the base call routed twice (`reference` and `again`, in `modes`); its
/// `b` is the call a witness stores beside the base call.
fn run_repeat(
    ctx: &Ctx,
    probe: Probe,
    case: &Case,
    (reference, again): (&Routing, &Routing),
    modes: (Mode, Mode),
    note: &str,
) -> Result<Finding> {
    let mut finding = Finding::empty(probe);
    let outcome = case.outcome(reference, again);
    Tally::of(&outcome).finish(&mut finding);
    finding.note = note.into();
    if let Some(hit) = pick_witness_token(&outcome) {
        let routed = Some((reference, again));
        finding.witness = witness::build_routed(ctx.router, probe, case, (hit.batch, hit.pos), routed, modes)?;
    }
    Ok(finding)
}
