//! Running the `ferry-schedule` binary as a user would, for the CLI tests.

use std::process::{Command, Output};

/// Runs the binary with `args` and collects its output.
pub(crate) fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferry-schedule"))
        .args(args)
        .output()
        .expect("the binary runs")
}

/// Its standard output, as text.
pub(crate) fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Its standard error, as text.
pub(crate) fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}
