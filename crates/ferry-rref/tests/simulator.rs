//! A deterministic, seeded simulator for the RRef reference-counting
//! protocol: several `RRefProtocol` workers under an adversarial network
//! (reordering, duplicated, dropped and retransmitted control messages,
//! remote calls that time out, user messages whose receiver refuses them
//! before decoding the RRef inside), checking after every step that no owner is
//! deleted while anything can still reach it, that nothing is deleted
//! twice, and, once every handle is dropped and the network drained, that
//! every table is empty and every value was deleted exactly once.
//!
//! `FERRY_SIM_SCHEDULES=n` sets how many schedules run (10,000 by default);
//! `FERRY_SIM_SEED=s` runs only schedule `s` and prints its trace (run with
//! `--nocapture`).
#![allow(clippy::unwrap_used)]

mod sim;

use std::time::Instant;

use sim::random::run_seed;
use sim::world::Stats;

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
    )
}

/// Runs one schedule; on a violation, runs it again with tracing and panics
/// with the seed and the full trace.
fn check_seed(seed: u64) -> Stats {
    let (result, _) = run_seed(seed, false);
    match result {
        Ok(stats) => stats,
        Err(first) => {
            let (again, trace) = run_seed(seed, true);
            panic!(
                "RRef simulator: schedule {seed} violated an invariant: {first}\n\
                 (traced re-run: {again:?})\n\
                 reproduce with: FERRY_SIM_SEED={seed} cargo test -p ferry-rref --test simulator -- --nocapture\n\
                 trace:\n{trace}"
            );
        }
    }
}

#[test]
fn random_schedules_keep_rref_invariants() {
    let started = Instant::now();
    let mut total = Stats::default();
    if let Some(seed) = env_u64("FERRY_SIM_SEED") {
        let (result, trace) = run_seed(seed, true);
        println!("{trace}");
        total.add(&check_seed(seed));
        println!("schedule {seed}: {result:?}");
    } else {
        let schedules = env_u64("FERRY_SIM_SCHEDULES").unwrap_or(10_000);
        for seed in 0..schedules {
            total.add(&check_seed(seed));
        }
        if schedules >= 1_000 {
            // The schedules must reach the interesting corners, or passing
            // says little.
            assert!(
                total.duplicates_seen > 0,
                "no duplicate was delivered: {total:?}"
            );
            assert!(total.lost > 0 && total.retransmits > 0, "{total:?}");
            assert!(total.replays > 0, "{total:?}");
            assert!(total.timeouts > 0 && total.forks_refused > 0, "{total:?}");
            assert!(total.late_returns_applied > 0, "{total:?}");
            assert!(total.late_returns_discarded > 0, "{total:?}");
            assert!(total.early_deletes > 0, "no early delete: {total:?}");
            assert!(total.before_creation > 0, "{total:?}");
            assert!(total.self_forks > 0, "{total:?}");
            assert!(
                total.refused > 0 && total.refused_owner_forks > 0,
                "no refused user message: {total:?}"
            );
        }
    }
    println!("{total:#?}\nin {:?}", started.elapsed());
}
