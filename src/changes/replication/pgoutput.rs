//! The change feed (replication): the few `pgoutput` messages the decoder
//! reads (protocol version 1): which relation a row change is of, and the
//! `id` of each row changed. Begin, Commit and logical messages are read by
//! the replication client; every other message (Type, Origin) is ignored.
//!
//! Only the `id` column of a row is read; the rest of the row is skipped
//! without being copied. Anything that cannot be read is an error, which the
//! decoder turns into one invalidation of every post, never a change
//! passed over.

use std::fmt;

/// A message of the stream, as far as the cache cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// The layout of a relation, sent before its first row change in a
    /// session and again when it changes.
    Relation(Relation),
    /// A row inserted, or updated in place: what is cached of it is old.
    Changed { relation: u32, id: Option<i64> },
    /// A row deleted.
    Deleted { relation: u32, id: Option<i64> },
    /// An update that changed a row's key: the old id is gone, the new one
    /// changed.
    Moved {
        relation: u32,
        from: Option<i64>,
        to: Option<i64>,
    },
    /// TRUNCATE of these relations.
    Truncated(Vec<u32>),
    /// Nothing the cache needs.
    Other,
}

/// A relation's layout: where its `id` column is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    pub oid: u32,
    pub namespace: String,
    pub name: String,
    /// The position of the column named `id`, when there is one.
    pub id_column: Option<usize>,
}

/// A message that could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pgoutput: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

/// Finds each row's id from the relations seen so far.
pub trait Layouts {
    fn id_column(&self, relation: u32) -> Option<usize>;
}

struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.bytes.len() < n {
            return Err(DecodeError(format!(
                "message ends early ({} bytes left, {n} wanted)",
                self.bytes.len()
            )));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.take(2)?.try_into().unwrap()))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().unwrap()))
    }

    fn string(&mut self) -> Result<String, DecodeError> {
        let end = self
            .bytes
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| DecodeError("string without its terminator".into()))?;
        let text = String::from_utf8_lossy(&self.bytes[..end]).into_owned();
        self.bytes = &self.bytes[end + 1..];
        Ok(text)
    }

    /// A TupleData: the value of column `wanted` as an id (`None` when the
    /// column is null or its value was not sent).
    fn id_of_tuple(&mut self, wanted: Option<usize>) -> Result<Option<i64>, DecodeError> {
        let columns = self.u16()? as usize;
        let mut id = None;
        for column in 0..columns {
            let kind = self.u8()?;
            let value = match kind {
                b'n' | b'u' => None,
                b't' | b'b' => {
                    let len = self.u32()? as usize;
                    Some((kind, self.take(len)?))
                }
                other => return Err(DecodeError(format!("unknown column kind {other:#04x}"))),
            };
            if Some(column) != wanted {
                continue;
            }
            id = match value {
                None => None,
                Some((b't', text)) => Some(
                    std::str::from_utf8(text)
                        .ok()
                        .and_then(|t| t.parse::<i64>().ok())
                        .ok_or_else(|| {
                            DecodeError(format!(
                                "id {:?} is not an integer",
                                String::from_utf8_lossy(text)
                            ))
                        })?,
                ),
                Some((_, binary)) => Some(match binary.len() {
                    8 => i64::from_be_bytes(binary.try_into().unwrap()),
                    4 => i32::from_be_bytes(binary.try_into().unwrap()) as i64,
                    2 => i16::from_be_bytes(binary.try_into().unwrap()) as i64,
                    n => return Err(DecodeError(format!("binary id of {n} bytes"))),
                }),
            };
        }
        Ok(id)
    }
}

/// Reads one message (the payload of an XLogData).
pub fn decode(bytes: &[u8], layouts: &impl Layouts) -> Result<Message, DecodeError> {
    let mut r = Reader { bytes };
    let tag = r.u8()?;
    let message = match tag {
        b'R' => {
            let oid = r.u32()?;
            let namespace = r.string()?;
            let name = r.string()?;
            let _replica_identity = r.u8()?;
            let columns = r.u16()? as usize;
            let mut id_column = None;
            for column in 0..columns {
                let _flags = r.u8()?;
                if r.string()? == "id" {
                    id_column = Some(column);
                }
                let _type = r.u32()?;
                let _modifier = r.u32()?;
            }
            Message::Relation(Relation {
                oid,
                namespace,
                name,
                id_column,
            })
        }
        b'I' => {
            let relation = r.u32()?;
            expect(r.u8()?, b'N')?;
            let id = r.id_of_tuple(layouts.id_column(relation))?;
            Message::Changed { relation, id }
        }
        b'U' => {
            let relation = r.u32()?;
            let column = layouts.id_column(relation);
            let mut kind = r.u8()?;
            let mut old = None;
            if kind == b'K' || kind == b'O' {
                old = Some(r.id_of_tuple(column)?);
                kind = r.u8()?;
            }
            expect(kind, b'N')?;
            let new = r.id_of_tuple(column)?;
            match old {
                // The old key is sent only when it changed (or with REPLICA
                // IDENTITY FULL, then it may be the same).
                Some(from) if from != new => Message::Moved {
                    relation,
                    from,
                    to: new,
                },
                _ => Message::Changed { relation, id: new },
            }
        }
        b'D' => {
            let relation = r.u32()?;
            let kind = r.u8()?;
            if kind != b'K' && kind != b'O' {
                return Err(DecodeError(format!("delete with tuple kind {kind:#04x}")));
            }
            let id = r.id_of_tuple(layouts.id_column(relation))?;
            Message::Deleted { relation, id }
        }
        b'T' => {
            let count = r.u32()? as usize;
            let _options = r.u8()?;
            let mut relations = Vec::with_capacity(count.min(64));
            for _ in 0..count {
                relations.push(r.u32()?);
            }
            Message::Truncated(relations)
        }
        _ => Message::Other,
    };
    Ok(message)
}

