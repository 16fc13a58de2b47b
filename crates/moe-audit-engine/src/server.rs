//! A running engine: which one it is (vLLM or SGLang, told by its own endpoints), how a request
//! of token ids is put to it, and how its answer is read back into routes (by the records
//! crate's readers, the same that `routes compare` uses on saved responses).

use crate::http::{Answer, Client};
use crate::EngineError;
use bytes::Bytes;
use moe_audit_core::error::excerpt;
use moe_audit_records::{Budget, Layout};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::Duration;

/// The serving engines audited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// vLLM: `/v1/completions` with `return_token_ids`; routes in `choices[0].routed_experts`.
    Vllm,
    /// SGLang: `/generate` with `return_routed_experts`; routes in `meta_info.routed_experts`.
    Sglang,
}

impl Engine {
    /// Both, in the order `--engine` lists them.
    pub const ALL: [Engine; 2] = [Engine::Vllm, Engine::Sglang];

    /// Its name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
        }
    }

    /// One line on what is read from it.
    pub fn about(self) -> &'static str {
        match self {
            Engine::Vllm => "vLLM (0.22-0.33): /v1/completions, --enable-return-routed-experts",
            Engine::Sglang => "SGLang (0.5.10-0.5.23): /generate, --enable-return-routed-experts",
        }
    }

    fn shown(self) -> &'static str {
        match self {
            Engine::Vllm => "vLLM",
            Engine::Sglang => "SGLang",
        }
    }
}

/// What a server says about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerInfo {
    /// The URL it was reached at.
    pub url: String,
    /// The engine.
    pub engine: Engine,
    /// Its version, as it reports it.
    pub version: String,
    /// The model it serves.
    pub model: String,
    /// The settings it reports that bear on routing (SGLang's `/server_info`; vLLM reports
    /// only its context length outside its dev mode).
    pub settings: BTreeMap<String, String>,
}

/// SGLang's `/server_info` keys kept in the report: what changes how a request is scheduled,
/// cached or computed.
const SGLANG_SETTINGS: [&str; 12] = [
    "chunked_prefill_size",
    "disable_radix_cache",
    "enable_deterministic_inference",
    "enable_return_routed_experts",
    "ep_size",
    "max_prefill_tokens",
    "max_running_requests",
    "moe_a2a_backend",
    "moe_runner_backend",
    "page_size",
    "schedule_policy",
    "tp_size",
];

/// One request: token ids (no tokenizer enters), greedy, exactly `max_tokens` generated
/// (end-of-sequence ignored), in the prefix-cache namespace `salt`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_tokens: usize,
    /// The prefix-cache namespace (`cache_salt`): requests share cached prefixes only within one.
    pub salt: String,
}

/// What came back: the tokens and their routes.
#[derive(Debug, Clone)]
pub struct Reply {
    /// Prompt and generated tokens.
    pub tokens: Vec<u32>,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Prompt tokens served from the prefix cache, when the server says.
    pub cached: Option<usize>,
    /// Layers of each route row.
    pub layers: usize,
    /// Experts per decision.
    pub top_k: usize,
    /// `[rows, layers, top_k]` expert ids, row `r` the routing of the token at position `r`
    /// (-1: no route); the last generated token has none (it was never fed back).
    pub routes: Vec<i32>,
}

impl Reply {
    /// Route rows held.
    pub fn rows(&self) -> usize {
        self.routes.len() / (self.layers * self.top_k).max(1)
    }

    /// The rows of positions `range`.
    pub(crate) fn rows_at(&self, range: std::ops::Range<usize>) -> &[i32] {
        let w = self.layers * self.top_k;
        &self.routes[range.start * w..range.end * w]
    }
}

/// A connected server.
#[derive(Debug, Clone)]
pub struct Server {
    client: Client,
    /// What it said about itself.
    pub info: ServerInfo,
    layout: Option<Layout>,
    memory: moe_audit_core::MemoryBudget,
}

/// How to reach a server.
#[derive(Debug, Clone)]
pub struct Connect {
    /// Every request's limit.
    pub timeout: Duration,
    /// The engine the user says it is: another is refused.
    pub engine: Option<Engine>,
    /// The model's layer layout (`config.json`): SGLang's payload has no shape of its own.
    pub layout: Option<Layout>,
    /// Memory for reading one response's routes.
    pub memory: moe_audit_core::MemoryBudget,
}

