//! GBNF grammars from arbitrary text: parsing gives a grammar or an error,
//! never a panic, hang or huge allocation; a grammar that parses then checks
//! and accepts arbitrary byte pieces (its bounds stop runaway grammars with an
//! error), and whatever it accepted it keeps allowing from the start. Text
//! that is a JSON Schema the converter takes gives GBNF that parses (unless
//! the schema only refers to itself, or outgrows the bounds).
#![no_main]

use les::grammar::{json_schema_to_gbnf, Grammar, Matcher};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Grammar text, then pieces, split at the first 0xFF byte.
    let (text, rest) = match data.iter().position(|&b| b == 0xff) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(text) = std::str::from_utf8(text) else {
        return;
    };
    if let Ok(gbnf) = json_schema_to_gbnf(text) {
        if let Err(e) = Grammar::parse(&gbnf) {
            assert!(
                e.0.contains("left-recursive") || e.0.contains("symbols") || e.0.contains("rules"),
                "{text:?} gave GBNF that does not parse: {e}\n{gbnf}"
            );
        }
    }
    let Ok(grammar) = Grammar::parse(text) else {
        return;
    };
    let Ok(mut m) = Matcher::new(grammar) else {
        return;
    };
    let mut accepted = Vec::new();
    for piece in rest.split(|&b| b == 0xfe).take(64) {
        let allowed = m.allows(piece);
        // Refused, or past a bound: the state stays as it was.
        if m.accept(piece).is_ok() {
            assert!(allowed, "accepted a piece not allowed: {piece:?}");
            accepted.extend_from_slice(piece);
        }
    }
    // The accepted bytes, again from the start in one piece, are accepted.
    if let Ok(text) = std::str::from_utf8(&accepted) {
        m.reset();
        if !text.is_empty() {
            assert!(m.accept(text.as_bytes()).is_ok(), "{text:?}");
        }
    }
});
