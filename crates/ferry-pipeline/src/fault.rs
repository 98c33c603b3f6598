//! What can go wrong in one action of a step, before it is named for the
//! driver, and the guard that turns a panic in a call into the user's code
//! or into libtorch into such a failure.

use std::time::Duration;

/// What went wrong in an action.
pub(crate) enum Fault {
    /// The action failed: its stage's forward, the loss or a backward
    /// returned an error or panicked, or a value was malformed.
    Failed(String),
    /// The step was aborted from elsewhere, with the reason.
    Aborted(String),
    /// A value the action needs did not arrive within the time limit.
    Missing {
        /// The stage that did not deliver it.
        from: usize,
        /// An activation (`true`) or a gradient.
        forward: bool,
        /// The microbatch.
        microbatch: usize,
        /// The limit.
        limit: Duration,
    },
}

impl From<String> for Fault {
    fn from(message: String) -> Self {
        Fault::Failed(message)
    }
}

impl From<&str> for Fault {
    fn from(message: &str) -> Self {
        Fault::Failed(message.to_owned())
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Failed(message) => f.write_str(message),
            Fault::Aborted(reason) => write!(f, "aborted: {reason}"),
            Fault::Missing {
                from,
                forward,
                microbatch,
                limit,
            } => write!(
                f,
                "no {} for microbatch {microbatch} arrived from stage {from} within {limit:?}",
                if *forward { "activation" } else { "gradient" }
            ),
        }
    }
}

/// Runs `body`, a call into the user's code (a stage's forward, the loss)
/// or into libtorch (a backward), turning a panic into the action's
/// failure: `"{what} panicked: {message}"`. The worker stays usable: its
/// state for the step is dropped when the step ends, whatever happened.
pub(crate) fn guarded<T>(what: &str, body: impl FnOnce() -> Result<T, Fault>) -> Result<T, Fault> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_owned());
        Err(Fault::Failed(format!("{what} panicked: {message}")))
    })
}
