//! Running the scripts against the server(s) and comparing each pairing's rows, per axis, with
//! the records crate's comparison (the same measures as `routes compare`).

use crate::plan::{scripts, Axis, Pairing, Prompt, Script, Settings};
use crate::server::{Reply, Request, Server, ServerInfo};
use crate::EngineError;
use bytes::Bytes;
use moe_audit_records::{compare, expert_set, from_ids, shared_experts, Budget, CompareOptions, Comparison, IdArray};
use serde::Serialize;
use std::ops::Range;

/// Changed decisions listed per axis (the rest are counted).
pub(crate) const CHANGES_SHOWN: usize = 20;

/// One (position, layer) decision whose expert set changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Change {
    /// The probe.
    pub probe: usize,
    /// The token position in the sequence.
    pub position: usize,
    /// The layer index.
    pub layer: usize,
    /// The reference's experts, sorted.
    pub a: Vec<i32>,
    /// The other side's experts, sorted.
    pub b: Vec<i32>,
}

/// Two replies whose generated tokens differ: rows from that position on route other inputs
/// and are not compared.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Divergence {
    /// The probe.
    pub probe: usize,
    /// The first position whose token differs.
    pub position: usize,
}

/// What one axis found.
#[derive(Debug, Clone, Serialize)]
pub struct AxisReport {
    /// The axis.
    pub axis: Axis,
    /// Pairs of replies compared.
    pub pairs: usize,
    /// (token, layer) decisions compared.
    pub decisions: usize,
    /// Decisions whose expert set changed.
    pub changed: usize,
    /// Of those, changes of one expert of the top-k (a k-th/(k+1)-th swap: what a near-tie
    /// looks like; the engine returns no router logits to tell).
    pub one_slot: usize,
    /// The first changed decisions, in probe and position order.
    pub changes: Vec<Change>,
    /// Pairs whose generated tokens differ.
    pub diverged: Vec<Divergence>,
    /// Prompt tokens served from the cache, per pair, when the server says (cache and stale).
    pub cached: Vec<Option<usize>>,
    /// Whether the user requires this axis to hold.
    pub must_hold: bool,
    /// The records comparison of the axis's rows (per layer, lanes, diagnoses).
    pub comparison: Option<Comparison>,
    /// The script of the first pair that changed: replayed by `moe-audit replay`.
    #[serde(skip)]
    pub witness: Option<Script>,
}

impl AxisReport {
    /// Whether every compared decision and token held.
    pub fn held(&self) -> bool {
        self.changed == 0 && self.diverged.is_empty()
    }

    /// Share of decisions that changed.
    pub fn share(&self) -> f64 {
        if self.decisions == 0 {
            0.0
        } else {
            self.changed as f64 / self.decisions as f64
        }
    }
}

/// The audit of a server.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The audited server.
    pub server: ServerInfo,
    /// The second server, when given.
    pub against: Option<ServerInfo>,
    /// The settings.
    pub settings: Settings,
    /// Requests sent.
    pub requests: usize,
    /// Per axis run.
    pub axes: Vec<AxisReport>,
    /// Whether an axis that must hold changed.
    pub failed: bool,
}

/// How an audit runs.
#[derive(Debug, Clone)]
pub struct Run<'a> {
    /// The audited server, then `--against`'s.
    pub servers: Vec<&'a Server>,
    /// Prefix of every salt: a new one per run keeps one run's cache entries from another's.
    pub run_id: String,
    /// The axes that must hold.
    pub must_hold: Vec<Axis>,
    /// Memory for the comparisons.
    pub memory: moe_audit_core::MemoryBudget,
}

