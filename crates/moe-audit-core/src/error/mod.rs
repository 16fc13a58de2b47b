//! The library's one error type: every variant says what is wrong and where.

use std::fmt;
use std::path::PathBuf;

mod protocol;
mod record;
mod setting;

pub use protocol::ProtocolError;
pub use record::{Part, RecordError};
pub use setting::{library_name, with_names, Names, Setting, Text};

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in moe-audit, with enough context to act on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A router configuration failed to parse or validate.
    #[error("{source_name}: {field}: {message}")]
    Config {
        /// The file (or `preset:NAME`) the configuration came from.
        source_name: String,
        /// The dotted field path, e.g. `capacity.factor` (`-` when the whole document is wrong).
        field: String,
        /// What is wrong, including the offending value.
        message: String,
    },
    /// A router name that is neither a preset nor a file.
    #[error("unknown router `{}`: not a preset ({known}) and not a file", excerpt(name))]
    UnknownRouter {
        /// What the user asked for.
        name: String,
        /// The preset names, comma separated.
        known: String,
    },
    /// A score that routing cannot use (NaN or infinite).
    #[error("non-finite score {value} at batch {batch}, position {pos}, expert {expert}")]
    NonFiniteScore {
        /// Sequence index in the batch.
        batch: usize,
        /// Position in the sequence.
        pos: usize,
        /// Expert id.
        expert: usize,
        /// The offending value.
        value: f32,
    },
    /// Tensor or matrix shapes that do not fit together.
    #[error("shape mismatch in {context}: {message}")]
    Shape {
        /// Where the shapes met.
        context: String,
        /// Expected versus got.
        message: Text,
    },
    /// An input file that could not be read or parsed.
    #[error("{}: {message}", shown(path))]
    Input {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: Text,
    },
    /// A file or directory that could not be read, written or created: what failed, and the
    /// system's error as its source.
    #[error("{}: {doing}", shown(path))]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What failed (`cannot read`, `cannot write`, `cannot create`), with advice if any.
        doing: Text,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// A file whose content is not the document it should be (a witness, a plan manifest, a
    /// safetensors file): what it should have been, and the parser's error as its source.
    #[error("{}: {expected}", shown(path))]
    Parse {
        /// The file.
        path: PathBuf,
        /// What it is not (`not a witness`), or what could not be done with it.
        expected: String,
        /// The parser's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// What the system refused: a thread pool that cannot start, a record that cannot be
    /// serialised; the system's error as its source.
    #[error("{what}")]
    System {
        /// What could not be done.
        what: String,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Content that cannot be used as given, not a setting of the run: a witness of another
    /// model, a snapshot header's `[input]` that does not fit its router, a harness's answer
    /// that does not fit its plan.
    #[error("{0}")]
    Invalid(Text),
    /// A setting (a size, a limit, a list) that cannot be used; settings are named as
    /// [`Setting`]s in the [`Text`], so that a front end writes them its own way.
    #[error("{0}")]
    Usage(Text),
    /// A setting out of its range, named as a value: a front end writes it its own way.
    #[error("{}: {message}", Text::from(*setting))]
    Setting {
        /// The setting.
        setting: Setting,
        /// What is wrong, including the offending value.
        message: Text,
    },
    /// An expert-parallel rank failed; every rank stops with this error.
    #[error("rank {rank} failed: {message}")]
    Rank {
        /// The rank that failed first.
        rank: usize,
        /// Its error.
        message: String,
    },
    /// A peer's message that breaks the wire protocol.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// A routing record that cannot be read.
    #[error(transparent)]
    Record(#[from] RecordError),
    /// A failure inside candle (device, dtype, kernel).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

impl Error {
    /// An [`Error::Config`]: `field` of the configuration from `source_name` is wrong.
    pub fn config(source_name: &str, field: &str, message: impl Into<String>) -> Self {
        Error::Config { source_name: source_name.to_string(), field: field.to_string(), message: message.into() }
    }

    /// An [`Error::Shape`]: shapes that do not fit together in `context`.
    pub fn shape(context: &str, message: impl Into<Text>) -> Self {
        Error::Shape { context: context.to_string(), message: message.into() }
    }

    /// An [`Error::Io`]: `doing` (`cannot read`) failed on `path` for `source`.
    pub fn io(path: impl Into<PathBuf>, doing: impl Into<Text>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), doing: doing.into(), source }
    }

    /// An [`Error::Parse`]: the file at `path` is not what `expected` says, for `source`.
    pub fn parse(
        path: impl Into<PathBuf>,
        expected: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Error::Parse { path: path.into(), expected: expected.into(), source: Box::new(source) }
    }

    /// An [`Error::System`]: `what` could not be done, for `source`.
    pub fn system(what: impl Into<String>, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        Error::System { what: what.into(), source: Box::new(source) }
    }

    /// An [`Error::Usage`]: a setting that cannot be used, in words that name it.
    pub fn usage(message: impl Into<Text>) -> Self {
        Error::Usage(message.into())
    }

    /// An [`Error::Invalid`]: content that cannot be used as given.
    pub fn invalid(message: impl Into<Text>) -> Self {
        Error::Invalid(message.into())
    }

    /// An [`Error::Setting`]: `setting` cannot be used, `message` says why.
    pub fn setting(setting: Setting, message: impl Into<Text>) -> Self {
        Error::Setting { setting, message: message.into() }
    }

    /// An [`Error::Input`]: what is wrong with the file at `path`.
    pub fn input(path: impl Into<PathBuf>, message: impl Into<Text>) -> Self {
        Error::Input { path: path.into(), message: message.into() }
    }
}

/// What is wrong with one field of a document (a router config, a sweep grid, a plan's options),
/// found before the caller adds which document it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// The dotted field path, e.g. `capacity.factor`.
    pub field: String,
    /// What is wrong, including the offending value.
    pub message: String,
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl FieldError {
    /// `field` is wrong: `message`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        FieldError { field: field.into(), message: message.into() }
    }

    /// The same error on `prefix.field` (a nested table, e.g. `inference`).
    pub fn within(self, prefix: &str) -> Self {
        FieldError { field: format!("{prefix}.{}", self.field), ..self }
    }

    /// As an [`Error::Config`] of the document `source_name`.
    pub fn in_config(self, source_name: &str) -> Error {
        Error::Config { source_name: source_name.to_string(), field: self.field, message: self.message }
    }
}

