//! Pre-tokenizer splits checked against reference splits.
//!
//! The tables were generated once by a Python script (Python 3.11, `tokenizers`
//! 0.23.3, `regex` 2026.11.19) from the original regexes in llama.cpp's
//! `src/llama-vocab.cpp` (the `(?i:...)` forms of the tokenizer.json files):
//!
//! - reference A applies llama.cpp's list of regexes for the pre-tokenizer one after
//!   another with the `regex` module, keeping matches and the unmatched stretches
//!   between them as pieces (llama.cpp's `unicode_regex_split`);
//! - reference B, for all but `Default` (which has no Hugging Face counterpart), is
//!   Hugging Face `tokenizers`' `pre_tokenizers.Split(Regex(pattern), behavior="isolated")`
//!   (for `Smollm`: `Sequence([Digits(individual_digits=True), Split(...)])`).
//!
//! The two references agreed on every case; the literals below are their output.
//!
//! `GPT4O` (2026-12-04, `regex` 2026.5.9) is reference A only, over the pattern
//! llama.cpp runs for `gpt-4o` (its `std::regex` rewrite of o200k's, with
//! lookaheads for the `\p{Lu}`/`\p{Ll}` classes, which splits some words the
//! original keeps whole, e.g. `ÉCOLE`): the inputs of `QWEN35` plus cases of
//! case, marks, scripts and `/`.
//!
//! `DEEPSEEK3` (2026-12-04, `regex` 2026.5.9) is reference A only, over
//! llama.cpp's three regexes for `deepseek-v3` (numbers in threes; CJK and
//! kana runs; the rest), on cases of punctuation before letters, symbols,
//! scripts, marks and whitespace. (5000 random strings over those characters
//! agreed the same way, a throwaway check.)
//!
//! `KIMI_K2` (2026-12-04) is llama.cpp's own scanner for `kimi-k2` (no
//! regex: `unicode_regex_split_custom_kimi_k2`), through llama-cpp-python
//! 0.3.36 with a vocabulary written for the check, whose every piece of
//! these splits (and of qwen2's) is one token: llama.cpp gave the ids these
//! pieces give, for these cases and for 5000 random strings of Han, CJK
//! extensions, kana, Latin of every case, marks, modifier letters, digits,
//! symbols, controls and whitespace (a throwaway check; qwen2's splits gave
//! other ids on 3391 of them, so the vocabulary tells splits apart).
//!
//! Everything sits in `mod tokenizer_splits` so that `cargo test tokenizer` selects it.

mod tokenizer_splits {
    use les::tokenizer::PreTokenizer;

