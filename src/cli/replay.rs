//! `moe-audit replay`: a router's witness (written by `check --witness-dir`) replayed from its
//! file alone, or against the live router with `--router-cmd`; an engine's witness (written by
//! `engine --witness-dir`) sent again to its server (or `--url`). A witness holds its router's
//! config or handshake, so no other flag describes the router. (A whole model's witness holds
//! only tokens: it replays with the model's own command line, `model ... --replay`.)

use super::common::{mode_parser, FailOn, MemoryArgs, TimeoutArgs};
use super::{exit, io_error};
use clap::Args;
use moe_audit::analyze::Witness;
use moe_audit::engine;
use moe_audit::error::Result;
use moe_audit::external::{ExternalRouter, Mode};
use moe_audit::render::render_replay;
use moe_audit::MemoryBudget;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

/// Arguments of `moe-audit replay`.
#[derive(Debug, Args)]
pub(crate) struct ReplayArgs {
    /// The witness file.
    #[arg(value_name = "WITNESS.json")]
    pub(crate) witness: PathBuf,
    /// Replay against this live router (the witness of a router outside moe-audit), a command
    /// speaking the moe-audit/1 or /2 protocol, run with `sh -c`.
    #[arg(long, value_name = "COMMAND")]
    pub(crate) router_cmd: Option<String>,
    /// The other launch of the layer that a witness of L across launches compares it with
    /// (the witness names the command it was found with).
    #[arg(long, value_name = "COMMAND", requires = "router_cmd")]
    pub(crate) layout_cmd: Option<String>,
    /// How long the router command may take.
    #[command(flatten)]
    pub(crate) timeout: TimeoutArgs,
    /// The mode the router command is called in.
    #[arg(long, value_parser = mode_parser(), default_value = "train", requires = "router_cmd")]
    pub(crate) mode: Mode,
    /// Seed the router command is started with.
    #[arg(long, default_value_t = 0, requires = "router_cmd")]
    pub(crate) seed: u64,
    /// Verdicts that make the replay exit 1 when they reproduce: `leak`, `latent` (only the
    /// capacity in force changed), `drift` (an X witness).
    #[arg(long, value_name = "VERDICTS", default_value = FailOn::DEFAULT, value_parser = FailOn::parse)]
    pub(crate) fail_on: FailOn,
    /// An engine witness: send its requests to this server instead of the one it names.
    #[arg(long, value_name = "URL", conflicts_with = "router_cmd")]
    pub(crate) url: Option<String>,
    /// The memory limit.
    #[command(flatten)]
    pub(crate) memory: MemoryArgs,
}

/// A validated `replay`.
#[derive(Debug)]
pub(crate) struct ReplayOptions {
    witness: PathBuf,
    /// The live router: its command, timeout, seed and mode.
    router: Option<(String, Duration, u64, Mode)>,
    /// The other launch of its layer (`--layout-cmd`).
    layout: Option<String>,
    fail_on: FailOn,
    /// An engine witness's server, when not the one it names.
    url: Option<String>,
    timeout: Duration,
    budget: MemoryBudget,
}

impl ReplayArgs {
    /// The flags checked.
    pub(crate) fn validated(&self) -> Result<ReplayOptions> {
        let timeout = self.timeout.validated()?;
        Ok(ReplayOptions {
            witness: self.witness.clone(),
            router: self.router_cmd.clone().map(|command| (command, timeout, self.seed, self.mode)),
            layout: self.layout_cmd.clone(),
            fail_on: self.fail_on,
            url: self.url.clone(),
            timeout,
            budget: self.memory.budget(),
        })
    }
}

/// Replays the witness: exit 1 while it still shows a verdict of `--fail-on` (its leak, its
/// latent capacity change, or under `--fail-on drift` an X witness's drift), 0 when not.
pub(super) fn run(replay: &ReplayOptions, out: &mut dyn Write) -> Result<u8> {
    let path = &replay.witness;
    let text = moe_audit::files::read_text_within(path, replay.budget)?;
    if let Ok(w) = serde_json::from_str::<engine::Witness>(&text) {
        return replay_engine(replay, &w, out);
    }
    let witness = Witness::parse(&text, path)?;
    let outcome = match &replay.router {
        None => witness.replay(path)?,
        Some((command, timeout, seed, mode)) => {
            let router = ExternalRouter::spawn(command, *timeout, *seed, *mode, replay.budget)?;
            let layout = replay.layout.as_ref().map(|c| router.spawn_layout(c, *timeout, replay.budget)).transpose()?;
            witness.replay_on(path, &router, layout.as_ref().map(|l| l as &dyn moe_audit::router::Router))?
        }
    };
    out.write_all(render_replay(&outcome).as_bytes()).map_err(io_error)?;
    // The verdict the replay shows fails as the audit's would (an X witness: drift).
    Ok(exit::failed_if(replay.fail_on.counts(outcome.verdict())))
}

/// Sends an engine witness's requests again: exit 1 while its axis still changes, 0 when not.
fn replay_engine(replay: &ReplayOptions, w: &engine::Witness, out: &mut dyn Write) -> Result<u8> {
    let layout = w
        .config
        .as_ref()
        .map(moe_audit::records::Layout::from_json)
        .transpose()
        .map_err(|m| moe_audit::Error::input(&replay.witness, format!("config: {m}")))?;
    let connect = engine::Connect { timeout: replay.timeout, engine: None, layout, memory: replay.budget };
    let urls = w.servers.iter().enumerate().map(|(i, s)| match (i, &replay.url) {
        (0, Some(url)) => url.as_str(),
        _ => s.url.as_str(),
    });
    let servers = urls.map(|u| engine::Server::connect(u, &connect)).collect::<std::result::Result<Vec<_>, _>>()?;
    let run = engine::Run {
        servers: servers.iter().collect(),
        run_id: format!("replay-{}", std::process::id()),
        must_hold: vec![w.axis],
        memory: replay.budget,
    };
    let axis = engine::replay(w, &run)?;
    out.write_all(moe_audit::render::engine_replay_text(&axis).as_bytes()).map_err(io_error)?;
    Ok(exit::failed_if(!axis.held()))
}
