//! `les batch` end to end: a file of requests in OpenAI's Batch API format
//! answered into result lines in the requests' order, each request's answer
//! the same whether the requests ran side by side (`--parallel`, prompt
//! lookup drafting too) or one at a time, and bad lines answered with an
//! error line of their own instead of ending the batch.

mod cli;

use std::path::{Path, PathBuf};
use std::process::Command;

use cli::{les, synth_once, tmp};
use serde_json::{json, Value};

/// A tiny qwen3moe (it has a chat template) made once.
fn model() -> PathBuf {
    synth_once(
        "batch_q3.gguf",
        &[
            "--quiet", "--arch", "qwen3moe", "--preset", "tiny", "--seed", "5",
        ],
    )
}

/// The request lines: chats, texts and a response, sampled and greedy, and
/// lines that are not requests or that the endpoint refuses.
fn requests() -> Vec<String> {
    let line = |id: &str, url: &str, body: Value| {
        json!({"custom_id": id, "method": "POST", "url": url, "body": body}).to_string()
    };
    let chat = |text: &str| json!([{"role": "user", "content": text}]);
    vec![
        line(
            "chat-1",
            "/v1/chat/completions",
            json!({"messages": chat("Hello"), "max_tokens": 24, "temperature": 0}),
        ),
        line(
            "text-1",
            "/v1/completions",
            json!({"prompt": "Once upon a time", "max_tokens": 30, "seed": 3}),
        ),
        String::new(),
        "not json".into(),
        line("chat-1", "/v1/completions", json!({"prompt": "again"})),
        line("get", "/v1/completions", json!({"prompt": "x"})).replace("POST", "GET"),
        line("other-url", "/v1/embeddings", json!({"input": "x"})),
        line("refused", "/v1/chat/completions", json!({"messages": []})),
        line(
            "text-2",
            "/v1/completions",
            json!({"prompt": "one two three one two three one two", "max_tokens": 40,
                   "temperature": 0, "logprobs": 2, "stream": true}),
        ),
        line(
            "response-1",
            "/v1/responses",
            json!({"input": "Hi there", "max_output_tokens": 12, "temperature": 0.7, "seed": 9}),
        ),
    ]
}

/// Runs `les batch` over `lines` (through standard input) with `extra`
/// arguments: its result lines and standard error.
fn batch(lines: &[String], extra: &[&str]) -> (Vec<Value>, String) {
    let input: String = lines.iter().map(|l| format!("{l}\n")).collect();
    let out = cli::with_stdin(
        les()
            .args(["batch", "-i", "-", "-m"])
            .arg(model())
            .args(extra),
        input.as_bytes(),
    );
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{err}");
    let results = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (results, err)
}

/// What a result says, without what differs between runs (ids, times, the
/// prompt tokens a slot happened to hold).
fn answer(r: &Value) -> Value {
    let Some(body) = r["response"].get("body") else {
        return json!({"custom_id": r["custom_id"], "error": r["error"]["code"]});
    };
    let text = match &body["object"] {
        v if v == "chat.completion" => body["choices"][0]["message"].clone(),
        v if v == "text_completion" => {
            json!([body["choices"][0]["text"], body["choices"][0]["logprobs"]])
        }
        v if v == "response" => body["output"][0]["content"].clone(),
        _ => body["error"]["message"].clone(),
    };
    let u = &body["usage"];
    let tokens = [
        u.get("prompt_tokens").or(u.get("input_tokens")),
        u.get("completion_tokens").or(u.get("output_tokens")),
    ];
    json!({"custom_id": r["custom_id"], "status": r["response"]["status_code"],
           "answer": text, "tokens": tokens})
}

/// Results come a line a request line in order; requests answer the same
/// side by side (with and without drafts) as one at a time; lines that are
/// no request get an error line, bodies the endpoint refuses its error with
/// its status.
#[test]
fn batch_answers_each_request_in_order() {
    let lines = requests();
    let (alone, err) = batch(&lines, &[]);
    let ids: Vec<&str> = alone
        .iter()
        .map(|r| r["custom_id"].as_str().unwrap_or("-"))
        .collect();
    assert_eq!(
        ids,
        [
            "chat-1",
            "text-1",
            "-",
            "chat-1",
            "get",
            "other-url",
            "refused",
            "text-2",
            "response-1"
        ],
        "{alone:?}"
    );
    let status: Vec<Value> = alone
        .iter()
        .map(|r| r["response"]["status_code"].clone())
        .collect();
    assert_eq!(
        status,
        [
            json!(200),
            json!(200),
            Value::Null,
            Value::Null,
            Value::Null,
            Value::Null,
            json!(400),
            json!(200),
            json!(200)
        ]
    );
    for r in &alone[2..6] {
        assert_eq!(r["error"]["code"], "invalid_request", "{r}");
        assert!(
            r["error"]["message"].as_str().unwrap().starts_with("line "),
            "{r}"
        );
    }
    assert!(alone[3]["error"]["message"]
        .as_str()
        .unwrap()
        .contains("repeated"));
    assert!(alone[6]["response"]["body"]["error"]["message"]
        .as_str()
        .unwrap()
        .contains("messages"));
    // Streaming is off in a batch: the whole answer, with its logprobs.
    assert_eq!(alone[7]["response"]["body"]["object"], "text_completion");
    assert!(alone[7]["response"]["body"]["choices"][0]["logprobs"].is_object());
    assert!(err.contains("les batch: answered 9 (5 failed)"), "{err}");
    let want: Vec<Value> = alone.iter().map(answer).collect();
    for extra in [
        &["--parallel", "3"][..],
        &["--parallel", "3", "-b", "4"],
        &[
            "--parallel",
            "2",
            "--speculate",
            "ngram",
            "--draft-max",
            "4",
            "--draft-fixed",
        ],
    ] {
        let (got, err) = batch(&lines, extra);
        let got: Vec<Value> = got.iter().map(answer).collect();
        assert_eq!(got, want, "{extra:?}");
        if extra[1] == "3" {
            // Side by side: more than one slot answered.
            assert!(err.contains("slot 1") && err.contains("slot 2"), "{err}");
        }
    }
}

/// `-o` writes the results to a file (never over the input); a missing
/// input file is an error before the model loads, an output that cannot be
/// written one that ends the batch.
#[test]
fn batch_writes_results_to_a_file() {
    let input = tmp("batch_in.jsonl");
    std::fs::write(&input, requests()[..2].join("\n")).unwrap();
    let output = tmp("batch_out.jsonl");
    let _ = std::fs::remove_file(&output);
    let run = |i: &Path, o: &Path| {
        Command::new(env!("CARGO_BIN_EXE_les"))
            .args(["batch", "-m"])
            .arg(model())
            .arg("-i")
            .arg(i)
            .arg("-o")
            .arg(o)
            .output()
            .unwrap()
    };
    let out = run(&input, &output);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.stdout.is_empty());
    let text = std::fs::read_to_string(&output).unwrap();
    let ids: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["custom_id"].clone())
        .collect();
    assert_eq!(ids, [json!("chat-1"), json!("text-1")]);
    for (i, o, says) in [
        (&input, &input, "is the input"),
        (&tmp("batch_missing.jsonl"), &output, "cannot read"),
    ] {
        let out = run(i, o);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{err}");
    }
    // An output that cannot be written ends the batch with its error.
    if Path::new("/dev/full").exists() {
        let out = run(&input, Path::new("/dev/full"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("space"), "{err}");
    }
    // The input is left as it was.
    assert_eq!(
        std::fs::read_to_string(&input).unwrap(),
        requests()[..2].join("\n")
    );
}
