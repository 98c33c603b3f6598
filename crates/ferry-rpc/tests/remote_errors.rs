//! What a caller learns of a failed remote call, across 2 worker processes
//! on 127.0.0.1: the callee's error text exactly as raised (line breaks,
//! control characters, a 10 KB text, a text at the limit), a text over
//! [`MAX_ERROR_TEXT_BYTES`] cut with the number of bytes left out, the
//! same text escaped on one line when the error is logged, and the two
//! signatures of a wrong-type call written the same way.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use ferry_rpc::{Function, Functions, RpcError, RpcOptions, Schema, MAX_ERROR_TEXT_BYTES};
use ferry_testkit::world_ok;
use serde::{Deserialize, Serialize};

/// Fails with its argument as the error's text.
const RAISE: Function<String, ()> = Function::new("raise");
/// The same from an async body.
const RAISE_ASYNC: Function<String, ()> = Function::new("raise_async");
/// Panics with its argument.
const PANIC_WITH: Function<String, ()> = Function::new("panic_with");
/// Takes a struct and a sequence: types whose shapes and names differ.
const TALLY: Function<(Log, Vec<String>), i64> = Function::new("tally");

/// PyTorch's `raise_func_escape` text (`test_py_raise_in_user_func_escaped_str`).
const PYTORCH_TEXT: &str = "\nFirst line of error \n next line of error \n last line of error";
/// A line a peer might hope to forge in the caller's log.
const FORGED: &str = "boom\n2026-01-01T00:00:00.000000Z  INFO ferry: all is well\u{1b}[2J\u{202e}";

#[derive(Debug, Serialize, Deserialize, Schema)]
struct Log {
    lines: Vec<String>,
}

fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(RAISE, Err::<(), _>);
    f.add(
        RAISE_ASYNC,
        |text: String| async move { Err::<(), _>(text) },
    );
    // A body that only diverges names its result.
    f.add(PANIC_WITH, |text: String| -> () {
        std::panic::panic_any(text)
    });
    f.add(TALLY, |(log, more): (Log, Vec<String>)| {
        (log.lines.len() + more.len()) as i64
    });
    f
}

fn start(rank: u32) {
    let options = RpcOptions::from_env(format!("worker{rank}"))
        .unwrap()
        .functions(functions())
        .init_timeout(Duration::from_secs(60));
    init_rpc(options).unwrap();
}

/// The `message` and `omitted_bytes` of a remote error.
fn remote(e: &RpcError) -> (&str, u64) {
    match e {
        RpcError::Remote {
            worker,
            function,
            message,
            omitted_bytes,
        } => {
            assert_eq!(worker, "worker1");
            assert!(function.starts_with("raise") || function == "panic_with");
            (message, *omitted_bytes)
        }
        other => panic!("expected a remote error, got: {other}"),
    }
}

/// A 10 KB text with every kind of line break, tabs, quotes, backslashes
/// and characters of several byte lengths.
fn ten_kb_text() -> String {
    let line = "Traceback line \t\"quoted\" \\path\\ é中😀 \r\n";
    let mut text = String::new();
    while text.len() < 10_000 {
        text.push_str(line);
        text.push('\n');
    }
    text
}

