//! Test support: a client connection on a bare socket, for what a
//! well-behaved HTTP client never does: headers sent half-way or a byte at a
//! time, a kept-alive connection left idle, a connection counted against a
//! cap.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

/// One client connection, read and written by hand.
pub struct RawConn {
    stream: TcpStream,
    /// Bytes read but not yet consumed as a response.
    read: Vec<u8>,
    pub opened: Instant,
    /// When the last whole response was read.
    pub answered: Option<Instant>,
}

/// A response read off a [`RawConn`].
#[derive(Debug)]
pub struct RawReply {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl RawConn {
    pub async fn open(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).await.expect("connect");
        Self {
            stream,
            read: Vec::new(),
            opened: Instant::now(),
            answered: None,
        }
    }

    /// Sends bytes as they are.
    pub async fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes).await
    }

    /// Sends `GET path` on this connection, kept alive, and reads the answer.
    pub async fn get(&mut self, path: &str) -> RawReply {
        self.send(raw_request(path).as_bytes())
            .await
            .expect("send a request");
        self.reply(Duration::from_secs(30))
            .await
            .unwrap_or_else(|| panic!("no answer to GET {path}"))
    }

    /// Reads one response (its body sized by Content-Length), or None if the
    /// connection closed or `within` passed first.
    pub async fn reply(&mut self, within: Duration) -> Option<RawReply> {
        tokio::time::timeout(within, async {
            let head_end = loop {
                if let Some(at) = find(&self.read, b"\r\n\r\n") {
                    break at + 4;
                }
                if !self.fill().await {
                    return None;
                }
            };
            let head = String::from_utf8_lossy(&self.read[..head_end]).into_owned();
            let status = head.split(' ').nth(1)?.parse().ok()?;
            let length: usize = head
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    if name.eq_ignore_ascii_case("content-length") {
                        value.trim().parse().ok()
                    } else {
                        None
                    }
                })
                .unwrap_or(0);
            while self.read.len() < head_end + length {
                if !self.fill().await {
                    return None;
                }
            }
            let body =
                String::from_utf8_lossy(&self.read[head_end..head_end + length]).into_owned();
            self.read.drain(..head_end + length);
            self.answered = Some(Instant::now());
            Some(RawReply { status, head, body })
        })
        .await
        .ok()
        .flatten()
    }

    /// Reads more bytes; false once the connection is closed (or reset).
    async fn fill(&mut self) -> bool {
        let mut buf = [0u8; 4096];
        match self.stream.read(&mut buf).await {
            Ok(0) | Err(_) => false,
            Ok(n) => {
                self.read.extend_from_slice(&buf[..n]);
                true
            }
        }
    }

    /// Waits for the server to close the connection, reading (and dropping)
    /// whatever comes; the instant it closed, or None if it was still open
    /// after `within`.
    pub async fn closed_within(&mut self, within: Duration) -> Option<Instant> {
        tokio::time::timeout(within, async {
            while self.fill().await {}
            Instant::now()
        })
        .await
        .ok()
    }
}

/// A whole `GET` that keeps the connection alive.
pub fn raw_request(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nhost: postcache\r\n\r\n")
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}
