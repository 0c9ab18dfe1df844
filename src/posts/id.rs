//! The post: the post id: a decimal integer in 1..=i64::MAX, parsed wherever
//! one arrives (the path of `GET /posts/{id}`, the command line).

use std::fmt;

/// Longest id segment accepted; i64::MAX has 19 digits, the slack admits leading zeros.
const MAX_ID_LEN: usize = 32;

/// A valid post id: a decimal integer in 1..=i64::MAX.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PostId(i64);

/// Why a path segment is not a post id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidId {
    #[error("the id is empty")]
    Empty,
    #[error("the id is longer than {MAX_ID_LEN} characters")]
    TooLong,
    #[error("the id must be a decimal integer")]
    NotDecimal,
    #[error("the id must be between 1 and 9223372036854775807")]
    OutOfRange,
}

impl PostId {
    /// Only ASCII digits: no sign, no spaces, no fraction, no exponent.
    pub fn parse(segment: &str) -> Result<Self, InvalidId> {
        if segment.is_empty() {
            return Err(InvalidId::Empty);
        }
        if segment.len() > MAX_ID_LEN {
            return Err(InvalidId::TooLong);
        }
        if !segment.bytes().all(|b| b.is_ascii_digit()) {
            return Err(InvalidId::NotDecimal);
        }
        match segment.parse::<i64>() {
            Ok(id) if id >= 1 => Ok(Self(id)),
            _ => Err(InvalidId::OutOfRange),
        }
    }

    pub fn get(self) -> i64 {
        self.0
    }
}

impl fmt::Display for PostId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimal_ids_in_range_parse() {
        assert_eq!(PostId::parse("1").unwrap().get(), 1);
        assert_eq!(PostId::parse("42").unwrap().get(), 42);
        assert_eq!(PostId::parse("007").unwrap().get(), 7);
        assert_eq!(
            PostId::parse("9223372036854775807").unwrap().get(),
            i64::MAX
        );
    }

    #[test]
    fn everything_else_is_refused() {
        for bad in [
            "",
            "abc",
            "0",
            "-1",
            "1.5",
            "+1",
            " 1",
            "1 ",
            "1e3",
            "0x10",
            "١",
            "9223372036854775808",
            "99999999999999999999",
        ] {
            assert!(PostId::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(PostId::parse(&"1".repeat(5000)), Err(InvalidId::TooLong));
    }
}

#[cfg(test)]
mod properties {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn any_string_parses_to_an_id_in_range_or_a_clean_error(s in "\\PC{0,40}") {
            if let Ok(id) = PostId::parse(&s) {
                prop_assert!(id.get() >= 1);
                prop_assert!(s.bytes().all(|b| b.is_ascii_digit()));
            }
        }

        #[test]
        fn every_valid_id_parses_back_to_itself(id in 1i64..=i64::MAX) {
            prop_assert_eq!(PostId::parse(&id.to_string()).unwrap().get(), id);
        }
    }
}