#[test]
fn remote_error_texts_arrive_as_raised_and_are_logged_escaped() {
    let Some(outputs) = world_ok(
        "remote_error_texts_arrive_as_raised_and_are_logged_escaped",
        2,
        |rank| {
            let _ = tracing_subscriber::fmt()
                .with_writer(std::io::stderr)
                .with_ansi(false)
                .with_max_level(tracing::Level::WARN)
                .try_init();
            start(rank);
            if rank == 0 {
                // PyTorch's case: the text as raised, line breaks and all.
                let e = RAISE.rpc_sync(1, PYTORCH_TEXT.to_string()).unwrap_err();
                assert_eq!(remote(&e), (PYTORCH_TEXT, 0));
                // Its Display is one line, escaped.
                assert_eq!(
                    e.to_string(),
                    r#"function "raise" failed on worker "worker1": \nFirst line of error \n next line of error \n last line of error"#
                );

                // 10 KB, from a blocking and from an async body.
                let text = ten_kb_text();
                let e = RAISE.rpc_sync(1, text.clone()).unwrap_err();
                assert_eq!(remote(&e), (text.as_str(), 0));
                let e = RAISE_ASYNC.rpc_sync(1, text.clone()).unwrap_err();
                assert_eq!(remote(&e), (text.as_str(), 0));

                // A panic: `panicked: ` and the payload as raised.
                let e = PANIC_WITH
                    .rpc_sync(1, PYTORCH_TEXT.to_string())
                    .unwrap_err();
                assert_eq!(
                    remote(&e),
                    (format!("panicked: {PYTORCH_TEXT}").as_str(), 0)
                );

                // Exactly at the limit: whole.
                let at_limit = "x\n".repeat(MAX_ERROR_TEXT_BYTES / 2);
                assert_eq!(at_limit.len(), MAX_ERROR_TEXT_BYTES);
                let e = RAISE.rpc_sync(1, at_limit.clone()).unwrap_err();
                assert_eq!(remote(&e), (at_limit.as_str(), 0));
                assert!(!e.to_string().contains("more bytes"), "{e}");

                // Over the limit: cut on a character boundary ("é" is two
                // bytes and straddles the limit), saying how much was left.
                let over = format!("a{}", "é".repeat(MAX_ERROR_TEXT_BYTES / 2 + 500));
                let e = RAISE.rpc_sync(1, over.clone()).unwrap_err();
                let (message, omitted) = remote(&e);
                assert_eq!(message.len(), MAX_ERROR_TEXT_BYTES - 1);
                assert!(over.starts_with(message));
                assert_eq!(omitted, (over.len() - message.len()) as u64);
                assert_eq!(omitted, 1002);
                assert!(
                    e.to_string().ends_with("éé…(1002 more bytes)"),
                    "{}",
                    &e.to_string()[e.to_string().len() - 40..]
                );

                // A text that tries to forge a log line: kept as raised in
                // the value, escaped in the log.
                let e = RAISE.rpc_sync(1, FORGED.to_string()).unwrap_err();
                assert_eq!(remote(&e), (FORGED, 0));
                tracing::warn!(error = %e, "the call failed");
                println!("CHECKED=yes");
            }
            ferry_rpc::shutdown().unwrap();
        },
    ) else {
        return;
    };
    assert_eq!(outputs[0].values("CHECKED"), ["yes"]);
    let log = &outputs[0].stderr;
    let line = log
        .lines()
        .find(|l| l.contains("the call failed"))
        .unwrap_or_else(|| panic!("no log line in: {log}"));
    assert!(
        line.contains(
            r#"function "raise" failed on worker "worker1": boom\n2026-01-01T00:00:00.000000Z  INFO ferry: all is well\u{1b}[2J\u{202e}"#
        ),
        "{line}"
    );
    // Nothing of the text escaped the line, nor reached the terminal raw.
    assert!(!log.lines().any(|l| l.starts_with("2026-01-01")), "{log}");
    assert!(
        !log.contains('\u{1b}') && !log.contains('\u{202e}'),
        "{log}"
    );
}

/// A wrong-type refusal writes both signatures the same way: as type
/// names without module paths when a side is not typed (what was
/// compared), as declared shapes when both are.
#[test]
fn wrong_types_show_both_signatures_in_one_notation() {
    let Some(outputs) = world_ok(
        "wrong_types_show_both_signatures_in_one_notation",
        2,
        |rank| {
            start(rank);
            if rank == 0 {
                let log = || Log {
                    lines: vec!["a".into()],
                };
                assert_eq!(TALLY.rpc_sync(1, (log(), vec!["b".into()])).unwrap(), 2);

                // String-named caller, typed registration: type names.
                let e = ferry_rpc::by_name("tally")
                    .rpc_sync::<i64, _>(1, (log(), "b".to_string()))
                    .unwrap_err();
                assert_eq!(
                    e.to_string(),
                    "wrong type calling \"tally\" on worker \"worker1\": it takes \
                     fn((Log, Vec<String>)) -> i64, the call sent fn((Log, String)) -> i64"
                );
                assert!(matches!(
                    e,
                    RpcError::WrongType {
                        by_schema: false,
                        ..
                    }
                ));

                // Typed caller, typed registration: shapes.
                const TALLY_ONE: Function<(Log, String), i64> = Function::new("tally");
                let e = TALLY_ONE.rpc_sync(1, (log(), "b".into())).unwrap_err();
                assert_eq!(
                    e.to_string(),
                    "wrong type calling \"tally\" on worker \"worker1\": it takes \
                     fn((Log { lines: [String] }, [String])) -> i64, the call sent \
                     fn((Log { lines: [String] }, String)) -> i64"
                );
                assert!(matches!(
                    e,
                    RpcError::WrongType {
                        by_schema: true,
                        ..
                    }
                ));

                println!("CHECKED=yes");
            }
            ferry_rpc::shutdown().unwrap();
        },
    ) else {
        return;
    };
    assert_eq!(outputs[0].values("CHECKED"), ["yes"]);
}

/// Starts this process's agent and makes it the process's (what
/// `ferry::init_rpc` does, with only the layers `options` has).
fn init_rpc(options: ferry_rpc::RpcOptions) -> Result<ferry_rpc::Agent, ferry_rpc::RpcError> {
    let agent = ferry_rpc::Agent::start(options)?;
    ferry_rpc::set_process_agent(&agent)?;
    Ok(agent)
}
