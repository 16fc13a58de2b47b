//! Replaying a witness: routing its two calls again, as the probe that found it prescribes, and
//! judging the token by the audit's own rule, so a witness replays with its audit's verdict.
//!
//! What routes the calls is a `Replayer`: the witness's router config (pure, from the file
//! alone), or a live router for a witness of a router outside moe-audit (`replay W
//! --router-cmd CMD`). Shrinking replays each candidate pair through the same `replay_pair`, so
//! what shrinking keeps is what a replay sees.

use super::{load, Witness};
use crate::analyze::case::Call;
use crate::analyze::{Probe, Verdict};
use crate::hints::HintsOf;
use crate::mode::Mode;
use moe_audit_core::config::RouterConfig;
use moe_audit_core::error::{excerpt, excerpt_long, Error, Result};
use moe_audit_core::router::Router;
use moe_audit_core::routing::{assign_routes, capacity_of, diff_token, Routing, TokenDiff, TokenRouting};
use moe_audit_core::text;
use std::path::Path;

/// A case reduced to one token, the unit that shrinking works on and a replay routes.
#[derive(Debug, Clone)]
pub(super) struct Pair {
    pub(super) a: Call,
    pub(super) b: Call,
    pub(super) seq_map: Vec<Option<usize>>,
    pub(super) offset: usize,
    pub(super) token: (usize, usize),
}

impl Pair {
    pub(super) fn token_b(&self) -> Option<(usize, usize)> {
        self.seq_map[self.token.0].map(|j| (j, self.token.1 + self.offset))
    }
}

/// Routes `call` under `config` for a comparison (routes only).
fn route_with(config: &RouterConfig, call: &Call) -> Result<Routing> {
    assign_routes(config, call.logits.view(), call.padding.as_ref().map(|m| m.view()))
}

/// What routes a witness's calls: its router config, or a live router.
pub(crate) trait Replayer: Sync {
    /// The routing of `call` in `mode`, for a comparison.
    fn route(&self, call: &Call, mode: Mode) -> Result<Routing>;
    /// Whether two calls may be routed at once (a config's routing is a pure function).
    fn concurrent(&self) -> bool;
}

impl Replayer for RouterConfig {
    fn route(&self, call: &Call, mode: Mode) -> Result<Routing> {
        match mode {
            Mode::Train => route_with(self, call),
            Mode::Inference => {
                let inference = self
                    .inference_config()?
                    .ok_or_else(|| Error::invalid("an inference-mode witness needs an [inference] table"))?;
                route_with(&inference, call)
            }
        }
    }

    fn concurrent(&self) -> bool {
        true
    }
}

/// A live router (an external one, for `replay W --router-cmd CMD`).
struct Live<'a>(&'a dyn Router);

impl Replayer for Live<'_> {
    fn route(&self, call: &Call, mode: Mode) -> Result<Routing> {
        match mode {
            Mode::Train => call.routes(self.0),
            Mode::Inference => match self.0.inference()? {
                Some(inference) => call.routes(inference.as_ref()),
                None => Err(Error::usage(format!("router `{}` has no inference mode", self.0.name()))),
            },
        }
    }

    fn concurrent(&self) -> bool {
        self.0.concurrent()
    }
}

/// Routes both sides as `probe` prescribes and diffs the token.
pub(super) fn replay_pair(
    with: &dyn Replayer,
    probe: Probe,
    pair: &Pair,
    modes: (Mode, Mode),
) -> Result<(Routing, Routing, TokenDiff)> {
    let Some(tb) = pair.token_b() else {
        return Err(Error::invalid("witness token has no counterpart in call b"));
    };
    let (ra, rb) = probe.rule().replay(with, &pair.a, &pair.b, modes)?;
    let diff = diff_token(&ra, pair.token, &rb, tb);
    Ok((ra, rb, diff))
}

/// The outcome of replaying a witness.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayOutcome {
    /// The witness as read.
    pub witness: Witness,
    /// What differs now (nothing: the leak no longer reproduces).
    pub diff: TokenDiff,
    /// The token's routing in the reference run now.
    pub before: TokenRouting,
    /// The token's routing in the changed run now.
    pub after: TokenRouting,
    /// The capacity in force for the token in each run now (its own, else its group's).
    pub capacity: (Option<usize>, Option<usize>),
}

/// The outcome of replaying a witness, under its name before 0.3.0.
#[deprecated(since = "0.3.0", note = "renamed `ReplayOutcome` (`Replay` named three things)")]
pub type Replay = ReplayOutcome;

impl ReplayOutcome {
    /// Whether the witness's change reproduces, judged by the audit's rule
    /// ([`TokenDiff::any`]): a changed decision, or the capacity in force alone.
    pub fn reproduces(&self) -> bool {
        self.diff.any()
    }

    /// The verdict the replay shows, as the audit's probe would give it: X's change is drift,
    /// a changed decision a leak, the capacity in force alone latent; nothing changed a pass.
    pub fn verdict(&self) -> Verdict {
        match (self.diff.any(), self.diff.decision()) {
            (false, _) => Verdict::Pass,
            _ if self.witness.probe == Probe::X => Verdict::Drift,
            (true, true) => Verdict::Leak,
            (true, false) => Verdict::Latent,
        }
    }
}

