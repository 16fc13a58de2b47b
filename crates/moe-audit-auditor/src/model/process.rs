//! A model in another process over `moe-audit/3`, with the guarantees of a `/2` router: the
//! same conversation ([`crate::external::process`]: its own process group killed on any error,
//! on drop and on a signal; every write and read bounded by the timeout; a line or payload
//! bounded by the memory limit and checked before it is allocated), errors naming the request.

use super::protocol::{frame_request, ResponseHeader};
use super::{Model, ModelInfo, ModelOutput, TokenCall};
use crate::external::process::Peer;
use moe_audit_core::error::Result;
use moe_audit_core::MemoryBudget;
use std::time::Duration;

/// A model behind a command (`model --cmd "python3 serve.py"`).
pub struct ModelProcess {
    peer: Peer,
    info: ModelInfo,
}

impl ModelProcess {
    /// Spawns `command` with `sh -c` and reads its handshake. `timeout` bounds the handshake and
    /// every write and read; a line or payload it sends is bounded by `budget`.
    pub fn spawn(command: &str, timeout: Duration, budget: MemoryBudget) -> Result<Self> {
        let peer = Peer::spawn("model", command, timeout, budget)?;
        let info = peer.handshake(ModelInfo::validate)?;
        Ok(ModelProcess { peer, info })
    }
}

impl Model for ModelProcess {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn call(&self, call: &TokenCall) -> Result<ModelOutput> {
        self.info.check_call(call)?;
        let id = self.peer.next_id()?;
        let what = format!("request {id} ({})", call.describe());
        self.peer.send(frame_request(id, call), &what)?;
        let line = self.peer.receive_line(&what)?;
        let fail =
            |e: moe_audit_core::error::ProtocolError| self.peer.fail(moe_audit_core::text!(format!("{what}: "), e));
        let header = ResponseHeader::parse(&line).map_err(fail)?;
        let len = header.payload_len(&self.info, id, call.tokens.len(), self.peer.read_limit() as u64).map_err(fail)?;
        let payload = self.peer.receive_bytes(len, &what)?;
        let out = header.decode(&self.info, call, &payload).map_err(fail)?;
        self.info.check_output(call, &out).map_err(fail)?;
        Ok(out)
    }
}
