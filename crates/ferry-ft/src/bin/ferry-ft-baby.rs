//! `ferry-ft-baby`: the child process of `ferry_ft::baby::BabyProcessGroup`.
//!
//! Not meant to be run by hand: the group starts it with the command
//! socket's fd and its own pid in the environment, and it exits when the
//! group says so, closes the socket, or dies. Logs go to stderr, filtered
//! by `RUST_LOG` (default `warn`).

fn main() {
    #[cfg(feature = "cli")]
    {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "warn".into()),
            )
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .try_init();
    }
    std::process::exit(ferry_ft::baby::child_main());
}
