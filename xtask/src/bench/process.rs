//! Running a benchmark program with a time bound and reading what it prints.

use std::io::Read;
use std::path::Path;
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::steps::root;

/// The last lines of the log at `log` (repository-relative), to quote in
/// an error; empty if there is nothing to read.
pub(crate) fn log_tail(log: &Path) -> String {
    const LINES: usize = 15;
    let text = std::fs::read_to_string(root().join(log)).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = &lines[lines.len().saturating_sub(LINES)..];
    if tail.is_empty() {
        String::new()
    } else {
        format!(", its last lines:\n{}", tail.join("\n"))
    }
}

/// Runs `c` (stdout piped) to its end and returns its stdout; kills it
/// after `limit`. Fails if it does not exit with success.
pub(crate) fn run_bounded(c: &mut Command, limit: Duration) -> Result<String> {
    let mut child = c.spawn().context("could not start the command")?;
    let mut stdout = child.stdout.take().context("the command's stdout")?;
    // Its stdout ends when it exits: the reader's message is the wait.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = tx.send(stdout.read_to_string(&mut text).map(|_| text));
    });
    let text = match rx.recv_timeout(limit) {
        Ok(text) => text.context("reading the command's stdout")?,
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            bail!("still running after {limit:?}: killed");
        }
    };
    let status = child.wait().context("waiting for the command")?;
    if !status.success() {
        bail!("exited with {status}");
    }
    Ok(text)
}

/// The last line of `text` that is a JSON object.
pub(crate) fn last_json_object(text: &str) -> Option<Value> {
    text.lines()
        .rev()
        .filter_map(|line| serde_json::from_str::<Value>(line.trim()).ok())
        .find(Value::is_object)
}
