//! Routing scopes: which tokens compete for capacity together, and in which order.

use crate::config::{Flatten, ScopeConfig, ScopeGroup};

/// Flat token indices (`batch * seq_len + pos`) of each routing group, in priority order.
pub fn groups(scope: &ScopeConfig, batch: usize, seq_len: usize) -> Vec<Vec<usize>> {
    let flat: Vec<usize> = match scope.flatten {
        Flatten::SequenceMajor => (0..batch * seq_len).collect(),
        Flatten::PositionMajor => (0..seq_len).flat_map(|s| (0..batch).map(move |b| b * seq_len + s)).collect(),
    };
    match scope.group {
        ScopeGroup::Batch => vec![flat],
        ScopeGroup::Sequence => (0..batch).map(|b| (b * seq_len..(b + 1) * seq_len).collect()).collect(),
        ScopeGroup::Tokens(n) => flat.chunks(n).map(<[usize]>::to_vec).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flattening_orders() {
        let pm = ScopeConfig { group: ScopeGroup::Batch, flatten: Flatten::PositionMajor };
        assert_eq!(groups(&pm, 2, 3), vec![vec![0, 3, 1, 4, 2, 5]]);
        let sm = ScopeConfig { group: ScopeGroup::Tokens(4), flatten: Flatten::SequenceMajor };
        assert_eq!(groups(&sm, 2, 3), vec![vec![0, 1, 2, 3], vec![4, 5]]);
        let seq = ScopeConfig { group: ScopeGroup::Sequence, flatten: Flatten::PositionMajor };
        assert_eq!(groups(&seq, 2, 2), vec![vec![0, 1], vec![2, 3]]);
    }
}
