//! Telemetry: the process's own series, under the names Prometheus' client
//! libraries give them (`process_cpu_seconds_total` and its siblings), so
//! that dashboards and alerts written for any service work here. Read from
//! `/proc` at each scrape (Linux; elsewhere none is rendered).

use std::fmt::Write;

/// Clock ticks per second of `/proc/self/stat`'s times: USER_HZ, which
/// Linux exports as 100 on every architecture.
const TICKS_PER_SECOND: f64 = 100.0;

/// What the process uses now.
#[derive(Debug, Default, PartialEq)]
struct Usage {
    cpu_seconds: f64,
    start_seconds: Option<f64>,
    resident_bytes: Option<u64>,
    virtual_bytes: Option<u64>,
    open_fds: Option<u64>,
    max_fds: Option<u64>,
}

/// Appends the process's series to `out` (nothing where `/proc` is not).
pub(super) fn render(out: &mut String) {
    let Some(usage) = read() else {
        return;
    };
    let mut series = |name: &str, kind: &str, help: &str, value: Option<f64>| {
        if let Some(value) = value {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            let _ = writeln!(out, "{name} {value}\n");
        }
    };
    series(
        "process_cpu_seconds_total",
        "counter",
        "Total user and system CPU time spent in seconds.",
        Some(usage.cpu_seconds),
    );
    series(
        "process_start_time_seconds",
        "gauge",
        "Start time of the process since unix epoch in seconds.",
        usage.start_seconds,
    );
    series(
        "process_resident_memory_bytes",
        "gauge",
        "Resident memory size in bytes.",
        usage.resident_bytes.map(|b| b as f64),
    );
    series(
        "process_virtual_memory_bytes",
        "gauge",
        "Virtual memory size in bytes.",
        usage.virtual_bytes.map(|b| b as f64),
    );
    series(
        "process_open_fds",
        "gauge",
        "Number of open file descriptors.",
        usage.open_fds.map(|n| n as f64),
    );
    series(
        "process_max_fds",
        "gauge",
        "Maximum number of open file descriptors.",
        usage.max_fds.map(|n| n as f64),
    );
}

fn read() -> Option<Usage> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|s| {
        s.lines()
            .find_map(|line| line.strip_prefix("btime "))
            .and_then(|t| t.trim().parse::<u64>().ok())
    });
    let mut usage = parse(&stat, &status, boot)?;
    usage.open_fds = std::fs::read_dir("/proc/self/fd")
        .ok()
        .map(|entries| entries.count() as u64);
    usage.max_fds = rlimit::getrlimit(rlimit::Resource::NOFILE)
        .ok()
        .map(|(soft, _)| soft);
    Some(usage)
}

/// The usage in `/proc/self/stat` and `/proc/self/status`; `boot`: the
/// system's boot time (unix seconds, `/proc/stat`'s btime).
fn parse(stat: &str, status: &str, boot: Option<u64>) -> Option<Usage> {
    // The command name, in parentheses, may hold spaces: fields are
    // counted after its closing parenthesis, from the state (field 3).
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let field = |n: usize| -> Option<u64> { fields.get(n - 3)?.parse().ok() };
    let (utime, stime) = (field(14)?, field(15)?);
    let started = field(22);
    let kib = |name: &str| -> Option<u64> {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| kib * 1024)
    };
    Some(Usage {
        cpu_seconds: (utime + stime) as f64 / TICKS_PER_SECOND,
        start_seconds: boot
            .zip(started)
            .map(|(boot, ticks)| boot as f64 + ticks as f64 / TICKS_PER_SECOND),
        resident_bytes: kib("VmRSS:"),
        virtual_bytes: kib("VmSize:"),
        open_fds: None,
        max_fds: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_usage_reads_from_stat_and_status_whatever_the_command_name() {
        // Fields 14, 15 (utime, stime) and 22 (starttime), after a name
        // with a space and a parenthesis in it.
        let stat = "4242 (post cache) (x) S 1 4242 4242 0 -1 4194560 1000 0 0 0 \
                    250 50 0 0 20 0 9 0 12345 1000000 500 18446744073709551615";
        let status = "Name:\tpostcache\nVmSize:\t  204800 kB\nVmRSS:\t   10240 kB\n";
        let usage = parse(stat, status, Some(1_700_000_000)).unwrap();
        assert_eq!(usage.cpu_seconds, 3.0);
        let started = usage.start_seconds.unwrap();
        assert!((started - 1_700_000_123.45).abs() < 1e-3, "{started}");
        assert_eq!(usage.resident_bytes, Some(10240 * 1024));
        assert_eq!(usage.virtual_bytes, Some(204800 * 1024));
        assert_eq!(parse("garbage", status, None), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_is_rendered_with_its_fds() {
        let mut out = String::new();
        render(&mut out);
        for name in [
            "process_cpu_seconds_total ",
            "process_resident_memory_bytes ",
            "process_open_fds ",
            "process_max_fds ",
            "process_start_time_seconds ",
        ] {
            assert!(out.contains(name), "{name} in {out}");
        }
    }
}