/// Audits the server(s) of `run` with `settings`; `progress` hears each request sent.
pub fn audit(run: &Run, settings: &Settings, progress: &(dyn Fn(usize, usize) + Sync)) -> Result<Report, EngineError> {
    settings.check(run.servers.len() > 1)?;
    for server in &run.servers {
        if let Some(max) = server.info.settings.get("max_model_len").and_then(|m| m.parse::<usize>().ok()) {
            if settings.longest() > max {
                return Err(EngineError::Settings {
                    why: format!(
                        "requests of up to {} tokens do not fit the context of {} ({max}): shorten the prompts",
                        settings.longest(),
                        server.url()
                    ),
                });
            }
        }
    }
    let scripts = scripts(settings);
    let total: usize = scripts.iter().map(Script::requests).sum();
    let mut sent = 0;
    let mut replies = Vec::with_capacity(scripts.len());
    for script in &scripts {
        replies.push(execute(run, script, &mut |n| {
            sent += n;
            progress(sent, total)
        })?);
    }
    let axes: Vec<AxisReport> = settings
        .axes
        .iter()
        .map(|&axis| measure(axis, &scripts, &replies, run.must_hold.contains(&axis), run))
        .collect::<Result<_, _>>()?;
    let failed = axes.iter().any(|a| a.must_hold && !a.held());
    Ok(Report {
        server: run.servers[0].info.clone(),
        against: run.servers.get(1).map(|s| s.info.clone()),
        settings: settings.clone(),
        requests: total,
        axes,
        failed,
    })
}

/// Sends a script's steps in order (each step's requests in flight together) and returns the
/// replies by step.
pub(crate) fn execute(run: &Run, script: &Script, sent: &mut dyn FnMut(usize)) -> Result<Vec<Vec<Reply>>, EngineError> {
    let mut replies: Vec<Vec<Reply>> = Vec::with_capacity(script.steps.len());
    for step in &script.steps {
        let server = run.servers.get(step.server).ok_or_else(|| EngineError::Settings {
            why: format!("a step is sent to server {}, and {} are given", step.server + 1, run.servers.len()),
        })?;
        let requests: Vec<Request> = step
            .requests
            .iter()
            .map(|p| {
                let prompt = match &p.prompt {
                    Prompt::Tokens(t) => t.clone(),
                    Prompt::Reply { step, index, then } => {
                        let earlier =
                            replies.get(*step).and_then(|r| r.get(*index)).ok_or_else(|| EngineError::Settings {
                                why: format!("a prompt extends reply {index} of a later step {step}"),
                            })?;
                        [earlier.tokens.clone(), then.clone()].concat()
                    }
                };
                let salt = format!("moe-audit-{}-{}-{}", run.run_id, script.probe, p.salt);
                Ok(Request { prompt, max_tokens: p.max_tokens, salt })
            })
            .collect::<Result<_, EngineError>>()?;
        let got = together(server, &requests, script.probe)?;
        sent(requests.len());
        replies.push(got);
    }
    Ok(replies)
}

