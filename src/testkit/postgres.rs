//! Test support: private PostgreSQL servers, a primary and its streaming
//! standbys, each on a free port in a temp dir of its own, stopped and
//! removed on drop (the fault tests of read replicas stop, lag and promote
//! them; the shared server is never touched).
//!
//! `initdb`, `pg_ctl` and `pg_basebackup` from PG_BIN (default
//! `/usr/lib/postgresql/15/bin`), run as the `postgres` user when the tests
//! run as root (PostgreSQL refuses to run as root).

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use super::{free_port, wait_until, A_WHILE};

/// A private PostgreSQL server: a primary, or a standby of one.
pub struct PgServer {
    pub port: u16,
    dir: PathBuf,
    running: bool,
}

fn bin(name: &str) -> PathBuf {
    let dir = std::env::var("PG_BIN").unwrap_or_else(|_| "/usr/lib/postgresql/15/bin".into());
    Path::new(&dir).join(name)
}

/// A PostgreSQL program, to run as the `postgres` user when we are root.
fn command(program: &str) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin(program));
        c
    } else {
        Command::new(bin(program))
    }
}

/// Runs a PostgreSQL program; panics with its output if it fails.
fn run(program: &str, args: &[&str]) {
    let out = command(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn is_root() -> bool {
    static ROOT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ROOT.get_or_init(|| {
        Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
    })
}

/// A fresh dir the `postgres` user owns.
fn own_dir(what: &str, port: u16) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("postcache-pg-{what}-{port}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    if is_root() {
        let out = Command::new("chown")
            .arg("postgres:postgres")
            .arg(&dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "chown failed");
    }
    dir
}

impl PgServer {
    /// Whether the programs are here (the tests that need them skip, or
    /// fail in CI, without them).
    pub fn available() -> bool {
        bin("initdb").exists() && bin("pg_basebackup").exists()
    }

    /// A primary with `wal_level=logical` (the change feed's replication
    /// mode) and room for standbys, started.
    pub async fn primary() -> Self {
        let server = Self::made_by(
            "primary",
            "initdb",
            &["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"],
        );
        server.append_conf(&[
            "wal_level = logical",
            "max_wal_senders = 10",
            "max_replication_slots = 10",
            "fsync = off",
            "full_page_writes = off",
            "shared_buffers = 16MB",
        ]);
        server.start_and_wait().await
    }

    /// A streaming standby of `primary` (`pg_basebackup -R`), with `conf`
    /// appended (for example `recovery_min_apply_delay = '1s'`), started.
    pub async fn standby_of(primary: &PgServer, conf: &[&str]) -> Self {
        let server = Self::made_by(
            "standby",
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &primary.port.to_string(),
                "-U",
                "postgres",
                "-R",
                "-X",
                "stream",
                "--no-sync",
                "-c",
                "fast",
            ],
        );
        server.append_conf(&["hot_standby = on"]);
        server.append_conf(conf);
        server.start_and_wait().await
    }

    /// A server of `role` on a free port, not started: its data directory
    /// made by `program` (initdb, or pg_basebackup from a primary) with
    /// `args` and `-D` the directory.
    fn made_by(role: &str, program: &str, args: &[&str]) -> Self {
        let port = free_port();
        let server = Self {
            port,
            dir: own_dir(role, port),
            running: false,
        };
        let data = server.data();
        let mut args = args.to_vec();
        args.extend(["-D", data.to_str().unwrap()]);
        run(program, &args);
        server
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// Appends settings to postgresql.conf (PostgreSQL 15's initdb has no
    /// `-c`); the port and socket dir of this server always come last.
    fn append_conf(&self, lines: &[&str]) {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(self.data().join("postgresql.conf"))
            .unwrap();
        for line in lines {
            writeln!(file, "{line}").unwrap();
        }
        writeln!(file, "port = {}", self.port).unwrap();
        writeln!(file, "listen_addresses = '127.0.0.1'").unwrap();
        writeln!(file, "unix_socket_directories = '{}'", self.dir.display()).unwrap();
    }

    async fn start_and_wait(mut self) -> Self {
        self.start().await;
        self
    }

    /// Starts the server (again) and waits until it takes connections.
    pub async fn start(&mut self) {
        let log = self.dir.join("log");
        run(
            "pg_ctl",
            &[
                "-D",
                self.data().to_str().unwrap(),
                "-l",
                log.to_str().unwrap(),
                "-w",
                "-t",
                "60",
                "start",
            ],
        );
        self.running = true;
        let url = format!("{}/postgres", self.url());
        wait_until(
            "the private PostgreSQL to take connections",
            A_WHILE,
            async || {
                use sqlx::Connection;
                sqlx::PgConnection::connect(&url).await.is_ok()
            },
        )
        .await;
    }

    /// Stops it at once (`-m immediate`: as a crash).
    pub fn stop(&mut self) {
        if self.running {
            let out = self.stop_at_once().expect("pg_ctl");
            assert!(
                out.status.success(),
                "pg_ctl stop failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            self.running = false;
        }
    }

    /// `pg_ctl stop -m immediate`, waited for.
    fn stop_at_once(&self) -> std::io::Result<std::process::Output> {
        command("pg_ctl")
            .args([
                "-D",
                self.data().to_str().unwrap(),
                "-m",
                "immediate",
                "-w",
                "stop",
            ])
            .output()
    }

    /// Promotes a standby to primary and waits until it is one.
    pub async fn promote(&self) {
        run(
            "pg_ctl",
            &["-D", self.data().to_str().unwrap(), "-w", "promote"],
        );
        let url = format!("{}/postgres", self.url());
        wait_until("the standby to be promoted", A_WHILE, async || {
            use sqlx::Connection;
            let Ok(mut conn) = sqlx::PgConnection::connect(&url).await else {
                return false;
            };
            sqlx::query_scalar::<_, bool>("select not pg_is_in_recovery()")
                .fetch_one(&mut conn)
                .await
                .unwrap_or(false)
        })
        .await;
    }

    /// `postgres://postgres@127.0.0.1:port`, without a database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}", self.port)
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    /// Waits until the standby has replayed everything `primary` has
    /// written so far.
    pub async fn until_replayed(&self, primary: &PgServer, database: &str) {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&format!("{}/postgres", primary.url()))
            .await
            .unwrap();
        let target: i64 =
            sqlx::query_scalar("select (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint")
                .fetch_one(&mut conn)
                .await
                .unwrap();
        let url = format!("{}/{database}", self.url());
        wait_until("the standby to replay the primary", A_WHILE, async || {
            let Ok(mut conn) = sqlx::PgConnection::connect(&url).await else {
                return false;
            };
            let replayed: Option<i64> =
                sqlx::query_scalar("select (pg_last_wal_replay_lsn() - '0/0'::pg_lsn)::bigint")
                    .fetch_one(&mut conn)
                    .await
                    .unwrap_or(None);
            replayed.is_some_and(|r| r >= target)
        })
        .await;
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        if self.running {
            let _ = self.stop_at_once();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
