//! Launching a group of local worker processes, like `torchrun` on one host.
//!
//! A program calls [`local`] at the top of `main`. Started by hand, it
//! becomes the launcher: it picks a free port, starts `world_size` copies
//! of itself with `MASTER_ADDR`, `MASTER_PORT`, `RANK` and `WORLD_SIZE` set,
//! waits for all of them and reports any that failed. Started by the
//! launcher, it returns the process's rank and the program goes on as that
//! worker.

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

/// Becomes a worker (when `RANK` is set) or launches `world_size` workers
/// of the current executable with the same arguments and waits for them.
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
    let mut children: Vec<(u32, Child)> = Vec::new();
    for rank in 0..world_size {
        let child = Command::new(&exe)
            .args(&args)
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
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
