//! From the driver's declaration (stage workers, a schedule, microbatches)
//! to one checked action list per rank. Pure: nothing runs until every
//! check here passed.

use std::collections::HashSet;

use ferry_schedule::{
    add_send_recv, check_deadlock, check_sends, validate, Action, Placement, Schedule, ScheduleKind,
};

use crate::error::PipelineError;

/// Which schedule a pipeline runs.
#[derive(Clone, Debug, PartialEq)]
pub enum ScheduleSpec {
    /// One of the schedules `ferry-schedule` generates, for the pipeline's
    /// ranks, stages per rank and microbatches.
    Kind(ScheduleKind),
    /// A schedule written by hand or loaded from PyTorch's CSV, one action
    /// list per rank, with the placement of its stages. A compute-only
    /// schedule is lowered here (sends and receives added as PyTorch's
    /// `_add_send_recv` does); one with sends and receives runs as written.
    Custom {
        /// The schedule.
        schedule: Schedule,
        /// Where its stages live.
        placement: Placement,
    },
}

impl From<ScheduleKind> for ScheduleSpec {
    fn from(kind: ScheduleKind) -> Self {
        ScheduleSpec::Kind(kind)
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
    let mut seen = HashSet::new();
    let distinct: Vec<&String> = stage_workers.iter().filter(|w| seen.insert(*w)).collect();
    let ranks = distinct.len();
    if stages % ranks != 0 {
        return Err(PipelineError::Config(format!(
            "{stages} stages do not spread evenly over {ranks} workers"
        )));
    }
    let placement = match spec {
        ScheduleSpec::Kind(kind) => kind.placement(),
        ScheduleSpec::Custom { placement, .. } => *placement,
    };
    let stage_to_rank = placement.stage_to_rank(stages, ranks)?;
    // Rank r is the worker of the first stage the placement puts on it.
    let mut rank_workers: Vec<Option<String>> = vec![None; ranks];
    for (stage, &rank) in stage_to_rank.iter().enumerate() {
        let worker = &stage_workers[stage];
        match &rank_workers[rank] {
            None => rank_workers[rank] = Some(worker.clone()),
            Some(expected) if expected != worker => {
                return Err(PipelineError::Config(format!(
                    "stage {stage} is on worker {worker}, but the {placement:?} placement of \
                     {stages} stages on {ranks} ranks puts it on rank {rank} with stage {first} \
                     (worker {expected})",
                    first = stage_to_rank.iter().position(|&r| r == rank).unwrap_or(0),
                )));
            }
            Some(_) => {}
        }
    }
    let rank_workers: Vec<String> = rank_workers.into_iter().flatten().collect();
    if rank_workers.len() != ranks {
        return Err(PipelineError::Config("a rank holds no stage".into()));
    }
    let schedule = match spec {
        ScheduleSpec::Kind(kind) => kind.generate(ranks, stages / ranks, microbatches)?,
        ScheduleSpec::Custom { schedule, .. } => schedule.clone(),
    };
    if schedule.ranks.len() != ranks {
        return Err(PipelineError::Config(format!(
            "the schedule has {} ranks but the stages are on {ranks} workers",
            schedule.ranks.len()
        )));
    }
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
    validate(&schedule, microbatches)?;
    let has_comms = schedule.has_comms();
    let lowered = if has_comms {
        // Every value that crosses ranks is sent (the runtime delivers on
        // SEND_F/SEND_B): ferry-schedule's check, naming rank, step and action.
        check_sends(&schedule, &stage_to_rank)?;
        schedule
    } else {
        add_send_recv(&schedule, &stage_to_rank)?
    };
    check_deadlock(&lowered, &stage_to_rank)?;
    Ok(Plan {
        ranks: rank_workers,
        stage_to_rank,
        lowered,
    })
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
        assert!(err.to_string().contains("stage 2 is on worker b"), "{err}");
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
        // Rank 1 waits for microbatch 1's backward before its forward.
        let text = "0F0,0F1,0B0,0B1\n1F0,1B0,1B1,1F1\n";
        let schedule = Schedule::from_csv(text).unwrap();
        let spec = ScheduleSpec::Custom {
            schedule,
            placement: Placement::Loop,
        };
        let err = plan(&workers(&["a", "b"]), &spec, 2).unwrap_err();
        assert!(
            matches!(
                err,
                PipelineError::Invalid(_) | PipelineError::Deadlock(_) | PipelineError::Lower(_)
            ),
            "{err}"
        );
    }

    #[test]
    fn a_custom_schedule_with_comms_must_send_what_crosses_ranks() {
        let text = "0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0\n";
        let schedule = Schedule::from_csv(text).unwrap();
        let spec = ScheduleSpec::Custom {
            schedule,
            placement: Placement::Loop,
        };
        let err = plan(&workers(&["a", "b"]), &spec, 1).unwrap_err();
        assert!(
            err.to_string().contains("never sends")
                || matches!(err, PipelineError::Invalid(_) | PipelineError::Deadlock(_)),
            "{err}"
        );
    }
}
