//! The Baby process group (`ferry_ft::baby`) across processes: each rank
//! is a process of its own (ferry-testkit), each with its Baby group's
//! child, the ranks meeting through a store rank 0 hosts.
//!
//! - Two and three replica groups allreduce through Baby groups, with
//!   results bit-identical to the in-process `ProcessGroup`'s (and to the
//!   rank-order reduction).
//! - Faults, each ending with the next quorum's allreduce succeeding: the
//!   child SIGKILLed mid-allreduce; the child SIGSTOPped past the timeout;
//!   a peer replica group's child killed; the parent SIGKILLed (its child
//!   exits by itself); a quorum change while an allreduce is in flight.
//! - After each, no child is left: none in this process's table (running
//!   or zombie), and none of the children it ever had still exists
//!   anywhere (no orphan).
//!
//! Nothing sleeps to wait for state: ranks order themselves through store
//! keys, and process exits are awaited through pidfds. Timeouts are short
//! so hangs are detected quickly; no assertion is about time.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::time::Duration;

use ferry_ft::baby::{BabyError, BabyOptions, BabyProcessGroup, ChildProgram, FailureKind};
use ferry_ft::collective::{
    reduce_in_rank_order, segment, ProcessGroup, ProcessGroupOptions, ReduceOp,
};
use ferry_store::{Store, StoreError, TcpStore, TcpStoreServer};
use ferry_testkit::{world, world_ok};
use rustix::process::{Pid, Signal};

/// Bound on any single wait.
const T: Duration = Duration::from_secs(30);
/// The collective's timeout in the fault tests (short: a hang is noticed
/// fast).
const SHORT: Duration = Duration::from_secs(2);

fn master() -> SocketAddr {
    format!("127.0.0.1:{}", std::env::var("MASTER_PORT").unwrap())
        .parse()
        .unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .try_init();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn name(rank: u32) -> String {
    format!("replica_{rank}")
}

fn members(world: u32) -> Vec<String> {
    (0..world).map(name).collect()
}

fn options(rank: u32, timeout: Duration) -> BabyOptions {
    BabyOptions::new(name(rank))
        .with_timeout(timeout)
        .with_connect_timeout(Duration::from_secs(5))
        .with_watchdog_margin(Duration::from_millis(500))
        .with_child(ChildProgram::Program(
            env!("CARGO_BIN_EXE_ferry-ft-baby").into(),
        ))
}

/// The store every rank meets at (rank 0 hosts it), and its address as a
/// quorum names it.
struct Meeting {
    _server: Option<TcpStoreServer>,
    store: TcpStore,
    address: String,
}

impl Meeting {
    async fn join(rank: u32) -> Self {
        let server = if rank == 0 {
            Some(TcpStoreServer::bind(master()).await.unwrap())
        } else {
            None
        };
        let store = TcpStore::connect(master(), T).await.unwrap();
        Self {
            _server: server,
            store,
            address: master().to_string(),
        }
    }

    async fn signal(&self, key: &str, value: impl Into<Vec<u8>>) {
        self.store.set(key, value.into()).await.unwrap();
    }

    async fn wait(&self, key: &str) -> Vec<u8> {
        self.store.wait(&[key.to_owned()], T).await.unwrap();
        self.store.get(key).await.unwrap()
    }

    /// Every rank of `world` reaches `name`. Rank 0 hosts the store: it
    /// returns only once every rank is past its wait (a wait still in
    /// flight when the store closes would fail with `Closed`); the others'
    /// last word may find the store closed, which is then no failure.
    async fn barrier(&self, name: &str, rank: u32, world: u32) {
        self.signal(&format!("barrier/{name}/{rank}"), "1").await;
        let keys: Vec<String> = (0..world).map(|r| format!("barrier/{name}/{r}")).collect();
        self.store.wait(&keys, T).await.unwrap();
        let past = |r: u32| format!("barrier/{name}/past/{r}");
        if rank == 0 {
            let keys: Vec<String> = (1..world).map(past).collect();
            self.store.wait(&keys, T).await.unwrap();
        } else {
            match self.store.set(&past(rank), b"1".to_vec()).await {
                Ok(()) | Err(StoreError::Closed) => {}
                Err(e) => panic!("barrier {name}: {e}"),
            }
        }
    }
}

/// Values of very different magnitudes, so summation order shows in the
/// bits.
fn values(seed: u64, len: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mantissa = (x % 2000) as f32 / 1000.0 - 1.0;
            let scale = [1e-3f32, 1.0, 1e4, 1e8][(x >> 20) as usize % 4];
            mantissa * scale
        })
        .collect()
}

