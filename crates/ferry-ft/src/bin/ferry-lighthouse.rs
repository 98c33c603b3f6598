//! `ferry-lighthouse`: Ferry's lighthouse as a program, a drop-in for
//! torchft's `torchft_lighthouse`.
//!
//! ```text
//! ferry-lighthouse --min-replicas 2 [--bind [::]:29510] [--join-timeout-ms 60000]
//!                  [--quorum-tick-ms 100] [--heartbeat-timeout-ms 5000]
//!                  [--threads 1]
//! ```
//!
//! torchft's spellings (`--min_replicas`, `--join_timeout_ms`,
//! `--quorum_tick_ms`, `--heartbeat_timeout_ms`) work too, and `--flag=value`
//! as well as `--flag value`. It prints the address it listens on to stdout
//! (one line, `ferry-lighthouse listening on http://ADDR`), logs through
//! `tracing` to stderr (`RUST_LOG`, default `info`), serves the dashboard on
//! the same port, and stops on SIGINT or SIGTERM.
//!
//! By default it serves on one thread (a current-thread tokio runtime). The
//! lighthouse's work per request is a few microseconds under one lock, so
//! more worker threads add cross-thread wake-ups without adding capacity:
//! measured here with many heartbeating clients, one thread handles up to
//! 1.6× the heartbeats per second of a two-worker runtime, with less CPU per
//! heartbeat. `--threads N` (N > 1) runs a multi-threaded runtime with N
//! workers instead.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use ferry_ft::lighthouse::{Lighthouse, LighthouseOptions};
use tracing_subscriber::EnvFilter;

const USAGE: &str = "\
Usage: ferry-lighthouse --min-replicas N [OPTIONS]

Ferry's lighthouse: forms quorums of replica groups (torchft.LighthouseService)
and serves a status dashboard on the same port.

Options:
  --bind ADDR                 Address to bind the server to [default: [::]:29510]
  --min-replicas N            Minimum number of replicas to consider a quorum (required)
  --join-timeout-ms MS        How long to wait for heartbeating stragglers to join
                              before issuing quorum [default: 60000]
  --quorum-tick-ms MS         How frequently to check for quorum when waiting for
                              stragglers [default: 100]
  --heartbeat-timeout-ms MS   How long to wait for a heartbeat before considering a
                              replica dead [default: 5000]
  --threads N                 Threads serving requests; 1 serves everything on one
                              thread, N > 1 uses N worker threads [default: 1]
  -h, --help                  Print this help
  -V, --version               Print the version

torchft's spellings (--min_replicas, --join_timeout_ms, --quorum_tick_ms,
--heartbeat_timeout_ms) are accepted too. Logs go to stderr (RUST_LOG, default info).";

/// What the command line asks for.
#[derive(Debug, PartialEq, Eq)]
enum Command {
    Run {
        bind: String,
        options: LighthouseOptions,
        /// Threads serving requests (`--threads`, at least 1).
        threads: usize,
    },
    Help,
    Version,
}

/// Parses the arguments after the program name.
fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Command, String> {
    let mut bind = "[::]:29510".to_owned();
    let mut min_replicas = None;
    let mut join_timeout_ms = 60_000;
    let mut quorum_tick_ms = 100;
    let mut heartbeat_timeout_ms = 5_000;
    let mut threads = 1;

    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        if arg == "-h" || arg == "--help" {
            return Ok(Command::Help);
        }
        if arg == "-V" || arg == "--version" {
            return Ok(Command::Version);
        }
        let Some(flag) = arg.strip_prefix("--") else {
            return Err(format!("unexpected argument {arg:?}"));
        };
        let (name, inline_value) = match flag.split_once('=') {
            Some((name, value)) => (name, Some(value.to_owned())),
            None => (flag, None),
        };
        // torchft spells flags with underscores, Ferry with dashes.
        let name = name.replace('_', "-");
        let mut value = || {
            inline_value
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("--{name} needs a value"))
        };
        let number = |text: String| {
            text.parse::<u64>()
                .map_err(|_| format!("--{name}: {text:?} is not a non-negative integer"))
        };
        match name.as_str() {
            "bind" => bind = value()?,
            "min-replicas" => min_replicas = Some(number(value()?)?),
            "join-timeout-ms" => join_timeout_ms = number(value()?)?,
            "quorum-tick-ms" => quorum_tick_ms = number(value()?)?,
            "heartbeat-timeout-ms" => heartbeat_timeout_ms = number(value()?)?,
            "threads" => {
                threads = usize::try_from(number(value()?)?)
                    .ok()
                    .filter(|&n| n >= 1)
                    .ok_or("--threads must be at least 1")?;
            }
            _ => return Err(format!("unknown option {arg:?}")),
        }
    }

    let min_replicas = min_replicas.ok_or("--min-replicas is required")?;
    Ok(Command::Run {
        bind,
        options: LighthouseOptions::new(min_replicas)
            .with_join_timeout(Duration::from_millis(join_timeout_ms))
            .with_quorum_tick(Duration::from_millis(quorum_tick_ms))
            .with_heartbeat_timeout(Duration::from_millis(heartbeat_timeout_ms)),
        threads,
    })
}

