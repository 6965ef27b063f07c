//! A small HTTP/1.1 server side over any byte stream, std only.
//!
//! [`read_request`] reads one request from a `BufRead`: the request line, the
//! header lines and a body of exactly `Content-Length` bytes (no chunked
//! bodies: a `Transfer-Encoding` is answered 411). Everything it reads is
//! untrusted, so it is bounded before anything is allocated for it: the head
//! (request line and headers) by [`Limits::max_head`] bytes and
//! [`Limits::max_headers`] lines, the body by [`Limits::max_body`], checked
//! against the declared length before a byte of the body is read. What follows
//! the body stays in the reader, so pipelined requests read back to back.
//!
//! [`write_response`] writes a whole response with a known length;
//! [`start_event_stream`] and [`write_event`] write a server-sent-events
//! stream, which ends when the connection closes.

use std::fmt;
use std::io::{self, BufRead, Read, Write};

/// Bounds on what a request may hold (untrusted input: bound before allocating).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Bytes of the request line and headers together (default 16 KiB).
    pub max_head: usize,
    /// Bytes of the body (default 64 MiB).
    pub max_body: usize,
    /// Number of header lines (default 64).
    pub max_headers: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_head: 16 << 10,
            max_body: 64 << 20,
            max_headers: 64,
        }
    }
}

/// A request, its body read whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Method as sent ("GET", "POST", ...).
    pub method: String,
    /// Path without the query ("/v1/chat/completions").
    pub path: String,
    /// Query string after '?', if any.
    pub query: Option<String>,
    /// HTTP minor version: 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor_version: u8,
    /// Header names lowercased, values trimmed, in order.
    pub headers: Vec<(String, String)>,
    /// The body (Content-Length bytes; empty without one).
    pub body: Vec<u8>,
}

impl Request {
    /// The first header of that (case-insensitive) name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Whether the connection stays open after the response: HTTP/1.1 unless
    /// "Connection: close", HTTP/1.0 only with "Connection: keep-alive"
    /// (token match, case-insensitive, comma-separated lists).
    pub fn keep_alive(&self) -> bool {
        let has = |token: &str| {
            self.headers
                .iter()
                .filter(|(n, _)| n == "connection")
                .flat_map(|(_, v)| v.split(','))
                .any(|t| t.trim().eq_ignore_ascii_case(token))
        };
        if has("close") {
            false
        } else {
            self.minor_version >= 1 || has("keep-alive")
        }
    }
}

/// Why a request could not be read.
#[derive(Debug)]
pub enum HttpError {
    /// The connection closed (or timed out) before the first byte of a request:
    /// not an error to answer.
    Closed,
    /// Reading failed mid-request (including a timeout: io::ErrorKind::WouldBlock / TimedOut).
    Io(io::Error),
    /// Malformed request line, header or Content-Length (400); the message says what.
    BadRequest(String),
    /// Request line and headers over `max_head` bytes or `max_headers` lines (431).
    HeadTooLarge,
    /// A Content-Length over `max_body` (413); checked BEFORE reading or allocating the body.
    BodyTooLarge {
        /// The declared Content-Length.
        length: u64,
        /// The `max_body` it exceeds.
        limit: usize,
    },
    /// Transfer-Encoding (chunked or any other) — this server needs Content-Length
    /// (411 Length Required).
    LengthRequired,
}

impl HttpError {
    /// The status code to answer with (Closed and Io: 400, they are normally not answered).
    pub fn status(&self) -> u16 {
        match self {
            HttpError::Closed | HttpError::Io(_) | HttpError::BadRequest(_) => 400,
            HttpError::HeadTooLarge => 431,
            HttpError::BodyTooLarge { .. } => 413,
            HttpError::LengthRequired => 411,
        }
    }
}

impl fmt::Display for HttpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HttpError::Closed => f.write_str("connection closed before a request"),
            HttpError::Io(e) => write!(f, "reading the request: {e}"),
            HttpError::BadRequest(m) => write!(f, "bad request: {m}"),
            HttpError::HeadTooLarge => f.write_str("request line and headers too large"),
            HttpError::BodyTooLarge { length, limit } => {
                write!(f, "body of {length} bytes is over the limit of {limit}")
            }
            HttpError::LengthRequired => {
                f.write_str("Transfer-Encoding is not supported: send a Content-Length")
            }
        }
    }
}

impl std::error::Error for HttpError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            HttpError::Io(e) => Some(e),
            _ => None,
        }
    }
}

fn bad(message: impl Into<String>) -> HttpError {
    HttpError::BadRequest(message.into())
}

/// The most of a body reserved up front: a client that claims a large body
/// and sends little costs no more than this; the rest grows as it arrives.
const RESERVE: usize = 1 << 20;

