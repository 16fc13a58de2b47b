//! What is sent: per probe prompt, a script of steps (each a group of requests in flight
//! together) and the comparisons its replies answer, one per axis. Seeded: the same settings
//! give the same token ids.

use crate::EngineError;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// One way an engine can route a token differently from a trainer that recomputes every token
/// in one prefill, or differently across requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Axis {
    /// A request alone against the same request in flight with others of other lengths.
    Batch,
    /// A request whose prefix is served from the prefix cache against a salted recompute.
    Cache,
    /// The cached rows against the rows of the request that filled the cache.
    Stale,
    /// Generated tokens (one decode step each) against the same tokens recomputed as a prompt.
    Decode,
    /// A prompt's rows with one generated token against with many (greedy).
    Continuation,
    /// The same requests on a second server that differs in one setting (`--against`).
    Against,
    /// The same request twice.
    Repeat,
}

impl Axis {
    /// Every axis, in report order.
    pub const ALL: [Axis; 7] =
        [Axis::Batch, Axis::Cache, Axis::Stale, Axis::Decode, Axis::Continuation, Axis::Against, Axis::Repeat];

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Axis::Batch => "batch",
            Axis::Cache => "cache",
            Axis::Stale => "stale",
            Axis::Decode => "decode",
            Axis::Continuation => "continuation",
            Axis::Against => "against",
            Axis::Repeat => "repeat",
        }
    }

    /// What its two sides are.
    pub fn about(self) -> &'static str {
        match self {
            Axis::Batch => "a request alone vs in flight with batch-mates of other lengths",
            Axis::Cache => "a prefix served from the cache vs recomputed (salted)",
            Axis::Stale => "the cached rows vs the rows of the request that filled the cache",
            Axis::Decode => "generated tokens' rows (decode) vs the same tokens recomputed as a prompt",
            Axis::Continuation => "a prompt's rows with 1 generated token vs with many",
            Axis::Against => "the same requests on the second server (--against)",
            Axis::Repeat => "the same request twice",
        }
    }
}

/// The audit's settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    /// Seed of every prompt.
    pub seed: u64,
    /// Probe prompts.
    pub prompts: usize,
    /// Shortest and longest probe prompt (tokens).
    pub prompt_len: (usize, usize),
    /// Tokens generated per probe (at least 2: the decode axis compares all but the last).
    pub generate: usize,
    /// Batch-mates in flight with each probe.
    pub mates: usize,
    /// Token ids are drawn from `[0, vocab)`.
    pub vocab: u32,
    /// Length of the prompt that fills the cache (the cache and stale axes): engines cache whole
    /// blocks only (vLLM's CPU build: 128 tokens, its GPU build 16; SGLang 1).
    pub cache_len: usize,
    /// Tokens appended to the cached prompt.
    pub extension: usize,
    /// Long prompts for the second server (chunking), and their length.
    pub long_prompts: usize,
    /// Length of a long prompt.
    pub long_len: usize,
    /// The most requests in flight at once.
    pub concurrency: usize,
    /// The axes run.
    pub axes: Vec<Axis>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            seed: 0,
            prompts: 8,
            prompt_len: (32, 96),
            generate: 8,
            mates: 5,
            vocab: 256,
            cache_len: 256,
            extension: 16,
            long_prompts: 2,
            long_len: 512,
            concurrency: 8,
            axes: Axis::ALL.to_vec(),
        }
    }
}

impl Settings {
    /// Rules the flags cannot say, each as one line naming the setting.
    pub fn check(&self, against: bool) -> Result<(), EngineError> {
        let (lo, hi) = self.prompt_len;
        let rules = [
            (self.prompts == 0, "prompts must be at least 1".to_string()),
            (lo == 0 || lo > hi, format!("prompt lengths {lo}..{hi}: give 1 <= shortest <= longest")),
            (self.generate < 2, "generate must be at least 2 (the decode axis compares all but the last)".into()),
            (self.vocab < 2, "vocab must be at least 2".into()),
            (
                (self.axes.contains(&Axis::Cache) || self.axes.contains(&Axis::Stale)) && self.cache_len == 0,
                "the cache prompt must be at least 1 token".into(),
            ),
            (self.concurrency == 0, "concurrency must be at least 1".into()),
            (
                self.axes.contains(&Axis::Batch) && self.mates + 1 > self.concurrency,
                format!(
                    "{} batch-mates and the probe make {} requests in flight, over the concurrency limit {}",
                    self.mates,
                    self.mates + 1,
                    self.concurrency
                ),
            ),
            (self.axes.contains(&Axis::Batch) && self.mates == 0, "mates must be at least 1 for the batch axis".into()),
            (self.axes.contains(&Axis::Against) && !against, "the against axis needs a second server".into()),
            (self.axes.is_empty(), "no axis to run".into()),
        ];
        rules.into_iter().find(|(bad, _)| *bad).map_or(Ok(()), |(_, why)| Err(EngineError::Settings { why }))
    }

