//! The `.snap` file: a TOML header saying how the routing was made (enough to make it again),
//! then one section per mode holding exactly [`snapshot`](super::snapshot)'s text.
//!
//! ```text
//! # moe-audit routing snapshot. Compare: moe-audit snapshot check FILE; rewrite: moe-audit snapshot update FILE.
//! format = "moe-audit-snapshot/2"
//! ...
//! header_sha256 = "…"
//! ...
//! [router]
//! source = "preset"
//! name = "megatron-probs"
//!
//! [input]
//! ...
//! === train ===
//! router megatron-probs | batch 2 x seq 8 | ...
//! ```

use crate::external::{InputKind, Mode};
use moe_audit_core::error::{excerpt, excerpt_long, Error, Result, Text};
use moe_audit_core::text;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The format tag of a snapshot file.
pub const FORMAT: &str = "moe-audit-snapshot/2";
/// The format before the header seal: `--update` migrates it, `--check` refuses it (an unsealed
/// header could be edited unnoticed).
pub(crate) const FORMAT_UNSEALED: &str = "moe-audit-snapshot/1";
/// Decimals of the weights in the routing text ([`render_table`](moe_audit_core::routing::render_table)).
pub(crate) const WEIGHT_DECIMALS: u32 = 4;

const COMMENT: &str =
    "# moe-audit routing snapshot. Compare: moe-audit snapshot check FILE; rewrite: moe-audit snapshot update FILE.\n";

/// How a snapshot was made: the first part of the file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Header {
    /// Always [`FORMAT`].
    pub format: String,
    /// The moe-audit version that wrote it (informative; the format tag decides compatibility).
    pub moe_audit: String,
    /// Decimals of the weights; a weight may move by one unit of the last decimal (float noise
    /// rounding across a boundary) without failing a check.
    pub weight_decimals: u32,
    /// The modes routed, one section each.
    pub modes: Vec<Mode>,
    /// Hex sha256 of the header as written with this field empty ([`Header::sealed`]): any edit
    /// of a value of the header (router, command, sizes, seed, modes, hashes) breaks it, so a
    /// check refuses an edited header instead of making what it now says. Empty in the unsealed
    /// format.
    #[serde(default)]
    pub header_sha256: String,
    /// The router.
    pub router: RouterSource,
    /// The inputs it routed.
    pub input: InputSpec,
}

impl Header {
    /// Parses the header part of a file (up to its first section) and checks its seal; errors
    /// name `path`. The unsealed format is refused, naming how to migrate it.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let header = Self::parse_unsealed(text, path)?;
        if header.format == FORMAT_UNSEALED {
            return Err(Error::input(
                path,
                text!(format!("format `{FORMAT_UNSEALED}` has no header seal (an edit of it would go unnoticed): read its header, then migrate it with "), crate::settings::UPDATE, format!(" {}", path.display())),
            ));
        }
        Ok(header)
    }

    /// [`Header::parse`], also reading the unsealed format (to migrate it with `--update`); a
    /// sealed header must still match its seal.
    pub fn parse_unsealed(text: &str, path: &Path) -> Result<Self> {
        let bad = |message: Text| Error::input(path, message);
        let header: Header = toml::from_str(text).map_err(|e| {
            bad(format!("not a moe-audit snapshot header: {}", excerpt_long(e.to_string().replace('\n', " "))).into())
        })?;
        if header.format != FORMAT && header.format != FORMAT_UNSEALED {
            return Err(bad(format!("format `{}`, this moe-audit reads `{FORMAT}`", excerpt(&header.format)).into()));
        }
        if header.weight_decimals != WEIGHT_DECIMALS {
            return Err(bad(format!(
                "weight_decimals = {}, this moe-audit renders {WEIGHT_DECIMALS}",
                header.weight_decimals
            )
            .into()));
        }
        if header.format == FORMAT && header.header_sha256 != header.sealed().header_sha256 {
            return Err(bad(
                text!("the header does not match its `header_sha256` (edited or corrupted): nothing is made from it; make the snapshot again (`moe-audit snapshot record ROUTER ", crate::settings::OUTPUT, " FILE`)"),
            ));
        }
        Ok(header)
    }

    /// This header in the current format with its seal set: the sha256 of its TOML with
    /// `header_sha256` empty. A seal is no signature (anyone can reseal an edit): it makes a
    /// hand edit, a bad merge or corruption an error rather than a silent new recipe, and a
    /// reviewer sees a resealed header change in the diff.
    pub fn sealed(&self) -> Self {
        let mut h = Header { format: FORMAT.into(), header_sha256: String::new(), ..self.clone() };
        h.header_sha256 = sha256(toml::to_string(&h).expect("a header always serialises").as_bytes());
        h
    }
}