impl Server {
    /// Reaches `url` and tells its engine: vLLM answers `GET /version`, SGLang `GET /server_info`.
    pub fn connect(url: &str, how: &Connect) -> Result<Server, EngineError> {
        // A response is read whole: at most a quarter of the memory limit.
        let client = Client::new(url, how.timeout, (how.memory.bytes() / 4).min(crate::http::MAX_RESPONSE))?;
        let info = identify(&client)?;
        if let Some(want) = how.engine {
            if want != info.engine {
                return Err(EngineError::Server {
                    url: client.base.clone(),
                    why: format!("it is {} {}, not {}", info.engine.shown(), info.version, want.shown()),
                });
            }
        }
        if info.engine == Engine::Sglang && how.layout.is_none() {
            return Err(EngineError::Server {
                url: client.base.clone(),
                why: "SGLang returns routes without their shape: give the model's config.json".into(),
            });
        }
        Ok(Server { client, info, layout: how.layout.clone(), memory: how.memory })
    }

    /// The model's layer layout, when given.
    pub fn layout(&self) -> Option<&Layout> {
        self.layout.as_ref()
    }

    /// The server's base URL.
    pub fn url(&self) -> &str {
        &self.client.base
    }

    /// Sends `request` and reads its reply (`n` names it in errors).
    pub fn generate(&self, request: &Request, n: usize) -> Result<Reply, EngineError> {
        let (path, body) = self.body(request);
        let at = format!("{}{path} (request {n})", self.client.base);
        let answer = self.client.post(path, &body)?;
        let doc = json_of(&at, &answer)?;
        let (output, cached) = match self.info.engine {
            Engine::Vllm => vllm_tokens(&at, &doc, request)?,
            Engine::Sglang => sglang_tokens(&at, &doc)?,
        };
        if output.len() != request.max_tokens {
            return Err(EngineError::Response {
                at,
                why: format!("{} tokens generated, {} asked (ignore_eos is set)", output.len(), request.max_tokens),
            });
        }
        let (layers, top_k, routes) = self.routes(&at, answer.body, request.prompt.len(), output.len())?;
        let mut tokens = request.prompt.clone();
        tokens.extend(output);
        Ok(Reply { tokens, prompt_len: request.prompt.len(), cached, layers, top_k, routes })
    }

    /// The engine's endpoint and body for `request`.
    fn body(&self, request: &Request) -> (&'static str, Value) {
        match self.info.engine {
            Engine::Vllm => (
                "/v1/completions",
                json!({
                    "model": self.info.model,
                    "prompt": request.prompt,
                    "max_tokens": request.max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": true,
                    "return_token_ids": true,
                    "cache_salt": request.salt,
                }),
            ),
            Engine::Sglang => (
                "/generate",
                json!({
                    "input_ids": request.prompt,
                    "sampling_params": {
                        "max_new_tokens": request.max_tokens,
                        "temperature": 0.0,
                        "ignore_eos": true,
                    },
                    "return_routed_experts": true,
                    "cache_salt": request.salt,
                }),
            ),
        }
    }

    /// The routes of an answer, read by the records crate's reader of its engine and checked
    /// against the token counts: (layers, top-k, `[rows, layers, top_k]` from position 0).
    fn routes(
        &self,
        at: &str,
        body: Vec<u8>,
        prompt: usize,
        generated: usize,
    ) -> Result<(usize, usize, Vec<i32>), EngineError> {
        let mut budget = Budget::new(self.memory);
        let record = moe_audit_records::from_bytes(at, Bytes::from(body), self.layout.as_ref(), None, &mut budget)
            .map_err(|e| EngineError::Routes { at: at.to_string(), why: e.to_string() })?;
        let expect = prompt + generated - 1;
        let first = record.sequences.first().map_or(0, |s| s.first_position);
        if record.tokens + first != expect || record.sequences.len() != 1 {
            return Err(EngineError::Response {
                at: at.to_string(),
                why: format!(
                    "{} route rows from position {first}, {expect} expected (prompt {prompt} + generated {generated} - 1)",
                    record.tokens
                ),
            });
        }
        if record.is_empty() {
            return Err(EngineError::Server {
                url: self.client.base.clone(),
                why: "its routes hold no expert choice (every id 0): not an MoE model, or the engine's capture \
                      does not run on this path (vLLM's CPU build without the moe_audit.vllm_cpu_capture plugin)"
                    .into(),
            });
        }
        let (layers, top_k) = (record.layers.len(), record.top_k);
        let mut routes = vec![-1; first * layers * top_k];
        let mut rows = Vec::new();
        record.rows(0..record.tokens, &mut rows);
        routes.extend(rows);
        Ok((layers, top_k, routes))
    }
}

fn json_of(at: &str, answer: &Answer) -> Result<Value, EngineError> {
    if answer.status != 200 {
        return Err(EngineError::Status {
            at: at.to_string(),
            status: answer.status,
            body: excerpt(&String::from_utf8_lossy(&answer.body)),
        });
    }
    serde_json::from_slice(&answer.body)
        .map_err(|e| EngineError::Response { at: at.to_string(), why: format!("not JSON ({e})") })
}

fn ids(at: &str, v: Option<&Value>, what: &str) -> Result<Vec<u32>, EngineError> {
    let bad = || EngineError::Response { at: at.to_string(), why: format!("`{what}` is not a list of token ids") };
    v.and_then(Value::as_array)
        .ok_or_else(bad)?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(bad))
        .collect()
}

