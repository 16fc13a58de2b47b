//! Making a snapshot from its header: build the router, make the inputs, route them in every
//! mode. `snapshot` runs this once to write a file and `snapshot check` again to compare.

use super::file::{file_sha256, sha256, Header, InputSpec, RouterSource, Rows, SnapshotFile};
use super::file::{FORMAT, WEIGHT_DECIMALS};
use crate::analyze::{AuditOptions, Probe};
use crate::external::protocol::PROTOCOL;
use crate::external::trace::{file_in, read_manifest, Manifest, PlannedCall, DECISIONS, INPUTS, MANIFEST};
use crate::external::{ExternalRouter, Handshake, InputKind, Mode, TraceRouter};
use candle_core::{DType, Device, Tensor};
use moe_audit_core::config::RouterConfig;
use moe_audit_core::error::{ensure_positive, excerpt, excerpt_long, Error, Result};
use moe_audit_core::files::write_atomic;
use moe_audit_core::layer::gate::GateSource;
use moe_audit_core::layer::CallSizes;
use moe_audit_core::layer::{MoeLayer, Seeded};
use moe_audit_core::router::Router;
use moe_audit_core::text;
use moe_audit_core::MemoryBudget;
use ndarray::Array3;
use std::collections::HashMap;
use std::path::Path;

/// The recipe a `snapshot plan` directory carries, so the snapshot of its answers records the
/// router and inputs rather than a temporary directory.
pub(crate) const PLAN_RECIPE: &str = "snapshot.toml";

/// A plan directory's recipe.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanRecipe {
    router: RouterSource,
    input: InputSpec,
}

/// Routes what `router` and `input` describe in every mode and returns the snapshot, its hashes
/// those of now. `traces` answers a `traces` or `harness` router instead of the recorded
/// directory; `budget` bounds the inputs.
pub fn make(
    router: &RouterSource,
    input: &InputSpec,
    traces: Option<&Path>,
    budget: MemoryBudget,
) -> Result<SnapshotFile> {
    let mut router = router.clone();
    let mut input = input.clone();
    ensure_positive(&[
        (moe_audit_core::settings::BATCH, input.batch),
        (moe_audit_core::settings::SEQ_LEN, input.seq_len),
    ])?;
    let routed: Vec<(Mode, Array3<f32>, moe_audit_core::routing::Routing)> = match &mut router {
        RouterSource::Preset { name } => config_routings(RouterConfig::load(name)?, &mut input, None, budget)?,
        RouterSource::Config { path, sha256 } => {
            *sha256 = file_sha256(Path::new(path))?;
            config_routings(RouterConfig::from_file(Path::new(path))?, &mut input, None, budget)?
        }
        RouterSource::Gate { router, weights, gate, bias, sha256 } => {
            *sha256 = file_sha256(Path::new(weights))?;
            let source =
                GateSource { weights: Path::new(weights), gate, bias: bias.as_deref(), hidden_states: None, budget };
            let config = RouterConfig::load(router)?;
            input.hidden = None;
            config_routings(config, &mut input, Some(&source), budget)?
        }
        RouterSource::Command { command, timeout } => {
            let timeout = crate::external::process::timeout(*timeout)?;
            let r = ExternalRouter::spawn(command, timeout, input.seed, Mode::Train, budget)?;
            input.hidden = None;
            let rows = rows(&mut input, r.handshake(), budget)?;
            let inference = r.inference()?.expect("an external router has an inference mode");
            vec![
                (Mode::Train, rows.clone(), r.assign(rows.view())?),
                (Mode::Inference, rows.clone(), inference.assign(rows.view())?),
            ]
        }
        RouterSource::Traces { dir, sha256 } => {
            let dir = traces.unwrap_or(Path::new(dir.as_str())).to_path_buf();
            if is_snapshot_plan(&dir) {
                harness(&dir, &mut router, &mut input, budget)?
            } else {
                *sha256 = file_sha256(&file_in(&dir, DECISIONS)?)?;
                input = InputSpec { rows: Rows::Traces, hidden: None, file: None, ..input };
                trace_routings(&dir, &mut input, budget)?
            }
        }
        RouterSource::Harness { .. } => {
            let Some(dir) = traces else {
                return Err(Error::usage(text!(
                    "this snapshot was answered by a harness (the Python helper): re-run its test, or pass ",
                    crate::settings::TRACES,
                    " DIR answered by the router"
                )));
            };
            harness(dir, &mut router, &mut input, budget)?
        }
    };
    let mut hasher = Vec::new();
    for (_, rows, _) in &routed {
        hasher.extend(rows.iter().flat_map(|v| v.to_le_bytes()));
    }
    input.sha256 = sha256(&hasher);
    Ok(SnapshotFile {
        header: Header {
            format: FORMAT.into(),
            moe_audit: env!("CARGO_PKG_VERSION").into(),
            weight_decimals: WEIGHT_DECIMALS,
            modes: routed.iter().map(|(m, _, _)| *m).collect(),
            header_sha256: String::new(),
            router,
            input,
        },
        sections: routed.into_iter().map(|(m, _, r)| (m, super::snapshot(&r))).collect(),
    })
}

