//! The end-to-end example (`examples/ft_train.rs`) as a test: a lighthouse
//! (min_replicas 2) in this process and three replica groups, each a
//! separate OS process with its own manager; one is SIGKILLed mid-training
//! and restarted; the others keep training; the newcomer heals from a live
//! peer and joins.
//!
//! The replica processes are this test binary re-executed in replica mode
//! (the example's code, included below as a module): a test cannot rely on
//! the example binary having been built. Every wait is on a line a replica
//! printed (no sleeps), the whole scenario is bounded by 60 s, and every
//! child is killed if anything fails.

#[path = "../examples/ft_train.rs"]
#[allow(dead_code)]
mod ft_train;

use std::process::Command;
use std::time::Duration;

/// Set in the children: the replica flags, separated by U+001F.
const CHILD_ENV: &str = "FERRY_FT_E2E_REPLICA";
/// The first test's name, for the children to run it again (in replica
/// mode).
const TEST_NAME: &str = "three_replica_groups_train_through_a_sigkill";

#[test]
fn three_replica_groups_train_through_a_sigkill() {
    scenario(TEST_NAME, false);
}

/// The same with every replica group's allreduce in a Baby process group
/// (the `ferry-ft-baby` program as its child, through FERRY_FT_BABY_BIN):
/// the SIGKILLed replica's child exits with it.
#[test]
fn three_replica_groups_train_through_a_sigkill_with_baby_groups() {
    scenario(
        "three_replica_groups_train_through_a_sigkill_with_baby_groups",
        true,
    );
}

fn scenario(test_name: &str, baby: bool) {
    if let Ok(flags) = std::env::var(CHILD_ENV) {
        let flags: Vec<String> = flags.split('\u{1f}').map(str::to_owned).collect();
        let code = match ft_train::replica_main(&flags) {
            Ok(()) => 0,
            Err(error) => {
                eprintln!("replica failed: {error:#}");
                1
            }
        };
        std::process::exit(code);
    }

    let exe = std::env::current_exe().expect("the test binary");
    let replica = |flags: &[String]| {
        let mut command = Command::new(&exe);
        command
            .args([test_name, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, flags.join("\u{1f}"))
            .env(
                ferry_ft::baby::CHILD_BIN_ENV,
                env!("CARGO_BIN_EXE_ferry-ft-baby"),
            );
        command
    };
    let options = ft_train::ScenarioOptions {
        deadline: Duration::from_secs(60),
        baby,
        ..ft_train::ScenarioOptions::default()
    };
    let report = ft_train::run_scenario(&options, &replica).unwrap_or_else(|e| panic!("{e:#}"));

    // No step was committed by fewer than min_replicas replica groups.
    assert!(!report.commits.is_empty());
    for commit in &report.commits {
        assert!(
            commit.participants >= options.min_replicas,
            "committed with too few replica groups: {commit:?}"
        );
    }
    // Replica group 2 trained, was killed, and the others went on alone.
    assert!(report.killed_after >= options.kill_after_step);
    assert!(
        report.commits_while_down >= 2,
        "the survivors did not train while replica group 2 was down: {report:?}"
    );
    // The step it died in (after its quorum, before its allreduce) was
    // committed by nobody in that quorum: the others' allreduce failed, so
    // they skipped it.
    let killed = report.killed_in;
    assert!(killed.step > options.kill_after_step);
    let same_step =
        |r: &&ft_train::Record| r.step == killed.step && r.quorum_id == killed.quorum_id;
    assert!(
        !report.commits.iter().any(|c| same_step(&c)),
        "the step replica group 2 died in was committed: {killed:?}"
    );
    let skipped: Vec<usize> = report
        .skips
        .iter()
        .filter(same_step)
        .map(|r| r.process)
        .collect();
    let started: Vec<usize> = report
        .steps
        .iter()
        .filter(same_step)
        .map(|r| r.process)
        .filter(|&p| p != 2)
        .collect();
    assert!(
        !started.is_empty(),
        "nobody else was in the step: {killed:?}"
    );
    for process in started {
        assert!(
            skipped.contains(&process),
            "process {process} did not skip {killed:?}"
        );
    }
    // The restarted group (process 3) healed from a live peer past the
    // step it was killed at, then committed with all three.
    let healed: Vec<i64> = report
        .heals
        .iter()
        .filter(|(process, _)| *process == 3)
        .map(|(_, step)| *step)
        .collect();
    assert!(
        healed.iter().any(|&step| step > report.killed_after),
        "the newcomer did not heal past step {}: {healed:?}",
        report.killed_after
    );
    assert!(report
        .commits
        .iter()
        .any(|c| c.process == 3 && c.participants == 3));
    // Everyone ends at the same step (the first at or after `steps` that
    // all three groups committed) with bit-identical parameters.
    let finals: Vec<_> = [0, 1, 3].iter().map(|p| &report.finals[p]).collect();
    for (step, params) in &finals {
        assert!(*step >= options.steps, "ended early: {finals:?}");
        assert_eq!(*step, finals[0].0, "steps differ: {finals:?}");
        assert_eq!(params, &finals[0].1, "parameters differ: {finals:?}");
    }
    assert!(report.elapsed < options.deadline);
    println!(
        "scenario done in {:.1} s, {} commits, skipped (process, step): {:?}",
        report.elapsed.as_secs_f64(),
        report.commits.len(),
        report
            .skips
            .iter()
            .map(|r| (r.process, r.step))
            .collect::<Vec<_>>()
    );
}
