//! Trace files, for routers that cannot run as a subprocess.
//!
//! `plan` writes every call the audit will make (`inputs.safetensors`, one tensor per distinct
//! input, and `manifest.json`, the calls in order); the user's harness answers each call in the
//! response format (`decisions.jsonl`); [`TraceRouter`] replays the answers, looking each call up
//! by its content (and how many times the same content was asked before, so D and S still see
//! repeats in order).
//!
//! The audit's inputs depend on the router's answers in one place only: targeted trials push
//! toward experts the base call's token uses. `plan` therefore runs the audit once per expert e
//! against a recorder that routes every token to e, and writes the union of the calls: whatever
//! the real router answers, every call it is asked is in the plan.

use super::protocol::{parse_response, Asked, Handshake, InputKind, Response, RouteOut};
use super::{Answers, External};
use crate::analyze::{audit, AuditOptions, Subject};
use crate::mode::Mode;
use crate::progress::Silent;
use candle_core::{Device, Tensor};
use moe_audit_core::error::{excerpt, Error, ProtocolError, Result, Text};
use moe_audit_core::layer::CallSizes;
use moe_audit_core::routing::Routing;
use moe_audit_core::text;
use moe_audit_core::MemoryBudget;
use ndarray::{Array3, ArrayView2, ArrayView3};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The manifest format tag.
pub const FORMAT: &str = "moe-audit-plan/1";
/// File names inside a trace directory.
pub(crate) const MANIFEST: &str = "manifest.json";
/// The probe inputs.
pub(crate) const INPUTS: &str = "inputs.safetensors";
/// The harness's answers, one response line per call.
pub(crate) const DECISIONS: &str = "decisions.jsonl";

/// One planned call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct PlannedCall {
    /// The id the response must carry.
    pub id: u64,
    /// Configuration to route with.
    pub mode: Mode,
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Tensor in `inputs.safetensors`, `[batch, seq_len, width]` f32.
    pub tensor: String,
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// The router, as its handshake would describe it.
    pub router: Handshake,
    /// The audit the plan is for; `check --traces` runs exactly this.
    pub options: AuditOptions,
    /// The calls, in the order the audit makes them; answer them in this order.
    pub calls: Vec<PlannedCall>,
}

/// Trace files hold routes only: a layer over ranks (its calls placed) or one that sends its
/// output rows runs as a subprocess.
fn traceable(hs: &Handshake) -> std::result::Result<(), Text> {
    match (hs.ranks, hs.output) {
        (None, None) => Ok(()),
        _ => Err(text!(
            "trace files carry no `ranks` placement and no `output` rows: audit such a layer with ",
            crate::settings::ROUTER_CMD
        )),
    }
}

/// A call's content: its shape and the exact bits of its rows.
type Content = ((usize, usize, usize), Vec<u32>);

fn content(rows: ArrayView3<f32>) -> Content {
    (rows.dim(), rows.iter().map(|v| v.to_bits()).collect())
}

type Log = Arc<Mutex<Vec<(Mode, Array3<f32>)>>>;

/// Records calls and answers each with every token routed to one expert.
struct Recorder {
    hs: Handshake,
    answer: usize,
    log: Log,
}

impl Answers for Recorder {
    fn handshake(&self) -> &Handshake {
        &self.hs
    }

    fn answer(&self, mode: Mode, rows: ArrayView3<f32>, _: Option<ArrayView2<bool>>) -> Result<Routing> {
        let (b, s, _) = rows.dim();
        self.log.lock().expect("log").push((mode, rows.as_standard_layout().into_owned()));
        let route = RouteOut { expert: self.answer as i64, weight: 1.0, kept: true };
        let response =
            Response { id: 0, tokens: vec![vec![route]; b * s], capacity: None, placement: None, output: None };
        let hs = Handshake { top_k: None, ..self.hs.clone() };
        let asked = Asked { id: 0, batch: b, seq_len: s, padding: None, logits: None, placement: None };
        response.into_routing(&hs, &asked).map_err(|e| Error::invalid(format!("plan: {e}")))
    }
}