type Routed = Vec<(Mode, Array3<f32>, moe_audit_core::routing::Routing)>;

/// A `snapshot plan` directory answered by a harness: the router and inputs its recipe
/// records, routed by the answers.
fn harness(dir: &Path, router: &mut RouterSource, input: &mut InputSpec, budget: MemoryBudget) -> Result<Routed> {
    let recipe = read_recipe(dir)?.ok_or_else(|| {
        Error::input(
            dir,
            text!(format!("no {PLAN_RECIPE}: not a directory written by a snapshot's "), crate::settings::PLAN),
        )
    })?;
    (*router, *input) = (recipe.router, recipe.input);
    let mut found = input.clone();
    trace_routings(dir, &mut found, budget)
}

/// A preset or TOML router on a seeded gate (or `gate`): seeded or given hidden states through
/// the gate, or given logits straight to assignment; the `[inference]` router, when there is
/// one, for the inference mode.
fn config_routings(
    config: RouterConfig,
    input: &mut InputSpec,
    gate: Option<&GateSource>,
    budget: MemoryBudget,
) -> Result<Routed> {
    if input.rows == Rows::Traces {
        let name = &config.name;
        return Err(Error::invalid(format!("[input] rows = \"traces\": router `{name}` is not a trace directory")));
    }
    let experts = config.experts;
    let logits = input.rows == Rows::Logits;
    let router: Box<dyn Router> = match gate {
        Some(source) => Box::new(source.router(config)?),
        None => {
            let hidden = if logits {
                1
            } else {
                input.hidden.ok_or_else(|| Error::invalid("[input] hidden: the seeded gate needs a hidden size"))?
            };
            ensure_positive(&[(moe_audit_core::settings::HIDDEN, hidden)])?;
            // The gate and its experts are made before the rows: bound them first.
            let (batch, seq_len) = (input.batch, input.seq_len);
            let sizes = CallSizes { batch, seq_len, experts, routes: config.k(), hidden, ffn: 1 };
            budget.ensure_fits("this snapshot", sizes.estimate())?;
            // The gate is the layer's first seeded tensor, so the expert sizes do not change it:
            // the same gate as `moe-audit route --seed S --hidden H`.
            let layer = MoeLayer::seeded(config, hidden, 1, input.seed, DType::F32, &Device::Cpu)?;
            Box::new(layer.router().clone())
        }
    };
    if logits {
        input.hidden = None;
    }
    let hs = Handshake {
        protocol: PROTOCOL.into(),
        name: router.name().into(),
        experts,
        top_k: router.config().and_then(|c| c.top_k()),
        input: if logits { InputKind::Logits } else { InputKind::Hidden },
        hidden_size: router.hidden_size(),
        responses: None,
        padding_mask: false,
        seed_calls: None,
        ranks: None,
        output: None,
        weights: None,
    };
    let rows = rows(input, &hs, budget)?;
    let inference = router.inference()?;
    let serve = inference.as_deref().unwrap_or(router.as_ref());
    let route = |r: &dyn Router| -> Result<moe_audit_core::routing::Routing> {
        if logits {
            r.assign(rows.view())
        } else {
            let x = Tensor::from_slice(rows.as_slice().expect("standard layout"), rows.dim(), &Device::Cpu)?;
            r.route(&x)
        }
    };
    Ok(vec![(Mode::Train, rows.clone(), route(router.as_ref())?), (Mode::Inference, rows.clone(), route(serve)?)])
}

/// The rows `input` describes for a router taking `hs.input` rows of `hs.row_width()`; fills in
/// `seq_len` from a file.
fn rows(input: &mut InputSpec, hs: &Handshake, budget: MemoryBudget) -> Result<Array3<f32>> {
    let width = hs.row_width();
    let sizes = CallSizes {
        batch: input.batch,
        seq_len: input.seq_len,
        experts: hs.experts,
        routes: hs.top_k.unwrap_or(1),
        hidden: width,
        ffn: 0,
    };
    budget.ensure_fits("this snapshot", sizes.estimate())?;
    let want = match input.rows {
        Rows::Seeded => {
            let (b, s) = (input.batch, input.seq_len);
            let t = Seeded::new(input.seed ^ crate::seeds::INPUT).normal(&[b, s, width], &Device::Cpu)?;
            return Ok(Array3::from_shape_vec((b, s, width), t.flatten_all()?.to_vec1()?).expect("shape"));
        }
        Rows::Logits => InputKind::Logits,
        Rows::HiddenStates => InputKind::Hidden,
        Rows::Traces => {
            return Err(Error::invalid(format!(
                "[input] rows = \"traces\": router `{}` is not a trace directory",
                hs.name
            )))
        }
    };
    let file = input.file.as_deref().ok_or_else(|| Error::invalid("[input] file: the rows file is missing"))?;
    if want != hs.input {
        let (given, takes) = match want {
            InputKind::Logits => {
                (crate::settings::LOGITS, text!("hidden states (", crate::settings::HIDDEN_STATES, ")"))
            }
            InputKind::Hidden => (crate::settings::HIDDEN_STATES, text!("logits (", crate::settings::LOGITS, ")")),
        };
        return Err(Error::usage(text!(given, format!(" {}: router `{}` takes ", excerpt(file), hs.name), takes)));
    }
    let what = match want {
        InputKind::Logits => format!("the router has {} experts", hs.experts),
        InputKind::Hidden => format!("the router's hidden size is {width}"),
    };
    let rows = moe_audit_core::files::read_rows(Path::new(file), input.batch, None, width, &what, budget)?;
    input.seq_len = rows.dim().1;
    Ok(rows)
}

