//! Which side of a comparison, spelt once: a [`Role`], and a [`Sides`] pair holding one value
//! for each (the two records, their sources, what each shows), so code says `sides.trainer` or
//! walks both with their role instead of matching strings or tuple fields.

use serde::Serialize;
use std::fmt;

/// Which record of the pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The inference engine's record (SGLang, vLLM, a Megatron inference response): the routes
    /// the tokens were sampled with.
    Rollout,
    /// The trainer's record: the routes its forward took (and a replay should repeat).
    Trainer,
}

impl Role {
    /// Both, in the report's order.
    pub const BOTH: [Role; 2] = [Role::Rollout, Role::Trainer];

    /// How the report names it: `rollout` or `trainer`.
    pub fn name(self) -> &'static str {
        match self {
            Role::Rollout => "rollout",
            Role::Trainer => "trainer",
        }
    }

    /// The other side.
    pub fn other(self) -> Role {
        match self {
            Role::Rollout => Role::Trainer,
            Role::Trainer => Role::Rollout,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One value for each side of a comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Sides<T> {
    /// The rollout's.
    pub rollout: T,
    /// The trainer's.
    pub trainer: T,
}

impl<T> Sides<T> {
    /// The pair of `rollout` and `trainer`.
    pub fn new(rollout: T, trainer: T) -> Self {
        Sides { rollout, trainer }
    }

    /// Each side's value from its role.
    pub fn from_fn(mut f: impl FnMut(Role) -> T) -> Self {
        Sides { rollout: f(Role::Rollout), trainer: f(Role::Trainer) }
    }

    /// Both values borrowed.
    pub fn as_ref(&self) -> Sides<&T> {
        Sides { rollout: &self.rollout, trainer: &self.trainer }
    }

    /// `f` applied to each value (rollout first).
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> Sides<U> {
        Sides { rollout: f(self.rollout), trainer: f(self.trainer) }
    }

    /// Each side's value paired with the same side's of `other`.
    pub fn zip<U>(self, other: Sides<U>) -> Sides<(T, U)> {
        Sides { rollout: (self.rollout, other.rollout), trainer: (self.trainer, other.trainer) }
    }

    /// Each value with its role, rollout first.
    pub fn iter(&self) -> std::array::IntoIter<(Role, &T), 2> {
        [(Role::Rollout, &self.rollout), (Role::Trainer, &self.trainer)].into_iter()
    }
}

impl<T, E> Sides<Result<T, E>> {
    /// Both values, or the rollout's error, else the trainer's.
    pub fn transpose(self) -> Result<Sides<T>, E> {
        Ok(Sides { rollout: self.rollout?, trainer: self.trainer? })
    }
}

impl<T> std::ops::Index<Role> for Sides<T> {
    type Output = T;

    fn index(&self, role: Role) -> &T {
        match role {
            Role::Rollout => &self.rollout,
            Role::Trainer => &self.trainer,
        }
    }
}

impl<T> std::ops::IndexMut<Role> for Sides<T> {
    fn index_mut(&mut self, role: Role) -> &mut T {
        match role {
            Role::Rollout => &mut self.rollout,
            Role::Trainer => &mut self.trainer,
        }
    }
}

impl<T> IntoIterator for Sides<T> {
    type Item = (Role, T);
    type IntoIter = std::array::IntoIter<(Role, T), 2>;

    fn into_iter(self) -> Self::IntoIter {
        [(Role::Rollout, self.rollout), (Role::Trainer, self.trainer)].into_iter()
    }
}

impl<'a, T> IntoIterator for &'a Sides<T> {
    type Item = (Role, &'a T);
    type IntoIter = std::array::IntoIter<(Role, &'a T), 2>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sides_keep_their_roles_through_map_zip_and_iteration() {
        let s = Sides::new(1, 2).map(|x| x * 10).zip(Sides::new("a", "b"));
        assert_eq!(s, Sides::new((10, "a"), (20, "b")));
        assert_eq!(s[Role::Trainer], (20, "b"));
        let roles: Vec<(Role, i32)> = s.into_iter().map(|(r, (x, _))| (r, x)).collect();
        assert_eq!(roles, [(Role::Rollout, 10), (Role::Trainer, 20)]);
        assert_eq!(Sides::from_fn(Role::other), Sides::new(Role::Trainer, Role::Rollout));
        assert_eq!(
            serde_json::to_string(&Sides::from_fn(|r| r)).unwrap(),
            r#"{"rollout":"rollout","trainer":"trainer"}"#
        );
        assert_eq!(Sides::new(Ok::<i32, i32>(1), Err(2)).transpose(), Err(2));
        assert_eq!(Role::Rollout.to_string(), "rollout");
    }
}
