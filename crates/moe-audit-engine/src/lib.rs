//! A live serving engine audited for routing that depends on what a request must not see.
//!
//! A trainer recomputes every token of a rollout in one prefill; an engine routed it among
//! batch-mates, from its prefix cache, in prefill chunks, one decode step at a time. Each of
//! those is a way for the engine's routes to differ from the trainer's (and, across requests, a
//! causality leak). The audit sends seeded requests of token ids to a running vLLM or SGLang
//! server and compares the routes it returns, axis by axis ([`Axis`]).
//!
//! The data flows one way: `plan` (seeded scripts of requests, one per probe prompt) → `server`
//! (a request put to the engine, its reply read back into routes by the records crate's readers)
//! → `audit` (the scripts run, each pairing's rows compared) → `witness` (the script of a change,
//! replayed). `http` is the bounded client beneath `server`.

#![warn(missing_docs)]

mod audit;
mod http;
mod plan;
mod server;
mod witness;

pub use audit::{audit, AxisReport, Change, Divergence, Report, Run};
pub use plan::{scripts, Axis, Pairing, Planned, Prompt, Script, Settings, Step, Take};
pub use server::{Connect, Engine, Reply, Request, Server, ServerInfo};
pub use witness::{replay, Witness, WITNESS_VERSION};

/// What can go wrong talking to a server: each says what and where in one line.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A URL that is not `http://host[:port]`.
    #[error("{url}: {why}")]
    Url {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        why: String,
    },
    /// No answer within the timeout.
    #[error("{url}: no answer within {seconds} s (the request timeout)")]
    Timeout {
        /// The request's URL.
        url: String,
        /// The timeout.
        seconds: f64,
    },
    /// A response over the size limit.
    #[error("{url}: the response is over {limit} bytes")]
    TooLarge {
        /// The request's URL.
        url: String,
        /// The limit.
        limit: u64,
    },
    /// The connection failed or dropped.
    #[error("{url}: {source}")]
    Connection {
        /// The request's URL.
        url: String,
        /// The client's error.
        #[source]
        source: Box<ureq::Error>,
    },
    /// An answer other than 200.
    #[error("{at}: HTTP {status}: {body}")]
    Status {
        /// The request.
        at: String,
        /// Its status.
        status: u16,
        /// The start of its body.
        body: String,
    },
    /// A 200 answer that is not what the engine writes.
    #[error("{at}: {why}")]
    Response {
        /// The request.
        at: String,
        /// What is wrong.
        why: String,
    },
    /// The routes of an answer could not be read.
    #[error("{at}: routes: {why}")]
    Routes {
        /// The request.
        at: String,
        /// The reader's error.
        why: String,
    },
    /// The server is not one the audit can use.
    #[error("{url}: {why}")]
    Server {
        /// The server.
        url: String,
        /// Why not.
        why: String,
    },
    /// Settings that cannot run.
    #[error("{why}")]
    Settings {
        /// Why not.
        why: String,
    },
}

/// Kept as the source of the library's error, so the chain the binary prints ends with it.
impl From<EngineError> for moe_audit_core::Error {
    fn from(e: EngineError) -> Self {
        moe_audit_core::Error::System { what: e.to_string(), source: Box::new(e) }
    }
}
