//! What torchrun (TorchElastic) tells its workers about the run:
//! `TORCHELASTIC_RUN_ID`, `TORCHELASTIC_RESTART_COUNT`,
//! `TORCHELASTIC_MAX_RESTARTS` and `TORCHELASTIC_USE_AGENT_STORE`.

use crate::RpcError;

/// A worker's run under torchrun, from the variables torchrun's agent
/// sets ([`from_vars`](Self::from_vars)).
///
/// With it, the agent rendezvous in the key namespace
/// [`namespace`](Self::namespace) (`torchelastic/{run id}/restart/{restart
/// count}`), so that the workers of a restarted attempt form a fresh group
/// and never read the keys an earlier attempt left in the store; and when
/// [`use_agent_store`](Self::use_agent_store) is set, it joins through the
/// c10d store torchrun's agent hosts at `MASTER_ADDR:MASTER_PORT` (a
/// [`C10dStore`](crate::store::C10dStore)) instead of hosting one on rank 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TorchElastic {
    /// `TORCHELASTIC_RUN_ID`: the job's run id (torchrun's `--rdzv-id`).
    pub run_id: String,
    /// `TORCHELASTIC_RESTART_COUNT`: how many times this node's agent has
    /// restarted the worker group after a failure.
    pub restart_count: u32,
    /// `TORCHELASTIC_MAX_RESTARTS`, if set.
    pub max_restarts: Option<u32>,
    /// `TORCHELASTIC_USE_AGENT_STORE` is `True`: the agent of node rank 0
    /// hosts the store at `MASTER_ADDR:MASTER_PORT`.
    pub use_agent_store: bool,
}

impl TorchElastic {
    /// Reads torchrun's variables through `lookup`: `None` without
    /// `TORCHELASTIC_RUN_ID` (not started by torchrun). With it,
    /// `TORCHELASTIC_RESTART_COUNT` must be set too; a value that is not a
    /// number, or a `TORCHELASTIC_USE_AGENT_STORE` other than `True` or
    /// `False`, is an error naming the variable.
    ///
    /// ```
    /// use ferry_rpc::TorchElastic;
    ///
    /// let env = |k: &str| match k {
    ///     "TORCHELASTIC_RUN_ID" => Some("job7".to_string()),
    ///     "TORCHELASTIC_RESTART_COUNT" => Some("1".to_string()),
    ///     "TORCHELASTIC_USE_AGENT_STORE" => Some("True".to_string()),
    ///     _ => None,
    /// };
    /// let te = TorchElastic::from_vars(env)?.expect("started by torchrun");
    /// assert!(te.use_agent_store);
    /// assert_eq!(te.namespace(), "torchelastic/job7/restart/1");
    /// # Ok::<(), ferry_rpc::RpcError>(())
    /// ```
    pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, RpcError> {
        let Some(run_id) = lookup("TORCHELASTIC_RUN_ID") else {
            return Ok(None);
        };
        if run_id.is_empty() {
            return Err(RpcError::Config("TORCHELASTIC_RUN_ID is empty".into()));
        }
        let num = |k: &str| -> Result<Option<u32>, RpcError> {
            lookup(k)
                .map(|v| {
                    v.trim()
                        .parse()
                        .map_err(|_| RpcError::Config(format!("{k} is not a number: {v:?}")))
                })
                .transpose()
        };
        let restart_count = num("TORCHELASTIC_RESTART_COUNT")?.ok_or_else(|| {
            RpcError::Config(
                "TORCHELASTIC_RUN_ID is set but TORCHELASTIC_RESTART_COUNT is not".into(),
            )
        })?;
        let max_restarts = num("TORCHELASTIC_MAX_RESTARTS")?;
        let use_agent_store = match lookup("TORCHELASTIC_USE_AGENT_STORE").as_deref() {
            None | Some("False") => false,
            Some("True") => true,
            Some(other) => {
                return Err(RpcError::Config(format!(
                    "TORCHELASTIC_USE_AGENT_STORE is {other:?} (True or False expected)"
                )))
            }
        };
        Ok(Some(TorchElastic {
            run_id,
            restart_count,
            max_restarts,
            use_agent_store,
        }))
    }

    /// The store namespace of this attempt's group:
    /// `torchelastic/{run_id}/restart/{restart_count}`.
    pub fn namespace(&self) -> String {
        format!(
            "torchelastic/{}/restart/{}",
            self.run_id, self.restart_count
        )
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn read(vars: &[(&str, &str)]) -> Result<Option<TorchElastic>, RpcError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        TorchElastic::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn absent_without_a_run_id() {
        assert_eq!(read(&[("TORCHELASTIC_RESTART_COUNT", "0")]).unwrap(), None);
    }

    #[test]
    fn reads_what_torchrun_sets() {
        let te = read(&[
            ("TORCHELASTIC_RUN_ID", "r"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
            ("TORCHELASTIC_MAX_RESTARTS", "3"),
            ("TORCHELASTIC_USE_AGENT_STORE", "False"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            te,
            TorchElastic {
                run_id: "r".into(),
                restart_count: 2,
                max_restarts: Some(3),
                use_agent_store: false
            }
        );
        assert_eq!(te.namespace(), "torchelastic/r/restart/2");
    }

    #[test]
    fn bad_values_name_the_variable() {
        let run = ("TORCHELASTIC_RUN_ID", "r");
        for (vars, text) in [
            (
                vec![run],
                "TORCHELASTIC_RUN_ID is set but TORCHELASTIC_RESTART_COUNT is not",
            ),
            (
                vec![run, ("TORCHELASTIC_RESTART_COUNT", "x")],
                "TORCHELASTIC_RESTART_COUNT is not a number: \"x\"",
            ),
            (
                vec![
                    run,
                    ("TORCHELASTIC_RESTART_COUNT", "0"),
                    ("TORCHELASTIC_USE_AGENT_STORE", "yes"),
                ],
                "TORCHELASTIC_USE_AGENT_STORE is \"yes\" (True or False expected)",
            ),
            (
                vec![("TORCHELASTIC_RUN_ID", "")],
                "TORCHELASTIC_RUN_ID is empty",
            ),
        ] {
            let e = read(&vars).unwrap_err();
            assert!(e.to_string().contains(text), "{e} lacks {text}");
        }
    }
}