/// `e` as a front end shows it: [`chain`] on [`one_line`], every [`Setting`] named by `names`
/// (the command line: its flags).
pub fn present(e: &dyn std::error::Error, names: Names) -> String {
    with_names(names, || one_line(&chain(e)))
}

/// An error and its causes on one line, `what: cause: its cause`, as the command line prints
/// it. A cause whose text the line already ends with (an error that prints its source, as
/// candle's and some parsers' do) is not repeated; each is bounded ([`excerpt_long`]).
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut line = e.to_string();
    let mut last = line.clone();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !last.ends_with(&text) && !last.contains(&excerpt_long(&text)) {
            line.push_str(": ");
            line.push_str(&excerpt_long(&text));
        }
        last = text;
        cause = c.source();
    }
    line
}

/// How many characters of something read (a value, a name, a key) a message quotes at most:
/// [`quote`] and [`excerpt`] keep this many.
pub const EXCERPT_CHARS: usize = 64;

/// How many characters of a longer text a message keeps ([`excerpt_long`]): another library's
/// message, which may echo what it read; [`chain`] bounds each cause to this.
pub const CAUSE_CHARS: usize = 400;

/// How many characters of a path a message shows: a path may be named by data (a snapshot
/// header, an archive's entry), and a long one keeps its start and its file name.
pub const PATH_CHARS: usize = 256;

/// How many characters an error line has at most, whatever built it ([`one_line`]).
pub const LINE_CHARS: usize = 4096;

/// `text`, something read, as a message quotes it: `"..."` with quotes, backslashes, control
/// and other non-printable characters escaped (as `{:?}` writes a string), and at most
/// [`EXCERPT_CHARS`] characters of it; a longer text keeps its start and its end around
/// `…[N chars in all]…`. A file is written by a stranger: a 64 MiB field must not become a
/// 64 MiB message, nor a newline or a terminal escape a second line or a recoloured screen.
pub fn quote(text: &str) -> String {
    format!("\"{}\"", bounded(text, EXCERPT_CHARS, true))
}

/// `text`, something read, as [`quote`] bounds and escapes it, without quotes: for what a
/// message shows as it is (a shape, a number, a name in backticks).
pub fn excerpt(text: &str) -> String {
    bounded(text, EXCERPT_CHARS, false)
}

