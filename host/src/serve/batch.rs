//! `les batch`: a file of requests in OpenAI's Batch API format (JSONL, one
//! request a line) answered by the [`Engine`] without a server, into a file
//! of results in that API's output format, a line each, in the order of the
//! requests.
//!
//! A request line is `{"custom_id": ID, "method": "POST", "url": URL,
//! "body": BODY}`, with `URL` one of `/v1/chat/completions`,
//! `/v1/completions` and `/v1/responses`, and `BODY` what that endpoint of
//! `les serve` takes (streaming is off). Its result line is `{"id",
//! "custom_id", "response": {"status_code", "request_id", "body"}, "error":
//! null}`, `body` being what `les serve` answers (an error's body with its
//! status where the request is refused or fails). A line that is no request
//! (not JSON, no or a repeated `custom_id`, another method or URL) gets
//! `"response": null` and `"error": {"code", "message"}` instead.
//!
//! With several slots the requests run side by side, as `les serve
//! --parallel` runs its completions: each
//! pass of the model reads a layer's experts once for all of them. Requests
//! are read as slots come free (a few ahead), so a file of any length takes
//! the memory of a few requests.

use std::collections::HashSet;
use std::io::{BufRead, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::api::{ApiError, Completion};
use super::{
    completion_id, now, server_error, work_all, About, Endpoint, Engine, Event, Job, ServeOptions,
    Shape,
};

/// Longest request line read (images travel in them as base64).
pub const MAX_LINE: usize = 64 << 20;

/// What a batch did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchSummary {
    /// Lines read (blank ones aside).
    pub requests: usize,
    /// Of them, those answered with a status of 200.
    pub succeeded: usize,
    /// Tokens generated for those answered.
    pub completion_tokens: usize,
    /// Prompt tokens of those answered.
    pub prompt_tokens: usize,
}

/// A request line's place in the output: its answer to come, or what is
/// wrong with it.
enum Pending {
    Job {
        custom_id: String,
        endpoint: Endpoint,
        answers: Receiver<Event>,
    },
    Invalid {
        custom_id: Option<String>,
        message: String,
    },
}

/// Answers the requests of `input` with `engine`, writing a result line for
/// each to `out` as soon as it and those before it are answered, and
/// progress to stderr. Fails only where `input` or `out` does.
pub fn run_batch(
    engine: &mut Engine<'_>,
    input: &mut (dyn BufRead + Send),
    out: &mut dyn Write,
    opts: &ServeOptions,
) -> std::io::Result<BatchSummary> {
    let about = About::new(engine, opts);
    // A few requests ahead of the engine, so that a slot coming free finds
    // one waiting.
    let (jobs, queue) = sync_channel::<Job>(2 * engine.slots.len());
    let (pending, results) = channel::<Pending>();
    let mut written = Results {
        results,
        head: None,
        summary: BatchSummary::default(),
        start: Instant::now(),
        noted: Instant::now(),
        model_id: &opts.model_id,
        tokenizer: about.tokenizer,
        failed: None,
    };
    // Set where the output cannot be written: no more requests are read.
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let stop = &stop;
        let reader = scope.spawn(move || read_requests(input, &pending, &jobs, stop));
        // The results are written between the engine's rounds.
        work_all(engine, queue, &about, &mut || {
            written.write_ready(out, false);
            if written.failed.is_some() {
                stop.store(true, Ordering::Relaxed);
            }
        });
        let read = reader.join().expect("the batch reader panicked");
        written.write_ready(out, true);
        note(&written.summary, written.start.elapsed());
        match (read, written.failed.take()) {
            (Err(e), _) | (_, Some(e)) => Err(e),
            _ => Ok(written.summary),
        }
    })
}

