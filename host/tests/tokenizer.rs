//! Tokenizer behaviour on small hand-built vocabularies: exact ids for BPE and
//! SentencePiece, special tokens, BOS/EOS, decoding, errors, chat templates, and
//! property tests for round trips and robustness.
//!
//! Everything sits in `mod tokenizer` so that `cargo test tokenizer` selects it.

mod tokenizer {
    use les::tokenizer::{
        byte_token_text, ChatTemplate, ChatTemplateError, ModelKind, PreTokenizer, TokenType,
        Tokenizer, TokenizerData, TokenizerError,
    };
    use proptest::prelude::*;

    // ---------------------------------------------------------------------------
    // Builders

    /// A byte-level vocabulary whose first 256 ids are the bytes (id = byte value).
    fn byte_vocab() -> Vec<String> {
        (0..=255u8).map(byte_token_text).collect()
    }

    /// GPT-2 characters for the bytes of `s` (" the" is "Ġthe").
    fn g(s: &str) -> String {
        s.bytes().map(byte_token_text).collect()
    }

    /// A byte-level BPE tokenizer: bytes, then `extra` tokens (ids 256..), then merges.
    fn bpe_data(pre: &str, extra: &[&str], merges: &[&str]) -> TokenizerData {
        let mut tokens = byte_vocab();
        tokens.extend(extra.iter().map(|s| s.to_string()));
        TokenizerData {
            model: "gpt2".into(),
            pre: Some(pre.into()),
            tokens,
            merges: merges.iter().map(|s| s.to_string()).collect(),
            ..TokenizerData::default()
        }
    }

    fn bpe(pre: &str, extra: &[&str], merges: &[&str]) -> Tokenizer {
        Tokenizer::new(bpe_data(pre, extra, merges)).unwrap()
    }

    fn bytes_of(s: &str) -> Vec<u32> {
        s.bytes().map(u32::from).collect()
    }

