//! `postcache healthcheck`: asks a running instance's `/livez` (or
//! `--path /readyz`) and exits 0 on a 200, 1 otherwise: for a container's
//! `HEALTHCHECK`, in an image that has no curl.
//!
//! It reads the same settings as `serve` (ADMIN_ADDR where set, else
//! LISTEN_ADDR), so the line in a Dockerfile or a compose file names no
//! address; an unspecified address (`0.0.0.0`, `::`) is asked on loopback.
//! One plain HTTP/1.1 request, bounded by `--timeout`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use anyhow::{bail, Context};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

use crate::config::HealthcheckArgs;

/// Most bytes of the answer read: the status line is in the first few.
const READ_AT_MOST: u64 = 4096;

/// The address asked: ADMIN_ADDR where set, else LISTEN_ADDR, loopback for
/// an unspecified one.
pub fn target(args: &HealthcheckArgs) -> SocketAddr {
    let mut addr = args.admin_addr.0.unwrap_or(args.listen_addr);
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        });
    }
    addr
}

/// The status code the instance answered `args.path` with, within the
/// timeout.
pub async fn run(args: &HealthcheckArgs) -> anyhow::Result<u16> {
    let addr = target(args);
    tokio::time::timeout(args.timeout, ask(addr, &args.path))
        .await
        .with_context(|| format!("no answer from {addr} within {:?}", args.timeout))?
}

async fn ask(addr: SocketAddr, path: &str) -> anyhow::Result<u16> {
    let mut stream = TcpStream::connect(addr)
        .await
        .with_context(|| format!("cannot connect to {addr}"))?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut answer = Vec::new();
    stream.take(READ_AT_MOST).read_to_end(&mut answer).await?;
    status_of(&answer)
}

/// The status code of an HTTP/1.x answer's status line.
fn status_of(answer: &[u8]) -> anyhow::Result<u16> {
    let line = answer.split(|&b| b == b'\r').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut words = line.split(' ');
    match (words.next(), words.next().map(str::parse::<u16>)) {
        (Some(version), Some(Ok(code))) if version.starts_with("HTTP/1.") => Ok(code),
        _ => bail!("not an HTTP answer: {line:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_is_read_from_the_status_line() {
        assert_eq!(status_of(b"HTTP/1.1 200 OK\r\n\r\n").unwrap(), 200);
        assert_eq!(
            status_of(b"HTTP/1.1 503 Service Unavailable\r\n").unwrap(),
            503
        );
        assert!(status_of(b"").is_err());
        assert!(status_of(b"SSH-2.0-OpenSSH\r\n").is_err());
        assert!(status_of(b"HTTP/1.1 abc\r\n").is_err());
    }
}
