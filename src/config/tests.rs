//! Settings: the tests of parsing and validation.

use super::*;

#[test]
fn durations_are_written_as_in_the_contract() {
    assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
    assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
    assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
    assert!(parse_duration("soon").is_err());
}

#[test]
fn jitter_outside_zero_to_one_is_refused() {
    assert_eq!(parse_jitter("0.1"), Ok(0.1));
    assert!(parse_jitter("1").is_err());
    assert!(parse_jitter("-0.1").is_err());
}

#[test]
fn defaults_match_the_contract() {
    let cli = Cli::try_parse_from(["postcache", "serve"]).expect("defaults parse");
    let Command::Serve(s) = cli.command else {
        panic!("serve expected")
    };
    assert_eq!(s.listen_addr.to_string(), "127.0.0.1:8080");
    assert_eq!(s.cache.cache_ttl, Duration::from_secs(60));
    assert_eq!(s.cache.lock_ttl, Duration::from_secs(5));
    assert_eq!(s.cache.wait_timeout, Duration::from_secs(3));
    assert_eq!(s.load_timeout(), Duration::from_millis(2_500));
    assert_eq!(s.cache.load_batch_max, 256);
    assert!(s.cache.existence_guard);
    for (value, parses) in [("on", true), ("off", true), ("maybe", false), ("", false)] {
        let cli = Cli::try_parse_from(["postcache", "serve", "--existence-guard", value]);
        assert_eq!(cli.is_ok(), parses, "{value:?}");
    }
    assert_eq!(s.cache.load_statements(&s.database), 2);
    assert_eq!(s.cache.negative_ttl, Duration::from_secs(10));
    assert_eq!(s.cache.cache_strategy, Strategy::Pubsub);
    assert_eq!(s.cache.stale_while_revalidate, Duration::ZERO);
    assert_eq!(s.cache.max_stale, Duration::from_secs(3600));
    assert_eq!(s.cache.failure_ttl, Duration::from_secs(2));
    assert_eq!(s.header_read_timeout, Duration::from_secs(10));
    assert_eq!(s.idle_timeout, Duration::from_secs(60));
    assert_eq!(s.max_connections, 10_000);
    assert_eq!(s.change_feed, ChangeFeed::Auto);
    assert_eq!(s.change_retention, Duration::from_secs(3600));
    s.validate().expect("defaults are consistent");
}

#[test]
fn change_feed_modes_parse_and_on_is_the_trigger_mode() {
    let mode = |value: &str| {
        let cli = Cli::try_parse_from(["postcache", "serve", "--change-feed", value]);
        cli.map(|cli| match cli.command {
            Command::Serve(s) => s.change_feed,
            _ => unreachable!(),
        })
    };
    assert_eq!(mode("replication").unwrap(), ChangeFeed::Replication);
    assert_eq!(mode("trigger").unwrap(), ChangeFeed::Trigger);
    assert_eq!(mode("on").unwrap(), ChangeFeed::Trigger);
    assert_eq!(mode("off").unwrap(), ChangeFeed::Off);
    assert_eq!(mode("auto").unwrap(), ChangeFeed::Auto);
    assert!(mode("sometimes").is_err());
}

#[test]
fn settings_that_would_overflow_or_break_the_hash_tags_are_refused() {
    let refusal = |flags: &[&str]| {
        let argv = ["postcache", "serve"].iter().chain(flags);
        let Command::Serve(s) = Cli::try_parse_from(argv).expect("parses").command else {
            panic!("serve expected")
        };
        s.validate().map(|_| ()).map_err(|e| e.to_string())
    };
    for (flags, named) in [
        (&["--cache-ttl", "1000000000h"][..], "CACHE_TTL"),
        (&["--wait-timeout", "400days"], "WAIT_TIMEOUT"),
        (&["--max-stale", "2years"], "MAX_STALE"),
        (&["--load-timeout", "1000days"], "LOAD_TIMEOUT"),
        (&["--db-acquire-timeout", "1000days"], "DB_ACQUIRE_TIMEOUT"),
        (&["--change-retention", "1000days"], "CHANGE_RETENTION"),
        (&["--key-prefix", "app{1}:"], "KEY_PREFIX"),
        (&["--key-prefix", "}"], "KEY_PREFIX"),
        (
            &["--max-connections", "18446744073709551615"],
            "MAX_CONNECTIONS",
        ),
        (&["--max-in-flight", "100000000"], "MAX_IN_FLIGHT"),
        (&["--db-max-connections", "0"], "DB_MAX_CONNECTIONS"),
        (&["--max-entry-bytes", "0"], "MAX_ENTRY_BYTES"),
        (&["--max-entry-bytes", "1000000000"], "MAX_ENTRY_BYTES"),
        (&["--load-batch-max", "0"], "LOAD_BATCH_MAX"),
        (&["--load-batch-max", "10001"], "LOAD_BATCH_MAX"),
        (&["--load-statements", "0"], "LOAD_STATEMENTS"),
        (&["--load-statements", "17"], "LOAD_STATEMENTS"),
    ] {
        let error = refusal(flags).expect_err(named);
        assert!(error.contains(named), "{flags:?}: {error}");
    }
    assert_eq!(
        refusal(&["--cache-ttl", "365days", "--key-prefix", "app:1:"]),
        Ok(())
    );
    for jitter in ["1.5", "NaN", "inf", "-0.5"] {
        assert!(
            Cli::try_parse_from(["postcache", "serve", "--ttl-jitter", jitter]).is_err(),
            "{jitter}"
        );
    }
}

#[test]
fn invalidate_takes_ids_or_all_but_not_both() {
    let parse = |args: &[&str]| {
        Cli::try_parse_from(["postcache", "invalidate"].iter().chain(args)).map(|cli| {
            let Command::Invalidate(a) = cli.command else {
                panic!("invalidate expected")
            };
            (a.ids, a.all)
        })
    };
    assert_eq!(parse(&["3", "7"]).unwrap(), (vec![3, 7], false));
    assert_eq!(parse(&["--all"]).unwrap(), (vec![], true));
    assert!(parse(&[]).is_err(), "nothing to invalidate");
    assert!(parse(&["3", "--all"]).is_err());
    assert!(parse(&["0"]).is_err());
    assert!(parse(&["x"]).is_err());
}

#[test]
fn a_statement_timeout_not_below_the_lock_ttl_is_refused() {
    let parse = |statement: &str, lock: &str| {
        let cli = Cli::try_parse_from([
            "postcache",
            "serve",
            "--db-statement-timeout",
            statement,
            "--lock-ttl",
            lock,
        ])
        .expect("parses");
        let Command::Serve(s) = cli.command else {
            panic!("serve expected")
        };
        s.validate()
    };
    assert!(parse("4s", "5s").is_ok());
    let error = parse("5s", "5s").unwrap_err().to_string();
    assert!(
        error.contains("DB_STATEMENT_TIMEOUT (5s) must be below LOCK_TTL (5s)"),
        "{error}"
    );
    assert!(parse("10s", "5s").is_err());
}

#[test]
fn an_empty_admin_addr_is_off_and_a_bad_one_is_refused() {
    assert_eq!(parse_optional_addr(""), Ok(OptionalAddr(None)));
    assert_eq!(
        parse_optional_addr("127.0.0.1:9090"),
        Ok(OptionalAddr(Some("127.0.0.1:9090".parse().unwrap())))
    );
    assert!(parse_optional_addr("localhost").is_err());
}
