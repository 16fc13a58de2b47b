//! HTTP to the server: one agent, a timeout on every request, bounded reads, no redirects. A
//! server's responses are untrusted input (SECURITY.md): every body is read up to a limit and
//! every failure is one [`EngineError`] naming the URL.

use crate::EngineError;
use std::time::Duration;

/// The most bytes of one response read: a routes payload of 1 GiB would be a 32k-token
/// sequence of a 64-layer model with top-8 as int32, base64.
pub(crate) const MAX_RESPONSE: u64 = 1 << 30;

/// A plain-HTTP client of one server.
#[derive(Debug, Clone)]
pub(crate) struct Client {
    agent: ureq::Agent,
    /// `http://host:port`, no trailing slash.
    pub base: String,
    timeout: Duration,
    limit: u64,
}

/// A response: its status and body (read whole, within the limit).
pub(crate) struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Client {
    /// A client of `url` (`http://host:port`, optionally a path prefix).
    pub fn new(url: &str, timeout: Duration, limit: u64) -> Result<Client, EngineError> {
        let base = url.trim_end_matches('/').to_string();
        let rest = base.strip_prefix("http://").ok_or_else(|| EngineError::Url {
            url: url.to_string(),
            why: if base.starts_with("https://") {
                "https is not supported: engines serve plain HTTP; reach the server on its own port".into()
            } else {
                "not an http:// URL".into()
            },
        })?;
        if rest.is_empty() || rest.starts_with('/') {
            return Err(EngineError::Url { url: url.to_string(), why: "no host".into() });
        }
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .http_status_as_error(false)
            .max_redirects(0)
            .build()
            .new_agent();
        Ok(Client { agent, base, timeout, limit })
    }

    /// GET `path`.
    pub fn get(&self, path: &str) -> Result<Answer, EngineError> {
        let url = format!("{}{path}", self.base);
        let response = self.agent.get(&url).call();
        self.answer(&url, response)
    }

    /// POST `body` as JSON to `path`.
    pub fn post(&self, path: &str, body: &serde_json::Value) -> Result<Answer, EngineError> {
        let url = format!("{}{path}", self.base);
        let response = self.agent.post(&url).header("content-type", "application/json").send(body.to_string());
        self.answer(&url, response)
    }

    fn answer(
        &self,
        url: &str,
        response: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<Answer, EngineError> {
        let failed = |e: ureq::Error| match e {
            ureq::Error::Timeout(_) => {
                EngineError::Timeout { url: url.to_string(), seconds: self.timeout.as_secs_f64() }
            }
            ureq::Error::BodyExceedsLimit(n) => EngineError::TooLarge { url: url.to_string(), limit: n },
            e => EngineError::Connection { url: url.to_string(), source: Box::new(e) },
        };
        let mut response = response.map_err(failed)?;
        let status = response.status().as_u16();
        let body = response.body_mut().with_config().limit(self.limit).read_to_vec().map_err(failed)?;
        Ok(Answer { status, body })
    }
}
