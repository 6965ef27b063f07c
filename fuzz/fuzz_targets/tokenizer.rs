//! Tokenizer encode/decode round trip on arbitrary bytes: byte-level BPE (the
//! synthetic vocabulary, under five pre-tokenizers) gives back the text it
//! encoded, and decoding arbitrary ids never panics.
#![no_main]

use std::sync::OnceLock;

use les::gguf::{Gguf, GgufWriter, MetaValue};
use les::synth::Vocab;
use les::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

const PRES: [&str; 5] = ["qwen2", "llama-bpe", "gpt-2", "kimi-k2", "gpt-4o"];

fn tokenizers() -> &'static [Tokenizer] {
    static T: OnceLock<Vec<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        let vocab = Vocab::build(400).expect("vocabulary");
        PRES.iter()
            .map(|pre| {
                let mut w = GgufWriter::new();
                for (k, v) in vocab.metadata() {
                    let v = if k == "tokenizer.ggml.pre" {
                        MetaValue::from(*pre)
                    } else {
                        v
                    };
                    w.add_kv(k, v).expect("metadata");
                }
                let mut bytes = Vec::new();
                let tw = w.write_header(&mut bytes).expect("header");
                tw.finish().expect("finish");
                let g = Gguf::parse(bytes).expect("parse");
                Tokenizer::from_gguf(&g).expect("tokenizer")
            })
            .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    for tok in tokenizers() {
        if let Ok(s) = std::str::from_utf8(data) {
            let ids = tok.encode(s, false, false);
            assert_eq!(tok.decode(&ids), s, "round trip");
        }
        // Any ids (in and out of the vocabulary) decode without panicking.
        let ids: Vec<u32> = data
            .chunks(2)
            .map(|c| u32::from(c[0]) | u32::from(*c.get(1).unwrap_or(&0)) << 8)
            .collect();
        let _ = tok.decode_with(&ids, true);
        let mut dec = tok.stream_decoder(false);
        for &id in &ids {
            let _ = dec.decode_piece(id);
        }
        let _ = dec.finish();
    }
});
