//! Router names, the one place they are checked and made safe for each output.
//!
//! A name comes from a config file, a handshake or a flag, and ends up in file names (witnesses),
//! CSV, markdown tables, JUnit XML, GitHub annotations and one-line errors. Names holding
//! control characters (a newline breaks every line-based format, and XML 1.0 cannot carry most
//! of them even escaped) are refused where they are read; the rest is escaped per format here.

use std::collections::HashMap;

/// The longest name accepted, in characters.
pub const MAX_LEN: usize = 200;

/// What is wrong with a router name, or with the names of one run. Its text follows the name
/// (or the field) the caller puts first: `name must not be empty`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// Blank.
    #[error("must not be empty")]
    Empty,
    /// Holds a control character.
    #[error("holds the control character {0:?}: names appear in one-line reports")]
    Control(char),
    /// Longer than [`MAX_LEN`] characters (its length).
    #[error("has {0} characters, at most {MAX_LEN} are allowed")]
    TooLong(usize),
    /// Two routers of one run share the name.
    #[error("two routers are named `{0}`: give each router of a run its own name")]
    Twice(String),
    /// Two routers of one run share a file stem: the names and the stem.
    #[error("routers `{0}` and `{1}` would share the file name `{2}`: rename one")]
    SameStem(String, String, String),
}

/// Checks a router name: not blank, no control characters, at most [`MAX_LEN`] characters.
pub fn check(name: &str) -> Result<(), NameError> {
    if name.trim().is_empty() {
        return Err(NameError::Empty);
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(NameError::Control(c));
    }
    let n = name.chars().count();
    if n > MAX_LEN {
        return Err(NameError::TooLong(n));
    }
    Ok(())
}

/// The name as a file stem: ASCII letters, digits, `-` and `_` kept, anything else `_`.
pub fn file_stem(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

/// Fails when two routers of one run share a name, or a file stem (they would write the same
/// witness file and be told apart in no report).
pub fn check_unique<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<(), NameError> {
    let mut stems: HashMap<String, &str> = HashMap::new();
    for name in names {
        if let Some(other) = stems.insert(file_stem(name), name) {
            return Err(if other == name {
                NameError::Twice(name.to_string())
            } else {
                NameError::SameStem(other.to_string(), name.to_string(), file_stem(name))
            });
        }
    }
    Ok(())
}

/// Text for a markdown table cell: `|` escaped, so it cannot start a new column.
pub fn markdown(text: &str) -> String {
    text.replace('\\', "\\\\").replace('|', "\\|")
}

/// Text for an XML attribute or element: markup escaped, and characters XML 1.0 cannot hold
/// (control characters but tab, LF and CR) replaced by U+FFFD.
pub fn xml(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(c),
            c if c.is_control() => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_and_escaped() {
        assert!(check("team/router, v2 | test").is_ok());
        assert_eq!(check("a\nb"), Err(NameError::Control('\n')));
        assert!(check("a\nb").unwrap_err().to_string().contains("'\\n'"));
        assert_eq!(check("  "), Err(NameError::Empty));
        assert_eq!(check(&"x".repeat(MAX_LEN + 1)), Err(NameError::TooLong(MAX_LEN + 1)));
        assert_eq!(file_stem("a/b.c"), "a_b_c");
        assert!(check_unique(["a", "b"]).is_ok());
        assert!(check_unique(["a", "a"]).unwrap_err().to_string().contains("two routers are named `a`"));
        assert_eq!(check_unique(["a/b", "a_b"]), Err(NameError::SameStem("a/b".into(), "a_b".into(), "a_b".into())));
        assert_eq!(markdown("a|b"), "a\\|b");
        assert_eq!(xml("<a\u{1}&>"), "&lt;a\u{fffd}&amp;&gt;");
    }
}