impl Witness {
    /// Replays the witness from its own contents (a witness with a router config).
    pub fn replay(self, path: &Path) -> Result<ReplayOutcome> {
        let Some(config) = self.router.clone() else {
            return Err(Error::usage(text!(
                format!(
                    "{}: the witness is of router `{}` outside moe-audit: replay it with ",
                    path.display(),
                    excerpt(self.name().unwrap_or_default())
                ),
                crate::settings::ROUTER_CMD
            )));
        };
        self.replay_with(path, &config, None, config.experts)
    }

    /// Replays the witness against a live router, which must introduce itself as the witness's
    /// handshake says (name, experts, top-k, input and hidden size; the protocol may differ).
    /// A witness of L across launches routes call `b` on `layout`, the other launch, which
    /// must introduce itself as the witness's `layout` says; any other witness takes none.
    pub fn replay_on(self, path: &Path, router: &dyn Router, layout: Option<&dyn Router>) -> Result<ReplayOutcome> {
        let Some(stored) = &self.handshake else {
            return Err(Error::usage(text!(
                format!("{}: the witness holds a router config: replay it without ", path.display()),
                crate::settings::ROUTER_CMD
            )));
        };
        same_router(path, stored, router, "router")?;
        match (&self.layout, layout) {
            (Some(stored), Some(layout)) => same_router(path, &stored.handshake, layout, "layout launch")?,
            (Some(stored), None) => {
                return Err(Error::usage(text!(
                    format!(
                        "{}: the witness compares router `{}` with another launch of it: replay it with ",
                        path.display(),
                        excerpt(self.name().unwrap_or_default())
                    ),
                    crate::settings::LAYOUT_CMD,
                    format!(" {}", excerpt_long(serde_json::Value::from(stored.command.as_str())))
                )))
            }
            (None, Some(_)) => {
                return Err(Error::usage(text!(
                    format!(
                        "{}: the witness compares no other launch of the layer: replay it without ",
                        path.display()
                    ),
                    crate::settings::LAYOUT_CMD
                )))
            }
            (None, None) => {}
        }
        let layout = layout.map(Live);
        self.replay_with(path, &Live(router), layout.as_ref().map(|l| l as &dyn Replayer), router.row_width())
    }

    /// Replays with `with` (and call `b` with `with_b`, another launch, when given), the calls'
    /// rows `width` wide.
    fn replay_with(
        mut self,
        path: &Path,
        with: &dyn Replayer,
        with_b: Option<&dyn Replayer>,
        width: usize,
    ) -> Result<ReplayOutcome> {
        let (a, b) = (load(&self.a, "a", path)?, load(&self.b, "b", path)?);
        if a.logits.dim().2 != width || b.logits.dim().2 != width {
            return Err(Error::input(
                path,
                format!("the calls' rows hold {} values, the router takes {width}", a.logits.dim().2),
            ));
        }
        let (ta, tb) = ((self.token_a.batch, self.token_a.pos), (self.token_b.batch, self.token_b.pos));
        let (ba, sa) = a.dims();
        let (bb, sb) = b.dims();
        let changes_input = self.probe.rule().changes_input();
        if ta.0 >= ba || ta.1 >= sa || (changes_input && (tb.0 >= bb || tb.1 >= sb)) {
            return Err(Error::input(path, "the witness token lies outside its calls".to_string()));
        }
        let mut seq_map = vec![None; ba];
        seq_map[ta.0] = Some(if changes_input { tb.0 } else { ta.0 });
        let offset = if changes_input {
            tb.1.checked_sub(ta.1).ok_or_else(|| Error::input(path, "token_b lies before token_a".to_string()))?
        } else {
            0
        };
        // Last of the checks, so that each edit above gets its own message.
        let stored = std::mem::take(&mut self.sha256);
        if stored != self.content_hash()? {
            return Err(Error::input(
                path,
                text!(
                    "the content does not match its `sha256` (edited or corrupted): write the witness again with ",
                    crate::settings::WITNESS_DIR
                ),
            ));
        }
        self.sha256 = stored;
        let pair = Pair { a, b, seq_map, offset, token: ta };
        let tb = pair.token_b().expect("mapped");
        let (ra, rb, diff) = match with_b {
            // Two launches: each side on its own; the probe's rule has nothing else to say.
            Some(with_b) => {
                let (ra, rb) = (with.route(&pair.a, self.a_mode)?, with_b.route(&pair.b, self.b_mode)?);
                let diff = diff_token(&ra, ta, &rb, tb);
                (ra, rb, diff)
            }
            None => replay_pair(with, self.probe, &pair, (self.a_mode, self.b_mode))?,
        };
        let (before, after) = (ra.token(ta.0, ta.1).clone(), rb.token(tb.0, tb.1).clone());
        let capacity = (capacity_of(&ra, &before), capacity_of(&rb, &after));
        Ok(ReplayOutcome { before, after, capacity, diff, witness: self })
    }
}

/// Whether `live` introduces itself as the `stored` handshake says (name, experts, top-k, input
/// and hidden size; the protocol may differ); `what` names it in the error.
fn same_router(path: &Path, stored: &serde_json::Value, live: &dyn Router, what: &str) -> Result<()> {
    let live = live.handshake().unwrap_or_default();
    let same = ["name", "experts", "top_k", "input", "hidden_size"]
        .iter()
        .all(|k| stored.get(k).filter(|v| !v.is_null()) == live.get(k).filter(|v| !v.is_null()));
    if same {
        return Ok(());
    }
    Err(Error::input(
        path,
        format!(
            "the witness's {what} is {}, the command's {what} is {}: not the same {what}",
            excerpt_long(stored),
            excerpt_long(&live)
        ),
    ))
}
