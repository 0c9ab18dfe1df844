//! The post: `timestamptz` as PostgreSQL holds it, every value of it: from
//! 4713 BC to 294276 AD, and `infinity` and `-infinity`.
//!
//! A calendar type (`time`, `chrono`) holds years −9999..=9999 at most, and
//! decoding a value outside it panics or fails (sqlx's decoding of
//! `infinity` overflows): a legal row would answer 5xx. Here the value is
//! kept as PostgreSQL sends it (microseconds since 2000-01-01 UTC) and only
//! turned into a date when written as JSON:
//!
//! - years 0000 to 9999: RFC 3339 in UTC, `2024-01-01T00:00:01Z`, with the
//!   fraction of a second when there is one (`…:01.25Z`), as before;
//! - other years: ISO 8601's expanded form, a sign and at least four digits,
//!   astronomical numbering (1 BC is year 0000, 44 BC is −0043):
//!   `-0043-03-15T00:00:00Z`, `+10000-01-01T00:00:00Z`;
//! - `"infinity"` and `"-infinity"`.

use std::fmt;

use serde::{Serialize, Serializer};
use sqlx::{
    encode::IsNull,
    error::BoxDynError,
    postgres::{PgHasArrayType, PgValueFormat},
    Decode, Encode, Postgres, Type,
};

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01 UTC).
const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;
const MICROS_PER_SECOND: i64 = 1_000_000;
const SECONDS_PER_DAY: i64 = 86_400;

/// The JSON form's pattern, for the OpenAPI document.
pub const PATTERN: &str = r"^(infinity|-infinity|([0-9]{4}|-[0-9]{4,}|\+[0-9]{5,})-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?Z)$";

/// A `timestamptz`: any value PostgreSQL accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Timestamp {
    NegInfinity,
    /// Microseconds since 2000-01-01 00:00:00 UTC.
    At(i64),
    Infinity,
}

impl Timestamp {
    /// The instant `unix_seconds` after the Unix epoch.
    pub fn from_unix_seconds(unix_seconds: i64) -> Self {
        Self::from_unix_micros(unix_seconds.saturating_mul(MICROS_PER_SECOND))
    }

    /// The instant `unix_micros` after the Unix epoch.
    pub fn from_unix_micros(unix_micros: i64) -> Self {
        Self::from_pg_micros(unix_micros.saturating_sub(PG_EPOCH_UNIX_MICROS))
    }

    /// As PostgreSQL's binary format carries it: `i64::MAX` is `infinity`,
    /// `i64::MIN` `-infinity`.
    pub fn from_pg_micros(micros: i64) -> Self {
        match micros {
            i64::MAX => Self::Infinity,
            i64::MIN => Self::NegInfinity,
            micros => Self::At(micros),
        }
    }

    fn pg_micros(self) -> i64 {
        match self {
            Self::NegInfinity => i64::MIN,
            Self::At(micros) => micros,
            Self::Infinity => i64::MAX,
        }
    }

    /// Microseconds since the Unix epoch, `None` for the infinities.
    pub fn unix_micros(self) -> Option<i128> {
        match self {
            Self::At(micros) => Some(i128::from(micros) + i128::from(PG_EPOCH_UNIX_MICROS)),
            _ => None,
        }
    }
}

/// The proleptic Gregorian date `days` after 1970-01-01: (year, month,
/// day), year in astronomical numbering (0 is 1 BC). Howard Hinnant's
/// `civil_from_days`, exact for every day an i64 of microseconds can name.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unix_micros = match self.unix_micros() {
            None if *self == Self::Infinity => return f.write_str("infinity"),
            None => return f.write_str("-infinity"),
            // Every i64 of PostgreSQL's microseconds, moved to the Unix
            // epoch, fits an i128; its days fit an i64.
            Some(micros) => micros,
        };
        let micros_per_day = i128::from(SECONDS_PER_DAY * MICROS_PER_SECOND);
        let days = unix_micros.div_euclid(micros_per_day) as i64;
        let of_day = unix_micros.rem_euclid(micros_per_day) as i64;
        let (year, month, day) = civil_from_days(days);
        match year {
            0..=9999 => write!(f, "{year:04}")?,
            ..0 => write!(f, "-{:04}", year.unsigned_abs())?,
            _ => write!(f, "+{year:04}")?,
        }
        let seconds = of_day / MICROS_PER_SECOND;
        write!(
            f,
            "-{month:02}-{day:02}T{:02}:{:02}:{:02}",
            seconds / 3600,
            seconds % 3600 / 60,
            seconds % 60
        )?;
        let fraction = of_day % MICROS_PER_SECOND;
        if fraction != 0 {
            // As RFC 3339 formatters write it: no trailing zeros.
            let digits = format!("{fraction:06}");
            write!(f, ".{}", digits.trim_end_matches('0'))?;
        }
        f.write_str("Z")
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl utoipa::PartialSchema for Timestamp {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::{ObjectBuilder, Type};
        ObjectBuilder::new()
            .schema_type(Type::String)
            .pattern(Some(PATTERN))
            .description(Some(
                "A `timestamptz`, in UTC: RFC 3339 for the years 0000 to 9999 \
                 (`2024-01-01T00:00:01Z`, a fraction of a second when there is one); ISO 8601's \
                 expanded form, a sign and at least four digits, for other years, in \
                 astronomical numbering (44 BC is `-0043-03-15T00:00:00Z`); or `infinity` or \
                 `-infinity`.",
            ))
            .examples(["2024-01-01T00:00:01Z", "-0043-03-15T00:00:00Z", "infinity"])
            .into()
    }
}

