//! Parsers of numeric options that clap's own do not bound: a bad value is a
//! usage error naming the option, never a silent default, an abort or a NaN.

/// Most compute or I/O threads an option may ask for (llama.cpp's limit too).
pub const MAX_THREADS: usize = 512;

/// A finite number `>= 0` (temperatures, top-p).
pub fn non_negative(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        Ok(_) => Err(format!("{s} is not a finite number >= 0")),
        Err(e) => Err(e.to_string()),
    }
}

/// A finite number `> 0` (the repeat penalty).
pub fn positive(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        Ok(_) => Err(format!("{s} is not a finite number > 0")),
        Err(e) => Err(e.to_string()),
    }
}

/// A finite number (negative allowed).
pub fn finite(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if v.is_finite() => Ok(v),
        Ok(_) => Err(format!("{s} is not a finite number")),
        Err(e) => Err(e.to_string()),
    }
}

/// A probability, `0..=1`.
pub fn probability(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        Ok(_) => Err(format!("{s} is not a probability (0 to 1)")),
        Err(e) => Err(e.to_string()),
    }
}

/// A KV cache element type by llama.cpp's name (`--cache-type-k`): `f16` or
/// `f32`; its quantized types are refused by name.
pub fn kv_type(s: &str) -> Result<les_core::model::forward::KvType, String> {
    use les_core::model::forward::KvType;
    match s {
        "f16" => Ok(KvType::F16),
        "f32" => Ok(KvType::F32),
        "bf16" | "q8_0" | "q4_0" | "q4_1" | "iq4_nl" | "q5_0" | "q5_1" => Err(format!(
            "{s}: les keeps the KV cache in f16 or f32 (llama.cpp's quantized caches are not supported)"
        )),
        _ => Err(format!("{s} is not a KV cache type (f16 or f32)")),
    }
}

/// A thread count, `0..=MAX_THREADS` (what 0 means is the option's to say).
pub fn threads(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(v) if v <= MAX_THREADS => Ok(v),
        Ok(_) => Err(format!("{s} threads: at most {MAX_THREADS}")),
        Err(e) => Err(e.to_string()),
    }
}

/// A percentage in `(0, 100]` (a sweep's budget).
pub fn percent(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 100.0 => Ok(v),
        Ok(_) => Err(format!("{s}% is not in (0, 100]")),
        Err(_) => Err(format!("{s:?} is not a percentage (a number such as 25)")),
    }
}

/// A token count of at least 1 that a session can hold
/// ([`crate::engine::MAX_POSITIONS`]).
pub fn tokens(s: &str) -> Result<usize, String> {
    let max = crate::engine::MAX_POSITIONS;
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(v) if v > max => Err(format!("{v} tokens: at most {max}")),
        Ok(v) => Ok(v),
        Err(e) => Err(e.to_string()),
    }
}

/// A prompt batch size, `1..=`[`crate::engine::MAX_PREFILL_BATCH`].
pub fn batch(s: &str) -> Result<usize, String> {
    let max = crate::engine::MAX_PREFILL_BATCH;
    match s.parse::<usize>() {
        Ok(v) if (1..=max).contains(&v) => Ok(v),
        Ok(v) => Err(format!("{v}: a batch is 1 to {max} positions")),
        Err(e) => Err(e.to_string()),
    }
}

/// Most sequences `les bench --parallel` decodes side by side.
pub const MAX_PARALLEL: usize = 64;

/// A count of sequences decoded side by side (1 to [`MAX_PARALLEL`]).
pub fn sequences(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(v) if (1..=MAX_PARALLEL).contains(&v) => Ok(v),
        Ok(v) => Err(format!("{v}: 1 to {MAX_PARALLEL} sequences")),
        Err(e) => Err(e.to_string()),
    }
}

/// A byte size ([`parse_size`](crate::supply::parse_size): `4096`, `4KiB`,
/// `1MiB`).
pub fn bytes(s: &str) -> Result<u64, String> {
    crate::supply::parse_size(s)
}

/// RAM for expert slots: a byte size, or a share of the model's expert bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertMem {
    /// So many bytes (`2GiB`).
    Bytes(u64),
    /// This percentage (`25%`, in (0, 100]) of the slot bytes that hold every
    /// expert of the model ([`crate::model::Model::expert_slot_bytes`]).
    Percent(f64),
}

impl ExpertMem {
    /// The budget in bytes for a model whose experts all fit `expert_bytes`.
    pub fn bytes(self, expert_bytes: u64) -> u64 {
        match self {
            ExpertMem::Bytes(b) => b,
            ExpertMem::Percent(p) => (expert_bytes as f64 * p / 100.0) as u64,
        }
    }
}

/// An [`ExpertMem`]: a byte size as [`bytes`] takes it, or a percentage as
/// [`percent`] does, followed by `%`.
pub fn expert_mem(s: &str) -> Result<ExpertMem, String> {
    match s.trim().strip_suffix('%') {
        Some(p) => percent(p.trim()).map(ExpertMem::Percent),
        None => bytes(s).map(ExpertMem::Bytes),
    }
}

/// A count of last tokens, or -1 for the whole context.
pub fn last_n(s: &str) -> Result<i64, String> {
    match s.parse::<i64>() {
        Ok(v) if v >= -1 => Ok(v),
        _ => Err(format!(
            "{s} is not a count of tokens (or -1 for the context)"
        )),
    }
}

/// A stop string: not empty (escapes are read later, see
/// [`process_escapes`]).
pub fn stop_string(s: &str) -> Result<String, String> {
    if s.is_empty() {
        return Err("a stop string must not be empty".into());
    }
    Ok(s.to_string())
}

