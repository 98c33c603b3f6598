//! Finding the child program and starting it: from one long-lived
//! launcher thread, with the parent-death signal armed between fork and
//! exec, and the command socket passed down as an inherited fd.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock, PoisonError};

use rustix::io::FdFlags;
use rustix::process::Signal;
use tokio::net::UnixStream;

use super::{BabyError, CHILD_BIN_ENV, CHILD_BIN_NAME, CHILD_FD_ENV, PARENT_PID_ENV};

/// Which program runs the child.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ChildProgram {
    /// The `ferry-ft-baby` program: the path in `FERRY_FT_BABY_BIN` if
    /// set, else `ferry-ft-baby` next to the current executable or in its
    /// parent directory (where cargo puts it for tests and examples), else
    /// on `PATH`.
    #[default]
    Auto,
    /// This program (any binary built on `ferry-ft`, e.g. a training
    /// program started by torchrun).
    Program(PathBuf),
    /// The current executable, re-executed; its `main` must call
    /// [`run_child_if_requested`](super::run_child_if_requested) first.
    CurrentExe,
}

/// The program `program` names: an existing file, or why none was found.
pub(crate) fn resolve(program: &ChildProgram) -> Result<PathBuf, BabyError> {
    let exe = std::env::current_exe().ok();
    match program {
        ChildProgram::Program(path) => Ok(path.clone()),
        ChildProgram::CurrentExe => exe.ok_or_else(|| BabyError::ChildNotFound {
            searched: vec![PathBuf::from("/proc/self/exe")],
        }),
        ChildProgram::Auto => {
            let from_env = std::env::var_os(CHILD_BIN_ENV).map(PathBuf::from);
            let path_dirs: Vec<PathBuf> = std::env::var_os("PATH")
                .map(|p| std::env::split_paths(&p).collect())
                .unwrap_or_default();
            let candidates = candidates(from_env, exe.as_deref(), &path_dirs);
            candidates
                .iter()
                .find(|path| path.is_file())
                .cloned()
                .ok_or(BabyError::ChildNotFound {
                    searched: candidates,
                })
        }
    }
}

/// Where [`ChildProgram::Auto`] looks, in order: the environment's path
/// alone if given; else next to the executable, its parent directory, and
/// `PATH`.
fn candidates(from_env: Option<PathBuf>, exe: Option<&Path>, path: &[PathBuf]) -> Vec<PathBuf> {
    if let Some(path) = from_env {
        return vec![path];
    }
    let mut out = Vec::new();
    if let Some(dir) = exe.and_then(Path::parent) {
        out.push(dir.join(CHILD_BIN_NAME));
        if let Some(up) = dir.parent() {
            out.push(up.join(CHILD_BIN_NAME));
        }
    }
    out.extend(path.iter().map(|dir| dir.join(CHILD_BIN_NAME)));
    out
}

type Job = Box<dyn FnOnce() + Send>;

/// The launcher thread's queue. Children are forked from this one thread,
/// which lives as long as the process: the parent-death signal fires when
/// the *thread* that forked a child exits, so forking from a runtime's
/// worker (which may exit while the process goes on) would kill children
/// that should live.
fn launcher() -> &'static Mutex<mpsc::Sender<Job>> {
    static LAUNCHER: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();
    LAUNCHER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        // If the thread cannot be made, `rx` is dropped and every launch
        // fails with a clear error below.
        let _ = std::thread::Builder::new()
            .name("ferry-ft-baby-launcher".into())
            .spawn(move || {
                for job in rx {
                    job();
                }
            });
        Mutex::new(tx)
    })
}

/// A started child: the process and the parent's end of its socket.
pub(crate) struct Launched {
    pub(crate) child: tokio::process::Child,
    pub(crate) stream: UnixStream,
    pub(crate) pid: u32,
    pub(crate) program: PathBuf,
}

/// Starts `program` as a Baby child of replica group `replica_id`. Must be
/// called within a tokio runtime with I/O and signals enabled.
pub(crate) async fn launch(
    program: &ChildProgram,
    replica_id: &str,
) -> Result<Launched, BabyError> {
    let path = resolve(program)?;
    let spawn_error = |reason: String| BabyError::Spawn {
        replica_id: replica_id.to_owned(),
        program: path.clone(),
        reason,
    };
    let (parent_end, child_end) = std::os::unix::net::UnixStream::pair()
        .map_err(|e| spawn_error(format!("socketpair: {e}")))?;
    let child_fd = child_end.as_raw_fd();
    let parent_pid = std::process::id();
    let mut command = std::process::Command::new(&path);
    command
        .env(CHILD_FD_ENV, child_fd.to_string())
        .env(PARENT_PID_ENV, parent_pid.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    // SAFETY: the closure runs in the forked child before exec and makes
    // only raw system calls (prctl, getppid, fcntl), which are
    // async-signal-safe; it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(Signal::KILL))?;
            // The parent may have died before the signal was armed.
            let ppid = rustix::process::getppid().map(|pid| pid.as_raw_nonzero().get());
            if ppid != Some(parent_pid as i32) {
                return Err(std::io::Error::other("the parent exited during the launch"));
            }
            // SAFETY: `child_fd` is open in this forked copy of the fd
            // table (the socketpair outlives the spawn in the parent).
            let fd = BorrowedFd::borrow_raw(child_fd);
            rustix::io::fcntl_setfd(fd, FdFlags::empty())?;
            Ok(())
        });
    }
    let mut command = tokio::process::Command::from(command);
    command.kill_on_drop(true);
    let handle = tokio::runtime::Handle::current();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job: Job = Box::new(move || {
        let _runtime = handle.enter();
        let _ = tx.send(command.spawn());
    });
    launcher()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .send(job)
        .map_err(|_| spawn_error("the launcher thread could not be started".to_owned()))?;
    let child = rx
        .await
        .map_err(|_| spawn_error("the launcher thread is gone".to_owned()))?
        .map_err(|e| spawn_error(e.to_string()))?;
    drop(child_end);
    let pid = child
        .id()
        .ok_or_else(|| spawn_error("the child exited at once".to_owned()))?;
    parent_end
        .set_nonblocking(true)
        .map_err(|e| spawn_error(format!("command socket: {e}")))?;
    let stream = UnixStream::from_std(parent_end)
        .map_err(|e| spawn_error(format!("command socket: {e}")))?;
    Ok(Launched {
        child,
        stream,
        pid,
        program: path,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_variable_alone_decides_when_set() {
        let got = candidates(
            Some(PathBuf::from("/opt/baby")),
            Some(Path::new("/x/y/app")),
            &[PathBuf::from("/bin")],
        );
        assert_eq!(got, [PathBuf::from("/opt/baby")]);
    }

    #[test]
    fn next_to_the_executable_then_its_parent_then_path() {
        let got = candidates(
            None,
            Some(Path::new("/t/debug/deps/test-123")),
            &[PathBuf::from("/usr/bin")],
        );
        assert_eq!(
            got,
            [
                PathBuf::from("/t/debug/deps/ferry-ft-baby"),
                PathBuf::from("/t/debug/ferry-ft-baby"),
                PathBuf::from("/usr/bin/ferry-ft-baby"),
            ]
        );
    }

    #[test]
    fn a_missing_program_names_where_it_looked() {
        let error = resolve(&ChildProgram::Program(PathBuf::from("/nonexistent/baby")));
        // An explicit program is taken as given; spawning it reports.
        assert_eq!(error, Ok(PathBuf::from("/nonexistent/baby")));
    }
}
