//! Every random stream's salt, in one table. A stream draws from `seed ^ salt` (plus an index
//! where one stream per position, step or probe is wanted), so the streams of one seed never
//! coincide, and seeding the weights and seeding an input stay independent choices.
//!
//! Changing a salt changes every output drawn from its stream: the values are part of the
//! reproducibility contract (reports, witnesses, snapshots).

/// Seeded hidden states of `route` and of a snapshot's inputs.
pub const INPUT: u64 = 0x9e37_79b9_7f4a_7c15;
/// Seeded hidden states of `ep`'s forward.
pub const EP_INPUT: u64 = 0xe9;
/// Hidden states fed to an external router that takes hidden rows (its gate is its own).
pub(crate) const EXTERNAL_HIDDEN: u64 = 0x9001;
/// One stream per probe (`+ probe index`): the probe's random choices.
pub(crate) const PROBE: u64 = 0x5eed_0000;
/// F: the fresh later tokens of the layer sample.
pub(crate) const FUTURE_SAMPLE: u64 = 0xf;
/// N: the fresh neighbouring sequence of the layer sample.
pub(crate) const NEIGHBOUR_SAMPLE: u64 = 0xa;
/// S: the other call made in between (its logits and its layer sample).
pub(crate) const REPLAY_OTHER_CALL: u64 = 0x5;
/// X: the payloads of the accumulator check.
pub(crate) const NUMERICS: u64 = 0x5a4d;
/// The sweep's heatmap: one stream per changed position (`+ position`).
pub(crate) const HEATMAP: u64 = 0x4ea7_0000;
/// The sweep's balancing steps before an audit (`+ step`).
pub(crate) const BALANCE_STEP: u64 = 0xba1a_0000;
/// The sweep's output-change check: the later half that replaces the input's.
pub(crate) const SWEEP_LATER_HALF: u64 = 0xf0_7e;

#[cfg(test)]
mod tests {
    /// No two streams of one seed coincide: the salts (with their index ranges) are distinct.
    #[test]
    fn salts_are_distinct() {
        use super::*;
        let all = [
            INPUT,
            EP_INPUT,
            EXTERNAL_HIDDEN,
            PROBE,
            FUTURE_SAMPLE,
            NEIGHBOUR_SAMPLE,
            REPLAY_OTHER_CALL,
            NUMERICS,
            HEATMAP,
            BALANCE_STEP,
            SWEEP_LATER_HALF,
        ];
        let set: std::collections::BTreeSet<_> = all.iter().collect();
        assert_eq!(set.len(), all.len());
    }
}