    type Cases = &'static [(&'static str, &'static [&'static str])];

    fn check(pre: PreTokenizer, cases: Cases) {
        for (text, expected) in cases {
            assert_eq!(&pre.split(text), expected, "{pre:?} on {text:?}");
        }
    }

    #[test]
    fn kimi_k2_splits() {
        check(PreTokenizer::KimiK2, KIMI_K2);
    }

    #[test]
    fn gpt2_splits() {
        check(PreTokenizer::Gpt2, GPT2);
    }

    #[test]
    fn smollm_splits() {
        check(PreTokenizer::Smollm, SMOLLM);
    }

    #[test]
    fn llama3_splits() {
        check(PreTokenizer::Llama3, LLAMA3);
    }

    #[test]
    fn qwen2_splits() {
        check(PreTokenizer::Qwen2, QWEN2);
    }

    #[test]
    fn qwen35_splits() {
        check(PreTokenizer::Qwen35, QWEN35);
    }

    #[test]
    fn gpt4o_splits() {
        check(PreTokenizer::Gpt4o, GPT4O);
    }

    #[test]
    fn deepseek3_splits() {
        check(PreTokenizer::Deepseek3, DEEPSEEK3);
    }

    #[test]
    fn default_splits() {
        check(PreTokenizer::Default, DEFAULT);
    }

    #[test]
    fn names_map_as_llama_cpp() {
        for (name, pre) in [
            ("default", PreTokenizer::Default),
            ("gpt-2", PreTokenizer::Gpt2),
            ("olmo", PreTokenizer::Gpt2),
            ("smollm", PreTokenizer::Smollm),
            ("starcoder", PreTokenizer::Smollm),
            ("llama-bpe", PreTokenizer::Llama3),
            ("dbrx", PreTokenizer::Llama3),
            ("qwen2", PreTokenizer::Qwen2),
            ("deepseek-r1-qwen", PreTokenizer::Qwen2),
            ("qwen35", PreTokenizer::Qwen35),
            ("gpt-4o", PreTokenizer::Gpt4o),
            ("minimax-m2", PreTokenizer::Gpt4o),
            ("llama4", PreTokenizer::Gpt4o),
            ("kanana2", PreTokenizer::Gpt4o),
            ("talkie", PreTokenizer::Gpt4o),
            ("deepseek-v3", PreTokenizer::Deepseek3),
            ("deepseek-llm", PreTokenizer::DeepseekLlm),
            ("glm5", PreTokenizer::Llama3),
            ("kimi-k2", PreTokenizer::KimiK2),
            ("bailingmoe2", PreTokenizer::Qwen2),
            ("llada-moe", PreTokenizer::Qwen2),
        ] {
            assert_eq!(PreTokenizer::from_name(name), Some(pre), "{name}");
        }
        for name in ["gpt2", "qwen3", "llama-4", "", "LLAMA-BPE"] {
            assert_eq!(PreTokenizer::from_name(name), None, "{name}");
        }
    }

    const GPT2: Cases = &[
        ("Hello world", &["Hello", " world"]),
        (
            "I'm you're they've he'll she'd it's don't I'M YOU'RE We'Ll",
            &[
                "I", "'m", " you", "'re", " they", "'ve", " he", "'ll", " she", "'d", " it", "'s",
                " don", "'t", " I", "'", "M", " YOU", "'", "RE", " We", "'", "Ll",
            ],
        ),
        ("'", &["'"]),
        ("''", &["''"]),
        ("'ss", &["'s", "s"]),
        ("x'", &["x", "'"]),
        (" 's", &[" '", "s"]),
        ("'s'S'rE", &["'s", "'", "S", "'", "rE"]),
        (
            "12345 1234567 3.14159 1,000,000",
            &[
                "12345", " 1234567", " 3", ".", "14159", " 1", ",", "000", ",", "000",
            ],
        ),
        (
            "２０２４年 ٣٤٥ ½ Ⅻ",
            &["２０２４", "年", " ٣٤٥", " ½", " Ⅻ"],
        ),
        (
            "a1b22c333d4444",
            &["a", "1", "b", "22", "c", "333", "d", "4444"],
        ),
        ("   leading spaces", &["  ", " leading", " spaces"]),
        ("trailing   ", &["trailing", "   "]),
        ("a  b   c", &["a", " ", " b", "  ", " c"]),
        ("\n\n\nx", &["\n\n", "\n", "x"]),
        (
            "line1\nline2\r\n\r\nline3",
            &["line", "1", "\n", "line", "2", "\r\n\r", "\n", "line", "3"],
        ),
        (" \n ", &[" \n "]),
        ("\t\tindent", &["\t", "\t", "indent"]),
        ("a \n b", &["a", " \n", " b"]),
        ("x \n\n  y", &["x", " \n\n ", " y"]),
        ("end\n", &["end", "\n"]),
        ("  ", &["  "]),
        (
            "Hello, world!!! (test) [x] {y} <z> ... --- ?!",
            &[
                "Hello", ",", " world", "!!!", " (", "test", ")", " [", "x", "]", " {", "y", "}",
                " <", "z", ">", " ...", " ---", " ?!",
            ],
        ),
        (
            "a+b=c; $100 #tag @user ~home ^caret |pipe `tick`",
            &[
                "a", "+", "b", "=", "c", ";", " $", "100", " #", "tag", " @", "user", " ~", "home",
                " ^", "caret", " |", "pipe", " `", "tick", "`",
            ],
        ),
        (
            "x86_64-linux-gnu",
            &["x", "86", "_", "64", "-", "linux", "-", "gnu"],
        ),
        ("...\n\nabc", &["...", "\n", "\n", "abc"]),
        ("!\r\n", &["!", "\r\n"]),
        (
            "你好世界，这是一个测试。",
            &["你好世界", "，", "这是一个测试", "。"],
        ),
        (
            "日本語のテキスト、カタカナ",
            &["日本語のテキスト", "、", "カタカナ"],
        ),
        ("한국어 텍스트", &["한국어", " 텍스트"]),
        (
            "I ❤\u{fe0f} 🦀 rust 👨\u{200d}👩\u{200d}👧",
            &["I", " ❤\u{fe0f}", " 🦀", " rust", " 👨\u{200d}👩\u{200d}👧"],
        ),
        ("😀😀 😀", &["😀😀", " 😀"]),
        (
            "Привет мир! Ελληνικά café naïve",
            &["Привет", " мир", "!", " Ελληνικά", " café", " naïve"],
        ),
        ("عربي ١٢٣ עברית", &["عربي", " ١٢٣", " עברית"]),
        ("mixedCASE123abc", &["mixedCASE", "123", "abc"]),
        ("e\u{301}te\u{301}", &["e", "\u{301}", "te", "\u{301}"]),
        (
            "नमस्ते दुनिया",
            &["नमस", "्", "त", "े", " द", "ु", "न", "ि", "य", "ा"],
        ),
        (
            "\u{a0}nbsp\u{3000}ideo",
            &["\u{a0}", "nbsp", "\u{3000}", "ideo"],
        ),
        ("tab\there", &["tab", "\t", "here"]),
        ("a\u{2028}b", &["a", "\u{2028}", "b"]),
        ("\u{0}\u{1}x", &["\u{0}\u{1}", "x"]),
        (" 😀", &[" 😀"]),
        ("   😀", &["  ", " 😀"]),
    ];

    const SMOLLM: Cases = &[
        ("Hello world", &["Hello", " world"]),
        (
            "I'm you're they've he'll she'd it's don't I'M YOU'RE We'Ll",
            &[
                "I", "'m", " you", "'re", " they", "'ve", " he", "'ll", " she", "'d", " it", "'s",
                " don", "'t", " I", "'", "M", " YOU", "'", "RE", " We", "'", "Ll",
            ],
        ),
        ("'", &["'"]),
        ("''", &["''"]),
        ("'ss", &["'s", "s"]),
        ("x'", &["x", "'"]),
        (" 's", &[" '", "s"]),
        ("'s'S'rE", &["'s", "'", "S", "'", "rE"]),
        (
            "12345 1234567 3.14159 1,000,000",
            &[
                "1", "2", "3", "4", "5", " ", "1", "2", "3", "4", "5", "6", "7", " ", "3", ".",
                "1", "4", "1", "5", "9", " ", "1", ",", "0", "0", "0", ",", "0", "0", "0",
            ],
        ),
        (
            "２０２４年 ٣٤٥ ½ Ⅻ",
            &[
                "２", "０", "２", "４", "年", " ", "٣", "٤", "٥", " ", "½", " ", "Ⅻ",
            ],
        ),
        (
            "a1b22c333d4444",
            &[
                "a", "1", "b", "2", "2", "c", "3", "3", "3", "d", "4", "4", "4", "4",
            ],
        ),
        ("   leading spaces", &["  ", " leading", " spaces"]),
        ("trailing   ", &["trailing", "   "]),
        ("a  b   c", &["a", " ", " b", "  ", " c"]),
        ("\n\n\nx", &["\n\n", "\n", "x"]),
        (
            "line1\nline2\r\n\r\nline3",
            &["line", "1", "\n", "line", "2", "\r\n\r", "\n", "line", "3"],
        ),
        (" \n ", &[" \n "]),
        ("\t\tindent", &["\t", "\t", "indent"]),
        ("a \n b", &["a", " \n", " b"]),
        ("x \n\n  y", &["x", " \n\n ", " y"]),
        ("end\n", &["end", "\n"]),
        ("  ", &["  "]),
        (
            "Hello, world!!! (test) [x] {y} <z> ... --- ?!",
            &[
                "Hello", ",", " world", "!!!", " (", "test", ")", " [", "x", "]", " {", "y", "}",
                " <", "z", ">", " ...", " ---", " ?!",
            ],
        ),
        (
            "a+b=c; $100 #tag @user ~home ^caret |pipe `tick`",
            &[
                "a", "+", "b", "=", "c", ";", " $", "1", "0", "0", " #", "tag", " @", "user", " ~",
                "home", " ^", "caret", " |", "pipe", " `", "tick", "`",
            ],
        ),
        (
            "x86_64-linux-gnu",
            &["x", "8", "6", "_", "6", "4", "-", "linux", "-", "gnu"],
        ),
        ("...\n\nabc", &["...", "\n", "\n", "abc"]),
        ("!\r\n", &["!", "\r\n"]),
        (
            "你好世界，这是一个测试。",
            &["你好世界", "，", "这是一个测试", "。"],
        ),
        (
            "日本語のテキスト、カタカナ",
            &["日本語のテキスト", "、", "カタカナ"],
        ),
        ("한국어 텍스트", &["한국어", " 텍스트"]),
        (
            "I ❤\u{fe0f} 🦀 rust 👨\u{200d}👩\u{200d}👧",
            &["I", " ❤\u{fe0f}", " 🦀", " rust", " 👨\u{200d}👩\u{200d}👧"],
        ),
        ("😀😀 😀", &["😀😀", " 😀"]),
        (
            "Привет мир! Ελληνικά café naïve",
            &["Привет", " мир", "!", " Ελληνικά", " café", " naïve"],
        ),
        ("عربي ١٢٣ עברית", &["عربي", " ", "١", "٢", "٣", " עברית"]),
        ("mixedCASE123abc", &["mixedCASE", "1", "2", "3", "abc"]),
        ("e\u{301}te\u{301}", &["e", "\u{301}", "te", "\u{301}"]),
        (
            "नमस्ते दुनिया",
            &["नमस", "्", "त", "े", " द", "ु", "न", "ि", "य", "ा"],
        ),
        (
            "\u{a0}nbsp\u{3000}ideo",
            &["\u{a0}", "nbsp", "\u{3000}", "ideo"],
        ),
        ("tab\there", &["tab", "\t", "here"]),
        ("a\u{2028}b", &["a", "\u{2028}", "b"]),
        ("\u{0}\u{1}x", &["\u{0}\u{1}", "x"]),
        (" 😀", &[" 😀"]),
        ("   😀", &["  ", " 😀"]),
    ];

    const LLAMA3: Cases = &[
        ("Hello world", &["Hello", " world"]),
        (
            "I'm you're they've he'll she'd it's don't I'M YOU'RE We'Ll",
            &[
                "I", "'m", " you", "'re", " they", "'ve", " he", "'ll", " she", "'d", " it", "'s",
                " don", "'t", " I", "'M", " YOU", "'RE", " We", "'Ll",
            ],
        ),
        ("'", &["'"]),
        ("''", &["''"]),
        ("'ss", &["'s", "s"]),
        ("x'", &["x", "'"]),
        (" 's", &[" '", "s"]),
        ("'s'S'rE", &["'s", "'S", "'rE"]),
        (
            "12345 1234567 3.14159 1,000,000",
            &[
                "123", "45", " ", "123", "456", "7", " ", "3", ".", "141", "59", " ", "1", ",",
                "000", ",", "000",
            ],
        ),
        (
            "２０２４年 ٣٤٥ ½ Ⅻ",
            &["２０２", "４", "年", " ", "٣٤٥", " ", "½", " ", "Ⅻ"],
        ),
        (
            "a1b22c333d4444",
            &["a", "1", "b", "22", "c", "333", "d", "444", "4"],
        ),
        ("   leading spaces", &["  ", " leading", " spaces"]),
        ("trailing   ", &["trailing", "   "]),
        ("a  b   c", &["a", " ", " b", "  ", " c"]),
        ("\n\n\nx", &["\n\n\n", "x"]),
        (
            "line1\nline2\r\n\r\nline3",
            &["line", "1", "\n", "line", "2", "\r\n\r\n", "line", "3"],
        ),
        (" \n ", &[" \n", " "]),
        ("\t\tindent", &["\t", "\tindent"]),
        ("a \n b", &["a", " \n", " b"]),
        ("x \n\n  y", &["x", " \n\n", " ", " y"]),
        ("end\n", &["end", "\n"]),
        ("  ", &["  "]),
        (
            "Hello, world!!! (test) [x] {y} <z> ... --- ?!",
            &[
                "Hello", ",", " world", "!!!", " (", "test", ")", " [", "x", "]", " {", "y", "}",
                " <", "z", ">", " ...", " ---", " ?!",
            ],
        ),
        (
            "a+b=c; $100 #tag @user ~home ^caret |pipe `tick`",
            &[
                "a", "+b", "=c", ";", " $", "100", " #", "tag", " @", "user", " ~", "home", " ^",
                "caret", " |", "pipe", " `", "tick", "`",
            ],
        ),
        (
            "x86_64-linux-gnu",
            &["x", "86", "_", "64", "-linux", "-gnu"],
        ),
        ("...\n\nabc", &["...\n\n", "abc"]),
        ("!\r\n", &["!\r\n"]),
        (
            "你好世界，这是一个测试。",
            &["你好世界", "，这是一个测试", "。"],
        ),
        (
            "日本語のテキスト、カタカナ",
            &["日本語のテキスト", "、カタカナ"],
        ),
        ("한국어 텍스트", &["한국어", " 텍스트"]),
        (
            "I ❤\u{fe0f} 🦀 rust 👨\u{200d}👩\u{200d}👧",
            &["I", " ❤\u{fe0f}", " 🦀", " rust", " 👨\u{200d}👩\u{200d}👧"],
        ),
        ("😀😀 😀", &["😀😀", " 😀"]),
        (
            "Привет мир! Ελληνικά café naïve",
            &["Привет", " мир", "!", " Ελληνικά", " café", " naïve"],
        ),
        ("عربي ١٢٣ עברית", &["عربي", " ", "١٢٣", " עברית"]),
        ("mixedCASE123abc", &["mixedCASE", "123", "abc"]),
        ("e\u{301}te\u{301}", &["e", "\u{301}te", "\u{301}"]),
        ("नमस्ते दुनिया", &["नमस", "्त", "े", " द", "ुन", "िय", "ा"]),
        ("\u{a0}nbsp\u{3000}ideo", &["\u{a0}nbsp", "\u{3000}ideo"]),
        ("tab\there", &["tab", "\there"]),
        ("a\u{2028}b", &["a", "\u{2028}b"]),
        ("\u{0}\u{1}x", &["\u{0}\u{1}", "x"]),
        (" 😀", &[" 😀"]),
        ("   😀", &["  ", " 😀"]),
    ];

    const QWEN2: Cases = &[
        ("Hello world", &["Hello", " world"]),
        (
            "I'm you're they've he'll she'd it's don't I'M YOU'RE We'Ll",
            &[
                "I", "'m", " you", "'re", " they", "'ve", " he", "'ll", " she", "'d", " it", "'s",
                " don", "'t", " I", "'M", " YOU", "'RE", " We", "'Ll",
            ],
        ),
        ("'", &["'"]),
        ("''", &["''"]),
        ("'ss", &["'s", "s"]),
        ("x'", &["x", "'"]),
        (" 's", &[" '", "s"]),
        ("'s'S'rE", &["'s", "'S", "'rE"]),
        (
            "12345 1234567 3.14159 1,000,000",
            &[
                "1", "2", "3", "4", "5", " ", "1", "2", "3", "4", "5", "6", "7", " ", "3", ".",
                "1", "4", "1", "5", "9", " ", "1", ",", "0", "0", "0", ",", "0", "0", "0",
            ],
        ),
        (
            "２０２４年 ٣٤٥ ½ Ⅻ",
            &[
                "２", "０", "２", "４", "年", " ", "٣", "٤", "٥", " ", "½", " ", "Ⅻ",
            ],
        ),
        (
            "a1b22c333d4444",
            &[
                "a", "1", "b", "2", "2", "c", "3", "3", "3", "d", "4", "4", "4", "4",
            ],
        ),
        ("   leading spaces", &["  ", " leading", " spaces"]),
        ("trailing   ", &["trailing", "   "]),
        ("a  b   c", &["a", " ", " b", "  ", " c"]),
        ("\n\n\nx", &["\n\n\n", "x"]),
        (
            "line1\nline2\r\n\r\nline3",
            &["line", "1", "\n", "line", "2", "\r\n\r\n", "line", "3"],
        ),
        (" \n ", &[" \n", " "]),
        ("\t\tindent", &["\t", "\tindent"]),
        ("a \n b", &["a", " \n", " b"]),
        ("x \n\n  y", &["x", " \n\n", " ", " y"]),
        ("end\n", &["end", "\n"]),
        ("  ", &["  "]),
        (
            "Hello, world!!! (test) [x] {y} <z> ... --- ?!",
            &[
                "Hello", ",", " world", "!!!", " (", "test", ")", " [", "x", "]", " {", "y", "}",
                " <", "z", ">", " ...", " ---", " ?!",
            ],
        ),
        (
            "a+b=c; $100 #tag @user ~home ^caret |pipe `tick`",
            &[
                "a", "+b", "=c", ";", " $", "1", "0", "0", " #", "tag", " @", "user", " ~", "home",
                " ^", "caret", " |", "pipe", " `", "tick", "`",
            ],
        ),
        (
            "x86_64-linux-gnu",
            &["x", "8", "6", "_", "6", "4", "-linux", "-gnu"],
        ),
        ("...\n\nabc", &["...\n\n", "abc"]),
        ("!\r\n", &["!\r\n"]),
        (
            "你好世界，这是一个测试。",
            &["你好世界", "，这是一个测试", "。"],
        ),
        (
            "日本語のテキスト、カタカナ",
            &["日本語のテキスト", "、カタカナ"],
        ),
        ("한국어 텍스트", &["한국어", " 텍스트"]),
        (
            "I ❤\u{fe0f} 🦀 rust 👨\u{200d}👩\u{200d}👧",
            &["I", " ❤\u{fe0f}", " 🦀", " rust", " 👨\u{200d}👩\u{200d}👧"],
        ),
        ("😀😀 😀", &["😀😀", " 😀"]),
        (
            "Привет мир! Ελληνικά café naïve",
            &["Привет", " мир", "!", " Ελληνικά", " café", " naïve"],
        ),
        ("عربي ١٢٣ עברית", &["عربي", " ", "١", "٢", "٣", " עברית"]),
        ("mixedCASE123abc", &["mixedCASE", "1", "2", "3", "abc"]),
        ("e\u{301}te\u{301}", &["e", "\u{301}te", "\u{301}"]),
        ("नमस्ते दुनिया", &["नमस", "्त", "े", " द", "ुन", "िय", "ा"]),
        ("\u{a0}nbsp\u{3000}ideo", &["\u{a0}nbsp", "\u{3000}ideo"]),
        ("tab\there", &["tab", "\there"]),
        ("a\u{2028}b", &["a", "\u{2028}b"]),
        ("\u{0}\u{1}x", &["\u{0}\u{1}", "x"]),
        (" 😀", &[" 😀"]),
        ("   😀", &["  ", " 😀"]),
    ];

    const GPT4O: Cases = &[
        ("Hello world", &["Hello", " world"]),
        (
            "I'm you're they've he'll she'd it's don't I'M YOU'RE We'Ll",
            &[
                "I'm", " you're", " they've", " he'll", " she'd", " it's", " don't", " I'M",
                " YOU'RE", " We'Ll",
            ],
        ),
        ("'", &["'"]),
        ("''", &["''"]),
        ("'ss", &["'ss"]),
        ("x'", &["x", "'"]),
        (" 's", &[" '", "s"]),
        ("'s'S'rE", &["'s'S", "'r", "E"]),
        (
            "12345 1234567 3.14159 1,000,000",
            &[
                "123", "45", " ", "123", "456", "7", " ", "3", ".", "141", "59", " ", "1", ",",
                "000", ",", "000",
            ],
        ),
        (
            "２０２４年 ٣٤٥ ½ Ⅻ",
            &["２０２", "４", "年", " ", "٣٤٥", " ", "½", " ", "Ⅻ"],
        ),
        (
            "a1b22c333d4444",
            &["a", "1", "b", "22", "c", "333", "d", "444", "4"],
        ),
        ("   leading spaces", &["  ", " leading", " spaces"]),
        ("trailing   ", &["trailing", "   "]),
        ("a  b   c", &["a", " ", " b", "  ", " c"]),
        ("\n\n\nx", &["\n\n\n", "x"]),
        (
            "line1\nline2\r\n\r\nline3",
            &["line", "1", "\n", "line", "2", "\r\n\r\n", "line", "3"],
        ),
        (" \n ", &[" \n", " "]),
        ("\t\tindent", &["\t", "\tindent"]),
        ("a \n b", &["a", " \n", " b"]),
        ("x \n\n  y", &["x", " \n\n", " ", " y"]),
        ("end\n", &["end", "\n"]),
        ("  ", &["  "]),
        (
            "Hello, world!!! (test) [x] {y} <z> ... --- ?!",
            &[
                "Hello", ",", " world", "!!!", " (", "test", ")", " [", "x", "]", " {", "y", "}",
                " <", "z", ">", " ...", " ---", " ?!",
            ],
        ),
        (
            "a+b=c; $100 #tag @user ~home ^caret |pipe `tick`",
            &[
                "a", "+b", "=c", ";", " $", "100", " #", "tag", " @", "user", " ~", "home", " ^",
                "caret", " |", "pipe", " `", "tick", "`",
            ],
        ),
        (
            "x86_64-linux-gnu",
            &["x", "86", "_", "64", "-linux", "-gnu"],
        ),
        ("...\n\nabc", &["...\n\n", "abc"]),
        ("!\r\n", &["!\r\n"]),
        (
            "你好世界，这是一个测试。",
            &["你好世界", "，这是一个测试", "。"],
        ),
        (
            "日本語のテキスト、カタカナ",
            &["日本語のテキスト", "、カタカナ"],
        ),
        ("한국어 텍스트", &["한국어", " 텍스트"]),
        ("I ❤️ 🦀 rust 👨‍👩‍👧", &["I", " ❤️", " 🦀", " rust", " 👨‍👩‍👧"]),
        ("😀😀 😀", &["😀😀", " 😀"]),
        (
            "Привет мир! Ελληνικά café naïve",
            &["Привет", " мир", "!", " Ελληνικά", " café", " naïve"],
        ),
        ("عربي ١٢٣ עברית", &["عربي", " ", "١٢٣", " עברית"]),
        ("mixedCASE123abc", &["mixed", "CASE", "123", "abc"]),
        ("e\u{301}te\u{301}", &["e", "\u{301}te", "\u{301}"]),
        ("नमस्ते दुनिया", &["नमस", "्त", "े", " द", "ुन", "िय", "ा"]),
        (" nbsp　ideo", &[" nbsp", "　ideo"]),
        ("tab\there", &["tab", "\there"]),
        ("a b", &["a", " b"]),
        ("\u{0}\u{1}x", &["\u{0}\u{1}", "x"]),
        (" 😀", &[" 😀"]),
        ("   😀", &["  ", " 😀"]),
        ("HELLOworld", &["HELLOworld"]),
        ("HelloWORLD", &["Hello", "WORLD"]),
        ("ÉCOLE école", &["É", "COLE", " école"]),
        ("naïve café", &["naïve", " café"]),
        ("Straße STRASSE", &["Straße", " STRASSE"]),
        ("ǅungla ǈ", &["ǅungla", " ǈ"]),
        ("(hello) [World]!", &["(hello", ")", " [", "World", "]!"]),
        ("foo/bar\n/baz", &["foo", "/bar", "\n", "/baz"]),
        ("a//b\r\n//c", &["a", "//", "b", "\r\n", "//", "c"]),
        ("don'T I'LL WE'VE", &["don'T", " I'LL", " WE'VE"]),
        ("x2y 12345", &["x", "2", "y", " ", "123", "45"]),
        ("İstanbul", &["İstanbul"]),
        ("e\u{301}te\u{301}", &["e", "\u{301}te", "\u{301}"]),
        ("ΑΒΓαβγ Σίσυφος", &["ΑΒΓαβγ", " Σίσυφος"]),
        ("日本語テキスト", &["日本語テキスト"]),
        ("   \n\n  x", &["   \n\n", " ", " x"]),
        ("tab\tsep", &["tab", "\tsep"]),
        ("mixedCASEWord", &["mixed", "CASEWord"]),
        ("ABCdef GHIjkl", &["ABCdef", " GHIjkl"]),
        ("ᾼ title", &["ᾼ", " title"]),
        ("'quoted' \"dq\"", &["'quoted", "'", " \"", "dq", "\""]),
        ("x'", &["x", "'"]),
        ("'S", &["'S"]),
    ];

    const QWEN35: Cases = &[
        ("Hello world", &["Hello", " world"]),
        (
            "I'm you're they've he'll she'd it's don't I'M YOU'RE We'Ll",
            &[
                "I", "'m", " you", "'re", " they", "'ve", " he", "'ll", " she", "'d", " it", "'s",
                " don", "'t", " I", "'M", " YOU", "'RE", " We", "'Ll",
            ],
        ),
        ("'", &["'"]),
        ("''", &["''"]),
        ("'ss", &["'s", "s"]),
        ("x'", &["x", "'"]),
        (" 's", &[" '", "s"]),
        ("'s'S'rE", &["'s", "'S", "'rE"]),
        (
            "12345 1234567 3.14159 1,000,000",
            &[
                "1", "2", "3", "4", "5", " ", "1", "2", "3", "4", "5", "6", "7", " ", "3", ".",
                "1", "4", "1", "5", "9", " ", "1", ",", "0", "0", "0", ",", "0", "0", "0",
            ],
        ),
        (
            "２０２４年 ٣٤٥ ½ Ⅻ",
            &[
                "２", "０", "２", "４", "年", " ", "٣", "٤", "٥", " ", "½", " ", "Ⅻ",
            ],
        ),
        (
            "a1b22c333d4444",
            &[
                "a", "1", "b", "2", "2", "c", "3", "3", "3", "d", "4", "4", "4", "4",
            ],
        ),
        ("   leading spaces", &["  ", " leading", " spaces"]),
        ("trailing   ", &["trailing", "   "]),
        ("a  b   c", &["a", " ", " b", "  ", " c"]),
        ("\n\n\nx", &["\n\n\n", "x"]),
        (
            "line1\nline2\r\n\r\nline3",
            &["line", "1", "\n", "line", "2", "\r\n\r\n", "line", "3"],
        ),
        (" \n ", &[" \n", " "]),
        ("\t\tindent", &["\t", "\tindent"]),
        ("a \n b", &["a", " \n", " b"]),
        ("x \n\n  y", &["x", " \n\n", " ", " y"]),
        ("end\n", &["end", "\n"]),
        ("  ", &["  "]),
        (
            "Hello, world!!! (test) [x] {y} <z> ... --- ?!",
            &[
                "Hello", ",", " world", "!!!", " (", "test", ")", " [", "x", "]", " {", "y", "}",
                " <", "z", ">", " ...", " ---", " ?!",
            ],
        ),
        (
            "a+b=c; $100 #tag @user ~home ^caret |pipe `tick`",
            &[
                "a", "+b", "=c", ";", " $", "1", "0", "0", " #", "tag", " @", "user", " ~", "home",
                " ^", "caret", " |", "pipe", " `", "tick", "`",
            ],
        ),
        (
            "x86_64-linux-gnu",
            &["x", "8", "6", "_", "6", "4", "-linux", "-gnu"],
        ),
        ("...\n\nabc", &["...\n\n", "abc"]),
        ("!\r\n", &["!\r\n"]),
        (
            "你好世界，这是一个测试。",
            &["你好世界", "，这是一个测试", "。"],
        ),
        (
            "日本語のテキスト、カタカナ",
            &["日本語のテキスト", "、カタカナ"],
        ),
        ("한국어 텍스트", &["한국어", " 텍스트"]),
        (
            "I ❤\u{fe0f} 🦀 rust 👨\u{200d}👩\u{200d}👧",
            &[
                "I",
                " ❤",
                "\u{fe0f}",
                " 🦀",
                " rust",
                " 👨\u{200d}👩\u{200d}👧",
            ],
        ),
        ("😀😀 😀", &["😀😀", " 😀"]),
        (
            "Привет мир! Ελληνικά café naïve",
            &["Привет", " мир", "!", " Ελληνικά", " café", " naïve"],
        ),
        ("عربي ١٢٣ עברית", &["عربي", " ", "١", "٢", "٣", " עברית"]),
        ("mixedCASE123abc", &["mixedCASE", "1", "2", "3", "abc"]),
        ("e\u{301}te\u{301}", &["e\u{301}te\u{301}"]),
        ("नमस्ते दुनिया", &["नमस्ते", " दुनिया"]),
        ("\u{a0}nbsp\u{3000}ideo", &["\u{a0}nbsp", "\u{3000}ideo"]),
        ("tab\there", &["tab", "\there"]),
        ("a\u{2028}b", &["a", "\u{2028}b"]),
        ("\u{0}\u{1}x", &["\u{0}\u{1}", "x"]),
        (" 😀", &[" 😀"]),
        ("   😀", &["  ", " 😀"]),
    ];

    const DEFAULT: Cases = &[
        ("Hello world", &["Hello", " world"]),
        (
            "I'm you're they've he'll she'd it's don't I'M YOU'RE We'Ll",
            &[
                "I", "'", "m", " you", "'", "re", " they", "'", "ve", " he", "'", "ll", " she",
                "'", "d", " it", "'", "s", " don", "'", "t", " I", "'", "M", " YOU", "'", "RE",
                " We", "'", "Ll",
            ],
        ),
        ("'", &["'"]),
        ("''", &["''"]),
        ("'ss", &["'", "ss"]),
        ("x'", &["x", "'"]),
        (" 's", &[" ", "'", "s"]),
        ("'s'S'rE", &["'", "s", "'", "S", "'", "rE"]),
        (
            "12345 1234567 3.14159 1,000,000",
            &[
                "123", "45", " ", "123", "456", "7", " ", "3", ".", "141", "59", " ", "1", ",",
                "000", ",", "000",
            ],
        ),
        (
            "２０２４年 ٣٤٥ ½ Ⅻ",
            &["２０２４", "年", " ", "٣٤٥", " ", "½", " ", "Ⅻ"],
        ),
        (
            "a1b22c333d4444",
            &["a", "1", "b", "22", "c", "333", "d", "444", "4"],
        ),
        ("   leading spaces", &["  ", " leading", " spaces"]),
        ("trailing   ", &["trailing", "   "]),
        ("a  b   c", &["a", " ", " b", "  ", " c"]),
        ("\n\n\nx", &["\n\n", "\n", "x"]),
        (
            "line1\nline2\r\n\r\nline3",
            &["line", "1", "\n", "line", "2", "\r\n\r", "\n", "line", "3"],
        ),
        (" \n ", &[" \n "]),
        ("\t\tindent", &["\t", "\t", "indent"]),
        ("a \n b", &["a", " \n", " b"]),
        ("x \n\n  y", &["x", " \n\n ", " y"]),
        ("end\n", &["end", "\n"]),
        ("  ", &["  "]),
        (
            "Hello, world!!! (test) [x] {y} <z> ... --- ?!",
            &[
                "Hello", ",", " world", "!!!", " ", "(", "test", ")", " ", "[", "x", "]", " ", "{",
                "y", "}", " ", "<", "z", ">", " ", "...", " ", "---", " ", "?!",
            ],
        ),
        (
            "a+b=c; $100 #tag @user ~home ^caret |pipe `tick`",
            &[
                "a", "+", "b", "=", "c", ";", " ", "$", "100", " ", "#", "tag", " ", "@", "user",
                " ", "~", "home", " ", "^", "caret", " ", "|", "pipe", " `", "tick", "`",
            ],
        ),
        (
            "x86_64-linux-gnu",
            &["x", "86", "_", "64", "-", "linux", "-", "gnu"],
        ),
        ("...\n\nabc", &["...", "\n", "\n", "abc"]),
        ("!\r\n", &["!", "\r\n"]),
        (
            "你好世界，这是一个测试。",
            &["你好世界", "，", "这是一个测试", "。"],
        ),
        (
            "日本語のテキスト、カタカナ",
            &["日本語のテキスト", "、", "カタカナ"],
        ),
        ("한국어 텍스트", &["한국어", " 텍스트"]),
        (
            "I ❤\u{fe0f} 🦀 rust 👨\u{200d}👩\u{200d}👧",
            &["I", " ❤\u{fe0f}", " 🦀", " rust", " 👨\u{200d}👩\u{200d}👧"],
        ),
        ("😀😀 😀", &["😀😀", " 😀"]),
        (
            "Привет мир! Ελληνικά café naïve",
            &["Привет", " мир", "!", " Ελληνικά", " café", " naïve"],
        ),
        ("عربي ١٢٣ עברית", &["عربي", " ", "١٢٣", " עברית"]),
        ("mixedCASE123abc", &["mixedCASE", "123", "abc"]),
        ("e\u{301}te\u{301}", &["e", "\u{301}", "te", "\u{301}"]),
        (
            "नमस्ते दुनिया",
            &["नमस", "्", "त", "े", " द", "ु", "न", "ि", "य", "ा"],
        ),
        (
            "\u{a0}nbsp\u{3000}ideo",
            &["\u{a0}", "nbsp", "\u{3000}", "ideo"],
        ),
        ("tab\there", &["tab", "\t", "here"]),
        ("a\u{2028}b", &["a", "\u{2028}", "b"]),
        ("\u{0}\u{1}x", &["\u{0}\u{1}", "x"]),
        (" 😀", &[" 😀"]),
        ("   😀", &["  ", " 😀"]),
    ];

    const KIMI_K2: Cases = &[
        ("Hello world", &["Hello", " world"]),
        (
            "It's a test, ISN'T it? They'LL see",
            &[
                "It's", " a", " test", ",", " ISN'T", " it", "?", " They'LL", " see",
            ],
        ),
        ("中文Text混合english", &["中文", "Text", "混合", "english"]),
        ("㐀豈𠀀abc", &["㐀豈𠀀", "abc"]),
        ("日本語のテキスト", &["日本語", "のテキスト"]),
        ("12345678 and 9", &["123", "456", "78", " and", " ", "9"]),
        ("x1y22z333", &["x", "1", "y", "22", "z", "333"]),
        (
            "  spaces   here\n\n  next\r\nline",
            &[
                " ", " spaces", "  ", " here", "\n\n", " ", " next", "\r\n", "line",
            ],
        ),
        (
            "(hello) [world] {x}",
            &["(hello", ")", " [", "world", "]", " {", "x", "}"],
        ),
        (
            "!!!hello ??? world\n\n",
            &["!!!", "hello", " ???", " world", "\n\n"],
        ),
        (
            "café naïve Ǆemo ʰmod",
            &["café", " naïve", " Ǆemo", " ʰmod"],
        ),
        ("e\u{301} combining", &["e", "\u{301}", " combining"]),
        ("$100 €50 ²³", &["$", "100", " €", "50", " ", "²³"]),
        ("ไทย العربية", &["ไทย", " العربية"]),
        (
            "don't'll 've'm'd 're",
            &["don't", "'ll", " '", "ve'm", "'d", " '", "re"],
        ),
    ];

    const DEEPSEEK3: Cases = &[
        ("Hello world", &["Hello", " world"]),
        (
            "It's a test, isn't it?",
            &["It", "'s", " a", " test", ",", " isn", "'t", " it", "?"],
        ),
        (
            "(hello) [world] {x}",
            &["(hello", ")", " [", "world", "]", " {", "x", "}"],
        ),
        (
            "www.example.com/path?q=1",
            &["www", ".example", ".com", "/path", "?q", "=", "1"],
        ),
        (
            "$100 + 20% = €120",
            &["$", "100", " +", " ", "20", "%", " =", " €", "120"],
        ),
        ("a+b=c", &["a", "+b", "=c"]),
        ("12345678", &["123", "456", "78"]),
        ("３４５ and ٣٤٥", &["３４５", " and", " ", "٣٤٥"]),
        (
            "中文测试和日本語のテキスト",
            &["中文测试和日本語のテキスト"],
        ),
        ("ひらがなカタカナ漢字", &["ひらがなカタカナ漢字"]),
        ("한국어 텍스트", &["한국어", " 텍스트"]),
        ("Ünïcödé café naïve", &["Ünïcödé", " café", " naïve"]),
        ("école", &["école"]),
        ("́abc", &["́abc"]),
        (
            "line1\nline2\r\n\r\nline3",
            &["line", "1", "\n", "line", "2", "\r\n\r\n", "line", "3"],
        ),
        (
            "  leading and trailing  ",
            &[" ", " leading", " and", " trailing", "  "],
        ),
        ("tabs\tand nbsp", &["tabs", "\tand", " nbsp"]),
        ("emoji 😀👍 ok", &["emoji", " 😀👍", " ok"]),
        ("#hashtag @user", &["#hashtag", " @", "user"]),
        ("x=[1,2,3];", &["x", "=[", "1", ",", "2", ",", "3", "];"]),
        ("‘quoted’ “text”", &["‘", "quoted", "’", " “", "text", "”"]),
        ("…ellipsis—dash", &["…", "ellipsis", "—", "dash"]),
        ("C++ and C#", &["C", "++", " and", " C", "#"]),
        (
            "snake_case and camelCase",
            &["snake", "_case", " and", " camelCase"],
        ),
        ("ÉCOLE ÉCOLE", &["ÉCOLE", " ÉCOLE"]),
        ("Γειά σου Κόσμε", &["Γειά", " σου", " Κόσμε"]),
        ("Привет мир", &["Привет", " мир"]),
        ("مرحبا بالعالم", &["مرحبا", " بالعالم"]),
        ("123abc456", &["123", "abc", "456"]),
        ("\u{200B}zero width", &["\u{200B}zero", " width"]),
        ("a\r\nb", &["a", "\r\n", "b"]),
        ("!!!\n\nx", &["!!!\n\n", "x"]),
    ];
}