/// Sends `requests` at once (one thread each, released together) and waits for every reply.
fn together(server: &Server, requests: &[Request], probe: usize) -> Result<Vec<Reply>, EngineError> {
    if let [one] = requests {
        return Ok(vec![server.generate(one, probe)?]);
    }
    let gate = std::sync::Barrier::new(requests.len());
    std::thread::scope(|s| {
        let handles: Vec<_> = requests
            .iter()
            .map(|r| {
                let gate = &gate;
                s.spawn(move || {
                    gate.wait();
                    server.generate(r, probe)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a request thread does not panic")).collect()
    })
}

/// The positions an axis compares of its two replies: the region the axis is about, cut where
/// their tokens first differ.
fn region(axis: Axis, a: &Reply, b: &Reply) -> (Range<usize>, Option<usize>) {
    let rows = a.rows().min(b.rows());
    let range = match axis {
        Axis::Continuation => 0..a.prompt_len.min(rows),
        Axis::Decode => a.prompt_len.min(rows)..rows,
        Axis::Stale => 0..b.cached.map_or(a.prompt_len, |c| c.min(a.prompt_len)).min(rows),
        _ => 0..rows,
    };
    let diverge = a.tokens.iter().zip(&b.tokens).position(|(x, y)| x != y);
    match diverge {
        Some(q) if q < range.end => (range.start.min(q)..q, Some(q)),
        _ => (range, None),
    }
}

/// Compares every pairing of `axis`: each pair's decisions counted, then the axis's rows as one
/// records comparison.
pub(crate) fn measure(
    axis: Axis,
    scripts: &[Script],
    replies: &[Vec<Vec<Reply>>],
    must_hold: bool,
    run: &Run,
) -> Result<AxisReport, EngineError> {
    let mut report = AxisReport::empty(axis, must_hold);
    let mut sides = [Vec::new(), Vec::new()];
    for (script, got) in scripts.iter().zip(replies) {
        for &pairing in script.pairings.iter().filter(|p| p.axis == axis) {
            let Pairing { a, b, .. } = pairing;
            let (a, b) = (&got[a.step][a.index], &got[b.step][b.index]);
            if (a.layers, a.top_k) != (b.layers, b.top_k) {
                return Err(EngineError::Settings {
                    why: format!(
                        "probe {}: the replies hold {} layers x top-{} and {} x top-{}: two different models",
                        script.probe, a.layers, a.top_k, b.layers, b.top_k
                    ),
                });
            }
            let range = report.add_pair(script.probe, a, b);
            if report.witness.is_none() && !report.held() {
                report.witness = Some(script.only(pairing));
            }
            if !range.is_empty() {
                for (side, r) in sides.iter_mut().zip([a, b]) {
                    side.push(id_array(r, range.clone()));
                }
            }
        }
    }
    report.comparison = comparison(axis, sides, run)?;
    Ok(report)
}

impl AxisReport {
    fn empty(axis: Axis, must_hold: bool) -> AxisReport {
        AxisReport {
            axis,
            pairs: 0,
            decisions: 0,
            changed: 0,
            one_slot: 0,
            changes: Vec::new(),
            diverged: Vec::new(),
            cached: Vec::new(),
            must_hold,
            comparison: None,
            witness: None,
        }
    }

    /// Counts the decisions of one pair over the axis's region; returns the positions compared.
    fn add_pair(&mut self, probe: usize, a: &Reply, b: &Reply) -> Range<usize> {
        self.pairs += 1;
        if matches!(self.axis, Axis::Cache | Axis::Stale) {
            self.cached.push(b.cached);
        }
        let (range, diverged) = region(self.axis, a, b);
        if let Some(position) = diverged {
            self.diverged.push(Divergence { probe, position });
        }
        let (w, k) = (a.layers * a.top_k, a.top_k);
        let (mut sa, mut sb) = (Vec::new(), Vec::new());
        let rows = a.rows_at(range.clone()).chunks(w).zip(b.rows_at(range.clone()).chunks(w));
        for (t, (ra, rb)) in rows.enumerate() {
            for (layer, (xa, xb)) in ra.chunks(k).zip(rb.chunks(k)).enumerate() {
                expert_set(xa, &mut sa);
                expert_set(xb, &mut sb);
                if sa.is_empty() && sb.is_empty() {
                    continue;
                }
                self.decisions += 1;
                if sa != sb {
                    self.changed += 1;
                    if shared_experts(&sa, &sb) + 1 == sa.len().max(sb.len()) {
                        self.one_slot += 1;
                    }
                    if self.changes.len() < CHANGES_SHOWN {
                        let position = range.start + t;
                        self.changes.push(Change { probe, position, layer, a: sa.clone(), b: sb.clone() });
                    }
                }
            }
        }
        range
    }
}

/// A reply's rows at `range` as an array in memory (int32, `[n, layers, top_k]`).
fn id_array(r: &Reply, range: Range<usize>) -> IdArray {
    let bytes: Vec<u8> = r.rows_at(range.clone()).iter().flat_map(|v| v.to_le_bytes()).collect();
    IdArray { bytes: Bytes::from(bytes), dtype: "int32".into(), shape: [range.len(), r.layers, r.top_k] }
}

/// The axis's rows, reference against other, as `routes compare` compares two records.
fn comparison(axis: Axis, sides: [Vec<IdArray>; 2], run: &Run) -> Result<Option<Comparison>, EngineError> {
    let [pa, pb] = sides;
    let Some(width) = pa.first().map(|p| p.shape[1]) else { return Ok(None) };
    let mut budget = Budget::new(run.memory);
    let layout = run.servers.first().and_then(|s| s.layout());
    let name = |side: &str| format!("{} ({side})", axis.name());
    // Both engines return every decoder layer, by absolute index.
    let numbers = || Some((0..width).collect());
    let records = from_ids(&name("reference"), pa, numbers(), layout, &mut budget)
        .and_then(|ra| Ok((ra, from_ids(&name("other"), pb, numbers(), layout, &mut budget)?)));
    let compared = records.and_then(|(ra, rb)| compare(&ra, &rb, layout, &CompareOptions::default(), &mut budget));
    compared.map(Some).map_err(|e| EngineError::Settings { why: e.to_string() })
}
