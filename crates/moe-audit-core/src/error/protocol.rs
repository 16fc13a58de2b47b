//! [`ProtocolError`]: a peer's message that breaks the wire protocol.

use super::{excerpt_long, Text};
use crate::settings::MAX_MEMORY;

/// A message of a peer process (a router or a model over moe-audit/1-3, a line of a trace file)
/// that breaks the protocol: what the auditor's decoders find before anything is built from it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// A line that does not parse as the message it should be; the parser's error is the source
    /// (quoted in the message already, so the chain does not repeat it).
    #[error("not {expected} ({}): `{}`", excerpt_long(source), excerpt_long(line))]
    NotA {
        /// The message expected (`a response`, `a binary response header`).
        expected: &'static str,
        /// The line read.
        line: String,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
    /// A binary payload larger than the memory limit lets a peer send.
    #[error("a payload of {bytes} bytes is over {limit} ({})", Text::from(MAX_MEMORY))]
    PayloadOverLimit {
        /// What the header announced.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
    /// A message that parses but says what the protocol does not allow: what is wrong.
    #[error("{0}")]
    Breaks(Text),
}

impl From<String> for ProtocolError {
    fn from(what: String) -> Self {
        ProtocolError::Breaks(what.into())
    }
}

impl From<&str> for ProtocolError {
    fn from(what: &str) -> Self {
        ProtocolError::Breaks(what.into())
    }
}

impl From<Text> for ProtocolError {
    fn from(what: Text) -> Self {
        ProtocolError::Breaks(what)
    }
}

/// Equal when they say the same (a parser's error has no equality of its own).
impl PartialEq for ProtocolError {
    fn eq(&self, other: &Self) -> bool {
        self.to_string() == other.to_string()
    }
}

impl PartialEq<&str> for ProtocolError {
    fn eq(&self, other: &&str) -> bool {
        let said = self.to_string();
        said == *other
    }
}

/// As the words of a message that adds where (the request, the router), its setting kept typed.
impl From<ProtocolError> for Text {
    fn from(e: ProtocolError) -> Self {
        match e {
            ProtocolError::Breaks(t) => t,
            ProtocolError::PayloadOverLimit { bytes, limit } => {
                crate::text!(format!("a payload of {bytes} bytes is over {limit} ("), MAX_MEMORY, ")")
            }
            e @ ProtocolError::NotA { .. } => e.to_string().into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{chain, present, Error};
    use std::error::Error as _;

    #[test]
    fn a_protocol_error_keeps_its_parser_error_and_names_its_setting() {
        let source = serde_json::from_str::<serde_json::Value>("{\"a\"").unwrap_err();
        let e: Error = ProtocolError::NotA { expected: "a response", line: "{\"a\"".into(), source }.into();
        assert!(e.source().and_then(|s| s.downcast_ref::<serde_json::Error>()).is_some());
        // The parser's words are in the message once.
        assert_eq!(chain(&e), "not a response (EOF while parsing an object at line 1 column 4): `{\"a\"`");
        let e: Error = ProtocolError::PayloadOverLimit { bytes: 74, limit: 50 }.into();
        assert_eq!(e.to_string(), "a payload of 74 bytes is over 50 (setting `max_memory`)");
        assert_eq!(present(&e, |_| "--max-memory".into()), "a payload of 74 bytes is over 50 (--max-memory)");
        let t = Text::from(ProtocolError::PayloadOverLimit { bytes: 74, limit: 50 });
        assert_eq!(t.settings().collect::<Vec<_>>(), [MAX_MEMORY]);
    }
}