    /// The longest sequence a request of the audit holds (prompt and generated).
    pub fn longest(&self) -> usize {
        let probe = (self.prompt_len.1 + self.generate).max(self.cache_len + self.extension + self.generate);
        if self.axes.contains(&Axis::Against) {
            probe.max(self.long_len + self.generate)
        } else {
            probe
        }
    }
}

/// A request as planned: its prompt, tokens to generate, and its prefix-cache namespace (a slot
/// of the script: the same slot, the same salt).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Planned {
    /// The prompt.
    pub prompt: Prompt,
    /// Tokens to generate.
    pub max_tokens: usize,
    /// The salt slot.
    pub salt: usize,
}

/// A prompt: token ids, or an earlier reply's tokens (prompt and generated), then more ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Prompt {
    /// These ids.
    Tokens(Vec<u32>),
    /// The tokens of reply `index` of step `step`, then `then`.
    Reply {
        /// Its step.
        step: usize,
        /// Its index in the step.
        index: usize,
        /// Ids appended.
        then: Vec<u32>,
    },
}

/// Requests sent together (all in flight at once) to one server (0: the audited, 1: `--against`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    /// The server.
    pub server: usize,
    /// The requests.
    pub requests: Vec<Planned>,
}

/// A reply of a script: its step and index there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Take {
    /// The step.
    pub step: usize,
    /// The request's index in the step.
    pub index: usize,
}

/// One comparison: the axis and its two replies (the first is the reference).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pairing {
    /// The axis.
    pub axis: Axis,
    /// The reference.
    pub a: Take,
    /// The other side.
    pub b: Take,
}

/// A probe's steps, sent in order, and the comparisons of their replies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Script {
    /// The probe's number.
    pub probe: usize,
    /// The steps.
    pub steps: Vec<Step>,
    /// The comparisons.
    pub pairings: Vec<Pairing>,
}

impl Script {
    /// Requests sent.
    pub fn requests(&self) -> usize {
        self.steps.iter().map(|s| s.requests.len()).sum()
    }

    /// The script one pairing needs: the steps up to its later side, and that pairing alone.
    pub fn only(&self, pairing: Pairing) -> Script {
        let last = pairing.a.step.max(pairing.b.step);
        Script { probe: self.probe, steps: self.steps[..=last].to_vec(), pairings: vec![pairing] }
    }
}

impl Script {
    /// Adds a step of `requests` to `server`; the [`Take`] of its request `index`.
    fn push(&mut self, server: usize, requests: Vec<Planned>, index: usize) -> Take {
        self.steps.push(Step { server, requests });
        Take { step: self.steps.len() - 1, index }
    }

    /// A salt slot no request of the script has used.
    fn fresh_salt(&self) -> usize {
        self.requests()
    }
}

/// The scripts of an audit: one per probe prompt (and per long prompt with a second server).
/// The draws are in a fixed order (probe length, probe, mates, cache prompt; long prompts last),
/// so a seed names the same requests whatever the axes.
pub fn scripts(settings: &Settings) -> Vec<Script> {
    let mut rng = ChaCha8Rng::seed_from_u64(settings.seed);
    let mut out: Vec<Script> = (0..settings.prompts).map(|probe| probe_script(probe, settings, &mut rng)).collect();
    if settings.axes.contains(&Axis::Against) {
        for n in 0..settings.long_prompts {
            let prompt = draw(&mut rng, settings.long_len, settings.vocab);
            let req = |salt| Planned { prompt: Prompt::Tokens(prompt.clone()), max_tokens: settings.generate, salt };
            let mut s = Script { probe: settings.prompts + n, steps: Vec::new(), pairings: Vec::new() };
            let a = s.push(0, vec![req(0)], 0);
            let b = s.push(1, vec![req(1)], 0);
            s.pairings.push(Pairing { axis: Axis::Against, a, b });
            out.push(s);
        }
    }
    out
}

