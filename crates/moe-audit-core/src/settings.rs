//! A setting as messages name it ([`Setting`]), and the settings this crate owns; a front end
//! spells them (the command line as flags).

/// A setting of a run (a size, a limit, a file) that a message may name: its field or parameter
/// name, `max_memory`. Each crate declares the settings it owns as constants (its `settings`
/// module); a front end spells them its own way.
///
/// There is no `Display`: a setting is written only through a [`Text`](crate::error::Text), so no message turns it
/// into the library's words before its caller names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Setting(&'static str);

impl Setting {
    /// The setting called `name` (snake case, as the field or parameter it sets).
    pub const fn new(name: &'static str) -> Self {
        Setting(name)
    }

    /// The library's name for it.
    pub fn name(self) -> &'static str {
        self.0
    }
}

/// Sequences per call.
pub const BATCH: Setting = Setting::new("batch");
/// Tokens per sequence.
pub const SEQ_LEN: Setting = Setting::new("seq_len");
/// Hidden size.
pub const HIDDEN: Setting = Setting::new("hidden");
/// Expert FFN size.
pub const FFN: Setting = Setting::new("ffn");
/// The memory limit.
pub const MAX_MEMORY: Setting = Setting::new("max_memory");

/// Every setting of this crate.
pub const ALL: [Setting; 5] = [BATCH, SEQ_LEN, HIDDEN, FFN, MAX_MEMORY];