/// Reads the request lines of `input`, each to `pending` (its place in the
/// output) and, a request, to `jobs`; returns at the end of `input`, where
/// the engine stopped, or once `stop` is set.
fn read_requests(
    input: &mut (dyn BufRead + Send),
    pending: &Sender<Pending>,
    jobs: &SyncSender<Job>,
    stop: &AtomicBool,
) -> std::io::Result<()> {
    let mut seen = HashSet::new();
    let mut line = Vec::new();
    for number in 1.. {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        line.clear();
        let n = (&mut *input)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)?;
        if n == 0 {
            break;
        }
        if line.len() > MAX_LINE {
            let message = format!("line {number} is longer than {MAX_LINE} bytes");
            let _ = pending.send(Pending::Invalid {
                custom_id: None,
                message,
            });
            // The rest of the line is not a request either.
            skip_line(input)?;
            continue;
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let BatchRequest {
            custom_id,
            endpoint,
            completion: read,
        } = match read_request(&line, &mut seen) {
            Ok(r) => r,
            Err(LineError { custom_id, message }) => {
                let message = format!("line {number}: {message}");
                let _ = pending.send(Pending::Invalid { custom_id, message });
                continue;
            }
        };
        let (events, answers) = channel();
        let _ = pending.send(Pending::Job {
            custom_id,
            endpoint,
            answers,
        });
        match read {
            Ok(completion) => {
                let job = Job {
                    completion,
                    endpoint,
                    events,
                    cancel: Arc::new(AtomicBool::new(false)),
                };
                if jobs.send(job).is_err() {
                    break;
                }
            }
            // Refused as the endpoint refuses it.
            Err(e) => {
                let _ = events.send(Event::Done(Err(e)));
            }
        }
    }
    Ok(())
}

/// The result lines to write, in the requests' order.
struct Results<'a> {
    results: Receiver<Pending>,
    /// The first result not written yet, once read from `results`.
    head: Option<Pending>,
    summary: BatchSummary,
    start: Instant,
    noted: Instant,
    model_id: &'a str,
    tokenizer: &'a crate::tokenizer::Tokenizer,
    /// The first error writing the output (nothing is written after it).
    failed: Option<std::io::Error>,
}

impl Results<'_> {
    /// Writes the results that are answered, in order, up to the first that
    /// is not; with `all`, waits for each instead (the engine is done).
    fn write_ready(&mut self, out: &mut dyn Write, all: bool) {
        while self.failed.is_none() {
            let p = match self.head.take() {
                Some(p) => p,
                None if all => match self.results.recv() {
                    Ok(p) => p,
                    Err(_) => return,
                },
                None => match self.results.try_recv() {
                    Ok(p) => p,
                    Err(_) => return,
                },
            };
            let n = self.summary.requests;
            let line = match p {
                Pending::Invalid { custom_id, message } => json!({
                    "id": format!("batch_req_{n}"),
                    "custom_id": custom_id,
                    "response": null,
                    "error": {"code": "invalid_request", "message": message},
                }),
                Pending::Job {
                    custom_id,
                    endpoint,
                    answers,
                } => {
                    let mut done = None;
                    while done.is_none() {
                        let event = if all {
                            answers.recv().map_err(|_| TryRecvError::Disconnected)
                        } else {
                            answers.try_recv()
                        };
                        match event {
                            Ok(Event::Done(r)) => done = Some(r),
                            Ok(_) => {}
                            Err(TryRecvError::Empty) => break,
                            Err(TryRecvError::Disconnected) => {
                                done = Some(Err(server_error("the engine stopped".into())));
                            }
                        }
                    }
                    let Some(result) = done else {
                        // Not answered yet: it waits at the head.
                        self.head = Some(Pending::Job {
                            custom_id,
                            endpoint,
                            answers,
                        });
                        return;
                    };
                    self.line(n, custom_id, endpoint, result)
                }
            };
            self.summary.requests += 1;
            if let Err(e) = writeln!(out, "{line}").and_then(|()| out.flush()) {
                self.failed = Some(e);
            }
            if self.noted.elapsed() >= Duration::from_secs(2) {
                self.noted = Instant::now();
                note(&self.summary, self.start.elapsed());
            }
        }
    }

    /// The result line of request `n` (`custom_id`, to `endpoint`), answered
    /// with `result`.
    fn line(
        &mut self,
        n: usize,
        custom_id: String,
        endpoint: Endpoint,
        result: Result<super::Finished, ApiError>,
    ) -> Value {
        let id = completion_id(endpoint);
        let shape = Shape {
            id: &id,
            created: now(),
            model: self.model_id,
            endpoint,
            tokenizer: self.tokenizer,
        };
        let (status, body) = match result {
            Ok(f) => {
                self.summary.succeeded += 1;
                self.summary.completion_tokens += f.completion_tokens;
                self.summary.prompt_tokens += f.prompt_tokens;
                (200, shape.whole(&f))
            }
            Err(e) => (e.status, shape.error(&e)),
        };
        json!({
            "id": format!("batch_req_{n}"),
            "custom_id": custom_id,
            "response": {"status_code": status, "request_id": id, "body": body},
            "error": null,
        })
    }
}

