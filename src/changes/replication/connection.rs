//! The change feed (replication): the replication connection: its settings,
//! from DATABASE_URL, and how the server refuses a slot.

use std::{collections::HashMap, time::Duration};

use anyhow::Context;
use pgwire_replication::{ReplicationConfig, SslMode, TlsConfig};

use crate::config::DatabaseSettings;

/// The publication of `posts` (migration 0004).
pub const PUBLICATION: &str = "postcache_posts";

/// Events buffered between the replication connection and the decoder.
const BUFFERED: usize = 256;

/// The replication connection's settings, from DATABASE_URL.
pub fn replication_config(database_url: &str, slot: &str) -> anyhow::Result<ReplicationConfig> {
    let url = url::Url::parse(database_url).context("invalid DATABASE_URL")?;
    let query: HashMap<String, String> = url.query_pairs().into_owned().collect();
    let decode = |s: &str| {
        percent_decode(s).with_context(|| format!("invalid percent-encoding in DATABASE_URL: {s}"))
    };
    let host = match query.get("host") {
        Some(host) => host.clone(),
        None => url
            .host_str()
            .unwrap_or("localhost")
            .trim_matches(['[', ']'])
            .to_owned(),
    };
    let user = decode(url.username())?;
    let user = if user.is_empty() {
        query
            .get("user")
            .cloned()
            .unwrap_or_else(|| "postgres".into())
    } else {
        user
    };
    let password = decode(url.password().unwrap_or(""))?;
    let database = decode(url.path().trim_start_matches('/'))?;
    let database = if database.is_empty() {
        user.clone()
    } else {
        database
    };
    let mode = match query.get("sslmode").map(String::as_str) {
        Some("disable") => SslMode::Disable,
        Some("require") => SslMode::Require,
        Some("verify-ca") => SslMode::VerifyCa,
        Some("verify-full") => SslMode::VerifyFull,
        // sqlx's default, as libpq's.
        _ => SslMode::Prefer,
    };
    let tls = TlsConfig {
        mode,
        ca_pem_path: query.get("sslrootcert").map(Into::into),
        client_cert_pem_path: query.get("sslcert").map(Into::into),
        client_key_pem_path: query.get("sslkey").map(Into::into),
        ..TlsConfig::default()
    };
    let mut config = ReplicationConfig::new(host, user, password, database, slot, PUBLICATION)
        .with_tls(tls)
        .with_buffer_size(BUFFERED)
        .with_status_interval(Duration::from_millis(200))
        // A status at least every half second while the stream is idle:
        // the client sends one otherwise only when the applied position
        // moves or the server asks (at half its wal_sender_timeout), and
        // the decoder's liveness judge counts PostgreSQL's silence from
        // the last status it heard (found: a decoder holding its position
        // back while changes waited for a paused Redis went unheard for
        // 2 s and gave up its slot).
        .with_wakeup_interval(Duration::from_millis(500))
        .with_application_name("postcache-decoder");
    if let Some(port) = url.port() {
        config = config.with_port(port);
    }
    Ok(config)
}

/// The decoder's session settings (the startup packet's `options`):
/// PostgreSQL ends the session when it hears nothing from the decoder for
/// `timeout` (`wal_sender_timeout`, which it also reads statuses by while
/// it decodes a large transaction: see `liveness.rs`), and its side of the
/// socket finds a peer gone without a word (DB_TCP_KEEPALIVE,
/// DB_TCP_USER_TIMEOUT).
pub(super) fn session_options(database: &DatabaseSettings, timeout: Duration) -> String {
    let mut options = vec![format!(
        "-c wal_sender_timeout={}",
        timeout.as_millis().max(1)
    )];
    options.extend(
        crate::store::socket_options(database)
            .into_iter()
            .map(|(name, value)| format!("-c {name}={value}")),
    );
    options.join(" ")
}

fn percent_decode(s: &str) -> anyhow::Result<String> {
    Ok(percent_encoding::percent_decode_str(s)
        .decode_utf8()?
        .into_owned())
}

/// Why the slot could not be streamed.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// Another session streams it: stand by.
    Held,
    /// It does not exist.
    Missing,
    /// It lost WAL it needs (`max_slot_wal_keep_size`).
    Invalidated,
    /// PostgreSQL is down, starting up or shutting down: it takes
    /// connections again within moments (a restart, a crash's recovery, a
    /// failover), and every moment the slot waits past that is staleness
    /// for the whole fleet.
    Unavailable,
    /// Anything else (no privilege, no publication, a protocol error).
    Other,
}