/// One probe prompt's script: the probe alone (step 0, every axis's reference but cache's), then
/// each axis's other side.
fn probe_script(probe: usize, settings: &Settings, rng: &mut ChaCha8Rng) -> Script {
    let on = |axis| settings.axes.contains(&axis);
    let (lo, hi) = settings.prompt_len;
    let len = rng.random_range(lo..=hi);
    let prompt = draw(rng, len, settings.vocab);
    let g = settings.generate;
    let alone = |salt| Planned { prompt: Prompt::Tokens(prompt.clone()), max_tokens: g, salt };
    let mut s = Script { probe, steps: Vec::new(), pairings: Vec::new() };
    let reference = s.push(0, vec![alone(0)], 0);
    let against_reference = |s: &mut Script, axis, server, requests, index| {
        let b = s.push(server, requests, index);
        s.pairings.push(Pairing { axis, a: reference, b });
    };
    if on(Axis::Repeat) {
        let r = alone(s.fresh_salt());
        against_reference(&mut s, Axis::Repeat, 0, vec![r], 0);
    }
    if on(Axis::Continuation) {
        let r = Planned { max_tokens: 1, ..alone(s.fresh_salt()) };
        against_reference(&mut s, Axis::Continuation, 0, vec![r], 0);
    }
    if on(Axis::Decode) {
        let prompt = Prompt::Reply { step: 0, index: 0, then: Vec::new() };
        let r = Planned { prompt, max_tokens: 1, salt: s.fresh_salt() };
        against_reference(&mut s, Axis::Decode, 0, vec![r], 0);
    }
    if on(Axis::Batch) {
        let (group, at) = batch_group(len, s.fresh_salt(), settings, rng);
        let group = group.into_iter().map(|p| p.unwrap_or_else(|| alone(s.fresh_salt() + settings.mates))).collect();
        against_reference(&mut s, Axis::Batch, 0, group, at);
    }
    if on(Axis::Cache) || on(Axis::Stale) {
        cache_steps(&mut s, settings, rng);
    }
    if on(Axis::Against) {
        let r = alone(s.fresh_salt());
        against_reference(&mut s, Axis::Against, 1, vec![r], 0);
    }
    s
}

/// The batch axis's group: `--mates` prompts of other lengths than the probe's (`len`), salted
/// from `first`, with a gap (`None`) in the middle for the probe; the gap's index.
fn batch_group(len: usize, first: usize, settings: &Settings, rng: &mut ChaCha8Rng) -> (Vec<Option<Planned>>, usize) {
    let (lo, hi) = settings.prompt_len;
    let mut group: Vec<Option<Planned>> = (0..settings.mates)
        .map(|m| {
            let mut n = rng.random_range(lo..=hi.max(lo + 1));
            if n == len {
                n = if n > lo { n - 1 } else { n + 1 };
            }
            let prompt = Prompt::Tokens(draw(rng, n, settings.vocab));
            Some(Planned { prompt, max_tokens: settings.generate, salt: first + m })
        })
        .collect();
    let at = settings.mates / 2;
    group.insert(at, None);
    (group, at)
}

/// The cache and stale axes: a prompt of whole cache blocks fills the cache in its own
/// namespace; the same prompt and new ids in that namespace hit it; the same in a fresh one
/// recompute it.
fn cache_steps(s: &mut Script, settings: &Settings, rng: &mut ChaCha8Rng) {
    let g = settings.generate;
    let fill = draw(rng, settings.cache_len, settings.vocab);
    let extended = [fill.clone(), draw(rng, settings.extension, settings.vocab)].concat();
    let salt = s.fresh_salt();
    let filled = s.push(0, vec![Planned { prompt: Prompt::Tokens(fill), max_tokens: g, salt }], 0);
    let hit = s.push(0, vec![Planned { prompt: Prompt::Tokens(extended.clone()), max_tokens: g, salt }], 0);
    if settings.axes.contains(&Axis::Stale) {
        s.pairings.push(Pairing { axis: Axis::Stale, a: filled, b: hit });
    }
    if settings.axes.contains(&Axis::Cache) {
        let fresh = Planned { prompt: Prompt::Tokens(extended), max_tokens: g, salt: s.fresh_salt() };
        let recomputed = s.push(0, vec![fresh], 0);
        s.pairings.push(Pairing { axis: Axis::Cache, a: recomputed, b: hit });
    }
}

fn draw(rng: &mut ChaCha8Rng, n: usize, vocab: u32) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(0..vocab)).collect()
}