/// Skips the rest of a line of `input`, a bounded piece at a time.
fn skip_line(input: &mut (dyn BufRead + Send)) -> std::io::Result<()> {
    let mut piece = Vec::new();
    loop {
        piece.clear();
        let n = (&mut *input).take(1 << 20).read_until(b'\n', &mut piece)?;
        if n == 0 || piece.last() == Some(&b'\n') {
            return Ok(());
        }
    }
}

/// A request line read ([`read_request`]).
#[derive(Debug)]
pub struct BatchRequest {
    /// Its id.
    pub custom_id: String,
    endpoint: Endpoint,
    /// Its completion, or the endpoint's refusal of its body.
    pub completion: Result<Completion, ApiError>,
}

/// A line that is no request.
#[derive(Debug)]
pub struct LineError {
    /// Its `custom_id`, where it has one.
    pub custom_id: Option<String>,
    /// What is wrong with it.
    pub message: String,
}

/// Reads a request line (streaming off); `seen` holds the ids read so far,
/// and a repeated one is refused.
pub fn read_request(line: &[u8], seen: &mut HashSet<String>) -> Result<BatchRequest, LineError> {
    let bad = |message: String| LineError {
        custom_id: None,
        message,
    };
    let v: Value =
        serde_json::from_slice(line).map_err(|e| bad(format!("not a JSON object: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| bad("not a JSON object".to_string()))?;
    let custom_id = obj
        .get("custom_id")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("'custom_id' must be a string".to_string()))?
        .to_string();
    let fail = |message: String| LineError {
        custom_id: Some(custom_id.clone()),
        message,
    };
    if !seen.insert(custom_id.clone()) {
        return Err(fail(format!("'custom_id' {custom_id:?} is repeated")));
    }
    match obj.get("method").and_then(Value::as_str) {
        Some("POST") => {}
        _ => return Err(fail("'method' must be \"POST\"".into())),
    }
    let url = obj.get("url").and_then(Value::as_str).unwrap_or_default();
    let endpoint = match url.trim_end_matches('/') {
        "/v1/chat/completions" => Endpoint::Chat,
        "/v1/completions" => Endpoint::Text,
        "/v1/responses" => Endpoint::Responses,
        _ => {
            return Err(fail(format!(
                "'url' {url:?} is not one of /v1/chat/completions, /v1/completions, /v1/responses"
            )))
        }
    };
    let body = obj
        .get("body")
        .filter(|b| b.is_object())
        .ok_or_else(|| fail("'body' must be an object".into()))?;
    let bytes = serde_json::to_vec(body).map_err(|e| fail(e.to_string()))?;
    let completion = endpoint
        .read(url, &bytes)
        .map(|c| Completion { stream: false, ..c });
    Ok(BatchRequest {
        custom_id,
        endpoint,
        completion,
    })
}

/// Notes how far the batch got.
fn note(s: &BatchSummary, took: Duration) {
    note!(
        "les batch: answered {} ({} failed), {} tokens generated in {:.1?} ({:.2} tok/s)",
        s.requests,
        s.requests - s.succeeded,
        s.completion_tokens,
        took,
        s.completion_tokens as f64 / took.as_secs_f64().max(1e-9)
    );
}
