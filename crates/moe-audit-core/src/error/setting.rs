//! Settings as messages name them: typed in the error, spelt by whoever shows it.
//!
//! A library message never names a command-line flag (a Python or Rust caller has none): it
//! holds the [`Setting`] itself, in a [`Text`], and [`Text`]'s `Display` writes it as the caller
//! of [`present`] names it (the binary: `--max-memory`; the Python extension: `max_memory`), or
//! as the library does, `` setting `max_memory` ``.

pub use crate::settings::Setting;
use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;

/// How a front end names a setting.
pub type Names = fn(Setting) -> Cow<'static, str>;

/// The library's own words: `` setting `max_memory` ``.
pub fn library_name(setting: Setting) -> Cow<'static, str> {
    format!("setting `{}`", setting.name()).into()
}

thread_local! {
    /// The names in force while [`present`] writes an error on this thread.
    static NAMES: Cell<Names> = const { Cell::new(library_name) };
}

/// `show()`, with every [`Setting`] it writes named by `names`: the one way a front end gets its
/// spelling into a message. Scoped to this call and this thread, so two front ends in one
/// process (the wheel's command line and its in-process `routes.compare`) each get their own.
pub fn with_names<T>(names: Names, show: impl FnOnce() -> T) -> T {
    struct Restore(Names);
    impl Drop for Restore {
        fn drop(&mut self) {
            NAMES.with(|n| n.set(self.0));
        }
    }
    let _restore = Restore(NAMES.with(|n| n.replace(names)));
    show()
}

/// A message that may name [`Setting`]s: said text and settings, in order, each setting written
/// when the message is shown ([`with_names`]). Build one with [`text!`](crate::text).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Text(Vec<Piece>);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Said(String),
    Setting(Setting),
}

impl Text {
    /// `self` followed by `more`.
    pub fn then(mut self, more: impl Into<Text>) -> Self {
        for piece in more.into().0 {
            match (self.0.last_mut(), piece) {
                (Some(Piece::Said(s)), Piece::Said(more)) => s.push_str(&more),
                (_, piece) => self.0.push(piece),
            }
        }
        self
    }

    /// Whether it says nothing.
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|p| matches!(p, Piece::Said(s) if s.is_empty()))
    }

    /// The settings it names, in order.
    pub fn settings(&self) -> impl Iterator<Item = Setting> + '_ {
        self.0.iter().filter_map(|p| match p {
            Piece::Setting(s) => Some(*s),
            Piece::Said(_) => None,
        })
    }
}

impl fmt::Display for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = NAMES.with(Cell::get);
        self.0.iter().try_for_each(|p| match p {
            Piece::Said(s) => f.write_str(s),
            Piece::Setting(s) => f.write_str(&names(*s)),
        })
    }
}

/// As its words, each setting named as in force ([`with_names`]): a report that a front end
/// writes out (JSON) names settings as it does.
impl serde::Serialize for Text {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl From<Setting> for Text {
    fn from(s: Setting) -> Self {
        Text(vec![Piece::Setting(s)])
    }
}

impl From<String> for Text {
    fn from(s: String) -> Self {
        Text(vec![Piece::Said(s)])
    }
}

impl From<&str> for Text {
    fn from(s: &str) -> Self {
        Text(vec![Piece::Said(s.to_string())])
    }
}

impl From<&String> for Text {
    fn from(s: &String) -> Self {
        s.as_str().into()
    }
}

impl From<&Text> for Text {
    fn from(t: &Text) -> Self {
        t.clone()
    }
}

/// A [`Text`] of its parts in order, each a `String`, `&str`, [`Setting`] or [`Text`]:
/// `text!(BATCH, format!(" {b} is not a multiple of {n}"))`.
#[macro_export]
macro_rules! text {
    ($($part:expr),* $(,)?) => {
        $crate::error::Text::default()$(.then($part))*
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::{BATCH, MAX_MEMORY};

    #[test]
    fn a_text_names_its_settings_as_its_shower_does() {
        let t = crate::text!(BATCH, format!(" {} is not a multiple of ", 6), "2 (", MAX_MEMORY, ")");
        assert_eq!(t.to_string(), "setting `batch` 6 is not a multiple of 2 (setting `max_memory`)");
        let flag = |s: Setting| -> Cow<'static, str> { format!("--{}", s.name().replace('_', "-")).into() };
        assert_eq!(with_names(flag, || t.to_string()), "--batch 6 is not a multiple of 2 (--max-memory)");
        // Scoped: the library's words again after the call.
        assert_eq!(t.to_string(), "setting `batch` 6 is not a multiple of 2 (setting `max_memory`)");
        assert_eq!(t.settings().collect::<Vec<_>>(), [BATCH, MAX_MEMORY]);
    }
}
