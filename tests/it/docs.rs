//! The documentation kept true by tests: the settings of `postcache serve`
//! as its `--help` gives them, the table of `docs/configuration.md` and the
//! lines of `.env.example` name the same environment variables.

use std::{collections::BTreeSet, path::Path, process::Command};

/// Variables `.env.example` sets that are no setting of `serve`, each with
/// why it belongs there anyway.
const ENV_EXAMPLE_ONLY: &[&str] = &[
    // The log filter, read by tracing's EnvFilter rather than by clap, so
    // that `--help` never lists it; docs/configuration.md explains it in
    // its notes, below the table.
    "RUST_LOG",
];

/// A file of the repository, as text.
#[track_caller]
fn read(relative: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Whether `name` is written as an environment variable: UPPER_SNAKE.
fn is_env_name(name: &str) -> bool {
    name.starts_with(|c: char| c.is_ascii_uppercase())
        && name
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
}

/// Every `[env: NAME=…]` of the help. A setting whose value is hidden
/// (`hide_env_values`: the URLs, which may hold passwords) shows as
/// `[env: NAME]`, so the name ends at `=` or `]`.
fn help_names(help: &str) -> BTreeSet<String> {
    help.split("[env: ")
        .skip(1)
        .map(|rest| {
            rest.chars()
                .take_while(|&c| c != '=' && c != ']')
                .collect::<String>()
        })
        .collect()
}

/// The first cell of every row of the page's tables that names an
/// environment variable (`` `NAME` ``); header and separator rows name none.
fn table_names(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter_map(|line| line.trim().strip_prefix('|'))
        .filter_map(|row| row.split('|').next())
        .map(|cell| cell.trim().trim_matches('`').to_owned())
        .filter(|name| is_env_name(name))
        .collect()
}

/// Every `NAME=` line of `.env.example`, set (`NAME=value`) or commented
/// out (`# NAME=value`: a setting whose default is computed, such as
/// LOAD_TIMEOUT, shown with an example value but left unset).
fn env_example_names(file: &str) -> BTreeSet<String> {
    file.lines()
        .map(|line| {
            let line = line.trim();
            line.strip_prefix('#').map_or(line, str::trim_start)
        })
        .filter_map(|line| line.split_once('='))
        .map(|(name, _)| name.to_owned())
        .filter(|name| is_env_name(name))
        .collect()
}

/// What one set has that the other lacks, for a failure message.
fn differences(
    (left, a): (&str, &BTreeSet<String>),
    (right, b): (&str, &BTreeSet<String>),
) -> Vec<String> {
    let mut out = Vec::new();
    let only_left: Vec<_> = a.difference(b).collect();
    if !only_left.is_empty() {
        out.push(format!("in {left} but not in {right}: {only_left:?}"));
    }
    let only_right: Vec<_> = b.difference(a).collect();
    if !only_right.is_empty() {
        out.push(format!("in {right} but not in {left}: {only_right:?}"));
    }
    out
}

#[test]
fn every_setting_is_documented_in_the_configuration_page_and_env_example() {
    // Arrange: the help of the built binary, with no setting in its
    // environment (a value set there would show in the help; the names
    // are read either way, but the help should not depend on the shell).
    let out = Command::new(env!("CARGO_BIN_EXE_postcache"))
        .args(["serve", "--help"])
        .env_clear()
        .output()
        .expect("run postcache serve --help");
    assert!(out.status.success(), "serve --help: {out:?}");
    let help = String::from_utf8(out.stdout).expect("UTF-8 help");

    // Act
    let settings = help_names(&help);
    let page = table_names(&read("docs/configuration.md"));
    let mut example = env_example_names(&read(".env.example"));
    for name in ENV_EXAMPLE_ONLY {
        assert!(
            example.remove(*name),
            "{name} is excused from .env.example's check but is not there: drop it from ENV_EXAMPLE_ONLY"
        );
    }

    // Assert
    assert!(
        settings.len() > 30,
        "the help lists {} settings: {settings:?}",
        settings.len()
    );
    let help_name = "`postcache serve --help`";
    let mut problems = differences(
        (help_name, &settings),
        ("the table of docs/configuration.md", &page),
    );
    problems.extend(differences(
        (help_name, &settings),
        (".env.example", &example),
    ));
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
