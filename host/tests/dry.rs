//! DRY's sequence breakers over a real vocabulary (a synthetic model's
//! byte-level BPE): a token whose text holds a breaker is never penalized
//! and stops a repetition, as llama.cpp's `get_overlapping_token_sequences`
//! makes them.

mod cli;

use cli::synth_once;
use les::model::Model;
use les::sampling::{Dry, DrySettings};
use les::tokenizer::Tokenizer;

fn tokenizer() -> Tokenizer {
    let path = synth_once(
        "dry-qwen3moe.gguf",
        &["--arch", "qwen3moe", "--preset", "tiny", "--quiet"],
    );
    let model = Model::open(&path).unwrap();
    Tokenizer::from_gguf(model.gguf()).unwrap()
}

fn settings() -> DrySettings {
    DrySettings {
        multiplier: 0.8,
        base: 1.75,
        allowed_length: 2,
        last_n: 1000,
    }
}

fn one(tok: &Tokenizer, text: &str) -> u32 {
    let ids = tok.encode(text, false, false);
    assert_eq!(ids.len(), 1, "{text:?} is {ids:?}");
    ids[0]
}

fn penalized(dry: &mut Dry, tokens: &[u32]) -> Vec<u32> {
    dry.clear();
    for &t in tokens {
        dry.accept(t);
    }
    dry.penalties().into_iter().map(|(t, _)| t).collect()
}

#[test]
fn breakers_from_text_cut_repeats_and_are_not_penalized() {
    let tok = tokenizer();
    let settings = settings();
    let [a, b, c, x] = ["a", "b", "c", "x"].map(|t| one(&tok, t));
    let colon = one(&tok, ":");
    let mut plain = Dry::new(settings, &[], &tok);
    let mut with_colon = Dry::new(settings, &[":".to_string()], &tok);
    // "a b c :" then "x a b c": ":" would extend the repeat of "a b c".
    let seq = [a, b, c, colon, x, a, b, c];
    assert_eq!(penalized(&mut plain, &seq), vec![colon]);
    // As a breaker it is not penalized.
    assert!(penalized(&mut with_colon, &seq).is_empty());
    // "a b c x : a b c": the repeat cannot reach back past ":" (3 tokens),
    // still enough for "a b c" to be found again, so x is penalized...
    let seq = [a, b, c, x, colon, a, b, c];
    assert_eq!(penalized(&mut with_colon, &seq), vec![x]);
    // ... but not where ":" cuts the ending short: "a b : c" against "a b c".
    let seq = [a, b, c, x, a, b, colon, c];
    assert!(penalized(&mut with_colon, &seq).is_empty());
    // Off, nothing.
    let off = DrySettings {
        multiplier: 0.0,
        ..settings
    };
    assert!(penalized(&mut Dry::new(off, &[], &tok), &[a, b, c, x, a, b, c]).is_empty());
}

/// A breaker of several tokens: its first token ending in a start of it and
/// the rest tokenized.
#[test]
fn a_breaker_of_several_tokens_stops_a_repeat_where_it_is_complete() {
    let tok = tokenizer();
    let settings = settings();
    let [a, b, c, x] = ["a", "b", "c", "x"].map(|t| one(&tok, t));
    // "qz" is two tokens here ("q", "z"): a breaker only as a pair.
    let (q, z) = (one(&tok, "q"), one(&tok, "z"));
    assert_eq!(tok.encode("qz", false, false), vec![q, z]);
    let mut dry = Dry::new(settings, &["qz".to_string()], &tok);
    // "a b c x q z a b c": the repeat may reach back to just after "q z".
    assert_eq!(penalized(&mut dry, &[a, b, c, x, q, z, a, b, c]), vec![x]);
    // "a b q z c ... a b q z c": the ending cannot reach past the last "q z".
    assert!(penalized(&mut dry, &[a, b, q, z, c, x, a, b, q, z, c]).is_empty());
    // "q" alone is no breaker: "a q b ... a q b" repeats.
    assert_eq!(penalized(&mut dry, &[a, q, b, x, a, q, b]), vec![x]);
}
