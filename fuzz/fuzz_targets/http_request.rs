//! The HTTP request reader of `les serve` on arbitrary bytes: reading requests
//! back to back (pipelining) until an error never panics, hangs or allocates
//! past the limits; every request read has a body of exactly its
//! Content-Length, within `max_body`; and reading through a tiny buffer gives
//! the same requests and the same final error as reading from one slice.
//! Each body also goes through both endpoints' JSON readers, which answer
//! with a request or a one-line error, never a panic.
#![no_main]

use std::io::{self, BufReader};

use les::serve::api;
use les::serve::http::{read_request, HttpError, Limits, Request};
use libfuzzer_sys::fuzz_target;

const LIMITS: Limits = Limits {
    max_head: 4096,
    max_body: 1 << 16,
    max_headers: 32,
};

const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// Reads requests from `r` until an error, checking each body.
fn read_all(r: &mut impl io::BufRead, interim: &mut impl io::Write) -> (Vec<Request>, HttpError) {
    let mut requests = Vec::new();
    loop {
        match read_request(r, interim, &LIMITS) {
            Ok(request) => {
                let declared = request.header("content-length").map_or(0, |v| {
                    v.parse::<u64>().expect("an accepted Content-Length parses")
                });
                assert_eq!(request.body.len() as u64, declared);
                assert!(request.body.len() <= LIMITS.max_body);
                requests.push(request);
            }
            Err(e) => {
                assert!(!e.to_string().contains('\n'), "{e}");
                assert!(matches!(e.status(), 400 | 411 | 413 | 431));
                return (requests, e);
            }
        }
    }
}

/// The error, as far as two reads of the same bytes must agree.
fn kind(e: &HttpError) -> String {
    match e {
        HttpError::Io(io) => format!("Io({:?})", io.kind()),
        other => format!("{other:?}"),
    }
}

fuzz_target!(|data: &[u8]| {
    // Each request consumes at least its request line, so this ends.
    let (requests, error) = read_all(&mut &data[..], &mut io::sink());

    let mut small = BufReader::with_capacity(3, data);
    let mut interim = Vec::new();
    let (again, error_again) = read_all(&mut small, &mut interim);
    assert_eq!(requests, again);
    assert_eq!(kind(&error), kind(&error_again));
    // Only 100 Continue lines, at most one per request (and one for the last,
    // failed one if its body was cut short).
    assert_eq!(interim.len() % CONTINUE.len(), 0);
    assert!(interim.chunks(CONTINUE.len()).all(|c| c == CONTINUE));
    assert!(interim.len() / CONTINUE.len() <= requests.len() + 1);
    for r in &requests {
        for read in [api::chat_request, api::text_request] {
            if let Err(e) = read(&r.body) {
                assert!(!e.message.contains('\n'), "{}", e.message);
                assert_eq!(e.status, 400);
            }
        }
    }
});