/// `s` with llama.cpp's escapes read (its `--escape`, on by default): `\n`,
/// `\r`, `\t`, `\'`, `\"`, `\\` and `\xHH` (a byte); a backslash before
/// anything else stays, as does a trailing one. An error where `\xHH` bytes
/// do not make UTF-8.
pub fn process_escapes(s: &str) -> Result<String, String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] != b'\\' || i + 1 == b.len() {
            out.push(b[i]);
            i += 1;
            continue;
        }
        let byte = match b[i + 1] {
            b'n' => Some(b'\n'),
            b'r' => Some(b'\r'),
            b't' => Some(b'\t'),
            c @ (b'\'' | b'"' | b'\\') => Some(c),
            _ => None,
        };
        if let Some(c) = byte {
            out.push(c);
            i += 2;
            continue;
        }
        let hex = (b[i + 1] == b'x')
            .then(|| b.get(i + 2..i + 4))
            .flatten()
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match hex {
            Some(v) => {
                out.push(v);
                i += 4;
            }
            None => {
                out.push(b'\\');
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?}: its \\x escapes do not make UTF-8 text"))
}

/// A logit bias as llama.cpp's `--logit-bias` takes it: `TOKEN_ID+BIAS` or
/// `TOKEN_ID-BIAS` (e.g. `15043+1`, `15043-inf`: never that token). The bias
/// is a finite number, or `inf` after `-`.
pub fn logit_bias(s: &str) -> Result<(u32, f32), String> {
    let want = || format!("{s:?} is not TOKEN_ID+BIAS or TOKEN_ID-BIAS (e.g. 15043+1, 15043-inf)");
    let t = s.trim();
    let at = t.find(['+', '-']).ok_or_else(want)?;
    let (id, rest) = t.split_at(at);
    let id: u32 = id.trim().parse().map_err(|_| want())?;
    let (sign, value) = rest.split_at(1);
    let value = value.trim();
    if value.starts_with(['+', '-']) {
        return Err(want());
    }
    let magnitude: f32 = value.parse().map_err(|_| want())?;
    let bias = if sign == "-" { -magnitude } else { magnitude };
    if bias.is_nan() || bias == f32::INFINITY {
        return Err(format!("{s:?}: the bias must be a finite number or -inf"));
    }
    Ok((id, bias))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds() {
        assert_eq!(non_negative("0.8"), Ok(0.8));
        assert_eq!(non_negative("0"), Ok(0.0));
        for bad in ["nan", "inf", "-1", "x"] {
            assert!(non_negative(bad).is_err(), "{bad}");
        }
        assert_eq!(probability("1"), Ok(1.0));
        for bad in ["nan", "1.5", "-0.1"] {
            assert!(probability(bad).is_err(), "{bad}");
        }
        assert_eq!(threads("0"), Ok(0));
        assert_eq!(threads("512"), Ok(512));
        assert!(threads("513").is_err());
        assert!(threads("100000").is_err());
        assert_eq!(percent("12.5"), Ok(12.5));
        for bad in ["0", "100.1", "nan", "-5"] {
            assert!(percent(bad).is_err(), "{bad}");
        }
        assert_eq!(expert_mem("2GiB"), Ok(ExpertMem::Bytes(2 << 30)));
        assert_eq!(expert_mem("25%"), Ok(ExpertMem::Percent(25.0)));
        assert_eq!(expert_mem(" 12.5 % "), Ok(ExpertMem::Percent(12.5)));
        assert_eq!(ExpertMem::Percent(25.0).bytes(4 << 30), 1 << 30);
        assert_eq!(ExpertMem::Percent(100.0).bytes(12345), 12345);
        assert_eq!(ExpertMem::Bytes(7).bytes(12345), 7);
        for bad in ["0%", "101%", "%", "x%", "-5%", "nan%", "2 parsecs"] {
            assert!(expert_mem(bad).is_err(), "{bad}");
        }
        assert_eq!(stop_string("</s>"), Ok("</s>".into()));
        assert!(stop_string("").is_err());
        assert_eq!(process_escapes(r"\n\nUser:"), Ok("\n\nUser:".into()));
        assert_eq!(process_escapes(r"a\tb\\n\r"), Ok("a\tb\\n\r".into()));
        assert_eq!(process_escapes(r#"\'\"\x41\xc3\xa9"#), Ok("'\"Aé".into()));
        // Unknown escapes, a short or bad \x, and a trailing backslash stay.
        assert_eq!(process_escapes(r"\q\x4\xzz\"), Ok(r"\q\x4\xzz\".into()));
        assert_eq!(process_escapes("plain é"), Ok("plain é".into()));
        assert!(process_escapes(r"\xff").is_err());
        assert_eq!(logit_bias("15043+1"), Ok((15043, 1.0)));
        assert_eq!(logit_bias("15043-1.5"), Ok((15043, -1.5)));
        assert_eq!(logit_bias(" 7 -inf"), Ok((7, f32::NEG_INFINITY)));
        assert_eq!(logit_bias("0+0"), Ok((0, 0.0)));
        for bad in [
            "15043",
            "15043+",
            "+1",
            "x+1",
            "15043*2",
            "15043+inf",
            "15043+nan",
            "15043--1",
            "15043+-1",
            "-1+2",
            "99999999999+1",
            "",
        ] {
            assert!(logit_bias(bad).is_err(), "{bad}");
        }
        assert_eq!(tokens("3"), Ok(3));
        assert!(tokens("0").is_err());
        assert!(tokens("18446744073709551615").is_err());
    }
}