/// Names read from a file (arrays, tensors, keys) as a message lists them: the first 8, each
/// an [`excerpt`], and how many there are when there are more.
pub fn excerpt_names<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    let (mut shown, mut n) = (Vec::new(), 0usize);
    for name in names {
        if n < 8 {
            shown.push(excerpt(name));
        }
        n += 1;
    }
    let more = if n > 8 { format!(", ... ({n} in all)") } else { String::new() };
    format!("{}{more}", shown.join(", "))
}

/// A text said by another program or library, as a message quotes it: a parser's message,
/// which may echo what it read (serde's `invalid type: string "..."`, `` unknown field `...` ``),
/// a router's line or its last line on stderr. Each span it quotes (`"..."`, `` `...` ``) is
/// an [`excerpt`], the rest is kept (what was expected, the line and column), and the whole is
/// escaped and at most [`CAUSE_CHARS`] characters, its start and end kept.
pub fn excerpt_long(text: impl fmt::Display) -> String {
    let text = text.to_string();
    let mut out = String::with_capacity(text.len().min(CAUSE_CHARS));
    let mut rest = text.as_str();
    while let Some(open) = rest.find(['"', '`']) {
        let quote = rest.as_bytes()[open];
        let body = &rest[open + 1..];
        // The closing quote; a `"` span may hold `\"` (as `{:?}` writes a string).
        let mut escaped = false;
        let close = body.bytes().position(|b| {
            let end = b == quote && !escaped;
            escaped = quote == b'"' && b == b'\\' && !escaped;
            end
        });
        let Some(close) = close else { break };
        out.push_str(&rest[..=open]);
        out.push_str(&excerpt(&body[..close]));
        out.push(quote as char);
        rest = &body[close + 1..];
    }
    out.push_str(rest);
    bounded(&out, CAUSE_CHARS, false)
}

/// `path` as an error names it: escaped, at most [`PATH_CHARS`] characters.
fn shown(path: &std::path::Path) -> String {
    bounded(&path.display().to_string(), PATH_CHARS, false)
}

/// `message` as the command line prints it: on one line (newlines and other control or
/// non-printable characters escaped), at most [`LINE_CHARS`] characters. The last bound:
/// every message quotes what it read through [`quote`] or [`excerpt`] already.
pub fn one_line(message: &str) -> String {
    bounded(message, LINE_CHARS, false)
}

/// `text` escaped (`quoted`: also `"` and `\`), and when the escaped text is longer than `max`
/// characters, its first three quarters and last quarter of `max` around a marker that says how
/// long `text` is.
fn bounded(text: &str, max: usize, quoted: bool) -> String {
    let escape = |c: char, out: &mut String| match c {
        '"' | '\\' if quoted => out.extend(c.escape_default()),
        '"' | '\'' | '\\' => out.push(c),
        // `escape_debug` leaves a printable character as it is.
        c => out.extend(c.escape_debug()),
    };
    let width = |c: char| match c {
        '"' | '\\' if quoted => 2,
        '"' | '\'' | '\\' => 1,
        c => c.escape_debug().len(),
    };
    let mut out = String::new();
    if text.chars().map(width).sum::<usize>() <= max {
        text.chars().for_each(|c| escape(c, &mut out));
        return out;
    }
    // Whole characters only, so an escape is never cut.
    let fit = |chars: &mut dyn Iterator<Item = char>, room: usize| {
        let mut used = 0;
        chars.take_while(|&c| (used + width(c) <= room).then(|| used += width(c)).is_some()).collect::<Vec<_>>()
    };
    let (head, tail) = (max - max / 4, max / 4);
    fit(&mut text.chars(), head).into_iter().for_each(|c| escape(c, &mut out));
    out.push_str(&format!("…[{} chars in all]…", text.chars().count()));
    fit(&mut text.chars().rev(), tail).into_iter().rev().for_each(|c| escape(c, &mut out));
    out
}