/// Reads one request from `r`, leaving what follows its body (a pipelined
/// request) in the reader.
///
/// Lines end in CRLF or a bare LF; empty lines before the request line are
/// skipped (they count toward `max_head`). The request-target is a path
/// (origin form), `*` for OPTIONS, or an absolute `http(s)://host/path`, of
/// which the path is kept. Header names are tokens (no space before ':');
/// folded lines (obs-fold), control characters and non-UTF-8 text are a
/// [`HttpError::BadRequest`], and so is a Content-Length that is not all
/// digits or given twice with different values. Any Transfer-Encoding is
/// [`HttpError::LengthRequired`].
///
/// The declared length is checked against `max_body` before a byte of the
/// body is read or reserved; the body is then read with `take(length)` into a
/// Vec reserved for at most `length` bytes (at most 1 MiB up front, growing as
/// bytes arrive). A body cut short is `Io(UnexpectedEof)`.
///
/// With `Expect: 100-continue` (curl sends it for bodies over 1 KiB), an
/// HTTP/1.1 request whose length is accepted and not zero gets
/// `HTTP/1.1 100 Continue\r\n\r\n` written to `interim` (and flushed) just
/// before its body is read; any other Expect value is a bad request.
///
/// An EOF, reset or timeout before anything but empty lines arrived is
/// [`HttpError::Closed`]; after that, an [`HttpError::Io`].
pub fn read_request(
    r: &mut impl BufRead,
    interim: &mut impl Write,
    limits: &Limits,
) -> Result<Request, HttpError> {
    let mut budget = limits.max_head;
    let mut line = Vec::new();

    // The request line, after any empty lines.
    loop {
        line.clear();
        match read_line(r, &mut line, &mut budget) {
            Ok(true) => {}
            Ok(false) if only_line_ends(&line) => return Err(HttpError::Closed),
            Ok(false) => return Err(HttpError::Io(io::ErrorKind::UnexpectedEof.into())),
            Err(HttpError::Io(e)) if only_line_ends(&line) && is_gone(&e) => {
                return Err(HttpError::Closed)
            }
            Err(e) => return Err(e),
        }
        if !line_text(&line)?.is_empty() {
            break;
        }
    }
    let (method, path, query, minor_version) = request_line(line_text(&line)?)?;

    // The header lines, up to the empty line.
    let mut headers = Vec::new();
    loop {
        line.clear();
        if !read_line(r, &mut line, &mut budget)? {
            return Err(HttpError::Io(io::ErrorKind::UnexpectedEof.into()));
        }
        let text = line_text(&line)?;
        if text.is_empty() {
            break;
        }
        if headers.len() == limits.max_headers {
            return Err(HttpError::HeadTooLarge);
        }
        headers.push(header_line(text)?);
    }

    if headers.iter().any(|(n, _)| n == "transfer-encoding") {
        return Err(HttpError::LengthRequired);
    }
    let mut length: Option<u64> = None;
    for (_, v) in headers.iter().filter(|(n, _)| n == "content-length") {
        if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad("Content-Length is not a number"));
        }
        let n: u64 = v
            .parse()
            .map_err(|_| bad("Content-Length is out of range"))?;
        if length.is_some_and(|l| l != n) {
            return Err(bad("two different Content-Length values"));
        }
        length = Some(n);
    }
    let mut continue_expected = false;
    for (_, v) in headers.iter().filter(|(n, _)| n == "expect") {
        if v.eq_ignore_ascii_case("100-continue") {
            continue_expected = true;
        } else {
            return Err(bad("unsupported Expect value (only 100-continue is)"));
        }
    }

    let length = length.unwrap_or(0);
    if length > limits.max_body as u64 {
        return Err(HttpError::BodyTooLarge {
            length,
            limit: limits.max_body,
        });
    }
    let mut body = Vec::new();
    if length > 0 {
        if continue_expected && minor_version == 1 {
            interim
                .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                .and_then(|()| interim.flush())
                .map_err(HttpError::Io)?;
        }
        // At most max_body (a usize) by the check above.
        let length_usize = length as usize;
        body.reserve_exact(length_usize.min(RESERVE));
        Read::take(&mut *r, length)
            .read_to_end(&mut body)
            .map_err(HttpError::Io)?;
        if body.len() != length_usize {
            return Err(HttpError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("body ended after {} of {length} bytes", body.len()),
            )));
        }
    }

    Ok(Request {
        method,
        path,
        query,
        minor_version,
        headers,
        body,
    })
}

/// Appends one line, through its '\n', to `line`, taking no more than
/// `budget` bytes (less what it takes). False: the stream ended first.
fn read_line(
    r: &mut impl BufRead,
    line: &mut Vec<u8>,
    budget: &mut usize,
) -> Result<bool, HttpError> {
    loop {
        let available = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(HttpError::Io(e)),
        };
        if available.is_empty() {
            return Ok(false);
        }
        let (n, done) = match available.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (available.len(), false),
        };
        if n > *budget {
            return Err(HttpError::HeadTooLarge);
        }
        line.extend_from_slice(&available[..n]);
        r.consume(n);
        *budget -= n;
        if done {
            return Ok(true);
        }
    }
}

/// Whether `line` holds nothing of a request yet (empty, or line ends only).
fn only_line_ends(line: &[u8]) -> bool {
    line.iter().all(|&b| b == b'\r' || b == b'\n')
}

/// Errors that, before a request has begun, mean the client went away or
/// stayed idle: nothing to answer.
fn is_gone(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        UnexpectedEof | WouldBlock | TimedOut | ConnectionReset | ConnectionAborted | BrokenPipe
    )
}

/// A line read by [`read_line`] without its CRLF or LF, as text: a CR
/// elsewhere, NUL or invalid UTF-8 is a bad request.
fn line_text(line: &[u8]) -> Result<&str, HttpError> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.iter().any(|&b| b == b'\r' || b == b'\n' || b == 0) {
        return Err(bad("stray CR or NUL in a line"));
    }
    std::str::from_utf8(line).map_err(|_| bad("a line is not UTF-8"))
}

/// RFC 9110 `tchar`.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn is_token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(is_tchar)
}

/// Method, path, query and minor version of a request line.
fn request_line(text: &str) -> Result<(String, String, Option<String>, u8), HttpError> {
    let mut parts = text.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad("malformed request line"));
    };
    if !is_token(method) {
        return Err(bad("malformed method"));
    }
    let minor_version = match version {
        "HTTP/1.1" => 1,
        "HTTP/1.0" => 0,
        v if v.starts_with("HTTP/") => return Err(bad("unsupported HTTP version")),
        _ => return Err(bad("malformed request line")),
    };
    if target.is_empty() || target.bytes().any(|b| b.is_ascii_control()) {
        return Err(bad("malformed request-target"));
    }
    let origin = if target.starts_with('/') {
        target
    } else if target == "*" {
        if method != "OPTIONS" {
            return Err(bad("request-target * is only for OPTIONS"));
        }
        target
    } else if let Some(rest) = strip_prefix_ignore_case(target, "http://")
        .or_else(|| strip_prefix_ignore_case(target, "https://"))
    {
        // Absolute form: drop the authority (an empty path is "/", below).
        rest.find(['/', '?']).map_or("", |i| &rest[i..])
    } else {
        return Err(bad("request-target must be a path"));
    };
    let (path, query) = match origin.split_once('?') {
        Some((p, q)) => (p, Some(q.to_owned())),
        None => (origin, None),
    };
    let path = if path.is_empty() { "/" } else { path };
    Ok((method.into(), path.into(), query, minor_version))
}

