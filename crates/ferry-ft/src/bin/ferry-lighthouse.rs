//! `ferry-lighthouse`: Ferry's lighthouse as a program, a drop-in for
//! torchft's `torchft_lighthouse`.
//!
//! ```text
//! ferry-lighthouse --min-replicas 2 [--bind [::]:29510] [--join-timeout-ms 60000]
//!                  [--quorum-tick-ms 100] [--heartbeat-timeout-ms 5000]
//!                  [--threads 1] [--tls-cert CERT.pem --tls-key KEY.pem]
//!                  [--allow 10.0.0.0/8,127.0.0.1]
//!                  [--manager-tls-ca CA.pem [--manager-tls-domain NAME]]
//!                  [--allowed-host NAME[:PORT]]...
//! ```
//!
//! `--tls-cert`/`--tls-key` serve over TLS (clients connect with
//! `https://` and must trust the certificate's CA); `--allow` closes
//! connections from clients outside the listed networks unread, with a
//! warning naming them (see `ferry_ft::access`). `--manager-tls-ca` is the
//! CA the dashboard's `Kill` trusts to reach managers serving over TLS
//! (`--manager-tls-domain`: the name their certificates carry, when not
//! their address's host). The dashboard answers only requests whose `Host`
//! is an IP address, `localhost` or the machine's host name, against DNS
//! rebinding; `--allowed-host` (repeatable) adds a name browsers use to
//! reach it (`NAME` on any port, `NAME:PORT` on that one).
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
//! more worker threads add cross-thread wake-ups without adding capacity
//! (`cargo xtask bench --only lighthouse` measures the heartbeats handled).
//! `--threads N` (N > 1) runs a multi-threaded runtime with N workers
//! instead.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use ferry_ft::access::{Access, AccessError, AllowList, ClientTls, TlsIdentity};
use ferry_ft::lighthouse::{Lighthouse, LighthouseOptions};
use tracing_subscriber::EnvFilter;

/// Ferry's lighthouse: forms quorums of replica groups
/// (torchft.LighthouseService) and serves a status dashboard on the same
/// port.
#[derive(Debug, Parser)]
#[command(
    name = "ferry-lighthouse",
    version,
    after_help = "torchft's spellings (--min_replicas, --join_timeout_ms, --quorum_tick_ms, \
                  --heartbeat_timeout_ms) are accepted too. Logs go to stderr (RUST_LOG, \
                  default info)."
)]
struct Args {
    /// Address to bind the server to.
    #[arg(long, value_name = "ADDR", default_value = "[::]:29510")]
    bind: String,
    /// Minimum number of replicas to consider a quorum.
    #[arg(long, value_name = "N", alias = "min_replicas")]
    min_replicas: u64,
    /// How long to wait for heartbeating stragglers to join before issuing
    /// quorum, in milliseconds.
    #[arg(
        long,
        value_name = "MS",
        alias = "join_timeout_ms",
        default_value_t = 60_000
    )]
    join_timeout_ms: u64,
    /// How frequently to check for quorum when waiting for stragglers, in
    /// milliseconds.
    #[arg(
        long,
        value_name = "MS",
        alias = "quorum_tick_ms",
        default_value_t = 100
    )]
    quorum_tick_ms: u64,
    /// How long to wait for a heartbeat before considering a replica dead, in
    /// milliseconds.
    #[arg(
        long,
        value_name = "MS",
        alias = "heartbeat_timeout_ms",
        default_value_t = 5_000
    )]
    heartbeat_timeout_ms: u64,
    /// Threads serving requests: 1 serves everything on one thread, N > 1
    /// uses N worker threads.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    threads: u64,
    /// Serve over TLS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// Accept clients only from these networks (comma-separated
    /// ADDRESS/PREFIX; default: every client).
    #[arg(long, value_name = "NETWORKS")]
    allow: Option<AllowList>,
    /// Reach managers serving over TLS (the dashboard's Kill) trusting this
    /// CA certificate (PEM).
    #[arg(long, value_name = "PEM")]
    manager_tls_ca: Option<std::path::PathBuf>,
    /// The name the managers' certificates carry (default: the host of
    /// their address); needs --manager-tls-ca.
    #[arg(long, value_name = "NAME", requires = "manager_tls_ca")]
    manager_tls_domain: Option<String>,
    /// Another host name the dashboard answers to (besides IP addresses,
    /// localhost and this machine's name): NAME for any port, NAME:PORT
    /// for one. Repeatable.
    #[arg(long = "allowed-host", value_name = "NAME[:PORT]")]
    allowed_hosts: Vec<String>,
}

impl Args {
    /// The lighthouse's options these arguments ask for.
    fn options(&self) -> Result<LighthouseOptions, AccessError> {
        let mut access = Access::default().with_allow(self.allow.clone().unwrap_or_default());
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            access = access.with_tls(TlsIdentity::from_files(cert, key)?);
        }
        let mut options = LighthouseOptions::new(self.min_replicas)
            .with_join_timeout(Duration::from_millis(self.join_timeout_ms))
            .with_quorum_tick(Duration::from_millis(self.quorum_tick_ms))
            .with_heartbeat_timeout(Duration::from_millis(self.heartbeat_timeout_ms))
            .with_access(access);
        for name in &self.allowed_hosts {
            options = options.with_allowed_host(name.clone());
        }
        if let Some(ca) = &self.manager_tls_ca {
            let mut tls = ClientTls::from_file(ca)?;
            if let Some(domain) = &self.manager_tls_domain {
                tls = tls.with_domain(domain.clone());
            }
            options = options.with_manager_tls(tls);
        }
        Ok(options)
    }
}

