//! Text a peer supplies (worker names, channel names, function names,
//! error texts), made safe to put into a log line or an error message.
//!
//! [`PeerText`] displays its text with every character that could forge or
//! hide log content escaped (line breaks, ANSI escape sequences, NUL, all
//! other control characters, Unicode bidirectional overrides and line
//! separators) and cut after a bounded number of characters with a note of
//! how many bytes were left out:
//!
//! ```
//! use ferry_wire::PeerText;
//!
//! let name = "evil\n2026-01-01 INFO all is well\u{1b}[2J";
//! assert_eq!(
//!     PeerText::new(name).to_string(),
//!     r"evil\n2026-01-01 INFO all is well\u{1b}[2J"
//! );
//! let long = "x".repeat(300);
//! assert_eq!(
//!     PeerText::new(&long).to_string(),
//!     format!("{}…(44 more bytes)", "x".repeat(256))
//! );
//! assert_eq!(format!("{:?}", PeerText::new("a \"b\"")), r#""a \"b\"""#);
//! ```
//!
//! Backslashes are kept as they are, so escaping is idempotent: displaying
//! an escaped text (within the bound) again changes nothing, and text that
//! travels through several workers is not escaped twice.

use std::fmt::{self, Write};

/// How many characters of a peer's text [`PeerText::new`] shows.
pub const MAX_PEER_TEXT_CHARS: usize = 256;

/// A peer's text, displayed escaped and bounded.
/// `Display` shows the text itself; `Debug` shows it quoted, with `"`
/// escaped too.
#[derive(Clone, Copy)]
pub struct PeerText<'a> {
    text: &'a str,
    max_chars: usize,
}

impl<'a> PeerText<'a> {
    /// `text`, shown up to [`MAX_PEER_TEXT_CHARS`] characters.
    pub fn new(text: &'a str) -> Self {
        Self::bounded(text, MAX_PEER_TEXT_CHARS)
    }

    /// `text`, shown up to `max_chars` characters (longer error texts).
    pub fn bounded(text: &'a str, max_chars: usize) -> Self {
        Self { text, max_chars }
    }

    fn write(&self, f: &mut fmt::Formatter<'_>, quoted: bool) -> fmt::Result {
        for (shown, (at, c)) in self.text.char_indices().enumerate() {
            if shown == self.max_chars {
                return write!(f, "…({} more bytes)", self.text.len() - at);
            }
            match c {
                '\n' => f.write_str("\\n")?,
                '\r' => f.write_str("\\r")?,
                '\t' => f.write_str("\\t")?,
                '\0' => f.write_str("\\0")?,
                '"' if quoted => f.write_str("\\\"")?,
                c if needs_escape(c) => write!(f, "\\u{{{:x}}}", c as u32)?,
                c => f.write_char(c)?,
            }
        }
        Ok(())
    }
}

/// Whether `c` must not reach a log as it is: control characters (ANSI
/// escapes start with one), characters that reorder what a terminal shows
/// (bidirectional overrides, isolates and marks) and line separators.
pub fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
}

impl fmt::Display for PeerText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(f, false)
    }
}

impl fmt::Debug for PeerText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_char('"')?;
        self.write(f, true)?;
        f.write_char('"')
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_dangerous_character_is_escaped() {
        let cases = [
            ("a\nb", r"a\nb"),
            ("a\r\nb", r"a\r\nb"),
            ("tab\there", r"tab\there"),
            ("nul\0", r"nul\0"),
            ("\u{1b}[31mred\u{1b}[0m", r"\u{1b}[31mred\u{1b}[0m"),
            ("bell\u{7}", r"bell\u{7}"),
            ("del\u{7f}", r"del\u{7f}"),
            ("c1\u{9b}31m", r"c1\u{9b}31m"),
            ("rlo\u{202e}gnp.exe", r"rlo\u{202e}gnp.exe"),
            ("iso\u{2066}x\u{2069}", r"iso\u{2066}x\u{2069}"),
            ("ls\u{2028}x", r"ls\u{2028}x"),
            ("plain worker-1:ok_é中", "plain worker-1:ok_é中"),
            (r"back\slash", r"back\slash"),
        ];
        for (input, shown) in cases {
            assert_eq!(PeerText::new(input).to_string(), shown, "{input:?}");
        }
    }

    #[test]
    fn long_text_is_cut_with_the_bytes_left_out() {
        let text = format!("{}{}", "é".repeat(256), "abc");
        assert_eq!(
            PeerText::new(&text).to_string(),
            format!("{}…(3 more bytes)", "é".repeat(256))
        );
        assert_eq!(
            PeerText::bounded("abcdef", 2).to_string(),
            "ab…(4 more bytes)"
        );
        assert_eq!(PeerText::bounded("ab", 2).to_string(), "ab");
        assert_eq!(PeerText::new("").to_string(), "");
    }
}