fn strip_prefix_ignore_case<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &s[prefix.len()..])
}

/// Lowercased name and trimmed value of a header line.
fn header_line(text: &str) -> Result<(String, String), HttpError> {
    if text.starts_with([' ', '\t']) {
        return Err(bad("folded header line (obs-fold)"));
    }
    let Some((name, value)) = text.split_once(':') else {
        return Err(bad("header line without ':'"));
    };
    if !is_token(name) {
        return Err(bad("malformed header name"));
    }
    let value = value.trim_matches([' ', '\t']);
    if value.bytes().any(|b| b.is_ascii_control() && b != b'\t') {
        return Err(bad("control character in a header value"));
    }
    Ok((name.to_ascii_lowercase(), value.to_owned()))
}

/// The standard reason phrase of `status` ("OK", "Bad Request", ... for 100,
/// 200, 204, 400, 404, 405, 411, 413, 415, 422, 431, 500, 501, 503 and a few
/// more; "Unknown" otherwise).
pub fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        201 => "Created",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        411 => "Length Required",
        413 => "Content Too Large",
        415 => "Unsupported Media Type",
        422 => "Unprocessable Content",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "Unknown",
    }
}

/// Refuses header text that would end the line early (response splitting).
fn check_header_text(s: &str) -> io::Result<()> {
    if s.bytes().any(|b| b == b'\r' || b == b'\n') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "CR or LF in a response header",
        ));
    }
    Ok(())
}

/// Writes a whole response: status line (HTTP/1.1), `Content-Type`,
/// `Content-Length`, `Connection: keep-alive` or `close`,
/// `Access-Control-Allow-Origin: *`, then `extra_headers` (name, value) pairs,
/// blank line, body; flushes.
///
/// An empty `content_type` leaves out `Content-Type`; a 1xx or 204 response
/// has neither `Content-Length` nor body (RFC 9110). Header text with CR or
/// LF is refused (`InvalidInput`) before anything is written. Head and body
/// go out in one write.
pub fn write_response(
    w: &mut impl Write,
    status: u16,
    content_type: &str,
    body: &[u8],
    keep_alive: bool,
    extra_headers: &[(&str, &str)],
) -> io::Result<()> {
    check_header_text(content_type)?;
    for (name, value) in extra_headers {
        check_header_text(name)?;
        check_header_text(value)?;
    }
    let bodiless = (100..200).contains(&status) || status == 204;
    let mut head = format!("HTTP/1.1 {status} {}\r\n", reason(status));
    if !content_type.is_empty() {
        head += &format!("Content-Type: {content_type}\r\n");
    }
    if !bodiless {
        head += &format!("Content-Length: {}\r\n", body.len());
    }
    head += if keep_alive {
        "Connection: keep-alive\r\n"
    } else {
        "Connection: close\r\n"
    };
    head += "Access-Control-Allow-Origin: *\r\n";
    for (name, value) in extra_headers {
        head += &format!("{name}: {value}\r\n");
    }
    head += "\r\n";
    let body = if bodiless { &[][..] } else { body };
    let mut out = Vec::with_capacity(head.len() + body.len());
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(body);
    w.write_all(&out)?;
    w.flush()
}

/// Starts a server-sent-events response: 200, `Content-Type: text/event-stream`,
/// `Cache-Control: no-cache`, `Connection: close`,
/// `Access-Control-Allow-Origin: *` and no length (the body ends when the
/// connection closes); flushes.
pub fn start_event_stream(w: &mut impl Write) -> io::Result<()> {
    w.write_all(
        b"HTTP/1.1 200 OK\r\n\
          Content-Type: text/event-stream\r\n\
          Cache-Control: no-cache\r\n\
          Connection: close\r\n\
          Access-Control-Allow-Origin: *\r\n\
          \r\n",
    )?;
    w.flush()
}

/// Writes one event `data: {data}\n\n` and flushes, in one write.
///
/// `data` should hold no line break (JSON from serde_json never does); if it
/// does, each line (split at CRLF, LF or CR, as an SSE reader splits them)
/// goes out as its own `data:` line, which a reader joins back with '\n'.
pub fn write_event(w: &mut impl Write, data: &str) -> io::Result<()> {
    write_named_event(w, None, data)
}