/// Where the router comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "source", rename_all = "kebab-case", deny_unknown_fields)]
pub enum RouterSource {
    /// A built-in preset, with a seeded gate.
    Preset {
        /// The preset name.
        name: String,
    },
    /// A router TOML file, with a seeded gate.
    Config {
        /// The file, relative to the directory the snapshot is checked from.
        path: String,
        /// sha256 of the file when the snapshot was made.
        sha256: String,
    },
    /// A preset or TOML router on a gate matrix from a checkpoint (`--weights --gate`).
    Gate {
        /// The preset name or TOML file.
        router: String,
        /// The safetensors file.
        weights: String,
        /// The gate tensor.
        gate: String,
        /// The selection-only bias tensor.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bias: Option<String>,
        /// sha256 of the weights file when the snapshot was made.
        sha256: String,
    },
    /// A command speaking `moe-audit/1` (`--router-cmd`).
    Command {
        /// The command, run with `sh -c`.
        command: String,
        /// Seconds to wait for the handshake and each answer.
        timeout: f64,
    },
    /// Trace files answered by a harness (`moe-audit plan`, `--traces DIR`).
    Traces {
        /// The trace directory.
        dir: String,
        /// sha256 of its `decisions.jsonl` when the snapshot was made.
        sha256: String,
    },
    /// A router answered in-process by a harness that re-runs it to check (the Python helper):
    /// `moe-audit snapshot plan DIR` wrote the inputs, the harness answered them.
    Harness {
        /// The router's name.
        name: String,
        /// Number of experts E.
        experts: usize,
        /// Experts per token; absent for expert choice.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        top_k: Option<usize>,
        /// What its rows hold.
        input: InputKind,
        /// Hidden size H (with `input = "hidden"`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        hidden_size: Option<usize>,
    },
}

/// The inputs routed in every mode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputSpec {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Where the rows come from.
    pub rows: Rows,
    /// Seed of the seeded rows and of a preset's or TOML router's gate.
    pub seed: u64,
    /// Hidden size of the seeded hidden states and gate (presets and TOML routers fed hidden
    /// states).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden: Option<usize>,
    /// The rows file (`rows = "logits"` or `"hidden-states"`): a JSON array of rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// sha256 of the routed rows (f32 little-endian, every mode in order): a check refuses to
    /// compare routings of other inputs.
    pub sha256: String,
}

/// What the rows of the input are and where they come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Rows {
    /// Standard normal from the seed: hidden states for a router with a gate, its rows for an
    /// external router.
    Seeded,
    /// Logits from `file`.
    Logits,
    /// Hidden states from `file`.
    HiddenStates,
    /// The first call of each mode in a trace directory.
    Traces,
}

/// A parsed snapshot file.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotFile {
    /// How it was made.
    pub header: Header,
    /// Per mode, the routing text ([`snapshot`](super::snapshot)).
    pub sections: Vec<(Mode, String)>,
}

fn section_line(mode: Mode) -> String {
    format!("=== {mode} ===\n")
}

impl SnapshotFile {
    /// The file's text.
    pub fn render(&self) -> String {
        let mut out = String::from(COMMENT);
        out.push_str(&toml::to_string(&self.header.sealed()).expect("a header always serialises"));
        for (mode, text) in &self.sections {
            out.push_str(&section_line(*mode));
            out.push_str(text);
        }
        out
    }

    /// Parses a file's text; errors name `path` and the line.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let bad = |message: Text| Error::input(path, message);
        let mut sections: Vec<(Mode, String)> = Vec::new();
        let mut header_text = String::new();
        for (i, line) in text.split_inclusive('\n').enumerate() {
            let mode = match line.trim_end() {
                "=== train ===" => Some(Mode::Train),
                "=== inference ===" => Some(Mode::Inference),
                l if l.starts_with("===") => {
                    return Err(bad(format!("line {}: unknown section `{}`", i + 1, excerpt(l)).into()))
                }
                _ => None,
            };
            match (mode, sections.last_mut()) {
                (Some(mode), _) => sections.push((mode, String::new())),
                (None, Some((_, body))) => body.push_str(line),
                (None, None) => header_text.push_str(line),
            }
        }
        let header = Header::parse(&header_text, path)?;
        let modes: Vec<Mode> = sections.iter().map(|(m, _)| *m).collect();
        if modes != header.modes {
            let names = |m: &[Mode]| m.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
            return Err(bad(format!(
                "the header lists modes [{}], the file has sections [{}]",
                names(&header.modes),
                names(&modes)
            )
            .into()));
        }
        Ok(SnapshotFile { header, sections })
    }

    /// Reads and parses a file.
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, "cannot read", e))?;
        Self::parse(&text, path)
    }
}

/// Writes `bytes` to `path` atomically: [`moe_audit_core::files::write_atomic`], which it forwards to.
#[deprecated(since = "0.3.0", note = "use `moe_audit::files::write_atomic`")]
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    moe_audit_core::files::write_atomic(path, bytes)
}

/// Hex sha256 of bytes.
pub(crate) fn sha256(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex(&Sha256::digest(bytes))
}

