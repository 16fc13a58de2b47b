//! [`RecordError`]: a routing record that cannot be read.

use super::{excerpt, shown, Text};
use std::fmt;
use std::path::PathBuf;

/// A routing record that cannot be read (moe-audit-records' readers): the file, the part of it
/// being read, what is wrong, and the reader's own error (zip, npy, JSON, safetensors) as its
/// source.
#[derive(Debug, thiserror::Error)]
#[error("{}{}", shown(path), self.what())]
pub struct RecordError {
    /// The file (or folder) being read.
    pub path: PathBuf,
    /// The part of it being read.
    pub part: Part,
    /// What is wrong (empty when the source says it all).
    pub problem: Text,
    /// The reader's error.
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

/// The part of a record file being read when it failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Part {
    /// The file as a whole (its format, its layout, what it holds).
    Whole,
    /// A named array (an `.npy` file, an `.npz` member, a safetensors tensor).
    Array(String),
    /// An archive's entry by its index.
    Entry(usize),
    /// An archive's entry by its name.
    EntryNamed(String),
    /// A safetensors tensor.
    Tensor(String),
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Part::Whole => Ok(()),
            Part::Array(name) => write!(f, "array `{}`", excerpt(name)),
            Part::Entry(i) => write!(f, "entry {i}"),
            Part::EntryNamed(name) => write!(f, "entry `{}`", excerpt(name)),
            Part::Tensor(name) => write!(f, "tensor `{}`", excerpt(name)),
        }
    }
}

impl RecordError {
    /// `part` of the record at `path` is wrong: `problem`.
    pub fn new(path: impl Into<PathBuf>, part: Part, problem: impl Into<Text>) -> Self {
        RecordError { path: path.into(), part, problem: problem.into(), source: None }
    }

    /// The same, caused by the reader's error `source`.
    pub fn because(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// `: part: problem`, each when there is one.
    fn what(&self) -> String {
        let problem = self.problem.to_string();
        [self.part.to_string(), problem].into_iter().filter(|s| !s.is_empty()).map(|s| format!(": {s}")).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{chain, present, Error};
    use std::error::Error as _;

    #[test]
    fn a_record_error_keeps_its_reader_error_and_names_its_part() {
        let json = serde_json::from_str::<serde_json::Value>("{").unwrap_err();
        let e: Error = RecordError::new("r.json", Part::Whole, "not JSON").because(json).into();
        // The umbrella is transparent: its source is the reader's error, kept as a value.
        let source = e.source().expect("a source");
        assert!(source.downcast_ref::<serde_json::Error>().is_some(), "{source:?}");
        assert_eq!(e.to_string(), "r.json: not JSON");
        assert_eq!(chain(&e), "r.json: not JSON: EOF while parsing an object at line 1 column 1");
        let zip = std::io::Error::other("invalid Zip archive: bad CDE");
        let e = RecordError::new("a.npz", Part::Entry(3), "").because(zip);
        assert_eq!(chain(&e), "a.npz: entry 3: invalid Zip archive: bad CDE");
        let e = RecordError::new("a.npy", Part::Array("ids\n".into()), "the header is not text");
        assert_eq!(e.to_string(), "a.npy: array `ids\\n`: the header is not text");
        let e = RecordError::new("r.jsonl", Part::Whole, crate::text!("give ", crate::settings::MAX_MEMORY));
        assert_eq!(present(&e, |s| format!("--{}", s.name()).into()), "r.jsonl: give --max_memory");
    }
}