/// The sizes that must be at least 1, checked in one place: the first that is 0 is named.
pub fn ensure_positive(sizes: &[(Setting, usize)]) -> Result<()> {
    match sizes.iter().find(|(_, v)| *v == 0) {
        Some((setting, _)) => Err(Error::usage(crate::text!(*setting, " must be at least 1"))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_prints_with_its_causes_on_one_line() {
        let e = Error::io("x.json", "cannot read", std::io::Error::other("gone"));
        assert_eq!(e.to_string(), "x.json: cannot read");
        assert_eq!(chain(&e), "x.json: cannot read: gone");
        let parse = serde_json::from_str::<Vec<f32>>("[1,").unwrap_err();
        let e = Error::parse("rows.json", "not rows", parse);
        assert_eq!(chain(&e), "rows.json: not rows: EOF while parsing a value at line 1 column 3");
        // A cause the message already ends with (candle prints its source) is not repeated.
        let e = Error::Candle(candle_core::Error::Msg("bad dtype".into()));
        assert_eq!(chain(&e), "candle: bad dtype");
    }

    #[test]
    fn what_was_read_is_quoted_short_escaped_and_on_one_line() {
        // Short: as `{:?}` writes it (quoted), or as it is (an excerpt).
        for s in ["decoder", "a \"b\" c\\d", "tab\there", "é ü 漢字", ""] {
            assert_eq!(quote(s), format!("{s:?}"));
        }
        assert_eq!(excerpt("a \"b\" 'c' \\d é"), "a \"b\" 'c' \\d é");
        // Control characters, terminal escapes and bidirectional overrides are escaped.
        assert_eq!(excerpt("a\nb\r\u{1b}[31mc\u{202e}d\u{2028}\0"), "a\\nb\\r\\u{1b}[31mc\\u{202e}d\\u{2028}\\0");
        assert_eq!(one_line("x\ny"), "x\\ny");
        // Long: the start and the end, and how long the whole is.
        let long = format!("start{}end", "x".repeat(64 << 20));
        let q = quote(&long);
        assert!(q.starts_with("\"startxxx") && q.ends_with("xxend\""), "{q}");
        assert!(q.contains(&format!("…[{} chars in all]…", long.len())), "{q}");
        assert!(q.chars().count() <= EXCERPT_CHARS + 40, "{} chars: {q}", q.chars().count());
        assert_eq!(quote(&"y".repeat(EXCERPT_CHARS)), format!("\"{}\"", "y".repeat(EXCERPT_CHARS)));
        assert!(quote(&"y".repeat(EXCERPT_CHARS + 1)).contains("chars in all"));
        // Escapes count in the bound and are never cut in half.
        let e = excerpt(&"\u{1b}".repeat(1000));
        assert!(e.chars().count() <= EXCERPT_CHARS + 40, "{e}");
        assert!(e.starts_with("\\u{1b}\\u{1b}") && e.ends_with("\\u{1b}"), "{e}");
        assert!(one_line(&"z".repeat(1 << 20)).chars().count() <= LINE_CHARS + 40);
    }

    #[test]
    fn a_cause_that_echoes_its_input_is_bounded() {
        let huge = format!("[\"{}\"]", "A".repeat(1 << 20));
        let e = Error::parse("rows.json", "not rows", serde_json::from_str::<Vec<f32>>(&huge).unwrap_err());
        let line = chain(&e);
        assert!(line.len() < 400, "{} bytes", line.len());
        assert!(line.starts_with("rows.json: not rows: invalid type: string \"AAAA"), "{line}");
        assert!(line.ends_with(&format!("AAAA\", expected f32 at line 1 column {}", huge.len() - 1)), "{line}");
        // A cause that prints its own source (safetensors' header error) is not repeated, cut
        // or not.
        #[derive(Debug, thiserror::Error)]
        #[error("invalid header: {0}")]
        struct Header(#[source] serde_json::Error);
        let inner = serde_json::from_str::<Vec<f32>>(&huge).unwrap_err();
        let line = chain(&Error::parse("h.safetensors", "not safetensors", Header(inner)));
        assert_eq!(line.matches("invalid type").count(), 1, "{line}");
        // What the parser expected is kept whole; only what it quotes of the input is cut.
        let fields: Vec<String> = (0..18).map(|i| format!("`field_{i}`")).collect();
        let said = format!("unknown field `{}`, expected one of {}", "B".repeat(1 << 20), fields.join(", "));
        let e = excerpt_long(&said);
        assert!(e.starts_with("unknown field `BBBB") && e.ends_with(&fields.join(", ")), "{e}");
        assert_eq!(e.matches("chars in all").count(), 1, "{e}");
        assert_eq!(excerpt_long(r#"string "a\"b`c", expected `x`"#), r#"string "a\"b`c", expected `x`"#);
        assert!(
            line.starts_with("h.safetensors: not safetensors: invalid header: invalid type: string \"AAAA"),
            "{line}"
        );
    }

    #[test]
    fn a_field_error_names_its_document_and_table() {
        let e = FieldError::new("capacity.factor", "must be finite and > 0, got 0").within("inference");
        assert_eq!(
            e.in_config("r.toml").to_string(),
            "r.toml: inference.capacity.factor: must be finite and > 0, got 0"
        );
    }
}
