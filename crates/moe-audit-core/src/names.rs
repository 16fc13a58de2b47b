//! Router names, the one place they are checked and made safe for each output.
//!
//! A name comes from a config file, a handshake or a flag, and ends up in file names (witnesses),
//! CSV, markdown tables, JUnit XML, GitHub annotations and one-line errors. Names holding
//! control characters (a newline breaks every line-based format, and XML 1.0 cannot carry most
//! of them even escaped) are refused where they are read; the rest is escaped per format here.

use std::collections::HashMap;

/// The longest name accepted, in characters.
pub const MAX_LEN: usize = 200;

/// Checks a router name: not blank, no control characters, at most [`MAX_LEN`] characters.
pub fn check(name: &str) -> Result<(), String> {
    if name.trim().is_empty() {
        return Err("must not be empty".into());
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(format!("holds the control character {:?}: names appear in one-line reports", c));
    }
    let n = name.chars().count();
    if n > MAX_LEN {
        return Err(format!("has {n} characters, at most {MAX_LEN} are allowed"));
    }
    Ok(())
}

/// The name as a file stem: ASCII letters, digits, `-` and `_` kept, anything else `_`.
pub fn file_stem(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

/// Fails when two routers of one run share a name, or a file stem (they would write the same
/// witness file and be told apart in no report).
pub fn check_unique<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<(), String> {
    let mut stems: HashMap<String, &str> = HashMap::new();
    for name in names {
        if let Some(other) = stems.insert(file_stem(name), name) {
            return Err(if other == name {
                format!("two routers are named `{name}`: give each router of a run its own name")
            } else {
                format!("routers `{other}` and `{name}` would share the file name `{}`: rename one", file_stem(name))
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
        assert!(check("a\nb").unwrap_err().contains("'\\n'"));
        assert!(check("  ").is_err());
        assert!(check(&"x".repeat(MAX_LEN + 1)).is_err());
        assert_eq!(file_stem("a/b.c"), "a_b_c");
        assert!(check_unique(["a", "b"]).is_ok());
        assert!(check_unique(["a", "a"]).unwrap_err().contains("two routers are named `a`"));
        assert!(check_unique(["a/b", "a_b"]).unwrap_err().contains("share the file name `a_b`"));
        assert_eq!(markdown("a|b"), "a\\|b");
        assert_eq!(xml("<a\u{1}&>"), "&lt;a\u{fffd}&amp;&gt;");
    }
}