/// vLLM: the generated ids (`choices[0].token_ids`), the prompt checked as sent, and the cached
/// prompt tokens (`usage.prompt_tokens_details`, with `--enable-prompt-tokens-details`).
/// vllm/entrypoints/openai/completion/serving.py @v0.33.0 L629-655.
fn vllm_tokens(at: &str, doc: &Value, request: &Request) -> Result<(Vec<u32>, Option<usize>), EngineError> {
    let choice = doc.pointer("/choices/0").ok_or_else(|| EngineError::Response {
        at: at.to_string(),
        why: "no `choices[0]`: not a completion response".into(),
    })?;
    if choice.get("routed_experts").is_none_or(Value::is_null) {
        return Err(EngineError::Server {
            url: at.to_string(),
            why: "it returned no routes (`routed_experts` null): start vLLM with --enable-return-routed-experts".into(),
        });
    }
    let prompt = ids(at, choice.get("prompt_token_ids"), "prompt_token_ids")?;
    if prompt != request.prompt {
        return Err(EngineError::Response {
            at: at.to_string(),
            why: format!("the server ran a prompt of {} tokens, {} sent", prompt.len(), request.prompt.len()),
        });
    }
    let output = ids(at, choice.get("token_ids"), "token_ids")?;
    let cached = doc.pointer("/usage/prompt_tokens_details/cached_tokens").and_then(Value::as_u64);
    Ok((output, cached.map(|c| c as usize)))
}

/// SGLang: the generated ids (`output_ids`) and `meta_info.cached_tokens`.
/// sglang/srt/managers/tokenizer_manager.py @v0.5.23 L2557 (`cached_tokens`), L2665-2669 (a
/// finished non-streaming answer carries every `output_ids`).
fn sglang_tokens(at: &str, doc: &Value) -> Result<(Vec<u32>, Option<usize>), EngineError> {
    if doc.pointer("/meta_info/routed_experts").is_none_or(Value::is_null) {
        return Err(EngineError::Server {
            url: at.to_string(),
            why: "it returned no routes (`meta_info.routed_experts`): start SGLang with --enable-return-routed-experts"
                .into(),
        });
    }
    let output = ids(at, doc.get("output_ids"), "output_ids")?;
    let cached = doc.pointer("/meta_info/cached_tokens").and_then(Value::as_u64);
    Ok((output, cached.map(|c| c as usize)))
}

/// Which engine answers at `client`, its version and model.
fn identify(client: &Client) -> Result<ServerInfo, EngineError> {
    let base = &client.base;
    let version = client.get("/version")?;
    let vllm = (version.status == 200)
        .then(|| serde_json::from_slice::<Value>(&version.body).ok())
        .flatten()
        .and_then(|v| v.get("version").and_then(Value::as_str).map(str::to_string));
    if let Some(version) = vllm {
        let at = format!("{base}/v1/models");
        let models = json_of(&at, &client.get("/v1/models")?)?;
        let model = models
            .pointer("/data/0/id")
            .and_then(Value::as_str)
            .ok_or_else(|| EngineError::Response { at: at.clone(), why: "no `data[0].id`: no model served".into() })?;
        let mut settings = BTreeMap::new();
        if let Some(n) = models.pointer("/data/0/max_model_len").and_then(Value::as_u64) {
            settings.insert("max_model_len".into(), n.to_string());
        }
        return Ok(ServerInfo { url: base.clone(), engine: Engine::Vllm, version, model: model.into(), settings });
    }
    let info = client.get("/server_info")?;
    let doc = (info.status == 200).then(|| serde_json::from_slice::<Value>(&info.body).ok()).flatten();
    let Some(doc) = doc.filter(|d| d.get("version").is_some_and(Value::is_string)) else {
        return Err(EngineError::Server {
            url: base.clone(),
            why: format!(
                "not vLLM or SGLang: GET /version answered HTTP {}, GET /server_info HTTP {}",
                version.status, info.status
            ),
        });
    };
    let text = |v: &Value| v.as_str().map_or_else(|| v.to_string(), str::to_string);
    let settings: BTreeMap<String, String> =
        SGLANG_SETTINGS.iter().filter_map(|&k| doc.get(k).map(|v| (k.to_string(), text(v)))).collect();
    if settings.get("enable_return_routed_experts").is_some_and(|v| v == "false") {
        return Err(EngineError::Server {
            url: base.clone(),
            why: "SGLang was started without --enable-return-routed-experts".into(),
        });
    }
    let model = doc.get("model_path").or_else(|| doc.get("served_model_name")).map_or_else(String::new, text);
    Ok(ServerInfo { url: base.clone(), engine: Engine::Sglang, version: text(&doc["version"]), model, settings })
}
