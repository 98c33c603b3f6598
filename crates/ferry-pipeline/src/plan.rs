//! From the driver's declaration (stage workers, a schedule, microbatches)
//! to one checked action list per rank. Pure: nothing runs until every
//! check here passed.

use std::collections::HashSet;

use ferry_schedule::placement::stage_to_rank_of;
use ferry_schedule::{
    add_send_recv, check_deadlock, check_sends, validate, Action, DeadlockError, LowerError,
    PlacementError, Schedule, ScheduleKind,
};

use crate::error::PipelineError;

/// Which schedule a pipeline runs.
#[derive(Clone, Debug, PartialEq)]
pub enum ScheduleSpec {
    /// One of the schedules `ferry-schedule` generates, for the pipeline's
    /// ranks, stages per rank and microbatches. The stages must sit where
    /// the kind's [`Placement`](ferry_schedule::Placement) puts them.
    Kind(ScheduleKind),
    /// A schedule written by hand or loaded from PyTorch's CSV, one action
    /// list per rank. A stage runs on the rank whose list holds its actions
    /// (any map: stages 0 and 1 on rank 0 and 2 and 3 on rank 1 is as good
    /// as a loop), and a rank runs on the worker its stages are declared on.
    /// A compute-only schedule is lowered here (sends and receives added as
    /// PyTorch's `_add_send_recv` does); one with sends and receives runs as
    /// written.
    Custom(Schedule),
}

impl From<ScheduleKind> for ScheduleSpec {
    fn from(kind: ScheduleKind) -> Self {
        ScheduleSpec::Kind(kind)
    }
}

impl From<Schedule> for ScheduleSpec {
    fn from(schedule: Schedule) -> Self {
        ScheduleSpec::Custom(schedule)
    }
}

/// A pipeline laid out on its ranks.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    /// The worker of every rank.
    pub ranks: Vec<String>,
    /// The rank of every stage.
    pub stage_to_rank: Vec<usize>,
    /// The lowered schedule (every slot an action).
    pub lowered: Schedule,
}

impl Plan {
    /// The actions of `rank`, in order.
    pub(crate) fn program(&self, rank: usize) -> Vec<Action> {
        self.lowered.ranks[rank].iter().flatten().cloned().collect()
    }

    /// The stages of `rank`.
    pub(crate) fn stages_of(&self, rank: usize) -> Vec<usize> {
        (0..self.stage_to_rank.len())
            .filter(|&s| self.stage_to_rank[s] == rank)
            .collect()
    }
}

/// Lays `stage_workers` (the worker of every stage, in stage order) out as
/// `spec` asks for `microbatches`, and checks it: placement, validity,
/// lowering and deadlock freedom.
pub(crate) fn plan(
    stage_workers: &[String],
    spec: &ScheduleSpec,
    microbatches: usize,
) -> Result<Plan, PipelineError> {
    let stages = stage_workers.len();
    if stages == 0 {
        return Err(PipelineError::Config(
            "a pipeline needs at least one stage".into(),
        ));
    }
    if microbatches == 0 {
        return Err(PipelineError::Config(
            "a pipeline needs at least one microbatch".into(),
        ));
    }
    let (stage_to_rank, ranks, by) = match spec {
        ScheduleSpec::Kind(kind) => {
            let mut seen = HashSet::new();
            let ranks = stage_workers.iter().filter(|w| seen.insert(*w)).count();
            if stages % ranks != 0 {
                return Err(PlacementError::Uneven { stages, ranks }.into());
            }
            let placement = kind.placement();
            let by = format!("the {placement:?} placement of {stages} stages on {ranks} ranks");
            (placement.stage_to_rank(stages, ranks)?, ranks, by)
        }
        ScheduleSpec::Custom(schedule) => {
            check_stages(schedule, stages)?;
            let map = stage_to_rank_of(schedule, stages)?;
            (map, schedule.ranks.len(), "the schedule".to_owned())
        }
    };
    let ranks = rank_workers(stage_workers, &stage_to_rank, ranks, &by)?;
    let schedule = match spec {
        ScheduleSpec::Kind(kind) => {
            kind.generate(ranks.len(), stages / ranks.len(), microbatches)?
        }
        ScheduleSpec::Custom(schedule) => schedule.clone(),
    };
    check_stages(&schedule, stages)?;
    validate(&schedule, microbatches)?;
    let lowered = if schedule.has_comms() {
        // Every value that crosses ranks is sent (the runtime delivers on
        // SEND_F/SEND_B): ferry-schedule's check, naming rank, step and action.
        check_sends(&schedule, &stage_to_rank)?;
        schedule
    } else {
        add_send_recv(&schedule, &stage_to_rank).map_err(|e| match e {
            // A compute-only schedule whose ranks all wait: a deadlock,
            // reported as the lowered schedule's would be.
            LowerError::Stuck { waiting } => DeadlockError::Stuck { waiting }.into(),
            other => PipelineError::Lower(other),
        })?
    };
    check_deadlock(&lowered, &stage_to_rank)?;
    Ok(Plan {
        ranks,
        stage_to_rank,
        lowered,
    })
}

