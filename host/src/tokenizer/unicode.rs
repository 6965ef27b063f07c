//! Character classes the pre-tokenizers need, and GPT-2's byte-to-unicode table.
//!
//! Classes follow llama.cpp's `unicode_cpt_flags`: letter is `\p{L}`, number `\p{N}`,
//! mark `\p{M}`, punctuation `\p{P}`, symbol `\p{S}` (all by general category),
//! and whitespace is the Unicode `White_Space` property, which is what llama.cpp's
//! `\s` means.

use unicode_general_category::{get_general_category, GeneralCategory as Gc};

/// `\p{L}`.
pub(crate) const LETTER: u8 = 1;
/// `\p{N}`.
pub(crate) const NUMBER: u8 = 2;
/// `\s` (`White_Space`).
pub(crate) const SPACE: u8 = 4;
/// `\p{M}`.
pub(crate) const MARK: u8 = 8;
/// `\p{P}`.
pub(crate) const PUNCT: u8 = 16;
/// `\p{S}`.
pub(crate) const SYMBOL: u8 = 32;

const fn ascii_flags() -> [u8; 128] {
    let mut t = [0u8; 128];
    let mut c = 0;
    while c < 128 {
        let b = c as u8;
        t[c] = if b.is_ascii_alphabetic() {
            LETTER
        } else if b.is_ascii_digit() {
            NUMBER
        } else if matches!(b, b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | b' ') {
            SPACE
        } else if matches!(
            b,
            b'!' | b'"'
                | b'#'
                | b'%'
                | b'&'
                | b'\''
                | b'('
                | b')'
                | b'*'
                | b','
                | b'-'
                | b'.'
                | b'/'
                | b':'
                | b';'
                | b'?'
                | b'@'
                | b'['
                | b'\\'
                | b']'
                | b'_'
                | b'{'
                | b'}'
        ) {
            PUNCT
        } else if matches!(
            b,
            b'$' | b'+' | b'<' | b'=' | b'>' | b'^' | b'`' | b'|' | b'~'
        ) {
            SYMBOL
        } else {
            0
        };
        c += 1;
    }
    t
}

static ASCII_FLAGS: [u8; 128] = ascii_flags();

/// The class bits of one character.
#[inline]
pub(crate) fn flags(c: char) -> u8 {
    let cp = c as u32;
    if cp < 128 {
        return ASCII_FLAGS[cp as usize];
    }
    let ws = if c.is_whitespace() { SPACE } else { 0 };
    let cat = match get_general_category(c) {
        Gc::UppercaseLetter
        | Gc::LowercaseLetter
        | Gc::TitlecaseLetter
        | Gc::ModifierLetter
        | Gc::OtherLetter => LETTER,
        Gc::DecimalNumber | Gc::LetterNumber | Gc::OtherNumber => NUMBER,
        Gc::NonspacingMark | Gc::SpacingMark | Gc::EnclosingMark => MARK,
        Gc::ConnectorPunctuation
        | Gc::DashPunctuation
        | Gc::OpenPunctuation
        | Gc::ClosePunctuation
        | Gc::InitialPunctuation
        | Gc::FinalPunctuation
        | Gc::OtherPunctuation => PUNCT,
        Gc::MathSymbol | Gc::CurrencySymbol | Gc::ModifierSymbol | Gc::OtherSymbol => SYMBOL,
        _ => 0,
    };
    ws | cat
}

const fn byte_to_char_table() -> [char; 256] {
    let mut t = ['\0'; 256];
    let mut n = 0u32;
    let mut b = 0usize;
    while b < 256 {
        let printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
        let cp = if printable {
            b as u32
        } else {
            n += 1;
            255 + n
        };
        t[b] = match char::from_u32(cp) {
            Some(c) => c,
            None => '\0',
        };
        b += 1;
    }
    t
}

/// GPT-2's reversible byte-to-unicode map: printable Latin-1 bytes map to themselves,
/// the other 68 bytes to U+0100.. in byte order (space becomes `Ġ`, newline `Ċ`).
pub(crate) static BYTE_TO_CHAR: [char; 256] = byte_to_char_table();

/// The byte a GPT-2 byte-level character stands for, if it is one.
#[inline]
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let cp = c as u32;
    match cp {
        0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff => Some(cp as u8),
        0x100..=0x143 => {
            // The (cp - 0x100)-th byte that is not printable.
            let k = (cp - 0x100) as usize;
            NON_PRINTABLE.get(k).copied()
        }
        _ => None,
    }
}

const fn non_printable_table() -> [u8; 68] {
    let mut t = [0u8; 68];
    let mut n = 0;
    let mut b = 0usize;
    while b < 256 {
        let printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
        if !printable {
            t[n] = b as u8;
            n += 1;
        }
        b += 1;
    }
    t
}

static NON_PRINTABLE: [u8; 68] = non_printable_table();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_round_trips() {
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(BYTE_TO_CHAR[b as usize]), Some(b));
        }
        assert_eq!(BYTE_TO_CHAR[b' ' as usize], 'Ġ');
        assert_eq!(BYTE_TO_CHAR[b'\n' as usize], 'Ċ');
        assert_eq!(BYTE_TO_CHAR[b'a' as usize], 'a');
        assert_eq!(char_to_byte('\u{144}'), None);
    }

    #[test]
    fn classes() {
        assert_eq!(flags('a'), LETTER);
        assert_eq!(flags('é'), LETTER);
        assert_eq!(flags('中'), LETTER);
        assert_eq!(flags('٣'), NUMBER);
        assert_eq!(flags('½'), NUMBER);
        assert_eq!(flags('\u{3000}'), SPACE);
        assert_eq!(flags('\u{a0}'), SPACE);
        assert_eq!(flags('\u{85}'), SPACE);
        assert_eq!(flags('\u{301}'), MARK);
        assert_eq!(flags('。'), PUNCT);
        assert_eq!(flags('$'), SYMBOL);
        assert_eq!(flags('😀'), SYMBOL);
        assert_eq!(flags('\u{200b}'), 0);
    }
}
