//! The lighthouse programs the bench starts, each its own process.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::bench::process::log_tail;
use crate::bench::results::release_binary;
use crate::setup::venv_python;
use crate::steps::root;

/// The options both lighthouse programs run with in the bench (after
/// `--bind 127.0.0.1:0`): those `lighthouse_bench.py --spawn-torchft` would
/// give torchft's in-process `LighthouseServer`.
const LIGHTHOUSE_OPTIONS: &[&str] = &[
    "--min_replicas",
    "1",
    "--join_timeout_ms",
    "50",
    "--quorum_tick_ms",
    "10",
    "--heartbeat_timeout_ms",
    "60000",
];

/// Bound on a lighthouse program telling the address it listens on
/// (`torchft_lighthouse` imports torch first: about a second).
const LIGHTHOUSE_START_TIMEOUT: Duration = Duration::from_secs(30);

/// A lighthouse program the bench starts: Ferry's or torchft's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LighthouseProgram {
    /// `ferry-lighthouse`, the release build.
    Ferry,
    /// `torchft_lighthouse`, the program torchft installs in the `.venv`
    /// (torchft's Rust lighthouse behind a Python entry point).
    Torchft,
}

impl LighthouseProgram {
    pub(crate) fn name(self) -> &'static str {
        match self {
            LighthouseProgram::Ferry => "ferry-lighthouse",
            LighthouseProgram::Torchft => "torchft_lighthouse",
        }
    }

    pub(crate) fn binary(self) -> PathBuf {
        match self {
            LighthouseProgram::Ferry => release_binary("ferry-lighthouse"),
            LighthouseProgram::Torchft => venv_python().with_file_name("torchft_lighthouse"),
        }
    }

    /// The arguments it runs with: [`LIGHTHOUSE_BIND`], then
    /// [`LIGHTHOUSE_OPTIONS`] (torchft's spellings, which both accept).
    pub(crate) fn args() -> Vec<&'static str> {
        [&["--bind", LIGHTHOUSE_BIND][..], LIGHTHOUSE_OPTIONS].concat()
    }

    /// How the result files name the server.
    pub(crate) fn command_line(self) -> String {
        format!("{} {}", self.name(), Self::args().join(" "))
    }

    /// The URL to reach it at, from one line of its output, if that line
    /// tells where it listens: `ferry-lighthouse` prints
    /// `ferry-lighthouse listening on http://ADDR` as its first line of
    /// stdout; `torchft_lighthouse` logs `... Lighthouse listening on:
    /// http://HOSTNAME:PORT` to stderr, with the machine's host name in
    /// place of the address it bound, so the URL is 127.0.0.1 and that port.
    pub(crate) fn parse_address(self, line: &str) -> Option<String> {
        match self {
            LighthouseProgram::Ferry => {
                let url = line.trim().strip_prefix("ferry-lighthouse listening on ")?;
                (url.starts_with("http://") && url.len() > "http://".len()).then(|| url.to_string())
            }
            LighthouseProgram::Torchft => {
                let (_, url) = line.split_once("Lighthouse listening on: ")?;
                let (_, port) = url.trim().strip_prefix("http://")?.rsplit_once(':')?;
                let port: u16 = port.parse().ok()?;
                (port != 0).then(|| format!("http://127.0.0.1:{port}"))
            }
        }
    }
}

/// Where both lighthouse programs listen in the bench (a free port).
const LIGHTHOUSE_BIND: &str = "127.0.0.1:0";

/// A running lighthouse program on 127.0.0.1 (port 0), its stderr (its
/// log) going to a file, killed when dropped.
pub(crate) struct LighthouseProcess {
    program: LighthouseProgram,
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub(crate) url: String,
}

impl LighthouseProcess {
    /// Starts `program` with [`LighthouseProgram::args`], its output (both
    /// streams) going to `log` (relative to the repository root), and waits
    /// for the address it tells: on stdout for `ferry-lighthouse`, in its
    /// log on stderr for `torchft_lighthouse`.
    pub(crate) fn start(program: LighthouseProgram, log: &Path) -> Result<Self> {
        let name = program.name();
        let binary = program.binary();
        let log_file = std::fs::File::create(root().join(log))
            .with_context(|| format!("creating {}", log.display()))?;
        let args = LighthouseProgram::args();
        let mut c = Command::new(&binary);
        c.current_dir(root())
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        eprintln!(
            "    $ {} {}  (log: {})",
            binary.display(),
            args.join(" "),
            log.display()
        );
        let mut child = c
            .spawn()
            .with_context(|| format!("could not start {}", binary.display()))?;
        // One thread per stream copies its lines to the log and sends the
        // address once a complete line tells it. When both streams end (the
        // program exited) the channel disconnects.
        let (tx, rx) = mpsc::channel();
        let streams: [Box<dyn Read + Send>; 2] = [
            Box::new(
                child
                    .stdout
                    .take()
                    .with_context(|| format!("{name}'s stdout"))?,
            ),
            Box::new(
                child
                    .stderr
                    .take()
                    .with_context(|| format!("{name}'s stderr"))?,
            ),
        ];
        for stream in streams {
            let tx = tx.clone();
            let mut log_file = log_file.try_clone().context("the lighthouse log")?;
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    let _ = writeln!(log_file, "{line}");
                    if let Some(url) = program.parse_address(&line) {
                        let _ = tx.send(url);
                    }
                }
            });
        }
        drop(tx);
        let url = match rx.recv_timeout(LIGHTHOUSE_START_TIMEOUT) {
            Ok(url) => url,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "{name} told no address within {LIGHTHOUSE_START_TIMEOUT:?} (log: {}){}",
                    log.display(),
                    log_tail(log)
                )
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = child.wait().context("waiting for the lighthouse")?;
                bail!(
                    "{name} exited before listening ({status}; log: {}){}",
                    log.display(),
                    log_tail(log)
                )
            }
        };
        eprintln!("    {name} listening on {url}");
        Ok(LighthouseProcess {
            program,
            child,
            url,
        })
    }

    /// Kills it, saying so if it had already exited (it should run until killed).
    pub(crate) fn stop(mut self) -> Result<()> {
        let name = self.program.name();
        if let Ok(Some(status)) = self.child.try_wait() {
            bail!("{name} exited during the bench ({status})");
        }
        self.child
            .kill()
            .with_context(|| format!("killing {name}"))
            .and_then(|()| {
                self.child
                    .wait()
                    .with_context(|| format!("waiting for {name}"))
            })?;
        Ok(())
    }
}

impl Drop for LighthouseProcess {
    fn drop(&mut self) {
        // Already reaped after `stop`: then both calls fail harmlessly.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
