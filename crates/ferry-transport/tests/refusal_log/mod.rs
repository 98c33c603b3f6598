//! Capturing the warnings a test's listener writes, to count the lines
//! about refused connections: a minimal `tracing` subscriber (this crate's
//! tests have no `tracing-subscriber`) that keeps every `WARN` and `ERROR`
//! event as one line, its message then `name=value` for each field.
//!
//! Tracing caches whether a log statement is enabled, and a statement
//! another thread's test hits first can miss a subscriber set as one
//! thread's default: a test that counts lines is the only test of its
//! binary, and runs its listener on its own thread (`#[tokio::test]`).
#![allow(dead_code)]

use std::fmt::{self, Write as _};
use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::DefaultGuard;
use tracing::{Event, Level, Metadata, Subscriber};

/// The lines captured so far.
#[derive(Clone, Default)]
pub(crate) struct Captured(Arc<Mutex<Vec<String>>>);

impl Captured {
    /// Every line, in order.
    pub(crate) fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The lines that contain `text`.
    pub(crate) fn lines_with(&self, text: &str) -> Vec<String> {
        self.lines()
            .into_iter()
            .filter(|l| l.contains(text))
            .collect()
    }

    /// Every line, one per line of text (for assertion messages).
    pub(crate) fn text(&self) -> String {
        self.lines().join("\n")
    }
}

/// Captures this thread's `WARN` and `ERROR` events until the guard drops.
pub(crate) fn capture() -> (Captured, DefaultGuard) {
    let captured = Captured::default();
    let guard = tracing::subscriber::set_default(Capture(captured.clone()));
    (captured, guard)
}

/// The `refusals=N` field of a line.
pub(crate) fn refusals(line: &str) -> u64 {
    let at = line.find("refusals=").expect("a refusals= field") + "refusals=".len();
    let digits: String = line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().expect("a count")
}

/// The sum of the `refusals=N` fields of `lines`.
pub(crate) fn total(lines: &[String]) -> u64 {
    lines.iter().map(|l| refusals(l)).sum()
}

struct Capture(Captured);

/// One event as text.
struct Line(String);

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let _ = if field.name() == "message" {
            write!(self.0, " {value:?}")
        } else {
            write!(self.0, " {}={value:?}", field.name())
        };
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        let _ = write!(self.0, " {}={value}", field.name());
    }
}

impl Subscriber for Capture {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        *metadata.level() <= Level::WARN
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(LevelFilter::WARN)
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut line = Line(event.metadata().level().to_string());
        event.record(&mut line);
        (self.0)
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(line.0);
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}