/// Writes the plan of `options` for a router described by `router` into `dir`; returns the
/// number of calls. Fails first when it is estimated to need more than `budget` bytes.
pub fn plan(router: &Handshake, options: &AuditOptions, dir: &Path, budget: MemoryBudget) -> Result<usize> {
    router.validate().map_err(Error::usage)?;
    traceable(router).map_err(Error::usage)?;
    // One audit at a time, plus every call it makes, kept until written: P's S prefixes (half
    // the call on average), F's and N's trials, R's cases at up to twice the size, a few more.
    let (width, routes) = (router.row_width(), router.top_k.unwrap_or(1));
    let call = CallSizes { batch: options.batch, seq_len: options.seq_len, experts: width, routes, hidden: 0, ffn: 0 };
    let trials = options.trials as u64;
    let logged = (options.seq_len as u64 / 2).saturating_add(2 * trials + 2 * (trials / 8 + 4) + 8);
    // What the plan keeps across the E passes: every distinct call once as a tensor and twice as
    // a content key, and once more while the tensors are written. The targeted trials (half of
    // F's and N's, a few more) differ in every pass: they accumulate E times.
    let distinct = logged.saturating_add((trials + 8).saturating_mul(router.experts as u64));
    let estimate = options
        .memory_estimate(width, routes, 0, 0)
        .saturating_add(call.logits_bytes().saturating_mul(logged))
        .saturating_add(call.logits_bytes().saturating_mul(distinct).saturating_mul(4));
    budget.ensure_fits("this plan", estimate)?;
    let mut calls: Vec<PlannedCall> = Vec::new();
    let mut names: HashMap<Content, String> = HashMap::new();
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    // How often each (mode, content) is planned: a pass adds only the occurrences the plan lacks.
    let mut planned: HashMap<(Mode, Content), usize> = HashMap::new();
    for answer in 0..router.experts {
        let log: Log = Arc::default();
        let recorder = External::new(
            Recorder { hs: router.clone(), answer, log: Arc::clone(&log) },
            options.seed,
            Mode::Train,
            false,
            budget,
        )?;
        audit(&Subject::router(&recorder), options, &Silent)?;
        drop(recorder);
        let mut this_pass: HashMap<(Mode, Content), usize> = HashMap::new();
        for (mode, data) in Arc::try_unwrap(log).expect("the audit is over").into_inner().expect("log") {
            let c = content(data.view());
            let k = (mode, c.clone());
            let seen = this_pass.entry(k.clone()).or_default();
            *seen += 1;
            let have = planned.entry(k).or_default();
            if *seen <= *have {
                continue;
            }
            *have += 1;
            let n = names.len();
            let name = names.entry(c).or_insert_with(|| format!("call.{n}")).clone();
            if !tensors.contains_key(&name) {
                let t = Tensor::from_slice(data.as_slice().expect("owned standard layout"), data.dim(), &Device::Cpu)?;
                tensors.insert(name.clone(), t);
            }
            let (batch, seq_len, _) = data.dim();
            calls.push(PlannedCall { id: calls.len() as u64 + 1, mode, batch, seq_len, tensor: name });
        }
    }
    // The inputs and the manifest are one set, renamed into place together.
    moe_audit_core::files::create_dir(dir)?;
    let mut staged = moe_audit_core::files::Staged::new();
    let inputs = dir.join(INPUTS);
    staged.write(&inputs, &moe_audit_core::files::safetensors_bytes(&tensors, &inputs)?)?;
    let manifest = Manifest { format: FORMAT.into(), router: router.clone(), options: options.clone(), calls };
    let json = serde_json::to_string_pretty(&manifest).expect("a manifest always serialises") + "\n";
    staged.write(&dir.join(MANIFEST), json.as_bytes())?;
    staged.commit()?;
    Ok(manifest.calls.len())
}

/// A router replaying a harness's answers to a plan.
pub type TraceRouter = External<TraceAnswers>;

/// The audit a trace directory was planned for, from its manifest alone (the inputs and the
/// decisions are read by [`TraceRouter::open`]).
pub(crate) fn planned_options(dir: &Path, budget: MemoryBudget) -> Result<AuditOptions> {
    Ok(read_manifest(dir, budget)?.options)
}

/// A trace folder's own file `name`: a symlink out of the folder is refused.
pub(crate) fn file_in(dir: &Path, name: &str) -> Result<PathBuf> {
    moe_audit_core::files::inside(dir, Path::new(name), name)
}

/// Reads and checks `manifest.json`: its format and the router it describes.
pub(crate) fn read_manifest(dir: &Path, budget: MemoryBudget) -> Result<Manifest> {
    let path = file_in(dir, MANIFEST)?;
    std::fs::metadata(&path).map_err(|e| Error::io(&path, "cannot read (write it with `moe-audit plan`)", e))?;
    let text = moe_audit_core::files::read_text_within(&path, budget)?;
    let manifest: Manifest = serde_json::from_str(&text).map_err(|e| Error::parse(&path, "not a plan manifest", e))?;
    if manifest.format != FORMAT {
        return Err(Error::input(&path, format!("format `{}`, expected `{FORMAT}`", excerpt(&manifest.format))));
    }
    manifest.router.validate().map_err(|e| Error::input(&path, e))?;
    manifest.options.check().map_err(|e| Error::input(&path, format!("options.{}: {}", e.field, e.message)))?;
    let mut ids = std::collections::HashSet::new();
    if let Some(call) = manifest.calls.iter().find(|c| !ids.insert(c.id)) {
        return Err(Error::input(&path, format!("calls: id {} appears twice (every call has its own id)", call.id)));
    }
    Ok(manifest)
}

/// A harness's answers by (mode, content), in plan order, and how many of each were used.
pub struct TraceAnswers {
    hs: Handshake,
    dir: PathBuf,
    options: AuditOptions,
    answers: HashMap<(Mode, Content), Vec<(u64, Routing)>>,
    used: Mutex<HashMap<(Mode, Content), usize>>,
}

