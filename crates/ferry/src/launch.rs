//! Launching a group of local worker processes, like `torchrun` on one host.
//!
//! A program calls [`local`] at the top of `main`. Started by hand, it
//! becomes the launcher: it picks a free port, starts `world_size` copies
//! of itself with `MASTER_ADDR`, `MASTER_PORT`, `RANK` and `WORLD_SIZE` set
//! (and torchrun's `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`),
//! waits for all of them and reports any that failed. Started by the
//! launcher, it returns the process's rank and the program goes on as that
//! worker.
//!
//! The workers share the host's cores, so the launcher also shortens how
//! long libtorch's OpenMP threads spin when idle ([`openmp_env`]), as
//! `torchrun` sets `OMP_NUM_THREADS` for the same reason.

use std::net::TcpListener;
use std::process::{Child, Command};

/// What [`local`] made of this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// This process is worker `rank` of `world_size`.
    Worker {
        /// This worker's rank.
        rank: u32,
        /// The group size.
        world_size: u32,
    },
    /// This process launched the workers and they have all exited successfully.
    Launcher,
}

/// Why launching failed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// A process could not be started.
    #[error("cannot start worker {rank}: {source}")]
    Spawn {
        /// The rank.
        rank: u32,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Workers exited with failure.
    #[error("workers {ranks:?} failed")]
    Failed {
        /// The ranks that failed.
        ranks: Vec<u32>,
    },
    /// The environment is inconsistent.
    #[error("{0}")]
    Env(String),
}

/// How many rounds an idle libgomp thread spins before it sleeps, in the
/// workers [`local`] starts: 2,000 rounds of `pause` (tens of
/// microseconds) instead of libgomp's 300,000 (milliseconds).
///
/// libtorch's intra-op parallelism is libgomp's OpenMP. After each parallel
/// region (a matrix product, say) the team's idle threads spin for the next
/// one. While one worker waits for another (an RPC, a backward pass that
/// moved on to the other worker, the other owner's optimizer step), its
/// spinning threads hold the cores that the other worker's computation
/// needs, which then runs at half speed on a machine with as many cores as
/// one worker's team. A spin of tens of microseconds still bridges the
/// gaps between the regions of one computation, and frees the cores soon
/// after it ends. `torchrun` instead sets `OMP_NUM_THREADS=1` when it
/// starts several processes, giving up intra-op parallelism.
pub const GOMP_SPINCOUNT: u32 = 2_000;

/// The OpenMP settings [`local`] gives its workers: `GOMP_SPINCOUNT` set
/// to [`GOMP_SPINCOUNT`], unless the launcher's own environment sets
/// `GOMP_SPINCOUNT` or `OMP_WAIT_POLICY` (then the workers inherit those).
pub fn openmp_env() -> Vec<(&'static str, String)> {
    openmp_env_given(|name| std::env::var_os(name).is_some())
}

fn openmp_env_given(is_set: impl Fn(&str) -> bool) -> Vec<(&'static str, String)> {
    if is_set("GOMP_SPINCOUNT") || is_set("OMP_WAIT_POLICY") {
        Vec::new()
    } else {
        vec![("GOMP_SPINCOUNT", GOMP_SPINCOUNT.to_string())]
    }
}

/// Becomes a worker (when `RANK` is set) or launches `world_size` workers
/// of the current executable with the same arguments and waits for them.
/// The workers get [`openmp_env`] on top of the launcher's environment.
pub fn local(world_size: u32) -> Result<Role, LaunchError> {
    if let Ok(rank) = std::env::var("RANK") {
        let rank = rank
            .parse()
            .map_err(|_| LaunchError::Env(format!("RANK={rank:?} is not a number")))?;
        let world_size = std::env::var("WORLD_SIZE")
            .ok()
            .and_then(|w| w.parse().ok())
            .unwrap_or(world_size);
        return Ok(Role::Worker { rank, world_size });
    }
    let port = free_port().map_err(|e| LaunchError::Env(format!("no free port: {e}")))?;
    let exe = std::env::current_exe()
        .map_err(|e| LaunchError::Env(format!("cannot find the current executable: {e}")))?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let openmp = openmp_env();
    let mut children: Vec<(u32, Child)> = Vec::new();
    for rank in 0..world_size {
        let child = Command::new(&exe)
            .args(&args)
            .envs(openmp.iter().map(|(name, value)| (*name, value.as_str())))
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            // torchrun's names, for code written against it: one host.
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", world_size.to_string())
            .env("GROUP_RANK", "0")
            .spawn();
        match child {
            Ok(c) => children.push((rank, c)),
            Err(source) => {
                for (_, mut c) in children {
                    let _ = c.kill();
                }
                return Err(LaunchError::Spawn { rank, source });
            }
        }
    }
    let mut failed = Vec::new();
    for (rank, mut c) in children {
        if !c.wait().map(|s| s.success()).unwrap_or(false) {
            failed.push(rank);
        }
    }
    if failed.is_empty() {
        Ok(Role::Launcher)
    } else {
        Err(LaunchError::Failed { ranks: failed })
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_get_a_short_openmp_spin_unless_the_user_chose_one() {
        assert_eq!(
            openmp_env_given(|_| false),
            vec![("GOMP_SPINCOUNT", "2000".to_string())]
        );
        assert!(openmp_env_given(|n| n == "GOMP_SPINCOUNT").is_empty());
        assert!(openmp_env_given(|n| n == "OMP_WAIT_POLICY").is_empty());
    }
}