/// [`write_event`] with an `event: {name}` line first, where given (names
/// hold no line break).
pub fn write_named_event(w: &mut impl Write, name: Option<&str>, data: &str) -> io::Result<()> {
    let mut out = Vec::with_capacity(data.len() + 32);
    if let Some(name) = name {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(name.replace(['\r', '\n'], " ").as_bytes());
        out.push(b'\n');
    }
    let mut rest = data;
    loop {
        out.extend_from_slice(b"data: ");
        match rest.find(['\r', '\n']) {
            Some(i) => {
                out.extend_from_slice(&rest.as_bytes()[..i]);
                out.push(b'\n');
                let skip = if rest[i..].starts_with("\r\n") { 2 } else { 1 };
                rest = &rest[i + skip..];
            }
            None => {
                out.extend_from_slice(rest.as_bytes());
                out.push(b'\n');
                break;
            }
        }
    }
    out.push(b'\n');
    w.write_all(&out)?;
    w.flush()
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::io::Cursor;
    use std::rc::Rc;

    use proptest::prelude::*;

    use super::*;

    fn read(bytes: &[u8]) -> Result<Request, HttpError> {
        read_request(&mut &bytes[..], &mut io::sink(), &Limits::default())
    }

    fn ok(bytes: &[u8]) -> Request {
        read(bytes).unwrap_or_else(|e| panic!("{:?}: {e}", bytes.escape_ascii().to_string()))
    }

    fn bad_request(bytes: &[u8]) -> String {
        match read(bytes) {
            Err(HttpError::BadRequest(m)) => m,
            other => panic!("{:?}: {other:?}", bytes.escape_ascii().to_string()),
        }
    }

    #[test]
    fn get_without_body() {
        let r = ok(b"GET /v1/models?x=1&y HTTP/1.1\r\nHost: localhost:8080\r\nUser-Agent:  curl/8 \r\n\r\n");
        assert_eq!(r.method, "GET");
        assert_eq!(r.path, "/v1/models");
        assert_eq!(r.query.as_deref(), Some("x=1&y"));
        assert_eq!(r.minor_version, 1);
        assert_eq!(
            r.headers,
            [
                ("host".to_owned(), "localhost:8080".to_owned()),
                ("user-agent".to_owned(), "curl/8".to_owned()),
            ]
        );
        assert!(r.body.is_empty());
        assert!(r.keep_alive());
        let r = ok(b"GET / HTTP/1.0\r\n\r\n");
        assert_eq!((r.path.as_str(), r.query, r.minor_version), ("/", None, 0));
        assert!(r.headers.is_empty());
    }

    #[test]
    fn post_with_body() {
        let body = br#"{"model":"m","messages":[]}"#;
        let mut bytes = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        bytes.extend_from_slice(body);
        let r = ok(&bytes);
        assert_eq!(r.method, "POST");
        assert_eq!(r.path, "/v1/chat/completions");
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(r.body, body);
        // Content-Length: 0 is an empty body.
        let r = ok(b"POST /x HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
        assert!(r.body.is_empty());
    }

    #[test]
    fn bare_lf_and_leading_empty_lines() {
        let r = ok(b"\r\n\nPOST /a HTTP/1.1\nContent-Length: 3\r\nX-A: b\n\nabc");
        assert_eq!(r.path, "/a");
        assert_eq!(r.header("x-a"), Some("b"));
        assert_eq!(r.body, b"abc");
    }

    #[test]
    fn keep_alive_rules() {
        let ka = |bytes: &[u8]| ok(bytes).keep_alive();
        assert!(ka(b"GET / HTTP/1.1\r\n\r\n"));
        assert!(!ka(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n"));
        assert!(!ka(b"GET / HTTP/1.1\r\nConnection: close, foo\r\n\r\n"));
        assert!(!ka(b"GET / HTTP/1.1\r\nConnection: foo,CLOSE\r\n\r\n"));
        assert!(!ka(
            b"GET / HTTP/1.1\r\nConnection: foo\r\nConnection: Close\r\n\r\n"
        ));
        assert!(
            ka(b"GET / HTTP/1.1\r\nConnection: closed\r\n\r\n"),
            "token match"
        );
        assert!(!ka(b"GET / HTTP/1.0\r\n\r\n"));
        assert!(ka(b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n"));
        assert!(ka(
            b"GET / HTTP/1.0\r\nConnection: foo , keep-alive\r\n\r\n"
        ));
        assert!(!ka(
            b"GET / HTTP/1.0\r\nConnection: keep-alive, close\r\n\r\n"
        ));
    }

    #[test]
    fn header_lookup_is_case_insensitive() {
        let r = ok(
            b"GET / HTTP/1.1\r\nX-Thing: one\r\nx-thing: two\r\nAuthorization: Bearer k\r\n\r\n",
        );
        assert_eq!(r.header("X-THING"), Some("one"), "the first one");
        assert_eq!(r.header("x-thing"), Some("one"));
        assert_eq!(r.header("authorization"), Some("Bearer k"));
        assert_eq!(r.header("Authorization"), Some("Bearer k"));
        assert_eq!(r.header("missing"), None);
        assert_eq!(r.headers[1], ("x-thing".to_owned(), "two".to_owned()));
    }

    #[test]
    fn request_targets() {
        let r = ok(b"OPTIONS * HTTP/1.1\r\n\r\n");
        assert_eq!((r.method.as_str(), r.path.as_str()), ("OPTIONS", "*"));
        let r = ok(b"GET http://localhost:8080/v1/models?a=b HTTP/1.1\r\n\r\n");
        assert_eq!(
            (r.path.as_str(), r.query.as_deref()),
            ("/v1/models", Some("a=b"))
        );
        let r = ok(b"GET HTTPS://h HTTP/1.1\r\n\r\n");
        assert_eq!((r.path.as_str(), r.query), ("/", None));
        let r = ok(b"GET http://h?q HTTP/1.1\r\n\r\n");
        assert_eq!((r.path.as_str(), r.query.as_deref()), ("/", Some("q")));
        let r = ok(b"GET /? HTTP/1.1\r\n\r\n");
        assert_eq!(r.query.as_deref(), Some(""));
        bad_request(b"GET * HTTP/1.1\r\n\r\n");
        bad_request(b"GET v1/models HTTP/1.1\r\n\r\n");
        bad_request(b"CONNECT host:443 HTTP/1.1\r\n\r\n");
        bad_request(b"GET ftp://h/x HTTP/1.1\r\n\r\n");
    }

    #[test]
    fn malformed_heads() {
        for bytes in [
            &b"GET /\r\n\r\n"[..],
            b"GET  / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1 \r\n\r\n",
            b"GET / HTTP/2.0\r\n\r\n",
            b"GET / http/1.1\r\n\r\n",
            b"G(T / HTTP/1.1\r\n\r\n",
            b"GET /a\x01 HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost : x\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost\r\n\r\n",
            b"GET / HTTP/1.1\r\n: x\r\n\r\n",
            b"GET / HTTP/1.1\r\nA: b\r\n c\r\n\r\n",
            b"GET / HTTP/1.1\r\n\tA: b\r\n\r\n",
            b"GET / HTTP/1.1\r\nA: b\rc\r\n\r\n",
            b"GET / HTTP/1.1\r\nA: b\0c\r\n\r\n",
            b"GET / HTTP/1.1\r\nA: \xff\r\n\r\n",
            b"GET / HTTP/1.1\r\nExpect: something-else\r\n\r\n",
        ] {
            bad_request(bytes);
        }
        let m = bad_request(b"GET / HTTP/1.1\r\nA: b\r\n continued\r\n\r\n");
        assert!(m.contains("obs-fold"), "{m}");
    }

    /// The interim writer and the reader share this log, so the reader can
    /// see whether 100 Continue went out before the body was asked for.
    #[derive(Clone, Default)]
    struct Log(Rc<RefCell<Vec<u8>>>);

    impl Write for Log {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.borrow_mut().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// Serves `head`, then, once asked for more, checks the log holds
    /// `expected_interim` and serves `body`.
    struct Staged {
        head: Cursor<Vec<u8>>,
        body: Cursor<Vec<u8>>,
        log: Log,
        expected_interim: &'static [u8],
        body_reads: usize,
    }

    impl Read for Staged {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.fill_buf()?.len().min(buf.len());
            buf[..n].copy_from_slice(&self.fill_buf()?[..n]);
            self.consume(n);
            Ok(n)
        }
    }

    impl BufRead for Staged {
        fn fill_buf(&mut self) -> io::Result<&[u8]> {
            if self.head.position() < self.head.get_ref().len() as u64 {
                return self.head.fill_buf();
            }
            assert_eq!(
                *self.log.0.borrow(),
                self.expected_interim,
                "before the body"
            );
            self.body_reads += 1;
            self.body.fill_buf()
        }
        fn consume(&mut self, n: usize) {
            if self.head.position() < self.head.get_ref().len() as u64 {
                self.head.consume(n)
            } else {
                self.body.consume(n)
            }
        }
    }

    fn staged(head: &[u8], body: &[u8], expected_interim: &'static [u8]) -> (Staged, Log) {
        let log = Log::default();
        let r = Staged {
            head: Cursor::new(head.to_vec()),
            body: Cursor::new(body.to_vec()),
            log: log.clone(),
            expected_interim,
            body_reads: 0,
        };
        (r, log)
    }

    const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

    #[test]
    fn expect_100_continue() {
        let head =
            b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nExpect: 100-Continue\r\n\r\n";
        let (mut r, mut log) = staged(head, b"hello", CONTINUE);
        let req = read_request(&mut r, &mut log, &Limits::default()).unwrap();
        assert_eq!(req.body, b"hello");
        assert!(r.body_reads > 0);
        assert_eq!(*log.0.borrow(), CONTINUE, "exactly once");

        // No body to read: no 100.
        let head = b"POST / HTTP/1.1\r\nContent-Length: 0\r\nExpect: 100-continue\r\n\r\n";
        let (mut r, mut log) = staged(head, b"", b"");
        read_request(&mut r, &mut log, &Limits::default()).unwrap();
        assert!(log.0.borrow().is_empty());

        // HTTP/1.0 clients never get a 100.
        let head = b"POST / HTTP/1.0\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n";
        let (mut r, mut log) = staged(head, b"hi", b"");
        assert_eq!(
            read_request(&mut r, &mut log, &Limits::default())
                .unwrap()
                .body,
            b"hi"
        );
        assert!(log.0.borrow().is_empty());

        // Refused length: no 100, body untouched.
        let head = b"POST / HTTP/1.1\r\nContent-Length: 11\r\nExpect: 100-continue\r\n\r\n";
        let (mut r, mut log) = staged(head, b"hello world", b"");
        let limits = Limits {
            max_body: 10,
            ..Limits::default()
        };
        let e = read_request(&mut r, &mut log, &limits).unwrap_err();
        assert!(
            matches!(
                e,
                HttpError::BodyTooLarge {
                    length: 11,
                    limit: 10
                }
            ),
            "{e:?}"
        );
        assert!(log.0.borrow().is_empty());
        assert_eq!(r.body_reads, 0);

        // Without Expect, no 100 either.
        let head = b"POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\n";
        let (mut r, mut log) = staged(head, b"hi", b"");
        read_request(&mut r, &mut log, &Limits::default()).unwrap();
        assert!(log.0.borrow().is_empty());
    }

    #[test]
    fn oversize_head() {
        let limits = Limits {
            max_head: 64,
            ..Limits::default()
        };
        // 64 bytes with the empty line: just fits; a byte more does not.
        let head =
            |n: usize| format!("GET / HTTP/1.1\r\nA: {}\r\n\r\n", "x".repeat(n)).into_bytes();
        let exact = head(41);
        assert_eq!(exact.len(), 64);
        assert!(read_request(&mut &exact[..], &mut io::sink(), &limits).is_ok());
        let over = head(42);
        let e = read_request(&mut &over[..], &mut io::sink(), &limits).unwrap_err();
        assert!(matches!(e, HttpError::HeadTooLarge), "{e:?}");
        assert_eq!(e.status(), 431);
        // One endless line: refused at the limit, not read to the end.
        let endless = io::repeat(b'a');
        let mut r = io::BufReader::new(endless);
        let e = read_request(&mut r, &mut io::sink(), &Limits::default()).unwrap_err();
        assert!(matches!(e, HttpError::HeadTooLarge), "{e:?}");
        // Empty lines before the request count too.
        let mut r = io::BufReader::new(io::repeat(b'\n'));
        let e = read_request(&mut r, &mut io::sink(), &limits).unwrap_err();
        assert!(matches!(e, HttpError::HeadTooLarge), "{e:?}");
    }

    #[test]
    fn too_many_headers() {
        let limits = Limits {
            max_headers: 3,
            ..Limits::default()
        };
        let three = b"GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\nC: 3\r\n\r\n";
        assert_eq!(
            read_request(&mut &three[..], &mut io::sink(), &limits)
                .unwrap()
                .headers
                .len(),
            3
        );
        let four = b"GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\nC: 3\r\nD: 4\r\n\r\n";
        let e = read_request(&mut &four[..], &mut io::sink(), &limits).unwrap_err();
        assert!(matches!(e, HttpError::HeadTooLarge), "{e:?}");
    }

    /// Serves a head, then panics if anything more is asked for.
    struct HeadOnly(Cursor<Vec<u8>>);

    impl Read for HeadOnly {
        fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
            panic!("read past the head");
        }
    }

    impl BufRead for HeadOnly {
        fn fill_buf(&mut self) -> io::Result<&[u8]> {
            assert!(
                self.0.position() < self.0.get_ref().len() as u64,
                "read past the head"
            );
            self.0.fill_buf()
        }
        fn consume(&mut self, n: usize) {
            self.0.consume(n)
        }
    }

    #[test]
    fn body_over_the_limit_is_not_read() {
        // Would take a terabyte if it were reserved.
        let head = b"POST / HTTP/1.1\r\nContent-Length: 1000000000000\r\n\r\n".to_vec();
        let mut r = HeadOnly(Cursor::new(head));
        let e = read_request(&mut r, &mut io::sink(), &Limits::default()).unwrap_err();
        assert!(
            matches!(e, HttpError::BodyTooLarge { length: 1_000_000_000_000, limit } if limit == 64 << 20),
            "{e:?}"
        );
        assert_eq!(e.status(), 413);

        // The body bytes stay in the reader.
        let bytes = b"POST / HTTP/1.1\r\nContent-Length: 9\r\n\r\n123456789";
        let mut r = Cursor::new(&bytes[..]);
        let limits = Limits {
            max_body: 8,
            ..Limits::default()
        };
        let e = read_request(&mut r, &mut io::sink(), &limits).unwrap_err();
        assert!(
            matches!(
                e,
                HttpError::BodyTooLarge {
                    length: 9,
                    limit: 8
                }
            ),
            "{e:?}"
        );
        assert_eq!(r.position() as usize, bytes.len() - 9);
    }

    #[test]
    fn short_body_of_a_large_claim() {
        // A 64 MiB claim (at the limit) with 3 bytes sent: reserves at most
        // RESERVE, reads what came, and reports the short body.
        let bytes = b"POST / HTTP/1.1\r\nContent-Length: 67108864\r\n\r\nabc";
        let e = read(bytes).unwrap_err();
        assert!(
            matches!(&e, HttpError::Io(io) if io.kind() == io::ErrorKind::UnexpectedEof),
            "{e:?}"
        );
    }

    #[test]
    fn transfer_encoding_needs_length() {
        for bytes in [
            &b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"[..],
            b"POST / HTTP/1.1\r\nContent-Length: 5\r\ntransfer-encoding: gzip, chunked\r\n\r\nhello",
            b"POST / HTTP/1.0\r\nTransfer-Encoding: identity\r\n\r\n",
        ] {
            let e = read(bytes).unwrap_err();
            assert!(matches!(e, HttpError::LengthRequired), "{e:?}");
            assert_eq!(e.status(), 411);
        }
    }

    #[test]
    fn bad_content_length() {
        for value in [
            "12a",
            "-1",
            "+1",
            "",
            " ",
            "1 2",
            "1,1",
            "0x10",
            "99999999999999999999999",
        ] {
            let bytes = format!("POST / HTTP/1.1\r\nContent-Length: {value}\r\n\r\n");
            let e = read(bytes.as_bytes()).unwrap_err();
            assert!(matches!(e, HttpError::BadRequest(_)), "{value:?}: {e:?}");
            assert_eq!(e.status(), 400);
        }
        let m =
            bad_request(b"POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc");
        assert!(m.contains("different"), "{m}");
        // The same value twice is one length.
        let r = ok(b"POST / HTTP/1.1\r\nContent-Length: 3\r\ncontent-length:  3\r\n\r\nabc");
        assert_eq!(r.body, b"abc");
        // Leading zeros are digits.
        assert_eq!(
            ok(b"POST / HTTP/1.1\r\nContent-Length: 003\r\n\r\nabc").body,
            b"abc"
        );
    }

    #[test]
    fn truncated_requests() {
        let e = read(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nshort").unwrap_err();
        assert!(
            matches!(&e, HttpError::Io(io) if io.kind() == io::ErrorKind::UnexpectedEof),
            "{e:?}"
        );
        for bytes in [
            &b"GE"[..],
            b"GET / HTTP/1.1\r\n",
            b"GET / HTTP/1.1\r\nHost: x\r\n",
            b"\r\nGET",
        ] {
            let e = read(bytes).unwrap_err();
            assert!(
                matches!(&e, HttpError::Io(io) if io.kind() == io::ErrorKind::UnexpectedEof),
                "{e:?}"
            );
        }
    }

    /// Yields its bytes, then an error of `kind`.
    struct ThenError(Cursor<Vec<u8>>, io::ErrorKind);

    impl Read for ThenError {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.0.read(buf)?;
            if n == 0 && !buf.is_empty() {
                return Err(self.1.into());
            }
            Ok(n)
        }
    }

    #[test]
    fn closed_before_a_request() {
        for bytes in [&b""[..], b"\r\n", b"\n\n\r"] {
            let e = read(bytes).unwrap_err();
            assert!(matches!(e, HttpError::Closed), "{bytes:?}: {e:?}");
        }
        // A timeout or reset on an idle connection is a close too.
        for kind in [
            io::ErrorKind::WouldBlock,
            io::ErrorKind::TimedOut,
            io::ErrorKind::ConnectionReset,
        ] {
            let mut r = io::BufReader::new(ThenError(Cursor::new(b"\r\n".to_vec()), kind));
            let e = read_request(&mut r, &mut io::sink(), &Limits::default()).unwrap_err();
            assert!(matches!(e, HttpError::Closed), "{kind:?}: {e:?}");
        }
        // Mid-request it is an I/O error.
        for (bytes, kind) in [
            (&b"GET / HT"[..], io::ErrorKind::WouldBlock),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 3\r\n\r\na",
                io::ErrorKind::TimedOut,
            ),
        ] {
            let mut r = io::BufReader::new(ThenError(Cursor::new(bytes.to_vec()), kind));
            let e = read_request(&mut r, &mut io::sink(), &Limits::default()).unwrap_err();
            assert!(
                matches!(&e, HttpError::Io(io) if io.kind() == kind),
                "{e:?}"
            );
        }
    }

    #[test]
    fn pipelined_requests() {
        let bytes = b"POST /a HTTP/1.1\r\nContent-Length: 4\r\n\r\nbodyGET /b HTTP/1.1\r\n\r\n\r\nPOST /c HTTP/1.1\nContent-Length: 1\n\nx";
        // Whole, and one byte at a time.
        for capacity in [8192, 1] {
            let mut r = io::BufReader::with_capacity(capacity, &bytes[..]);
            let mut next = || read_request(&mut r, &mut io::sink(), &Limits::default());
            let a = next().unwrap();
            assert_eq!((a.path.as_str(), a.body.as_slice()), ("/a", &b"body"[..]));
            let b = next().unwrap();
            assert_eq!((b.method.as_str(), b.path.as_str()), ("GET", "/b"));
            assert!(b.body.is_empty());
            let c = next().unwrap();
            assert_eq!((c.path.as_str(), c.body.as_slice()), ("/c", &b"x"[..]));
            assert!(matches!(next(), Err(HttpError::Closed)));
        }
    }

    #[test]
    fn error_statuses_and_messages() {
        let errors = [
            HttpError::Closed,
            HttpError::Io(io::ErrorKind::UnexpectedEof.into()),
            bad("malformed request line"),
            HttpError::HeadTooLarge,
            HttpError::BodyTooLarge {
                length: 9,
                limit: 8,
            },
            HttpError::LengthRequired,
        ];
        let statuses: Vec<u16> = errors.iter().map(HttpError::status).collect();
        assert_eq!(statuses, [400, 400, 400, 431, 413, 411]);
        for e in &errors {
            let text = e.to_string();
            assert!(!text.is_empty() && !text.contains('\n'), "{text:?}");
            assert_ne!(reason(e.status()), "Unknown");
        }
    }

    #[test]
    fn reasons() {
        for (status, phrase) in [
            (100, "Continue"),
            (200, "OK"),
            (204, "No Content"),
            (400, "Bad Request"),
            (404, "Not Found"),
            (405, "Method Not Allowed"),
            (411, "Length Required"),
            (413, "Content Too Large"),
            (415, "Unsupported Media Type"),
            (422, "Unprocessable Content"),
            (431, "Request Header Fields Too Large"),
            (500, "Internal Server Error"),
            (501, "Not Implemented"),
            (503, "Service Unavailable"),
            (299, "Unknown"),
        ] {
            assert_eq!(reason(status), phrase);
        }
    }

    #[test]
    fn response_bytes() {
        let mut out = Vec::new();
        write_response(&mut out, 200, "application/json", b"{\"a\":1}", true, &[]).unwrap();
        assert_eq!(
            out,
            b"HTTP/1.1 200 OK\r\n\
              Content-Type: application/json\r\n\
              Content-Length: 7\r\n\
              Connection: keep-alive\r\n\
              Access-Control-Allow-Origin: *\r\n\
              \r\n\
              {\"a\":1}"
        );

        let mut out = Vec::new();
        let extra = [("Allow", "GET, POST"), ("X-Request-Id", "7")];
        write_response(
            &mut out,
            405,
            "text/plain; charset=utf-8",
            b"no",
            false,
            &extra,
        )
        .unwrap();
        assert_eq!(
            out,
            b"HTTP/1.1 405 Method Not Allowed\r\n\
              Content-Type: text/plain; charset=utf-8\r\n\
              Content-Length: 2\r\n\
              Connection: close\r\n\
              Access-Control-Allow-Origin: *\r\n\
              Allow: GET, POST\r\n\
              X-Request-Id: 7\r\n\
              \r\n\
              no"
        );

        let mut out = Vec::new();
        write_response(
            &mut out,
            204,
            "",
            b"",
            true,
            &[("Access-Control-Allow-Methods", "GET")],
        )
        .unwrap();
        assert_eq!(
            out,
            b"HTTP/1.1 204 No Content\r\n\
              Connection: keep-alive\r\n\
              Access-Control-Allow-Origin: *\r\n\
              Access-Control-Allow-Methods: GET\r\n\
              \r\n"
        );

        // No response splitting.
        let mut out = Vec::new();
        let e = write_response(
            &mut out,
            200,
            "text/plain",
            b"",
            true,
            &[("X", "a\r\nSet-Cookie: b")],
        )
        .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(out.is_empty());
    }

    #[test]
    fn event_stream_bytes() {
        let mut out = Vec::new();
        start_event_stream(&mut out).unwrap();
        write_event(&mut out, r#"{"choices":[]}"#).unwrap();
        write_event(&mut out, "[DONE]").unwrap();
        assert_eq!(
            out,
            b"HTTP/1.1 200 OK\r\n\
              Content-Type: text/event-stream\r\n\
              Cache-Control: no-cache\r\n\
              Connection: close\r\n\
              Access-Control-Allow-Origin: *\r\n\
              \r\n\
              data: {\"choices\":[]}\n\n\
              data: [DONE]\n\n"
        );

        let mut out = Vec::new();
        write_event(&mut out, "a\nb\r\nc\rd\n").unwrap();
        assert_eq!(out, b"data: a\ndata: b\ndata: c\ndata: d\ndata: \n\n");
        let mut out = Vec::new();
        write_event(&mut out, "").unwrap();
        assert_eq!(out, b"data: \n\n");
    }

    /// Counts flushes, to check every writer flushes.
    #[derive(Default)]
    struct Flushes(Vec<u8>, usize);

    impl Write for Flushes {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            self.1 += 1;
            Ok(())
        }
    }

    #[test]
    fn writers_flush() {
        let mut w = Flushes::default();
        write_response(&mut w, 200, "text/plain", b"x", true, &[]).unwrap();
        assert_eq!(w.1, 1);
        start_event_stream(&mut w).unwrap();
        assert_eq!(w.1, 2);
        write_event(&mut w, "x").unwrap();
        assert_eq!(w.1, 3);
    }

    /// The body invariant: the declared length, read whole, within the limit.
    fn check_body(r: &Request, limits: &Limits) {
        let declared = r
            .header("content-length")
            .map_or(0, |v| v.parse::<u64>().expect("Content-Length parsed"));
        assert_eq!(r.body.len() as u64, declared);
        assert!(r.body.len() <= limits.max_body);
    }

    /// Reads requests until an error, checking each.
    fn read_all(bytes: &[u8], limits: &Limits) -> Vec<Request> {
        let mut r = bytes;
        let mut requests = Vec::new();
        loop {
            let before = r.len();
            match read_request(&mut r, &mut io::sink(), limits) {
                Ok(req) => {
                    assert!(r.len() < before, "a request consumed nothing");
                    check_body(&req, limits);
                    requests.push(req);
                }
                Err(e) => {
                    assert!(!e.to_string().contains('\n'));
                    return requests;
                }
            }
        }
    }

    fn small_limits() -> Limits {
        Limits {
            max_head: 256,
            max_body: 64,
            max_headers: 4,
        }
    }

    /// Pieces of requests, so random mixes are often well formed.
    fn piece() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            Just(b"GET / HTTP/1.1\r\n".to_vec()),
            Just(b"POST /v1/chat/completions HTTP/1.1\n".to_vec()),
            Just(b"OPTIONS * HTTP/1.0\r\n".to_vec()),
            Just(b"\r\n".to_vec()),
            Just(b"\n".to_vec()),
            Just(b"Expect: 100-continue\r\n".to_vec()),
            Just(b"Transfer-Encoding: chunked\r\n".to_vec()),
            Just(b"Connection: close\r\n".to_vec()),
            (0u32..100).prop_map(|n| format!("Content-Length: {n}\r\n").into_bytes()),
            proptest::collection::vec(any::<u8>(), 0..16),
            "[a-zA-Z0-9 :/?\r\n-]{0,16}".prop_map(String::into_bytes),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            read_all(&bytes, &small_limits());
            read_all(&bytes, &Limits::default());
        }

        #[test]
        fn mixed_pieces_never_panic(pieces in proptest::collection::vec(piece(), 0..24)) {
            let bytes = pieces.concat();
            read_all(&bytes, &small_limits());
            read_all(&bytes, &Limits::default());
        }

        #[test]
        fn well_formed_requests_read_back(
            method in "[A-Z]{1,7}",
            path in "/[a-z0-9/._-]{0,20}",
            query in proptest::option::of("[a-z0-9=&]{0,10}"),
            headers in proptest::collection::vec(("[A-Za-z][A-Za-z0-9-]{0,10}", "[ -~]{0,20}"), 0..5),
            body in proptest::collection::vec(any::<u8>(), 0..100),
            crlf in any::<bool>(),
            count in 1usize..4,
        ) {
            let eol = if crlf { "\r\n" } else { "\n" };
            let target = match &query {
                Some(q) => format!("{path}?{q}"),
                None => path.clone(),
            };
            let headers: Vec<(String, String)> = headers
                .into_iter()
                .filter(|(n, _)| {
                    let n = n.to_ascii_lowercase();
                    n != "content-length" && n != "transfer-encoding" && n != "expect"
                })
                .collect();
            let mut one = format!("{method} {target} HTTP/1.1{eol}").into_bytes();
            for (n, v) in &headers {
                one.extend_from_slice(format!("{n}: {v}{eol}").as_bytes());
            }
            one.extend_from_slice(format!("Content-Length: {}{eol}{eol}", body.len()).as_bytes());
            one.extend_from_slice(&body);
            let bytes = one.repeat(count);
            let requests = read_all(&bytes, &Limits::default());
            prop_assert_eq!(requests.len(), count);
            for r in &requests {
                prop_assert_eq!(&r.method, &method);
                prop_assert_eq!(&r.path, &path);
                prop_assert_eq!(&r.query, &query);
                prop_assert_eq!(&r.body, &body);
                prop_assert_eq!(r.headers.len(), headers.len() + 1);
                for ((n, v), (rn, rv)) in headers.iter().zip(&r.headers) {
                    prop_assert_eq!(&n.to_ascii_lowercase(), rn);
                    prop_assert_eq!(v.trim_matches(' '), rv);
                }
            }
        }
    }
}