/// A harness's answers, under their name before 0.3.0.
#[deprecated(since = "0.3.0", note = "renamed `TraceAnswers` (`Replay` named three things)")]
pub type Replay = TraceAnswers;

impl TraceRouter {
    /// Opens a trace directory: the manifest, the inputs and the decisions, all checked against
    /// each other before anything is analyzed. Its hidden-row pool (for `input: hidden`) may
    /// take at most `budget` bytes.
    pub fn open(dir: &Path, budget: MemoryBudget) -> Result<Self> {
        let manifest = read_manifest(dir, budget)?;
        let hs = manifest.router;
        traceable(&hs).map_err(|e| Error::input(dir.join(MANIFEST), e))?;
        let inputs_path = file_in(dir, INPUTS)?;
        let inputs = moe_audit_core::layer::load_safetensors(&inputs_path, &Device::Cpu, budget.tensors())?;
        let decisions_path = file_in(dir, DECISIONS)?;
        std::fs::metadata(&decisions_path).map_err(|e| {
            Error::io(
                &decisions_path,
                format!("cannot read (your harness writes one response line per call of {MANIFEST})"),
                e,
            )
        })?;
        let decisions = moe_audit_core::files::read_text_within(&decisions_path, budget)?;
        let mut responses = HashMap::new();
        for (n, line) in decisions.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let at = |m: ProtocolError| Error::input(&decisions_path, text!(format!("line {}: ", n + 1), m));
            let r = parse_response(line).map_err(at)?;
            if responses.insert(r.id, r).is_some() {
                return Err(at("a second response for this id".into()));
            }
        }
        let mut answers: HashMap<(Mode, Content), Vec<(u64, Routing)>> = HashMap::new();
        for call in &manifest.calls {
            let t = inputs.get(&call.tensor).ok_or_else(|| {
                Error::input(&inputs_path, format!("no tensor `{}` (call {})", excerpt(&call.tensor), call.id))
            })?;
            let dims = (call.batch, call.seq_len, hs.row_width());
            let data =
                t.dims3().ok().filter(|&d| d == dims).and_then(|_| {
                    t.to_dtype(candle_core::DType::F32).and_then(|t| t.flatten_all()?.to_vec1::<f32>()).ok()
                });
            let Some(data) = data else {
                return Err(Error::input(
                    &inputs_path,
                    format!(
                        "tensor `{}` is {}, call {} needs {dims:?}",
                        excerpt(&call.tensor),
                        excerpt(&format!("{:?}", t.dims())),
                        call.id
                    ),
                ));
            };
            let rows = Array3::from_shape_vec(dims, data).expect("shape checked");
            let response = responses.remove(&call.id).ok_or_else(|| {
                Error::input(
                    &decisions_path,
                    format!("no response for call {} ({}, tensor `{}`)", call.id, call.mode, excerpt(&call.tensor)),
                )
            })?;
            let logits = (hs.input == InputKind::Logits).then(|| rows.as_slice().expect("standard layout"));
            let asked =
                Asked { id: call.id, batch: call.batch, seq_len: call.seq_len, padding: None, logits, placement: None };
            let routing = response.into_routing(&hs, &asked).map_err(|e| {
                Error::input(
                    &decisions_path,
                    format!("call {} ({}, batch {} x seq_len {}): {e}", call.id, call.mode, call.batch, call.seq_len),
                )
            })?;
            answers.entry((call.mode, content(rows.view()))).or_default().push((call.id, routing));
        }
        if let Some(id) = responses.keys().min() {
            return Err(Error::input(&decisions_path, format!("response id {id} is not a call of {MANIFEST}")));
        }
        let seed = manifest.options.seed;
        let replay =
            TraceAnswers { hs, dir: dir.to_path_buf(), options: manifest.options, answers, used: Mutex::default() };
        // The plan's targeted rows are untargeted pool rows (no answers existed when planning).
        External::new(replay, seed, Mode::Train, false, budget)
    }

    /// The audit the traces were planned for.
    pub fn options(&self) -> &AuditOptions {
        &self.source().options
    }
}

impl Answers for TraceAnswers {
    fn handshake(&self) -> &Handshake {
        &self.hs
    }

    fn answer(&self, mode: Mode, rows: ArrayView3<f32>, _: Option<ArrayView2<bool>>) -> Result<Routing> {
        let k = (mode, content(rows));
        let mut used = self.used.lock().expect("replay");
        let n = used.entry(k.clone()).or_default();
        let (b, s, _) = rows.dim();
        let answers = self.answers.get(&k).map_or(&[][..], Vec::as_slice);
        let Some((_, routing)) = answers.get(*n) else {
            return Err(Error::input(
                &self.dir,
                format!(
                    "the audit asks a {} call (batch {b} x seq_len {s}) that the plan holds {} time(s), asked {} time(s): plan and audit differ (re-run `moe-audit plan`)",
                    mode,
                    answers.len(),
                    *n + 1
                ),
            ));
        };
        *n += 1;
        Ok(routing.clone())
    }
}