impl utoipa::ToSchema for Timestamp {}

impl Type<Postgres> for Timestamp {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        <time::OffsetDateTime as Type<Postgres>>::type_info()
    }
}

impl PgHasArrayType for Timestamp {
    fn array_type_info() -> sqlx::postgres::PgTypeInfo {
        <time::OffsetDateTime as PgHasArrayType>::array_type_info()
    }
}

impl<'r> Decode<'r, Postgres> for Timestamp {
    fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, BoxDynError> {
        match value.format() {
            // Every statement of ours is prepared: binary results.
            PgValueFormat::Binary => Ok(Self::from_pg_micros(<i64 as Decode<Postgres>>::decode(
                value,
            )?)),
            PgValueFormat::Text => {
                Err("timestamptz in text format: only the binary format is read".into())
            }
        }
    }
}

impl Encode<'_, Postgres> for Timestamp {
    fn encode_by_ref(
        &self,
        buf: &mut sqlx::postgres::PgArgumentBuffer,
    ) -> Result<IsNull, BoxDynError> {
        <i64 as Encode<Postgres>>::encode(self.pg_micros(), buf)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use time::{format_description::well_known::Rfc3339, OffsetDateTime};

    use super::*;

    /// Microseconds since 2000-01-01 of a date PostgreSQL writes as given.
    const TABLE: &[(i64, &str)] = &[
        (0, "2000-01-01T00:00:00Z"),
        (1, "2000-01-01T00:00:00.000001Z"),
        (250_000, "2000-01-01T00:00:00.25Z"),
        (-1, "1999-12-31T23:59:59.999999Z"),
        // As PostgreSQL sends them (`timestamptz_send`) for the dates it
        // writes as given: '0001-01-01 00:00:00+00'
        (-63_082_281_600_000_000, "0001-01-01T00:00:00Z"),
        // 1 BC is year 0 in ISO 8601; RFC 3339 writes it 0000.
        (-63_113_904_000_000_000, "0000-01-01T00:00:00Z"),
        // '0044-03-15 BC'
        (-64_464_508_800_000_000, "-0043-03-15T00:00:00Z"),
        // '4713-01-01 00:00:00+00 BC', PostgreSQL's smallest
        (-211_810_204_800_000_000, "-4712-01-01T00:00:00Z"),
        // '9999-12-31 23:59:59.999999+00'
        (252_455_615_999_999_999, "9999-12-31T23:59:59.999999Z"),
        // '10000-01-01 00:00:00+00'
        (252_455_616_000_000_000, "+10000-01-01T00:00:00Z"),
        // '294276-12-31 23:59:59.999999+00', PostgreSQL's largest
        (9_223_371_331_199_999_999, "+294276-12-31T23:59:59.999999Z"),
    ];

    #[test]
    fn every_year_postgresql_holds_is_written_in_rfc_3339_or_the_expanded_form() {
        for &(micros, written) in TABLE {
            assert_eq!(
                Timestamp::from_pg_micros(micros).to_string(),
                written,
                "{micros}"
            );
        }
        assert_eq!(Timestamp::Infinity.to_string(), "infinity");
        assert_eq!(Timestamp::NegInfinity.to_string(), "-infinity");
        assert_eq!(Timestamp::from_pg_micros(i64::MAX), Timestamp::Infinity);
        assert_eq!(Timestamp::from_pg_micros(i64::MIN), Timestamp::NegInfinity);
        assert_eq!(
            serde_json::to_string(&Timestamp::Infinity).unwrap(),
            r#""infinity""#
        );
    }

    #[test]
    fn the_documented_pattern_matches_every_form_and_nothing_else() {
        let pattern = regex::Regex::new(PATTERN).unwrap();
        for &(micros, _) in TABLE {
            let written = Timestamp::from_pg_micros(micros).to_string();
            assert!(pattern.is_match(&written), "{written}");
        }
        assert!(pattern.is_match("infinity") && pattern.is_match("-infinity"));
        for not_ours in [
            "2024-01-01 00:00:00",
            "+2024-01-01T00:00:00Z",
            "2024-01-01T00:00:00.Z",
        ] {
            assert!(!pattern.is_match(not_ours), "{not_ours}");
        }
    }

    proptest! {
        /// Inside the years a calendar type holds, the same text as an RFC
        /// 3339 formatter writes.
        #[test]
        fn in_years_0_to_9999_it_is_what_rfc_3339_writes(
            micros in -63_113_904_000_000_000i64..252_455_616_000_000_000
        ) {
            let ts = Timestamp::from_pg_micros(micros);
            let unix_nanos = ts.unix_micros().unwrap() * 1_000;
            let reference = OffsetDateTime::from_unix_timestamp_nanos(unix_nanos)
                .unwrap()
                .format(&Rfc3339)
                .unwrap();
            prop_assert_eq!(ts.to_string(), reference);
        }

        /// Any value: no panic, and the text orders as the instants do
        /// within a year's sign and width.
        #[test]
        fn any_value_is_written_without_a_panic(micros in any::<i64>()) {
            let written = Timestamp::from_pg_micros(micros).to_string();
            prop_assert!(written.ends_with('Z') || written.ends_with("infinity"));
        }
    }
}