pub(super) fn refusal(error: &pgwire_replication::PgWireError) -> Refusal {
    use std::io::ErrorKind;
    if let pgwire_replication::PgWireError::Io(io) = error {
        return match io.kind() {
            ErrorKind::ConnectionRefused
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::NotConnected
            | ErrorKind::BrokenPipe
            | ErrorKind::UnexpectedEof => Refusal::Unavailable,
            _ => Refusal::Other,
        };
    }
    let text = error.to_string();
    // 57P01 admin_shutdown (a fast or immediate shutdown, or a terminated
    // backend), 57P02 crash_shutdown (another backend crashed), 57P03
    // cannot_connect_now (starting up, in recovery, shutting down).
    if ["57P01", "57P02", "57P03"]
        .iter()
        .any(|code| text.contains(code))
    {
        return Refusal::Unavailable;
    }
    if text.contains("55006") || text.contains("is active for PID") {
        Refusal::Held
    } else if text.contains("42704") || text.contains("does not exist") && text.contains("slot") {
        Refusal::Missing
    } else if text.contains("can no longer get changes")
        || text.contains("has been invalidated")
        // PostgreSQL 15's START_REPLICATION on an invalidated slot (its
        // DETAIL, which says why, is not in the error): taken for any other
        // failure, the fleet retried for ever with its feed down.
        || text.contains("cannot read from logical replication slot")
    {
        Refusal::Invalidated
    } else {
        Refusal::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_replication_connection_follows_database_url() {
        let c = replication_config(
            "postgres://us%40er:p%2Fw@db.example:6543/my%20db?sslmode=require",
            "s",
        )
        .unwrap();
        assert_eq!(
            (
                c.host.as_str(),
                c.port,
                c.user.as_str(),
                c.password.as_str()
            ),
            ("db.example", 6543, "us@er", "p/w")
        );
        assert_eq!(c.database, "my db");
        assert_eq!(c.tls.mode, SslMode::Require);

        let d = replication_config("postgres://postgres@127.0.0.1/postcache", "s").unwrap();
        assert_eq!((d.port, d.tls.mode), (5432, SslMode::Prefer));
        let socket = replication_config("postgres:///postcache?host=/run/postgresql", "s").unwrap();
        assert_eq!(socket.host, "/run/postgresql");
    }

    #[test]
    fn refusals_are_told_apart() {
        use pgwire_replication::PgWireError::Server;
        let held = Server("replication slot \"s\" is active for PID 12 (SQLSTATE 55006)".into());
        let missing = Server("replication slot \"s\" does not exist (SQLSTATE 42704)".into());
        let lost =
            Server("can no longer get changes from replication slot \"s\" (SQLSTATE 55000)".into());
        assert_eq!(refusal(&held), Refusal::Held);
        assert_eq!(refusal(&missing), Refusal::Missing);
        assert_eq!(refusal(&lost), Refusal::Invalidated);
        let lost_15 =
            Server("cannot read from logical replication slot \"s\" (SQLSTATE 55000)".into());
        assert_eq!(refusal(&lost_15), Refusal::Invalidated);
        assert_eq!(
            refusal(&Server(
                "permission denied to start WAL sender (SQLSTATE 42501)".into()
            )),
            Refusal::Other
        );
        // PostgreSQL down, recovering from a crash, or shutting down.
        let io = |kind| {
            pgwire_replication::PgWireError::Io(std::sync::Arc::new(std::io::Error::from(kind)))
        };
        assert_eq!(
            refusal(&io(std::io::ErrorKind::ConnectionRefused)),
            Refusal::Unavailable
        );
        assert_eq!(
            refusal(&io(std::io::ErrorKind::UnexpectedEof)),
            Refusal::Unavailable
        );
        assert_eq!(
            refusal(&io(std::io::ErrorKind::PermissionDenied)),
            Refusal::Other
        );
        let starting = Server("the database system is starting up (SQLSTATE 57P03)".into());
        assert_eq!(refusal(&starting), Refusal::Unavailable);
        let stopping = Server(
            "terminating connection due to immediate shutdown command (SQLSTATE 57P01)".into(),
        );
        assert_eq!(refusal(&stopping), Refusal::Unavailable);
    }
}