fn expect(got: u8, wanted: u8) -> Result<(), DecodeError> {
    if got == wanted {
        Ok(())
    } else {
        Err(DecodeError(format!(
            "expected tuple kind {:?}, got {got:#04x}",
            wanted as char
        )))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::HashMap;

    use super::*;

    impl Layouts for HashMap<u32, usize> {
        fn id_column(&self, relation: u32) -> Option<usize> {
            self.get(&relation).copied()
        }
    }

    /// Builds messages as pgoutput writes them.
    #[derive(Default)]
    pub(crate) struct Wire(pub Vec<u8>);

    impl Wire {
        pub fn new(tag: u8) -> Self {
            Self(vec![tag])
        }
        pub fn u8(mut self, v: u8) -> Self {
            self.0.push(v);
            self
        }
        pub fn u16(mut self, v: u16) -> Self {
            self.0.extend(v.to_be_bytes());
            self
        }
        pub fn u32(mut self, v: u32) -> Self {
            self.0.extend(v.to_be_bytes());
            self
        }
        pub fn string(mut self, v: &str) -> Self {
            self.0.extend(v.as_bytes());
            self.0.push(0);
            self
        }
        /// A TupleData of text values (`None`: null).
        pub fn tuple(mut self, values: &[Option<&str>]) -> Self {
            self = self.u16(values.len() as u16);
            for value in values {
                self = match value {
                    None => self.u8(b'n'),
                    Some(text) => {
                        let mut w = self.u8(b't').u32(text.len() as u32);
                        w.0.extend(text.as_bytes());
                        w
                    }
                };
            }
            self
        }
    }

    fn posts_relation() -> Vec<u8> {
        let mut w = Wire::new(b'R')
            .u32(16384)
            .string("public")
            .string("posts")
            .u8(b'd')
            .u16(3);
        for (flags, name) in [(1, "id"), (0, "title"), (0, "body")] {
            w = w.u8(flags).string(name).u32(20).u32(u32::MAX);
        }
        w.0
    }

    fn layouts() -> HashMap<u32, usize> {
        HashMap::from([(16384, 0)])
    }

    #[test]
    fn a_relation_says_where_its_id_is() {
        let message = decode(&posts_relation(), &layouts()).unwrap();
        assert_eq!(
            message,
            Message::Relation(Relation {
                oid: 16384,
                namespace: "public".into(),
                name: "posts".into(),
                id_column: Some(0),
            })
        );
    }

    #[test]
    fn inserts_updates_and_deletes_give_the_id() {
        let row = [Some("42"), Some("a title"), None];
        let insert = Wire::new(b'I').u32(16384).u8(b'N').tuple(&row).0;
        let update = Wire::new(b'U').u32(16384).u8(b'N').tuple(&row).0;
        let delete = Wire::new(b'D')
            .u32(16384)
            .u8(b'K')
            .tuple(&[Some("42"), None, None])
            .0;
        let l = layouts();
        assert_eq!(
            decode(&insert, &l).unwrap(),
            Message::Changed {
                relation: 16384,
                id: Some(42)
            }
        );
        assert_eq!(
            decode(&update, &l).unwrap(),
            Message::Changed {
                relation: 16384,
                id: Some(42)
            }
        );
        assert_eq!(
            decode(&delete, &l).unwrap(),
            Message::Deleted {
                relation: 16384,
                id: Some(42)
            }
        );
    }

    #[test]
    fn an_update_of_the_key_moves_the_row() {
        let update = Wire::new(b'U')
            .u32(16384)
            .u8(b'K')
            .tuple(&[Some("7"), None, None])
            .u8(b'N')
            .tuple(&[Some("8"), Some("t"), Some("b")])
            .0;
        assert_eq!(
            decode(&update, &layouts()).unwrap(),
            Message::Moved {
                relation: 16384,
                from: Some(7),
                to: Some(8)
            }
        );
    }

    #[test]
    fn a_truncate_names_its_relations() {
        let truncate = Wire::new(b'T').u32(2).u8(0).u32(16384).u32(99).0;
        assert_eq!(
            decode(&truncate, &layouts()).unwrap(),
            Message::Truncated(vec![16384, 99])
        );
    }

    #[test]
    fn what_cannot_be_read_is_an_error_never_a_panic() {
        let l = layouts();
        let not_a_number = Wire::new(b'I').u32(16384).u8(b'N').tuple(&[Some("4x2")]).0;
        assert!(decode(&not_a_number, &l).is_err());
        let full = Wire::new(b'I')
            .u32(16384)
            .u8(b'N')
            .tuple(&[Some("42"), Some("title")])
            .0;
        for end in 0..full.len() {
            assert!(decode(&full[..end], &l).is_err(), "cut at {end}");
        }
        assert!(decode(&[b'I', 0, 0, 0, 1, b'X'], &l).is_err());
    }

    #[test]
    fn a_row_of_an_unknown_relation_has_no_id() {
        let insert = Wire::new(b'I').u32(5).u8(b'N').tuple(&[Some("1")]).0;
        assert_eq!(
            decode(&insert, &layouts()).unwrap(),
            Message::Changed {
                relation: 5,
                id: None
            }
        );
    }
}
