//! The `cma` channel: the receiver pulls a tensor's bytes straight from the
//! sender's memory into the destination it allocated, with one
//! `process_vm_readv` (cross-memory attach). One copy, no staging.
//!
//! Viability is checked the way TensorPipe checks it:
//! - the syscall works in this process (a seccomp filter may forbid it: a
//!   read of our own memory is tried);
//! - the kernel's Yama policy allows it: with `ptrace_scope` 0 (or no Yama)
//!   the classic same-user rule applies; with 1 only an ancestor may read a
//!   process, so two sibling workers can use `cma` only if each declares
//!   that any process may read it (`PR_SET_PTRACER_ANY`), which this build
//!   does only when `FERRY_CMA_PTRACER_ANY=1` asks for it (see below); with
//!   2 it needs `CAP_SYS_PTRACE`; with 3 it is never allowed;
//! - the two processes share a boot id, PID namespace, user namespace and
//!   user and group ids: all of these go into the channel's domain
//!   descriptor, so selection only picks `cma` between processes that have
//!   them in common (and the kernel then lets them read each other).
//!
//! When any check fails the channel is simply not offered, and selection
//! falls back to the next channel.
//!
//! # Whom a receiver reads
//!
//! Only the process the kernel names at the other end of the connection:
//! `cma` is selected only with the `shm` transport, and the pid comes from
//! `SO_PEERCRED` on the Unix socket the rings were passed over, never from
//! the peer's handshake (see `connection`). A peer can make the receiver
//! read only its own memory.
//!
//! # The ptrace opt-in (`FERRY_CMA_PTRACER_ANY`)
//!
//! Under Yama `ptrace_scope` 1 (the default of several distributions),
//! `PR_SET_PTRACER_ANY` switches Yama's protection off for this process:
//! every process of the same user may then attach to it (`ptrace`, a
//! debugger) and read or write its memory, not only the Ferry peers. It is
//! the price of `cma` between sibling workers on such a host, and it is off
//! by default: without it `cma` is not offered there and tensors take the
//! `shm` channel (one more copy). Where Yama is absent or at 0 (as on the
//! machines Ferry is tested on) the opt-in is not needed and not used.
//!
//! On the wire a `cma` tensor is a record (address, token) in the frame; the
//! sender keeps the tensor alive under its token until the receiver's
//! release names it.

use std::io;

/// Why `cma` cannot be used in this process, or its domain descriptor.
pub(crate) fn descriptor() -> Result<String, String> {
    probe_syscall()?;
    check_ptrace_policy()?;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map_err(|e| format!("cannot read the boot id: {e}"))?;
    let ns = |kind: &str| {
        std::fs::read_link(format!("/proc/self/ns/{kind}"))
            .map(|p| p.to_string_lossy().into_owned())
            .map_err(|e| format!("cannot read the {kind} namespace: {e}"))
    };
    Ok(format!(
        "{}/{}/{}/uid={}/gid={}",
        boot.trim(),
        ns("pid")?,
        ns("user")?,
        rustix::process::geteuid().as_raw(),
        rustix::process::getegid().as_raw(),
    ))
}

/// Tries `process_vm_readv` on this process's own memory.
fn probe_syscall() -> Result<(), String> {
    let source = [0x5au8; 16];
    let mut dest = [0u8; 16];
    let pid = std::process::id() as i32;
    read(pid, source.as_ptr() as u64, &mut dest)
        .map_err(|e| format!("process_vm_readv is not permitted here: {e}"))?;
    if dest != source {
        return Err("process_vm_readv returned wrong bytes".into());
    }
    Ok(())
}

fn check_ptrace_policy() -> Result<(), String> {
    let scope = match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
        Ok(s) => s.trim().parse::<u32>().unwrap_or(0),
        Err(_) => return Ok(()), // no Yama: classic ptrace permissions apply
    };
    match scope {
        0 => Ok(()),
        1 if ptracer_any_opted_in() => rustix::process::set_ptracer(rustix::process::PTracer::Any)
            .map_err(|e| format!("Yama ptrace_scope is 1 and PR_SET_PTRACER failed: {e}")),
        1 => Err(
            "Yama ptrace_scope is 1: sibling processes cannot read each other unless \
                  FERRY_CMA_PTRACER_ANY=1 lets any process of this user trace this one"
                .into(),
        ),
        2 if has_cap_sys_ptrace() => Ok(()),
        2 => Err("Yama ptrace_scope is 2 and this process lacks CAP_SYS_PTRACE".into()),
        n => Err(format!(
            "Yama ptrace_scope is {n}: no process may read another"
        )),
    }
}