/// The rank-order reduction every member must end with.
fn expected(inputs: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
    let len = inputs[0].len();
    let mut out = vec![0.0; len];
    for k in 0..inputs.len() {
        let range = segment(len, inputs.len(), k);
        let parts: Vec<&[f32]> = inputs.iter().map(|v| &v[range.clone()]).collect();
        reduce_in_rank_order(&parts, op, &mut out[range]);
    }
    out
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

// ------------------------------------------------------------------------
// The process table.

/// `(pid, ppid, state, start time)` of a process, from `/proc/<pid>/stat`.
fn stat(pid: u32) -> Option<(u32, u32, char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold anything.
    let (_, rest) = text.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?.chars().next()?;
    let ppid = fields.get(1)?.parse().ok()?;
    let start = fields.get(19)?.parse().ok()?;
    Some((pid, ppid, state, start))
}

/// This process's children: running, stopped or zombie.
fn children() -> Vec<(u32, char)> {
    let me = std::process::id();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(stat)
        .filter(|&(_, ppid, _, _)| ppid == me)
        .map(|(pid, _, state, _)| (pid, state))
        .collect()
}

/// Every child a Baby group had, to check none outlives the test.
#[derive(Default)]
struct Children(BTreeSet<(u32, u64)>);

impl Children {
    fn note(&mut self, pg: &BabyProcessGroup) {
        if let Some(pid) = pg.child_pid() {
            if let Some((_, _, _, start)) = stat(pid) {
                self.0.insert((pid, start));
            }
        }
    }

    /// No child left in this process's table (no zombie), and none of
    /// those noted still exists anywhere (no orphan).
    fn assert_all_gone(&self) {
        assert_eq!(children(), [], "children left in the process table");
        for &(pid, start) in &self.0 {
            let alive = stat(pid).filter(|&(_, _, _, s)| s == start);
            assert!(
                alive.is_none(),
                "Baby child {pid} outlived its group: {alive:?}"
            );
        }
        assert!(!self.0.is_empty(), "no Baby child was ever noted");
    }
}

fn signal(pid: u32, signal: Signal) {
    rustix::process::kill_process(Pid::from_raw(pid as i32).unwrap(), signal).unwrap();
}

/// A pidfd of `pid`, which becomes readable when it exits.
fn pidfd(pid: u32) -> OwnedFd {
    rustix::process::pidfd_open(
        Pid::from_raw(pid as i32).unwrap(),
        rustix::process::PidfdFlags::empty(),
    )
    .unwrap()
}

/// Waits (at most [`T`]) for the process behind `pidfd` to exit (a pidfd
/// turns readable then).
fn await_exit(pidfd: &OwnedFd) {
    let mut fds = [rustix::event::PollFd::new(
        pidfd,
        rustix::event::PollFlags::IN,
    )];
    let timeout = rustix::event::Timespec {
        tv_sec: T.as_secs() as i64,
        tv_nsec: 0,
    };
    let ready = rustix::event::poll(&mut fds, Some(&timeout)).unwrap();
    assert_eq!(ready, 1, "the process did not exit within {T:?}");
}

// ------------------------------------------------------------------------
// Bit-identical results.

/// Every rank allreduces the same inputs through a Baby group and an
/// in-process group (on separate quorum ids) and checks both against the
/// rank-order reduction, bit for bit.
fn bit_identical(rank: u32, world: u32) {
    runtime().block_on(async {
        let meeting = Meeting::join(rank).await;
        let ids = members(world);
        let mut baby = BabyProcessGroup::new(options(rank, T));
        let mut inproc = ProcessGroup::bind(
            "127.0.0.1:0",
            ProcessGroupOptions::new(name(rank)).with_timeout(T),
        )
        .await
        .unwrap();
        let mut seen = Children::default();
        baby.configure_with(&meeting.address, 1, &ids, rank.into())
            .await
            .unwrap();
        seen.note(&baby);
        inproc
            .configure_with(&meeting.address, 1001, &ids, rank.into())
            .await
            .unwrap();
        assert_eq!(baby.world_size(), Some(world.into()));
        assert_eq!(baby.rank(), Some(rank.into()));
        for (round, len) in [1001usize, 2, 0, 65_537].into_iter().enumerate() {
            for op in [ReduceOp::Mean, ReduceOp::Sum] {
                let inputs: Vec<Vec<f32>> = (0..world)
                    .map(|r| values(round as u64 * 10 + u64::from(r), len))
                    .collect();
                let want = bits(&expected(&inputs, op));
                let mut through_baby = inputs[rank as usize].clone();
                baby.allreduce(&mut through_baby, op).await.unwrap();
                let mut in_process = inputs[rank as usize].clone();
                inproc.allreduce(&mut in_process, op).await.unwrap();
                assert_eq!(bits(&through_baby), bits(&in_process), "len {len} {op:?}");
                assert_eq!(bits(&through_baby), want, "len {len} {op:?}");
                // The same through a shared buffer, without copies.
                let mut buffer = baby.buffer(len).unwrap();
                buffer.copy_from_slice(&inputs[rank as usize]);
                let buffer = baby.allreduce_buffer(buffer, op).await.unwrap();
                assert_eq!(bits(&buffer), want, "shared buffer, len {len} {op:?}");
            }
        }
        meeting.barrier("done", rank, world).await;
        baby.shutdown().await;
        seen.assert_all_gone();
        println!("BABY_OK={rank}");
    });
}

#[test]
fn two_replica_groups_allreduce_bit_identical_to_the_in_process_group() {
    let Some(outputs) = world_ok(
        "two_replica_groups_allreduce_bit_identical_to_the_in_process_group",
        2,
        |rank| bit_identical(rank, 2),
    ) else {
        return;
    };
    for (rank, output) in outputs.iter().enumerate() {
        assert_eq!(output.values("BABY_OK"), [rank.to_string()]);
    }
}

#[test]
fn three_replica_groups_allreduce_bit_identical_to_the_in_process_group() {
    let Some(outputs) = world_ok(
        "three_replica_groups_allreduce_bit_identical_to_the_in_process_group",
        3,
        |rank| bit_identical(rank, 3),
    ) else {
        return;
    };
    for (rank, output) in outputs.iter().enumerate() {
        assert_eq!(output.values("BABY_OK"), [rank.to_string()]);
    }
}

// ------------------------------------------------------------------------
// Faults.

/// After a fault in quorum 1: a broken group (`broken`) refuses the same
/// quorum, quorum 2 runs in a fresh child whose allreduce succeeds
/// bit-identically, and nothing is left once the group shuts down.
async fn recover(
    meeting: &Meeting,
    mut pg: BabyProcessGroup,
    mut seen: Children,
    rank: u32,
    world: u32,
    broken: bool,
) {
    let ids = members(world);
    if broken {
        assert!(
            pg.is_broken(),
            "rank {rank}: the failed group must be broken"
        );
        assert_eq!(pg.quorum_id(), Some(1));
        let again = pg
            .configure_with(&meeting.address, 1, &ids, rank.into())
            .await;
        assert!(
            matches!(again, Err(BabyError::Broken { quorum_id: 1, .. })),
            "rank {rank}: {again:?}"
        );
    }
    let before = pg.child_pid();
    let before_quorum = pg.quorum_id();
    pg.configure_with(&meeting.address, 2, &ids, rank.into())
        .await
        .unwrap();
    seen.note(&pg);
    if before_quorum != Some(2) {
        assert_ne!(pg.child_pid(), before, "quorum 2 runs in a fresh child");
    }
    let inputs: Vec<Vec<f32>> = (0..world)
        .map(|r| values(100 + u64::from(r), 4099))
        .collect();
    let mut data = inputs[rank as usize].clone();
    pg.allreduce_mean(&mut data).await.unwrap();
    assert_eq!(bits(&data), bits(&expected(&inputs, ReduceOp::Mean)));
    meeting.barrier("recovered", rank, world).await;
    pg.shutdown().await;
    seen.assert_all_gone();
    println!("RECOVERED={rank}");
}

fn assert_recovered(outputs: &[ferry_testkit::Output], ranks: &[usize]) {
    for &rank in ranks {
        assert_eq!(
            outputs[rank].values("RECOVERED"),
            [rank.to_string()],
            "rank {rank}: {}",
            outputs[rank].stderr
        );
    }
}

/// Configures quorum 1 on every rank of `world` with short timeouts.
async fn quorum_one(meeting: &Meeting, rank: u32, world: u32) -> (BabyProcessGroup, Children) {
    let mut pg = BabyProcessGroup::new(options(rank, SHORT));
    pg.configure_with(&meeting.address, 1, &members(world), rank.into())
        .await
        .unwrap();
    let mut seen = Children::default();
    seen.note(&pg);
    meeting.barrier("configured", rank, world).await;
    (pg, seen)
}

#[test]
fn a_child_killed_mid_allreduce_fails_the_step_and_the_next_quorum_succeeds() {
    let Some(outputs) = world_ok(
        "a_child_killed_mid_allreduce_fails_the_step_and_the_next_quorum_succeeds",
        2,
        |rank| {
            runtime().block_on(async {
                let meeting = Meeting::join(rank).await;
                let (pg, seen) = quorum_one(&meeting, rank, 2).await;
                let mut buffer = pg.buffer(1 << 16).unwrap();
                buffer.fill(1.0);
                if rank == 0 {
                    // Rank 1 holds back its allreduce until this child is
                    // dead: ours cannot have finished, it is in flight.
                    let work = pg.allreduce_buffer(buffer, ReduceOp::Sum);
                    let pid = pg.child_pid().unwrap();
                    signal(pid, Signal::KILL);
                    let failure = work.await.unwrap_err();
                    assert!(
                        matches!(&failure.error, BabyError::ChildDied { pid: p, during, .. }
                            if *p == pid && during == "allreduce"),
                        "{failure}"
                    );
                    assert!(failure.buffer.is_some(), "the buffer comes back");
                    meeting.signal("killed", "1").await;
                } else {
                    meeting.wait("killed").await;
                    let failure = pg
                        .allreduce_buffer(buffer, ReduceOp::Sum)
                        .await
                        .unwrap_err();
                    assert!(failure.error.is_child_failure(), "{failure}");
                }
                recover(&meeting, pg, seen, rank, 2, true).await;
            });
        },
    ) else {
        return;
    };
    assert_recovered(&outputs, &[0, 1]);
}

#[test]
fn a_child_stopped_past_the_timeout_is_killed_and_the_next_quorum_succeeds() {
    let Some(outputs) =
        world_ok(
            "a_child_stopped_past_the_timeout_is_killed_and_the_next_quorum_succeeds",
            2,
            |rank| {
                runtime().block_on(async {
                let meeting = Meeting::join(rank).await;
                let (pg, seen) = quorum_one(&meeting, rank, 2).await;
                let mut buffer = pg.buffer(1 << 16).unwrap();
                buffer.fill(1.0);
                if rank == 0 {
                    let pid = pg.child_pid().unwrap();
                    // A hang: the child stops answering anything.
                    signal(pid, Signal::STOP);
                    meeting.signal("stopped", "1").await;
                    let failure = pg.allreduce_buffer(buffer, ReduceOp::Sum).await.unwrap_err();
                    assert!(
                        matches!(&failure.error, BabyError::ChildHung { pid: p, .. } if *p == pid),
                        "{failure}"
                    );
                    assert!(failure.buffer.is_some(), "the buffer comes back");
                } else {
                    meeting.wait("stopped").await;
                    let failure = pg.allreduce_buffer(buffer, ReduceOp::Sum).await.unwrap_err();
                    // This child's own collective times out on the
                    // stopped peer (or loses it once it is killed).
                    assert!(
                        matches!(
                            &failure.error,
                            BabyError::ChildFailed {
                                kind: FailureKind::Timeout | FailureKind::PeerLost,
                                ..
                            }
                        ),
                        "{failure}"
                    );
                }
                recover(&meeting, pg, seen, rank, 2, true).await;
            });
            },
        )
    else {
        return;
    };
    assert_recovered(&outputs, &[0, 1]);
}

#[test]
fn a_peer_replica_groups_child_killed_fails_the_others_and_the_next_quorum_succeeds() {
    let Some(outputs) = world_ok(
        "a_peer_replica_groups_child_killed_fails_the_others_and_the_next_quorum_succeeds",
        3,
        |rank| {
            runtime().block_on(async {
                let meeting = Meeting::join(rank).await;
                let (pg, seen) = quorum_one(&meeting, rank, 3).await;
                let mut buffer = pg.buffer(1 << 16).unwrap();
                buffer.fill(1.0);
                if rank == 2 {
                    // Killed before it takes part: the others' allreduce
                    // cannot complete.
                    signal(pg.child_pid().unwrap(), Signal::KILL);
                    meeting.signal("killed", "1").await;
                    let failure = pg
                        .allreduce_buffer(buffer, ReduceOp::Sum)
                        .await
                        .unwrap_err();
                    // Depending on when its driver sees the death: the
                    // death itself, the group already broken, or the
                    // request abandoned because of it.
                    assert!(
                        matches!(
                            &failure.error,
                            BabyError::ChildDied { .. }
                                | BabyError::Broken { .. }
                                | BabyError::Aborted { .. }
                        ),
                        "{failure}"
                    );
                } else {
                    let work = pg.allreduce_buffer(buffer, ReduceOp::Sum);
                    meeting.wait("killed").await;
                    let failure = work.await.unwrap_err();
                    assert!(
                        matches!(&failure.error, BabyError::ChildFailed { .. }),
                        "{failure}"
                    );
                }
                recover(&meeting, pg, seen, rank, 3, true).await;
            });
        },
    ) else {
        return;
    };
    assert_recovered(&outputs, &[0, 1, 2]);
}

#[test]
fn a_quorum_change_during_an_allreduce_aborts_it_and_the_new_quorum_succeeds() {
    let Some(outputs) = world_ok(
        "a_quorum_change_during_an_allreduce_aborts_it_and_the_new_quorum_succeeds",
        2,
        |rank| {
            runtime().block_on(async {
                let meeting = Meeting::join(rank).await;
                let (mut pg, mut seen) = quorum_one(&meeting, rank, 2).await;
                if rank == 0 {
                    // Rank 1 never joins this allreduce: it stays in
                    // flight until the quorum changes under it.
                    let mut buffer = pg.buffer(1 << 16).unwrap();
                    buffer.fill(1.0);
                    let work = pg.allreduce_buffer(buffer, ReduceOp::Sum);
                    let old = pg.child_pid();
                    let ids = members(2);
                    let (failure, configured) = tokio::join!(
                        work,
                        pg.configure_with(&meeting.address, 2, &ids, 0)
                    );
                    configured.unwrap();
                    seen.note(&pg);
                    let failure = failure.unwrap_err();
                    assert!(
                        matches!(&failure.error, BabyError::Aborted { pid, .. } if Some(*pid) == old),
                        "{failure}"
                    );
                    assert!(failure.buffer.is_some(), "the buffer comes back");
                }
                recover(&meeting, pg, seen, rank, 2, false).await;
            });
        },
    ) else {
        return;
    };
    assert_recovered(&outputs, &[0, 1]);
}

#[test]
fn a_child_exits_by_itself_when_its_parent_is_sigkilled() {
    let Some(outputs) = world(
        "a_child_exits_by_itself_when_its_parent_is_sigkilled",
        2,
        |rank| {
            runtime().block_on(async {
                let meeting = Meeting::join(rank).await;
                let (pg, mut seen) = quorum_one(&meeting, rank, 2).await;
                if rank == 1 {
                    // The victim: publishes its pid and its child's, then
                    // waits to be killed.
                    let child = pg.child_pid().unwrap();
                    meeting
                        .signal("victim", format!("{} {child}", std::process::id()))
                        .await;
                    std::future::pending::<()>().await;
                }
                let victim = String::from_utf8(meeting.wait("victim").await).unwrap();
                let (parent, child) = victim.split_once(' ').unwrap();
                let (parent, child): (u32, u32) = (parent.parse().unwrap(), child.parse().unwrap());
                // Opened before the kill: it names that very process.
                let child_fd = pidfd(child);
                signal(parent, Signal::KILL);
                tokio::task::spawn_blocking(move || await_exit(&child_fd))
                    .await
                    .unwrap();
                println!("ORPHAN_EXITED={child}");
                // This replica group's allreduce in quorum 1 fails (its
                // peer is gone); the next quorum, of this group alone,
                // succeeds.
                let failure = pg
                    .allreduce_buffer(pg.buffer(4).unwrap(), ReduceOp::Sum)
                    .await;
                assert!(failure.is_err(), "a dead peer cannot allreduce");
                let mut pg = pg;
                pg.configure_with(&meeting.address, 2, &[name(0)], 0)
                    .await
                    .unwrap();
                seen.note(&pg);
                let mut data = vec![1.5f32; 10];
                pg.allreduce_mean(&mut data).await.unwrap();
                assert_eq!(data, vec![1.5f32; 10]);
                pg.shutdown().await;
                seen.assert_all_gone();
                println!("RECOVERED=0");
            });
        },
    ) else {
        return;
    };
    assert!(outputs[0].success, "rank 0: {}", outputs[0].stderr);
    assert_recovered(&outputs, &[0]);
    assert!(
        outputs[1].status.contains("SIGKILL") || outputs[1].status.contains("signal: 9"),
        "the victim was killed: {}",
        outputs[1].status
    );
}

#[tokio::test]
async fn a_child_program_that_cannot_start_is_a_typed_error_and_no_group() {
    let mut pg = BabyProcessGroup::new(
        BabyOptions::new("replica_0")
            .with_child(ChildProgram::Program("/nonexistent/ferry-ft-baby".into())),
    );
    let error = pg
        .configure_with("127.0.0.1:1", 1, &members(1), 0)
        .await
        .unwrap_err();
    assert!(
        matches!(&error, BabyError::Spawn { program, .. }
            if program.to_str() == Some("/nonexistent/ferry-ft-baby")),
        "{error}"
    );
    assert_eq!(pg.quorum_id(), None);
    assert_eq!(pg.child_pid(), None);
    let failure = pg
        .allreduce_buffer(pg.buffer(3).unwrap(), ReduceOp::Sum)
        .await
        .unwrap_err();
    assert_eq!(failure.error, BabyError::NotConfigured);
    assert_eq!(
        failure.buffer.map(|b| b.len()),
        Some(3),
        "the buffer comes back"
    );
}