    /// A SentencePiece vocabulary: 0 `<unk>`, 1 `<s>`, 2 `</s>`, 3..=258 `<0xXX>`,
    /// then `pieces` (id 259..) with their scores.
    fn spm_data(pieces: &[(&str, f32)]) -> TokenizerData {
        let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
        let mut types = vec![2, 3, 3];
        let mut scores = vec![0.0, 0.0, 0.0];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
            scores.push(0.0);
        }
        for (p, s) in pieces {
            tokens.push(p.to_string());
            types.push(1);
            scores.push(*s);
        }
        TokenizerData {
            model: "llama".into(),
            tokens,
            token_type: Some(types),
            scores: Some(scores),
            ..TokenizerData::default()
        }
    }

    const SPM_PIECES: &[(&str, f32)] = &[
        ("▁h", -5.0),     // 259
        ("▁he", -4.0),    // 260
        ("ll", -3.0),     // 261
        ("llo", -2.0),    // 262
        ("▁hello", -1.0), // 263
        ("h", -10.0),     // 264
        ("e", -10.0),     // 265
        ("l", -10.0),     // 266
        ("o", -10.0),     // 267
        ("▁", -10.0),     // 268
        ("ab", -1.0),     // 269
        ("bc", -1.0),     // 270
        ("a", -10.0),     // 271
        ("b", -10.0),     // 272
        ("c", -10.0),     // 273
    ];

    fn spm_byte(b: u8) -> u32 {
        3 + u32::from(b)
    }

    // ---------------------------------------------------------------------------
    // Byte-level BPE: exact ids

    #[test]
    fn merges_apply_by_rank() {
        let th_first = bpe("qwen2", &["th", "he"], &["t h", "h e"]);
        assert_eq!(th_first.encode("the", false, false), [256, u32::from(b'e')]);
        let he_first = bpe("qwen2", &["th", "he"], &["h e", "t h"]);
        assert_eq!(he_first.encode("the", false, false), [u32::from(b't'), 257]);
    }

    #[test]
    fn equal_ranks_merge_leftmost_first() {
        let tok = bpe("qwen2", &["aa"], &["a a"]);
        assert_eq!(
            tok.encode("aaaaa", false, false),
            [256, 256, u32::from(b'a')]
        );
    }

    #[test]
    fn merges_chain_within_words_only() {
        let the = g(" the");
        let tok = bpe(
            "gpt-2",
            &[&g(" t"), &g(" th"), &the],
            &["Ġ t", "Ġt h", "Ġth e"],
        );
        assert_eq!(tok.encode(" the", false, false), [258]);
        let mut expected = bytes_of("the");
        expected.push(258);
        assert_eq!(tok.encode("the the", false, false), expected);
        assert_eq!(tok.decode(&expected), "the the");
    }

    #[test]
    fn digit_groups_follow_the_pre_tokenizer() {
        let extra = ["12", "123", "45"];
        let merges = ["1 2", "12 3", "4 5"];
        // llama-3: \p{N}{1,3} gives "123" "45"; default: \p{N}+ then [0-9]{3} gives the
        // same; GPT-2 keeps "12345" whole and merges reach "123" "45" too.
        for pre in ["llama-bpe", "default", "gpt-2"] {
            assert_eq!(
                bpe(pre, &extra, &merges).encode("12345", false, false),
                [257, 258],
                "{pre}"
            );
        }
        // qwen2 and smollm cut every digit alone: nothing merges.
        for pre in ["qwen2", "smollm", "qwen35"] {
            assert_eq!(
                bpe(pre, &extra, &merges).encode("12345", false, false),
                bytes_of("12345"),
                "{pre}"
            );
        }
        // "1234": llama-3 gives "123" "4"; gpt-2 merges "12" then "123".
        assert_eq!(
            bpe("llama-bpe", &extra, &merges).encode("1234", false, false),
            [257, u32::from(b'4')]
        );
    }

    #[test]
    fn contractions_merge_only_when_split_out() {
        let extra = ["'s", "'S"];
        let merges = ["' s", "' S"];
        let its = |pre: &str, text: &str| bpe(pre, &extra, &merges).encode(text, false, false);
        assert_eq!(
            its("llama-bpe", "it's"),
            [u32::from(b'i'), u32::from(b't'), 256]
        );
        // llama-3 matches 'S case-insensitively; GPT-2 only lower case, so "'S" becomes
        // "'" then "S" and cannot merge.
        assert_eq!(
            its("llama-bpe", "IT'S"),
            [u32::from(b'I'), u32::from(b'T'), 257]
        );
        assert_eq!(its("gpt-2", "IT'S"), bytes_of("IT'S"));
    }

    #[test]
    fn llama3_takes_whole_word_tokens_without_merges() {
        let extra = ["xyz"];
        assert_eq!(
            bpe("llama-bpe", &extra, &[]).encode("xyz", false, false),
            [256]
        );
        assert_eq!(
            bpe("qwen2", &extra, &[]).encode("xyz", false, false),
            bytes_of("xyz")
        );
        // GLM-4.5's `glm4` (and `glm5`) too, llama.cpp's `ignore_merges`;
        // `chatglm-bpe` (GLM-4) merges.
        for pre in ["glm4", "glm5"] {
            let tok = bpe(pre, &extra, &[]);
            assert_eq!(tok.encode("xyz", false, false), [256], "{pre}");
        }
        assert_eq!(
            bpe("chatglm-bpe", &extra, &[]).encode("xyz", false, false),
            bytes_of("xyz")
        );
    }

    #[test]
    fn whitespace_runs_and_newlines() {
        let tok = bpe("llama-bpe", &["ĠĠ", "ĊĊ"], &["Ġ Ġ", "Ċ Ċ"]);
        // "a", "  ", " b", "\n\n"
        assert_eq!(
            tok.encode("a   b\n\n", false, false),
            [u32::from(b'a'), 256, 32, u32::from(b'b'), 257]
        );
    }

    #[test]
    fn multibyte_characters_merge_from_bytes() {
        let ni = g("你");
        let hao = g("好");
        let ni_hao = format!("{ni}{hao}");
        let m1 = format!("{} {}", byte_token_text(0xe4), byte_token_text(0xbd));
        let first_two = format!("{}{}", byte_token_text(0xe4), byte_token_text(0xbd));
        let m2 = format!("{first_two} {}", byte_token_text(0xa0));
        let m3 = format!("{} {}", byte_token_text(0xe5), byte_token_text(0xa5));
        let hao_two = format!("{}{}", byte_token_text(0xe5), byte_token_text(0xa5));
        let m4 = format!("{hao_two} {}", byte_token_text(0xbd));
        let m5 = format!("{ni} {hao}");
        let tok = bpe(
            "qwen2",
            &[&first_two, &ni, &hao_two, &hao, &ni_hao],
            &[&m1, &m2, &m3, &m4, &m5],
        );
        assert_eq!(tok.encode("你好", false, false), [260]);
        assert_eq!(tok.encode("你好!", false, false), [260, u32::from(b'!')]);
        assert_eq!(tok.encode("好你", false, false), [259, 257]);
        assert_eq!(tok.decode(&[259, 257]), "好你");
        // Emoji have no merges: their four bytes.
        assert_eq!(tok.encode("🦀", false, false), bytes_of("🦀"));
    }

    #[test]
    fn bytes_without_a_token_are_dropped() {
        let mut data = bpe_data("qwen2", &[], &[]);
        data.tokens[usize::from(b'z')] = "zz-not-a-byte".into();
        let tok = Tokenizer::new(data).unwrap();
        assert_eq!(
            tok.encode("azb", false, false),
            [u32::from(b'a'), u32::from(b'b')]
        );
    }

    #[test]
    fn large_vocabulary_builds_and_round_trips() {
        // 150k tokens and 150k merges: every pair of "Ġa".."z" letters, then pairs of those.
        let letters: Vec<String> = "Ġabcdefghijklmnopqrstuvwxyz"
            .chars()
            .map(String::from)
            .collect();
        let mut tokens = byte_vocab();
        let mut merges = Vec::new();
        let mut pairs = Vec::new();
        for a in &letters {
            for b in &letters[1..] {
                pairs.push(format!("{a}{b}"));
                merges.push(format!("{a} {b}"));
                tokens.push(format!("{a}{b}"));
            }
        }
        'outer: for a in &pairs {
            for b in pairs.iter().filter(|b| !b.starts_with('Ġ')) {
                merges.push(format!("{a} {b}"));
                tokens.push(format!("{a}{b}"));
                if merges.len() == 150_000 {
                    break 'outer;
                }
            }
        }
        let tok = Tokenizer::new(TokenizerData {
            model: "gpt2".into(),
            pre: Some("qwen2".into()),
            tokens,
            merges,
            ..TokenizerData::default()
        })
        .unwrap();
        assert_eq!((tok.n_vocab(), tok.n_merges()), (150_256, 150_000));
        let mut text = String::new();
        let mut x: u64 = 1;
        for _ in 0..50_000 {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let r = (x >> 33) % 30;
            text.push(match r {
                0..=25 => char::from(b'a' + r as u8),
                26..=28 => ' ',
                _ => '\n',
            });
        }
        let ids = tok.encode(&text, false, false);
        assert!(ids.len() < text.len() / 2, "merges should shrink the text");
        assert_eq!(tok.decode(&ids), text);
        // One very long word: the merge queue stays O(n log n).
        let ids = tok.encode(&"ab".repeat(50_000), false, false);
        assert_eq!(ids, vec![tok.token_id("abab").unwrap(); 25_000]);
    }

    // ---------------------------------------------------------------------------
    // Special tokens

    fn chatml() -> Tokenizer {
        Tokenizer::new(chatml_data()).unwrap()
    }

    fn chatml_data() -> TokenizerData {
        let mut data = bpe_data(
            "qwen2",
            &[
                "<|im_start|>",
                "<|im_end|>",
                "<think>",
                "<|im",
                "<|endoftext|>",
            ],
            &[],
        );
        let mut types = vec![1; 256];
        types.extend([3, 3, 4, 3, 1]);
        data.token_type = Some(types);
        data.eos_id = Some(260);
        data
    }

    #[test]
    fn control_tokens_need_parse_special() {
        let tok = chatml();
        let mut expected = vec![256];
        expected.extend(bytes_of("hi"));
        expected.push(257);
        assert_eq!(
            tok.encode("<|im_start|>hi<|im_end|>", false, true),
            expected
        );
        assert_eq!(
            tok.encode("<|im_start|>hi<|im_end|>", false, false),
            bytes_of("<|im_start|>hi<|im_end|>")
        );
    }

    #[test]
    fn user_defined_tokens_always_match() {
        let tok = chatml();
        let mut expected = vec![258];
        expected.extend(bytes_of("x"));
        assert_eq!(tok.encode("<think>x", false, false), expected);
        assert_eq!(tok.encode("<think>x", false, true), expected);
    }

    #[test]
    fn longest_special_token_wins() {
        let tok = chatml();
        assert_eq!(tok.encode("<|im<|im_start|>", false, true), [259, 256]);
        assert_eq!(tok.encode("<|im_start|><|im", false, true), [256, 259]);
    }

    #[test]
    fn end_of_generation_tokens() {
        let tok = chatml();
        assert!(tok.is_eog(257)); // <|im_end|> by text
        assert!(tok.is_eog(260)); // <|endoftext|>, also the EOS
        assert!(!tok.is_eog(256));
        assert!(!tok.is_eog(u32::MAX));
        // "<|endoftext|>" was typed normal but llama.cpp makes it control.
        assert_eq!(tok.token_type(260), Some(TokenType::Control));
        assert_eq!(tok.eot(), Some(257)); // the lowest id among llama.cpp's EOT texts
        assert_eq!(tok.eos(), Some(260));
        assert_eq!(tok.eog_ids(), [257, 260]);
        // An end-of-message id in the metadata ends generation too (GLM-4.5's
        // `<|observation|>`), whatever its text.
        let mut data = chatml_data();
        data.eom_id = Some(256);
        let tok = Tokenizer::new(data).unwrap();
        assert_eq!(tok.eog_ids(), [256, 257, 260]);
    }

    #[test]
    fn decoding_hides_control_tokens_unless_asked() {
        let tok = chatml();
        let ids = tok.encode("<|im_start|>hi<think><|im_end|>", false, true);
        assert_eq!(tok.decode(&ids), "hi<think>");
        assert_eq!(
            tok.decode_with(&ids, true),
            "<|im_start|>hi<think><|im_end|>"
        );
    }

    #[test]
    fn bos_and_eos_follow_metadata_and_defaults() {
        let mut data = bpe_data("llama-bpe", &["<|begin_of_text|>", "<|end_of_text|>"], &[]);
        data.bos_id = Some(256);
        data.eos_id = Some(257);
        let llama3 = Tokenizer::new(data.clone()).unwrap();
        assert!(llama3.add_bos() && !llama3.add_eos());
        assert_eq!(llama3.encode("hi", true, false), [256, 104, 105]);
        assert_eq!(llama3.encode("hi", false, false), [104, 105]);
        assert_eq!(llama3.encode("", true, false), [256]);

        data.pre = Some("qwen2".into());
        let qwen = Tokenizer::new(data.clone()).unwrap();
        assert!(!qwen.add_bos());
        assert_eq!(qwen.encode("hi", true, false), [104, 105]);

        data.add_bos = Some(true);
        data.add_eos = Some(true);
        let both = Tokenizer::new(data).unwrap();
        assert_eq!(both.encode("hi", true, false), [256, 104, 105, 257]);
    }

    #[test]
    fn bpe_default_ids_are_llama_cpps() {
        // Without ids in the metadata llama.cpp takes 11 for BOS and EOS of a BPE vocab.
        let tok = bpe("qwen2", &[], &[]);
        assert_eq!(
            (tok.bos(), tok.eos(), tok.unk()),
            (Some(11), Some(11), None)
        );
        assert_eq!(tok.kind(), ModelKind::Bpe);
        assert_eq!(tok.pre_tokenizer(), Some(PreTokenizer::Qwen2));
        let no_pre = Tokenizer::new(TokenizerData {
            pre: None,
            ..bpe_data("x", &[], &[])
        })
        .unwrap();
        assert_eq!(no_pre.pre_tokenizer(), Some(PreTokenizer::Default));
    }

    // ---------------------------------------------------------------------------
    // SentencePiece

    #[test]
    fn spm_merges_by_score_with_space_prefix() {
        let tok = Tokenizer::new(spm_data(SPM_PIECES)).unwrap();
        assert_eq!(tok.kind(), ModelKind::Spm);
        assert!(tok.add_bos() && tok.add_space_prefix());
        assert_eq!(
            (tok.bos(), tok.eos(), tok.unk()),
            (Some(1), Some(2), Some(0))
        );
        // "▁hello": ll, llo, ▁h, ▁he, ▁hello.
        assert_eq!(tok.encode("hello", false, false), [263]);
        assert_eq!(tok.encode("hello", true, false), [1, 263]);
        // "i" has no token: byte fallback.
        assert_eq!(
            tok.encode("hello hi", false, false),
            [263, 259, spm_byte(b'i')]
        );
        assert_eq!(
            tok.encode("é", false, false),
            [268, spm_byte(0xc3), spm_byte(0xa9)]
        );
        assert_eq!(tok.decode(&[1, 263, 259, spm_byte(b'i')]), "hello hi");
        assert_eq!(tok.decode_with(&[1, 263], true), "<s> hello");
    }

    #[test]
    fn spm_ties_go_left() {
        let mut data = spm_data(SPM_PIECES);
        data.add_space_prefix = Some(false);
        let tok = Tokenizer::new(data).unwrap();
        assert_eq!(tok.encode("abc", false, false), [269, 273]);
        // Without the prefix "hello" never gets "▁": h e llo.
        assert_eq!(tok.encode("hello", false, false), [264, 265, 262]);
    }

    #[test]
    fn spm_space_prefix_after_special_tokens() {
        let tok = Tokenizer::new(spm_data(SPM_PIECES)).unwrap();
        assert_eq!(tok.encode("<s>hello", false, true), [1, 263]);
        let literal: Vec<u32> = tok.encode("<s>", false, false);
        let mut expected = vec![268];
        expected.extend(b"<s>".iter().map(|&b| spm_byte(b)));
        assert_eq!(literal, expected);
    }

    // ---------------------------------------------------------------------------
    // Decoding

    #[test]
    fn stream_decoder_never_splits_a_character() {
        let tok = bpe("qwen2", &[], &[]);
        let ids = tok.encode("é😀", false, false);
        assert_eq!(ids, bytes_of("é😀"));
        let mut dec = tok.stream_decoder(false);
        let outs: Vec<String> = ids.iter().map(|&id| dec.decode_piece(id)).collect();
        assert_eq!(outs, ["", "é", "", "", "", "😀"]);
        assert_eq!(dec.finish(), "");

        // A stray continuation byte is replaced at once; an unfinished character at the end
        // is replaced by finish().
        let mut dec = tok.stream_decoder(false);
        assert_eq!(dec.decode_piece(0x80), "\u{fffd}");
        assert_eq!(dec.decode_piece(u32::from(b'a')), "a");
        assert_eq!(dec.decode_piece(0xe4), "");
        assert_eq!(dec.decode_piece(u32::from(b'b')), "\u{fffd}b");
        assert_eq!(dec.decode_piece(0xf0), "");
        assert_eq!(dec.finish(), "\u{fffd}");
    }

    #[test]
    fn pieces() {
        let tok = chatml();
        assert_eq!(tok.piece(u32::from(b' '), false), b" ");
        assert_eq!(tok.piece(256, false), b"");
        assert_eq!(tok.piece(256, true), b"<|im_start|>");
        assert_eq!(tok.piece(258, false), b"<think>");
        assert_eq!(tok.piece(100_000, true), b"");
        assert_eq!(tok.token_text(u32::from(b' ')), Some("Ġ"));
        assert_eq!(tok.token_id("<think>"), Some(258));
        assert_eq!(tok.n_vocab(), 261);
    }

    #[test]
    fn tokenizers_can_be_shared_across_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Tokenizer>();
        send_sync::<ChatTemplate>();
        let tok = chatml();
        assert!(format!("{tok:?}").contains("n_vocab: 261"));
    }

    // ---------------------------------------------------------------------------
    // Validation

    fn err(data: TokenizerData) -> String {
        Tokenizer::new(data).unwrap_err().to_string()
    }

    #[test]
    fn bad_data_is_refused_with_the_bad_item_named() {
        assert!(err(TokenizerData {
            model: "bert".into(),
            ..bpe_data("qwen2", &[], &[])
        })
        .contains("\"bert\""));
        assert!(err(bpe_data("qwen9", &[], &[])).contains("\"qwen9\""));
        assert_eq!(
            Tokenizer::new(TokenizerData {
                model: "gpt2".into(),
                ..TokenizerData::default()
            })
            .unwrap_err(),
            TokenizerError::EmptyVocab
        );
        assert!(err(bpe_data("qwen2", &[], &["a zz"])).contains("\"zz\" is not a token"));
        assert!(err(bpe_data("qwen2", &[], &["a b"])).contains("\"ab\" is not a token"));
        assert!(err(bpe_data("qwen2", &["ab"], &["ab"])).contains("merge 0"));
        assert!(err(bpe_data("qwen2", &["a"], &[])).contains("tokens 97 and 256 are both \"a\""));

        let mut data = bpe_data("qwen2", &[], &[]);
        data.eos_id = Some(300);
        assert!(err(data).contains("eos_token_id = 300"));

        let mut data = bpe_data("qwen2", &[], &[]);
        data.token_type = Some(vec![1; 10]);
        assert!(err(data).contains("token_type has 10 entries for 256 tokens"));

        let mut data = bpe_data("qwen2", &[], &[]);
        let mut types = vec![1; 256];
        types[7] = 9;
        data.token_type = Some(types);
        assert!(err(data).contains("token 7 has unknown token_type 9"));

        let mut data = spm_data(&[]);
        data.scores.as_mut().unwrap()[5] = f32::NAN;
        assert!(err(data).contains("token 5 has a NaN score"));

        let mut data = spm_data(&[]);
        data.tokens[3] = "<0xZZ>".into();
        assert!(err(data).contains("\"<0xZZ>\""));

        let mut data = bpe_data("glm4", &[], &[]);
        data.add_bos = Some(true);
        assert!(
            err(data).contains("add_bos_token is true but tokenizer.ggml.bos_token_id is not set")
        );

        let mut data = bpe_data("qwen2", &[], &[]);
        data.tokens.push("x".repeat(70_000));
        assert!(err(data).contains("token 256 is 70000 bytes"));
    }

    // ---------------------------------------------------------------------------
    // Chat templates

    /// Qwen2.5-Instruct's chat template.
    const QWEN_TEMPLATE: &str = r#"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

    // The expected strings in these tests were rendered with Python jinja2 3.x in the
    // configuration Hugging Face uses (ImmutableSandboxedEnvironment, trim_blocks,
    // lstrip_blocks, loopcontrols, tojson = json.dumps(ensure_ascii=False)).

    #[test]
    fn qwen_chat_template() {
        let mut data = bpe_data(
            "qwen2",
            &["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
            &[],
        );
        data.chat_template = Some(QWEN_TEMPLATE.into());
        data.eos_id = Some(258);
        data.token_type = Some([vec![1; 256], vec![3, 3, 3]].concat());
        let tok = Tokenizer::new(data).unwrap();
        let messages = [
            ("system", "You are terse."),
            ("user", "Hi!"),
            ("assistant", "Hello."),
            ("user", "2+2?"),
        ];
        assert_eq!(
            tok.apply_chat_template(&messages, true).unwrap(),
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n\
         <|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n\
         <|im_start|>assistant\n"
        );
        assert_eq!(
        tok.apply_chat_template(&messages[1..2], false).unwrap(),
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\
         <|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    );
        // The rendered prompt tokenizes with its markers as single ids.
        let ids = tok.encode(
            &tok.apply_chat_template(&messages[1..2], true).unwrap(),
            false,
            true,
        );
        assert_eq!(ids.iter().filter(|&&id| id == 256).count(), 3);
        assert_eq!(ids.iter().filter(|&&id| id == 257).count(), 2);
    }

    /// A template that writes `{{ bos_token }}` itself, for a tokenizer that
    /// adds BOS: the prompt gets one BOS, as llama.cpp gives it (it drops the
    /// rendered one), and one EOS where both add it.
    #[test]
    fn chat_prompt_has_one_bos_and_one_eos() {
        let mut data = bpe_data("qwen2", &["<s>", "</s>"], &[]);
        data.chat_template = Some(
            "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}"
                .into(),
        );
        data.bos_id = Some(256);
        data.eos_id = Some(257);
        data.token_type = Some([vec![1; 256], vec![3, 3]].concat());
        for (add_bos, add_eos) in [(true, false), (false, false), (true, true)] {
            data.add_bos = Some(add_bos);
            data.add_eos = Some(add_eos);
            let tok = Tokenizer::new(data.clone()).unwrap();
            let rendered = tok.apply_chat_template(&[("user", "hi")], true).unwrap();
            assert_eq!(rendered, "<s>hi</s>");
            let ids = tok.encode(
                &tok.chat_prompt(&[("user", "hi")], true).unwrap(),
                true,
                true,
            );
            let count = |id| ids.iter().filter(|&&t| t == id).count();
            assert_eq!(
                (count(256), count(257)),
                (1, 1),
                "add_bos {add_bos}, add_eos {add_eos}: {ids:?}"
            );
            assert_eq!(ids[0], 256);
            assert_eq!(*ids.last().unwrap(), 257);
        }
    }

    const EXTRA_TEMPLATE: &str = "{{ bos_token }}
{% set ns = namespace(n=0) %}
{% for m in messages %}
  {% if m.role == 'skip' %}{% continue %}{% endif %}
  {% if m.role == 'stop' %}{% break %}{% endif %}
  {% set ns.n = ns.n + 1 %}
[{{ loop.index }}:{{ m.role | upper }}] {{ m.content.strip().split('|')[-1] }}{{ ' (starts with a)' if m.content.startswith('a') }}
{% endfor %}
count={{ ns.n }} json={{ {'k': [1, 'é']} | tojson }} {{ eos_token }}
{% if messages | length > 5 %}{{ raise_exception('too many messages') }}{% endif %}
";

    #[test]
    fn template_features_hugging_face_templates_use() {
        let t = ChatTemplate::new(EXTRA_TEMPLATE, "<s>", "</s>").unwrap();
        let messages = [
            ("user", "  x|abc  "),
            ("skip", "no"),
            ("assistant", "done"),
            ("stop", "-"),
            ("user", "never"),
        ];
        assert_eq!(
            t.apply(&messages, false).unwrap(),
            "<s>\n[1:USER] abc\n[3:ASSISTANT] done\ncount=2 json={\"k\": [1, \"é\"]} </s>\n"
        );
        let six = [("user", "a"); 6];
        let e = t.apply(&six, false).unwrap_err();
        assert!(
            matches!(&e, ChatTemplateError::Render(m) if m.contains("too many messages")),
            "{e}"
        );
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let t = ChatTemplate::new(
        "{{ {'a': '<b> & \"q\"\\n', 'n': [1, 2.5, none, true, 1e20, -0.0001], 'e': {}, 'l': [], 'u': 'é😀'} | tojson(indent=2) }}\n\
         {{ {'a': '<b>', 'u': 'é😀'} | tojson(ensure_ascii=true) }}\n\
         {{ {'z': 1, 'a': 2} | tojson(sort_keys=true, separators=(',', ':')) }}",
        "",
        "",
    )
    .unwrap();
        let no_messages: [(&str, &str); 0] = [];
        assert_eq!(
        t.apply(&no_messages, false).unwrap(),
        "{\n  \"a\": \"<b> & \\\"q\\\"\\n\",\n  \"n\": [\n    1,\n    2.5,\n    null,\n    true,\n    \
         1e+20,\n    -0.0001\n  ],\n  \"e\": {},\n  \"l\": [],\n  \"u\": \"é😀\"\n}\n\
         {\"a\": \"<b>\", \"u\": \"\\u00e9\\ud83d\\ude00\"}\n\
         {\"a\":2,\"z\":1}"
    );
    }

    #[test]
    fn strftime_now_is_available() {
        let t = ChatTemplate::new("{{ strftime_now('%Y') }}", "", "").unwrap();
        let year = t.apply(&[("user", "")], false).unwrap();
        assert!(year.len() == 4 && year.starts_with('2'), "{year}");
    }

    #[test]
    fn template_errors() {
        assert_eq!(
            bpe("qwen2", &[], &[]).chat_template().unwrap_err(),
            ChatTemplateError::Missing
        );
        assert!(matches!(
            ChatTemplate::new("{% if %}", "", ""),
            Err(ChatTemplateError::Syntax(_))
        ));
    }

    // ---------------------------------------------------------------------------
    // Properties

    /// Byte vocabulary plus merges for common English pairs and a few multi-byte ones.
    fn rich_bpe(pre: &str) -> Tokenizer {
        let pairs = [
            ("t", "h"),
            ("h", "e"),
            ("Ġ", "t"),
            ("i", "n"),
            ("e", "r"),
            ("a", "n"),
            ("Ġ", "a"),
            ("o", "n"),
            ("Ġt", "he"),
            ("Ġ", "Ġ"),
            ("ĠĠ", "ĠĠ"),
            ("Ċ", "Ċ"),
            ("1", "2"),
            ("Ã", "©"),
            ("ä", "½"),
            ("ð", "Ł"),
            ("'", "s"),
            ("in", "g"),
            ("Ġ", "s"),
        ];
        let mut extra: Vec<String> = Vec::new();
        let mut merges = Vec::new();
        for (a, b) in pairs {
            extra.push(format!("{a}{b}"));
            merges.push(format!("{a} {b}"));
        }
        // "Ġthe" needs "Ġt" and "he" first; they are in the list before it.
        let extra_refs: Vec<&str> = extra.iter().map(String::as_str).collect();
        let merge_refs: Vec<&str> = merges.iter().map(String::as_str).collect();
        bpe(pre, &extra_refs, &merge_refs)
    }

    fn spm_no_prefix() -> Tokenizer {
        let mut data = spm_data(SPM_PIECES);
        data.add_space_prefix = Some(false);
        Tokenizer::new(data).unwrap()
    }

    /// A per-token list for the garbage test: absent, stretched to one entry per token,
    /// or as generated.
    fn per_token<T: Clone>(mode: u8, v: Vec<T>, n: usize) -> Option<Vec<T>> {
        match mode {
            0 => None,
            1 if !v.is_empty() => Some(v.iter().cycle().take(n).cloned().collect()),
            _ => Some(v),
        }
    }

    const PRES: [&str; 6] = ["default", "gpt-2", "smollm", "llama-bpe", "qwen2", "qwen35"];

    fn text() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            "[a-z 'A-Z0-9.,!?\\n\\t]{0,40}",
            "[ \\n\\r\\t\u{a0}\u{3000}]{0,12}[a-z]{0,3}",
            "(the |ing|12|é|你|😀|'s|  |\\n){0,12}",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn pre_tokenizers_cover_the_text(s in text()) {
            for pre in PRES {
                let p = PreTokenizer::from_name(pre).unwrap();
                let pieces = p.split(&s);
                prop_assert!(pieces.iter().all(|w| !w.is_empty()));
                prop_assert_eq!(pieces.concat(), s.clone());
            }
        }

        #[test]
        fn bpe_round_trips(s in text()) {
            for pre in PRES {
                let tok = rich_bpe(pre);
                let ids = tok.encode(&s, false, false);
                prop_assert_eq!(tok.decode(&ids), s.clone(), "{}", pre);
            }
        }

        #[test]
        fn spm_round_trips(s in text()) {
            // U+2581 is SentencePiece's space: it cannot survive a round trip.
            let s = s.replace('▁', "_");
            let tok = spm_no_prefix();
            let ids = tok.encode(&s, false, false);
            prop_assert_eq!(tok.decode(&ids), s);
        }

        #[test]
        fn spm_prefix_round_trips(s in text()) {
            let s = s.replace('▁', "_");
            let tok = Tokenizer::new(spm_data(SPM_PIECES)).unwrap();
            let ids = tok.encode(&s, true, false);
            prop_assert_eq!(tok.decode(&ids), s);
        }

        #[test]
        fn stream_decoding_equals_decode(ids in proptest::collection::vec(0u32..300, 0..40), special: bool) {
            for tok in [rich_bpe("qwen2"), spm_no_prefix(), chatml()] {
                let mut dec = tok.stream_decoder(special);
                let mut streamed: String = ids.iter().map(|&id| dec.decode_piece(id)).collect();
                streamed.push_str(&dec.finish());
                prop_assert_eq!(streamed, tok.decode_with(&ids, special));
            }
        }

    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        #[test]
        fn garbage_never_panics(
            model in prop_oneof![4 => Just("gpt2".to_string()), 4 => Just("llama".to_string()), 1 => ".{0,6}"],
            pre in proptest::option::of(prop_oneof![
                Just("qwen2".to_string()), Just("llama-bpe".to_string()), Just("default".to_string()),
                Just("smollm".to_string()), Just("glm4".to_string()), ".{0,8}",
            ]),
            with_bytes: bool,
            mut tokens in proptest::collection::vec(".{0,4}", 0..40),
            type_mode in prop_oneof![4 => Just(0u8), 4 => Just(1u8), 1 => Just(2u8)],
            types in proptest::collection::vec(prop_oneof![8 => 0i32..6, 1 => -1i32..8], 0..80),
            score_mode in prop_oneof![4 => Just(0u8), 4 => Just(1u8), 1 => Just(2u8)],
            scores in proptest::collection::vec(any::<f32>(), 0..80),
            merge_mode in 0..3u8,
            garbage_merges in proptest::collection::vec(".{0,5}", 0..20),
            pairs in proptest::collection::vec((any::<usize>(), any::<usize>()), 0..10),
            ids in proptest::collection::vec(proptest::option::weighted(0.3, 0u32..300), 6),
            dedup in proptest::bool::weighted(0.8),
            flags in proptest::collection::vec(proptest::option::of(any::<bool>()), 3),
            template in proptest::option::of(".{0,30}"),
            input in text(),
            decode_ids in proptest::collection::vec(any::<u32>(), 0..10),
        ) {
            // Mostly well-formed data with one thing or another wrong, so both the checks
            // and the tokenizers built from odd but valid data get exercised.
            if with_bytes {
                tokens.splice(0..0, byte_vocab());
            }
            let merges = match merge_mode {
                0 => Vec::new(),
                1 => garbage_merges,
                _ if tokens.is_empty() => Vec::new(),
                _ => {
                    let n0 = tokens.len();
                    let mut merges = Vec::new();
                    for (i, j) in pairs {
                        let (a, b) = (tokens[i % n0].clone(), tokens[j % n0].clone());
                        merges.push(format!("{a} {b}"));
                        tokens.push(a + &b);
                    }
                    merges
                }
            };
            if dedup {
                let mut seen = std::collections::HashSet::new();
                tokens.retain(|t| seen.insert(t.clone()));
            }
            let n = tokens.len();
            let data = TokenizerData {
                model,
                pre,
                tokens,
                token_type: per_token(type_mode, types, n),
                merges,
                scores: per_token(score_mode, scores, n),
                bos_id: ids[0], eos_id: ids[1], unk_id: ids[2], pad_id: ids[3], eot_id: ids[4],
                eom_id: ids[5],
                add_bos: flags[0], add_eos: flags[1], add_space_prefix: flags[2],
                chat_template: template,
            };
            if let Ok(tok) = Tokenizer::new(data) {
                for parse_special in [false, true] {
                    let ids = tok.encode(&input, true, parse_special);
                    prop_assert!(ids.iter().all(|&id| (id as usize) < tok.n_vocab()));
                    let _ = tok.decode(&ids);
                }
                let _ = tok.decode_with(&decode_ids, true);
                let _ = tok.apply_chat_template(&[("user", input.as_str())], true);
            }
        }
    }
}