/// Whether `FERRY_CMA_PTRACER_ANY=1` accepts the ptrace trade-off.
fn ptracer_any_opted_in() -> bool {
    std::env::var("FERRY_CMA_PTRACER_ANY").is_ok_and(|v| v.trim() == "1")
}

fn has_cap_sys_ptrace() -> bool {
    const CAP_SYS_PTRACE: u32 = 19;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << CAP_SYS_PTRACE) != 0)
}

/// Copies `dest.len()` bytes at `remote_addr` in process `pid` into `dest`.
pub(crate) fn read(pid: i32, remote_addr: u64, dest: &mut [u8]) -> io::Result<()> {
    let mut done = 0usize;
    while done < dest.len() {
        let local = libc::iovec {
            iov_base: dest[done..].as_mut_ptr().cast(),
            iov_len: dest.len() - done,
        };
        let remote = libc::iovec {
            iov_base: (remote_addr as usize + done) as *mut libc::c_void,
            iov_len: dest.len() - done,
        };
        // SAFETY: `local` points into `dest`, which we borrow mutably for the
        // call; the kernel validates the remote range against the other
        // process's mappings (EFAULT when it is not mapped there).
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "process_vm_readv made no progress",
            ));
        }
        done += n as usize;
    }
    Ok(())
}

/// Whether a failed [`read`] failed because the peer's process is gone
/// (`ESRCH`: it died after sending the record): the connection lost,
/// as a closed socket would be, rather than the channel failing.
pub(crate) fn peer_gone(error: &io::Error) -> bool {
    error.raw_os_error() == Some(libc::ESRCH)
}

/// Copies a large tensor with `threads` threads in parallel, each pulling one
/// contiguous part.
pub(crate) fn read_parallel(
    pid: i32,
    remote_addr: u64,
    dest: &mut [u8],
    threads: usize,
) -> io::Result<()> {
    if threads <= 1 || dest.len() < PARALLEL_MIN {
        return read(pid, remote_addr, dest);
    }
    let part = dest.len().div_ceil(threads).div_ceil(4096) * 4096;
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        let mut chunks = dest.chunks_mut(part).enumerate();
        let first = chunks.next();
        for (i, chunk) in chunks {
            let addr = remote_addr + (i * part) as u64;
            handles.push(scope.spawn(move || read(pid, addr, chunk)));
        }
        let mut result = match first {
            Some((_, chunk)) => read(pid, remote_addr, chunk),
            None => Ok(()),
        };
        for h in handles {
            let r = h
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("a cma copy thread panicked")));
            if result.is_ok() {
                result = r;
            }
        }
        result
    })
}

/// Tensors at least this large are copied by several threads.
pub(crate) const PARALLEL_MIN: usize = 8 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_process_that_is_gone_is_told_apart() {
        // No process has pid i32::MAX (above pid_max): ESRCH, as for a
        // peer that died after sending its record.
        let mut dest = [0u8; 8];
        let error = read(i32::MAX, 0x1000, &mut dest).unwrap_err();
        assert!(peer_gone(&error), "{error}");
        assert!(!peer_gone(&io::Error::from_raw_os_error(libc::EFAULT)));
    }

    #[test]
    fn this_process_reads_itself_and_names_its_domain() {
        let d = descriptor().expect("cma is viable on the build machine");
        assert!(d.contains("pid:[") && d.contains("user:["), "{d}");
        let src: Vec<u8> = (0..(9 << 20)).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        read_parallel(std::process::id() as i32, src.as_ptr() as u64, &mut dst, 3).expect("read");
        assert!(dst == src);
    }

    #[test]
    fn a_bad_address_is_an_error() {
        let mut dst = [0u8; 8];
        let err = read(std::process::id() as i32, 8, &mut dst).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EFAULT));
    }
}