fn main() -> ExitCode {
    let (bind, options, threads) = match parse_args(std::env::args().skip(1)) {
        Ok(Command::Run {
            bind,
            options,
            threads,
        }) => (bind, options, threads),
        Ok(Command::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Ok(Command::Version) => {
            println!("ferry-lighthouse {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("ferry-lighthouse: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };

    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();

    let mut builder = if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.worker_threads(threads);
        builder
    };
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("ferry-lighthouse: cannot start the tokio runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(&bind, options)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("{error}");
            eprintln!("ferry-lighthouse: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run(bind: &str, options: LighthouseOptions) -> Result<(), Box<dyn std::error::Error>> {
    let lighthouse = Lighthouse::bind(bind, options).await?;
    {
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "ferry-lighthouse listening on {}", lighthouse.url())?;
        stdout.flush()?;
    }
    stop_signal().await?;
    lighthouse.shutdown().await?;
    Ok(())
}

/// Resolves on SIGINT (Ctrl-C) or, on Unix, SIGTERM.
async fn stop_signal() -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut terminate = signal(SignalKind::terminate())?;
        tokio::select! {
            result = tokio::signal::ctrl_c() => result,
            _ = terminate.recv() => Ok(()),
        }
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Command, String> {
        parse_args(args.iter().map(|arg| (*arg).to_owned()))
    }

    fn run(bind: &str, options: LighthouseOptions) -> Result<Command, String> {
        Ok(Command::Run {
            bind: bind.to_owned(),
            options,
            threads: 1,
        })
    }

    #[test]
    fn ferry_spellings() {
        assert_eq!(
            parse(&[
                "--bind",
                "127.0.0.1:0",
                "--min-replicas",
                "3",
                "--join-timeout-ms=250",
                "--quorum-tick-ms",
                "7",
                "--heartbeat-timeout-ms",
                "900",
            ]),
            run(
                "127.0.0.1:0",
                LighthouseOptions::new(3)
                    .with_join_timeout(Duration::from_millis(250))
                    .with_quorum_tick(Duration::from_millis(7))
                    .with_heartbeat_timeout(Duration::from_millis(900)),
            )
        );
    }

    #[test]
    fn torchft_spellings() {
        assert_eq!(
            parse(&[
                "--min_replicas",
                "2",
                "--join_timeout_ms",
                "1000",
                "--quorum_tick_ms=50",
                "--heartbeat_timeout_ms",
                "2000",
                "--bind=[::]:29511",
            ]),
            run(
                "[::]:29511",
                LighthouseOptions::new(2)
                    .with_join_timeout(Duration::from_millis(1000))
                    .with_quorum_tick(Duration::from_millis(50))
                    .with_heartbeat_timeout(Duration::from_millis(2000)),
            )
        );
    }

    #[test]
    fn threads() {
        assert_eq!(
            parse(&["--min-replicas", "1", "--threads=4"]),
            Ok(Command::Run {
                bind: "[::]:29510".to_owned(),
                options: LighthouseOptions::new(1),
                threads: 4,
            })
        );
    }

    #[test]
    fn torchft_defaults() {
        assert_eq!(
            parse(&["--min_replicas", "1"]),
            run("[::]:29510", LighthouseOptions::new(1))
        );
    }

    #[test]
    fn errors() {
        assert!(parse(&[])
            .unwrap_err()
            .contains("--min-replicas is required"));
        assert!(parse(&["--min-replicas"])
            .unwrap_err()
            .contains("needs a value"));
        assert!(parse(&["--min-replicas", "two"])
            .unwrap_err()
            .contains("not a non-negative integer"));
        assert!(parse(&["--min-replicas", "1", "--frobnicate", "3"])
            .unwrap_err()
            .contains("unknown option"));
        assert!(parse(&["min_replicas", "1"])
            .unwrap_err()
            .contains("unexpected argument"));
        assert!(parse(&["--min-replicas", "1", "--threads", "0"])
            .unwrap_err()
            .contains("--threads must be at least 1"));
        assert_eq!(parse(&["--min-replicas", "1", "--help"]), Ok(Command::Help));
        assert_eq!(parse(&["-V"]), Ok(Command::Version));
    }
}