/// Refuses actions naming a stage the pipeline does not have.
fn check_stages(schedule: &Schedule, stages: usize) -> Result<(), PipelineError> {
    for action in schedule.ranks.iter().flatten().flatten() {
        let mut actions = vec![action];
        actions.extend(action.sub_actions());
        for a in actions {
            if !a.is_compound() && a.stage() >= stages {
                return Err(PipelineError::Config(format!(
                    "action {a} names stage {}, but the pipeline has {stages} stages",
                    a.stage()
                )));
            }
        }
    }
    Ok(())
}

/// The worker of every rank: the one its stages are declared on. Refuses a
/// stage declared elsewhere than its rank's other stages, and two ranks on
/// one worker. `by` says what placed the stages, for the errors.
fn rank_workers(
    stage_workers: &[String],
    stage_to_rank: &[usize],
    ranks: usize,
    by: &str,
) -> Result<Vec<String>, PlacementError> {
    let mut first_stage: Vec<Option<usize>> = vec![None; ranks];
    for (stage, &rank) in stage_to_rank.iter().enumerate() {
        let worker = &stage_workers[stage];
        let Some(slot) = first_stage.get_mut(rank) else {
            return Err(PlacementError::EmptyRank { rank });
        };
        match *slot {
            None => *slot = Some(stage),
            Some(first) if stage_workers[first] != *worker => {
                return Err(PlacementError::Misplaced {
                    stage,
                    worker: worker.clone(),
                    by: by.to_owned(),
                    rank,
                    with_stage: first,
                    expected: stage_workers[first].clone(),
                });
            }
            Some(_) => {}
        }
    }
    let mut workers: Vec<String> = Vec::with_capacity(ranks);
    for (rank, first) in first_stage.into_iter().enumerate() {
        let worker = &stage_workers[first.ok_or(PlacementError::EmptyRank { rank })?];
        if let Some(other) = workers.iter().position(|w| w == worker) {
            return Err(PlacementError::SharedWorker {
                worker: worker.clone(),
                first: other,
                second: rank,
            });
        }
        workers.push(worker.clone());
    }
    Ok(workers)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use ferry_schedule::ActionKind;

    fn workers(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn interleaved_stages_alternate_between_two_workers() {
        let plan = plan(
            &workers(&["a", "b", "a", "b"]),
            &ScheduleKind::Interleaved1F1B.into(),
            4,
        )
        .unwrap();
        assert_eq!(plan.ranks, ["a", "b"]);
        assert_eq!(plan.stage_to_rank, [0, 1, 0, 1]);
        assert_eq!(plan.stages_of(1), [1, 3]);
        assert!(plan
            .program(0)
            .iter()
            .any(|a| a.kind() == ActionKind::SendF));
    }

    #[test]
    fn the_v_placement_keeps_the_middle_stages_together_and_sends_nothing_between_them() {
        let plan = plan(
            &workers(&["a", "b", "b", "a"]),
            &ScheduleKind::ZbvZeroBubble.into(),
            4,
        )
        .unwrap();
        assert_eq!(plan.stage_to_rank, [0, 1, 1, 0]);
        // Stages 1 and 2 share rank 1: no send between them.
        assert!(!plan
            .program(1)
            .iter()
            .any(|a| a.kind() == ActionKind::SendF && a.stage() == 1));
    }

    #[test]
    fn stages_on_workers_the_placement_contradicts_are_refused() {
        let err = plan(
            &workers(&["a", "a", "b", "b"]),
            &ScheduleKind::Interleaved1F1B.into(),
            4,
        )
        .unwrap_err();
        assert!(matches!(err, PipelineError::Placement(_)), "{err}");
        assert_eq!(
            err.to_string(),
            "cannot place the stages: stage 2 is on worker b, but the Loop placement of 4 stages \
             on 2 ranks puts it on rank 0 with stage 0 (worker a)"
        );
    }

    #[test]
    fn shapes_the_schedule_refuses_are_refused_before_anything_runs() {
        let err = plan(&workers(&["a", "b"]), &ScheduleKind::OneFOneB.into(), 1).unwrap_err();
        assert!(matches!(err, PipelineError::Generate(_)), "{err}");
        let err = plan(
            &workers(&["a", "b", "c"]),
            &ScheduleKind::ZbvZeroBubble.into(),
            4,
        )
        .unwrap_err();
        assert!(matches!(err, PipelineError::Generate(_)), "{err}");
        let err = plan(&workers(&[]), &ScheduleKind::GPipe.into(), 4).unwrap_err();
        assert!(err.to_string().contains("at least one stage"), "{err}");
    }

    #[test]
    fn a_custom_schedule_that_deadlocks_is_refused() {
        // Rank 1 runs microbatch 1 first; rank 0 makes it only after
        // microbatch 0's backward, which waits for rank 1.
        let text = "0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n";
        let schedule = Schedule::from_csv(text).unwrap();
        let spec = ScheduleSpec::Custom(schedule);
        let err = plan(&workers(&["a", "b"]), &spec, 2).unwrap_err();
        assert!(matches!(err, PipelineError::Deadlock(_)), "{err}");
        assert!(err.to_string().contains("rank 1 at 1F1"), "{err}");
        // A backward before its forward is invalid, not a deadlock.
        let text = "0F0,0F1,0B0,0B1\n1F0,1B0,1B1,1F1\n";
        let spec = ScheduleSpec::Custom(Schedule::from_csv(text).unwrap());
        let err = plan(&workers(&["a", "b"]), &spec, 2).unwrap_err();
        assert!(matches!(err, PipelineError::Invalid(_)), "{err}");
    }

    #[test]
    fn a_custom_schedule_with_comms_must_send_what_crosses_ranks() {
        let text = "0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0\n";
        let schedule = Schedule::from_csv(text).unwrap();
        let spec = ScheduleSpec::Custom(schedule);
        let err = plan(&workers(&["a", "b"]), &spec, 1).unwrap_err();
        assert!(
            err.to_string().contains("never sends")
                || matches!(err, PipelineError::Invalid(_) | PipelineError::Deadlock(_)),
            "{err}"
        );
    }

    #[test]
    fn a_custom_schedule_declares_any_stage_to_rank_map() {
        // Stages 0 and 1 on rank 0, 2 and 3 on rank 1 (not a loop, not a V).
        let text = "0F0,1F0,0F1,1F1,,,1B1,0B1,1B0,0B0\n,,2F0,3F0,2F1,3F1,3B0,2B0,3B1,2B1\n";
        let spec = ScheduleSpec::Custom(Schedule::from_csv(text).unwrap());
        let laid = plan(&workers(&["a", "a", "b", "b"]), &spec, 2).unwrap();
        assert_eq!(laid.stage_to_rank, [0, 0, 1, 1]);
        assert_eq!(laid.ranks, ["a", "b"]);
        // Stage 1 hands to stage 2 across ranks; 0 to 1 stays in memory.
        assert!(laid.program(0).iter().any(|a| a.to_string() == "1SEND_F0"));
        assert!(!laid.program(0).iter().any(|a| a.to_string() == "0SEND_F0"));
        // Declared on workers that contradict the schedule's map: refused.
        let err = plan(&workers(&["a", "b", "a", "b"]), &spec, 2).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot place the stages: stage 1 is on worker b, but the schedule puts it on rank 0 \
             with stage 0 (worker a)"
        );
        // Two ranks on one worker: refused.
        let err = plan(&workers(&["a", "a", "a", "a"]), &spec, 2).unwrap_err();
        assert!(
            matches!(
                err,
                PipelineError::Placement(PlacementError::SharedWorker { .. })
            ),
            "{err}"
        );
    }

    #[test]
    fn a_stage_on_two_ranks_or_on_none_is_refused() {
        let two = Schedule::from_csv("0F0,1F0,1B0,0B0\n1F0\n").unwrap();
        let err = plan(&workers(&["a", "b"]), &ScheduleSpec::Custom(two), 1).unwrap_err();
        assert!(
            matches!(
                err,
                PipelineError::Placement(PlacementError::TwoRanks { stage: 1, .. })
            ),
            "{err}"
        );
        let none = Schedule::from_csv("0F0,0B0\n1F0,1B0\n").unwrap();
        let err = plan(&workers(&["a", "b", "c"]), &ScheduleSpec::Custom(none), 1).unwrap_err();
        assert!(
            matches!(
                err,
                PipelineError::Placement(PlacementError::Unplaced { stage: 2 })
            ),
            "{err}"
        );
    }
}