/// The first call of each mode of a trace directory, routed by its answers.
fn trace_routings(dir: &Path, input: &mut InputSpec, budget: MemoryBudget) -> Result<Routed> {
    let router = TraceRouter::open(dir, budget)?;
    let path = dir.join(MANIFEST);
    let manifest = read_manifest(dir, budget)?;
    let inputs = moe_audit_core::layer::load_safetensors(&file_in(dir, INPUTS)?, &Device::Cpu, budget.tensors())?;
    let width = router.handshake().row_width();
    let mut out = Vec::new();
    for mode in [Mode::Train, Mode::Inference] {
        let Some(call) = manifest.calls.iter().find(|c| c.mode == mode) else { continue };
        // TraceRouter::open checked every call's tensor and shape.
        let t = &inputs[&call.tensor];
        let rows = Array3::from_shape_vec((call.batch, call.seq_len, width), t.flatten_all()?.to_vec1()?)
            .expect("checked when opened");
        let routing = match mode {
            Mode::Train => router.assign(rows.view())?,
            Mode::Inference => router.inference()?.expect("external").assign(rows.view())?,
        };
        (input.batch, input.seq_len) = (call.batch, call.seq_len);
        out.push((mode, rows, routing));
    }
    if out.is_empty() {
        return Err(Error::input(&path, "plans no call"));
    }
    Ok(out)
}

fn read_recipe(dir: &Path) -> Result<Option<PlanRecipe>> {
    let path = moe_audit_core::files::inside(dir, Path::new(PLAN_RECIPE), PLAN_RECIPE)?;
    if !path.is_file() {
        return Ok(None);
    }
    let text = moe_audit_core::files::read_text(
        &path,
        moe_audit_core::files::TEXT_LIMIT,
        "the most a snapshot recipe may hold",
    )?;
    toml::from_str(&text).map(Some).map_err(|e| {
        Error::input(&path, format!("not a snapshot recipe: {}", excerpt_long(e.to_string().replace('\n', " "))))
    })
}

/// Whether `dir` was written by [`write_plan`] (its snapshot then records the router, not the
/// directory).
pub(crate) fn is_snapshot_plan(dir: &Path) -> bool {
    dir.join(PLAN_RECIPE).is_file()
}

/// Writes the inputs of a snapshot of the router `hs` describes into `dir`, for a harness to
/// answer (`manifest.json` with one train and one inference call, `inputs.safetensors`) with the
/// recipe of the snapshot beside them; `moe-audit snapshot record --traces DIR` then makes the snapshot.
pub fn write_plan(dir: &Path, hs: &Handshake, input: &InputSpec, budget: MemoryBudget) -> Result<()> {
    hs.validate().map_err(Error::usage)?;
    let mut input = InputSpec { hidden: None, ..input.clone() };
    let rows = rows(&mut input, hs, budget)?;
    let bytes: Vec<u8> = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
    input.sha256 = sha256(&[bytes.as_slice(), bytes.as_slice()].concat());
    let (batch, seq_len, _) = rows.dim();
    let options = AuditOptions {
        probes: vec![Probe::M],
        batch,
        seq_len,
        trials: 1, // M makes no random trial; the manifest wants at least one
        seed: input.seed,
        ranks: 1,
        exhaustive: false,
    };
    let calls = [Mode::Train, Mode::Inference]
        .iter()
        .enumerate()
        .map(|(i, &mode)| PlannedCall { id: i as u64 + 1, mode, batch, seq_len, tensor: "rows".into() })
        .collect();
    let manifest = Manifest { format: crate::external::trace::FORMAT.into(), router: hs.clone(), options, calls };
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, "cannot create", e))?;
    let t = Tensor::from_slice(rows.as_slice().expect("standard layout"), rows.dim(), &Device::Cpu)?;
    let inputs = dir.join(INPUTS);
    write_atomic(
        &inputs,
        &moe_audit_core::files::safetensors_bytes(&HashMap::from([("rows".to_string(), t)]), &inputs)?,
    )?;
    let router = RouterSource::Harness {
        name: hs.name.clone(),
        experts: hs.experts,
        top_k: hs.top_k,
        input: hs.input,
        hidden_size: hs.hidden_size,
    };
    let recipe = toml::to_string(&PlanRecipe { router, input }).expect("a recipe always serialises");
    write_atomic(&dir.join(PLAN_RECIPE), recipe.as_bytes())?;
    let manifest = serde_json::to_string_pretty(&manifest).expect("a manifest always serialises") + "\n";
    write_atomic(&dir.join(MANIFEST), manifest.as_bytes())
}