/// Hex sha256 of a file's content, read in fixed chunks: memory stays bounded whatever the size
/// (a checkpoint may be far larger than memory). Only a regular file is hashed: a FIFO or a
/// device (`/dev/zero`) has no end to reach.
pub(crate) fn file_sha256(path: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let cannot = |e: std::io::Error| Error::io(path, "cannot read", e);
    if !std::fs::metadata(path).map_err(cannot)?.is_file() {
        return Err(Error::input(path, "not a regular file"));
    }
    let mut file = std::fs::File::open(path).map_err(cannot)?;
    let (mut hasher, mut chunk) = (Sha256::new(), vec![0u8; 1 << 16]);
    loop {
        match file.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => hasher.update(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(cannot(e)),
        }
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> SnapshotFile {
        SnapshotFile {
            header: Header {
                format: FORMAT.into(),
                moe_audit: "0.1.0".into(),
                weight_decimals: 4,
                modes: vec![Mode::Train, Mode::Inference],
                header_sha256: String::new(),
                router: RouterSource::Harness {
                    name: "r".into(),
                    experts: 4,
                    top_k: Some(2),
                    input: InputKind::Logits,
                    hidden_size: None,
                },
                input: InputSpec {
                    batch: 1,
                    seq_len: 2,
                    rows: Rows::Seeded,
                    seed: 0,
                    hidden: None,
                    file: None,
                    sha256: "ab".into(),
                },
            },
            sections: vec![(Mode::Train, "a\nb\n".into()), (Mode::Inference, "c\n".into())],
        }
    }

    #[test]
    fn a_file_round_trips() {
        let text = file().render();
        assert!(text.contains("[router]\nsource = \"harness\"\n"), "{text}");
        let sealed = SnapshotFile { header: file().header.sealed(), ..file() };
        assert_eq!(SnapshotFile::parse(&text, Path::new("x.snap")).unwrap(), sealed);
        assert_eq!(sealed.render(), text);
    }

    #[test]
    fn every_edit_of_a_header_value_breaks_its_seal() {
        let p = Path::new("x.snap");
        let text = file().render();
        for (from, to) in [
            ("seed = 0", "seed = 1"),
            ("batch = 1", "batch = 1000000000"),
            ("name = \"r\"", "name = \"s\""),
            ("modes = [\"train\", \"inference\"]", "modes = [\"inference\", \"train\"]"),
            ("sha256 = \"ab\"", "sha256 = \"cd\""),
            ("moe_audit = \"0.1.0\"", "moe_audit = \"9.9.9\""),
        ] {
            assert!(text.contains(from), "{from}");
            let err = SnapshotFile::parse(&text.replace(from, to), p).unwrap_err().to_string();
            assert!(err.starts_with("x.snap: the header does not match its `header_sha256`"), "{to}: {err}");
        }
        // Layout is not content: a blank line or a comment changes no value.
        assert!(SnapshotFile::parse(&text.replace("seed = 0", "# a comment\nseed = 0\n"), p).is_ok());
        // The unsealed format: refused by a check, read to migrate.
        let old = text.replace(FORMAT, FORMAT_UNSEALED).replace("seed = 0", "seed = 1");
        let old: String = old.lines().filter(|l| !l.starts_with("header_sha256")).map(|l| format!("{l}\n")).collect();
        let err = SnapshotFile::parse(&old, p).unwrap_err().to_string();
        let update = text!(crate::settings::UPDATE, " x.snap").to_string();
        assert!(err.contains("`moe-audit-snapshot/1` has no header seal") && err.contains(&update), "{err}");
        let end = old.find("=== ").unwrap();
        assert_eq!(Header::parse_unsealed(&old[..end], p).unwrap().input.seed, 1);
    }

    #[test]
    fn bad_files_are_named() {
        let p = Path::new("x.snap");
        let text = file().render();
        let err = |t: &str| SnapshotFile::parse(t, p).unwrap_err().to_string();
        assert!(err("hello\n").starts_with("x.snap: not a moe-audit snapshot header"));
        assert!(err(&text.replace("source = \"harness\"", "source = \"nope\"")).contains("unknown variant `nope`"));
        assert!(err(&text.replace("seed = 0", "seed = 0\nextra = 1")).contains("unknown field `extra`"));
        assert!(err(&text.replace("snapshot/2", "snapshot/9")).contains("format `moe-audit-snapshot/9`"));
        assert_eq!(
            err(&text.replace("=== inference ===\n", "")),
            "x.snap: the header lists modes [train, inference], the file has sections [train]"
        );
        assert!(err(&text.replace("=== inference", "=== serve")).contains("unknown section `=== serve ===`"));
    }

    #[test]
    fn atomic_writes_leave_no_temporary() {
        let dir = std::env::temp_dir().join(format!("moe-audit-snap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.snap");
        moe_audit_core::files::write_atomic(&path, b"one").unwrap();
        moe_audit_core::files::write_atomic(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        assert!(moe_audit_core::files::write_atomic(&dir.join("missing/a.snap"), b"x").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