fn main() -> ExitCode {
    // Help, version and bad arguments exit here (usage errors with code 2).
    let args = Args::parse();
    let options = match args.options() {
        Ok(options) => options,
        Err(error) => {
            eprintln!("ferry-lighthouse: {error}");
            return ExitCode::from(2);
        }
    };
    let threads = usize::try_from(args.threads).unwrap_or(usize::MAX);
    let bind = args.bind;

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
    use clap::error::ErrorKind;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("ferry-lighthouse").chain(args.iter().copied()))
    }

    fn parsed(args: &[&str]) -> (String, LighthouseOptions, u64) {
        let args = parse(args).expect("valid arguments");
        (
            args.bind.clone(),
            args.options().expect("valid access options"),
            args.threads,
        )
    }

    #[test]
    fn tls_and_allow_list_flags() {
        // A self-signed certificate made here (the flags only read files).
        let dir = tempfile::tempdir().unwrap();
        let made = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        let write = |name: &str, pem: String| {
            let path = dir.path().join(name);
            std::fs::write(&path, pem).unwrap();
            path.display().to_string()
        };
        let cert = write("server.pem", made.cert.pem());
        let key = write("server.key", made.signing_key.serialize_pem());
        let (_, options, _) = parsed(&[
            "--min-replicas",
            "1",
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--allow",
            "10.0.0.0/8,127.0.0.1",
        ]);
        assert!(options.access.tls.is_some());
        assert!(options.access.allow.allows("127.0.0.1".parse().unwrap()));
        assert!(!options.access.allow.allows("192.168.1.1".parse().unwrap()));
        // A certificate without its key, or a bad network, is a usage error.
        assert!(parse(&["--min-replicas", "1", "--tls-cert", &cert]).is_err());
        assert!(parse(&["--min-replicas", "1", "--allow", "10.0.0.0/40"]).is_err());
        let missing = parse(&[
            "--min-replicas",
            "1",
            "--tls-cert",
            "/nonexistent.pem",
            "--tls-key",
            &key,
        ])
        .unwrap();
        assert!(missing.options().is_err());
        // The CA the dashboard's Kill trusts to reach TLS managers.
        let (_, options, _) = parsed(&[
            "--min-replicas",
            "1",
            "--manager-tls-ca",
            &cert,
            "--manager-tls-domain",
            "replica-a.internal",
        ]);
        let tls = options.manager_tls.unwrap();
        assert_eq!(tls.domain.as_deref(), Some("replica-a.internal"));
        assert!(parse(&["--min-replicas", "1", "--manager-tls-domain", "x"]).is_err());
    }

    #[test]
    fn allowed_hosts_repeat() {
        let (_, options, _) = parsed(&[
            "--min-replicas",
            "1",
            "--allowed-host",
            "lighthouse.internal",
            "--allowed-host=proxy.example:8080",
        ]);
        assert_eq!(
            options.allowed_hosts,
            ["lighthouse.internal", "proxy.example:8080"]
        );
        let (_, options, _) = parsed(&["--min-replicas", "1"]);
        assert!(options.allowed_hosts.is_empty());
    }

    #[test]
    fn the_command_is_well_formed() {
        Args::command().debug_assert();
    }

    #[test]
    fn ferry_spellings() {
        assert_eq!(
            parsed(&[
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
            (
                "127.0.0.1:0".to_owned(),
                LighthouseOptions::new(3)
                    .with_join_timeout(Duration::from_millis(250))
                    .with_quorum_tick(Duration::from_millis(7))
                    .with_heartbeat_timeout(Duration::from_millis(900)),
                1
            )
        );
    }

    #[test]
    fn torchft_spellings() {
        assert_eq!(
            parsed(&[
                "--min_replicas",
                "2",
                "--join_timeout_ms",
                "1000",
                "--quorum_tick_ms=50",
                "--heartbeat_timeout_ms",
                "2000",
                "--bind=[::]:29511",
            ]),
            (
                "[::]:29511".to_owned(),
                LighthouseOptions::new(2)
                    .with_join_timeout(Duration::from_millis(1000))
                    .with_quorum_tick(Duration::from_millis(50))
                    .with_heartbeat_timeout(Duration::from_millis(2000)),
                1
            )
        );
    }

    #[test]
    fn threads() {
        assert_eq!(
            parsed(&["--min-replicas", "1", "--threads=4"]),
            ("[::]:29510".to_owned(), LighthouseOptions::new(1), 4)
        );
    }

    #[test]
    fn torchft_defaults() {
        assert_eq!(
            parsed(&["--min_replicas", "1"]),
            ("[::]:29510".to_owned(), LighthouseOptions::new(1), 1)
        );
    }

    #[test]
    fn errors_name_the_argument() {
        let kind = |args: &[&str]| parse(args).unwrap_err().kind();
        let text = |args: &[&str]| parse(args).unwrap_err().to_string();
        assert_eq!(kind(&[]), ErrorKind::MissingRequiredArgument);
        assert!(text(&[]).contains("--min-replicas"));
        assert!(text(&["--min-replicas"]).contains("--min-replicas"));
        assert!(text(&["--min-replicas", "two"]).contains("'two'"));
        assert_eq!(
            kind(&["--min-replicas", "1", "--frobnicate", "3"]),
            ErrorKind::UnknownArgument
        );
        assert!(text(&["min_replicas", "1"]).contains("min_replicas"));
        assert!(text(&["--min-replicas", "1", "--threads", "0"]).contains("--threads"));
        assert_eq!(
            kind(&["--min-replicas", "1", "--help"]),
            ErrorKind::DisplayHelp
        );
        assert_eq!(kind(&["-V"]), ErrorKind::DisplayVersion);
    }
}
