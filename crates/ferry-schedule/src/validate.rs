//! The validator: accepts or rejects any schedule, user-written included.

use std::collections::{HashMap, HashSet};

use crate::action::{Action, ActionKind};
use crate::csv::Schedule;

/// Why a schedule is rejected, with where.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("rank {rank}, step {step}, action {action}: {rule}\n{grid}")]
pub struct ValidationError {
    /// The rank of the offending action.
    pub rank: usize,
    /// Its step (column).
    pub step: usize,
    /// The action.
    pub action: Action,
    /// The rule it breaks.
    pub rule: String,
    /// The schedule grid with the offending slot marked `>...<`.
    pub grid: String,
}

/// Checks a schedule of `microbatches` microbatches against the rules:
/// every stage lives on one rank; each stage runs F exactly once per
/// microbatch, and B (or I) once, after its F; W once, after its I (never
/// after a full B, which already computed the weight gradients: PyTorch
/// refuses "Backward Weight ... without first running Backward Input");
/// and,
/// where the schedule has comms, every send is received once and every
/// receive sent once.
pub fn validate(schedule: &Schedule, microbatches: usize) -> Result<(), ValidationError> {
    let mut owner: HashMap<usize, usize> = HashMap::new();
    let mut seen: HashSet<(usize, ActionKind, usize)> = HashSet::new();
    // (stage, microbatch) whose backward was an I, so a W may follow.
    let mut inputs_only: HashSet<(usize, usize)> = HashSet::new();
    let mut sends: HashMap<(usize, ActionKind, usize), usize> = HashMap::new();
    let fail = |rank: usize, step: usize, action: &Action, rule: String| ValidationError {
        rank,
        step,
        action: action.clone(),
        rule,
        grid: grid(schedule, rank, step),
    };
    for (rank, row) in schedule.ranks.iter().enumerate() {
        for (step, action) in row.iter().enumerate() {
            let Some(action) = action else { continue };
            let leaves: Vec<&Action> = if action.sub_actions().is_empty() {
                vec![action]
            } else {
                action.sub_actions().iter().collect()
            };
            for leaf in leaves {
                let stage = leaf.stage();
                if let Some(&other) = owner.get(&stage) {
                    if other != rank {
                        return Err(fail(rank, step, action, format!("stage {stage} already runs on rank {other}; a stage lives on one rank")));
                    }
                }
                owner.insert(stage, rank);
                let Some(mb) = leaf.microbatch() else {
                    continue;
                };
                let kind = leaf.kind();
                if leaf.kind().is_compute() && mb >= microbatches {
                    return Err(fail(
                        rank,
                        step,
                        action,
                        format!(
                            "microbatch {mb} is out of range (the schedule has {microbatches})"
                        ),
                    ));
                }
                let key_kind = if kind == ActionKind::BackwardInput {
                    ActionKind::FullBackward
                } else {
                    kind
                };
                if kind.is_compute() && !seen.insert((stage, key_kind, mb)) {
                    return Err(fail(
                        rank,
                        step,
                        action,
                        format!("stage {stage} already ran {kind} for microbatch {mb}"),
                    ));
                }
                let needs = match kind {
                    ActionKind::FullBackward | ActionKind::BackwardInput => {
                        Some(ActionKind::Forward)
                    }
                    ActionKind::BackwardWeight => Some(ActionKind::FullBackward),
                    _ => None,
                };
                if kind == ActionKind::BackwardInput {
                    inputs_only.insert((stage, mb));
                }
                if kind == ActionKind::BackwardWeight
                    && seen.contains(&(stage, ActionKind::FullBackward, mb))
                    && !inputs_only.contains(&(stage, mb))
                {
                    return Err(fail(
                        rank,
                        step,
                        action,
                        format!(
                            "{kind} of microbatch {mb} follows a full B, which already computed \
                             the weight gradients: a W needs an I (backward input) before it"
                        ),
                    ));
                }
                if let Some(need) = needs {
                    if !seen.contains(&(stage, need, mb)) {
                        let what = if need == ActionKind::Forward {
                            "F"
                        } else {
                            "I"
                        };
                        return Err(fail(
                            rank,
                            step,
                            action,
                            format!("{kind} of microbatch {mb} comes before its {what}"),
                        ));
                    }
                }
                match kind {
                    ActionKind::SendF => {
                        *sends.entry((stage + 1, ActionKind::RecvF, mb)).or_default() += 1
                    }
                    ActionKind::SendB if stage > 0 => {
                        *sends.entry((stage - 1, ActionKind::RecvB, mb)).or_default() += 1
                    }
                    _ => {}
                }
            }
        }
    }
    let first_missing = |stage: usize, kind: ActionKind| {
        (0..microbatches).find(|&mb| !seen.contains(&(stage, kind, mb)))
    };
    for (&stage, &rank) in &owner {
        for kind in [ActionKind::Forward, ActionKind::FullBackward] {
            if seen.iter().any(|&(s, k, _)| s == stage && k == kind) || kind == ActionKind::Forward
            {
                if let Some(mb) = first_missing(stage, kind) {
                    let step = schedule.ranks[rank].len();
                    let action = Action::new(stage, kind, Some(mb));
                    return Err(fail(
                        rank,
                        step,
                        &action,
                        format!("stage {stage} never runs {kind} for microbatch {mb}"),
                    ));
                }
            }
        }
    }
    let mut recvs: HashMap<(usize, ActionKind, usize), usize> = HashMap::new();
    for (rank, row) in schedule.ranks.iter().enumerate() {
        for (step, action) in row.iter().enumerate() {
            let Some(action) = action else { continue };
            let kind = action.kind();
            if matches!(kind, ActionKind::RecvF | ActionKind::RecvB) {
                let Some(mb) = action.microbatch() else {
                    continue;
                };
                let key = (action.stage(), kind, mb);
                let n = recvs.entry(key).or_default();
                *n += 1;
                if *n > sends.get(&key).copied().unwrap_or(0) {
                    return Err(fail(
                        rank,
                        step,
                        action,
                        "no send pairs with this receive".to_owned(),
                    ));
                }
            }
        }
    }
    for (rank, row) in schedule.ranks.iter().enumerate() {
        for (step, action) in row.iter().enumerate() {
            let Some(action) = action else { continue };
            let key = match (action.kind(), action.microbatch()) {
                (ActionKind::SendF, Some(mb)) => (action.stage() + 1, ActionKind::RecvF, mb),
                (ActionKind::SendB, Some(mb)) if action.stage() > 0 => {
                    (action.stage() - 1, ActionKind::RecvB, mb)
                }
                _ => continue,
            };
            if recvs.get(&key).copied().unwrap_or(0) < sends.get(&key).copied().unwrap_or(0) {
                return Err(fail(
                    rank,
                    step,
                    action,
                    "no receive pairs with this send".to_owned(),
                ));
            }
        }
    }
    Ok(())
}

/// Checks a schedule that comes with its own sends and receives (one a
/// runtime executes as written, such as a user's lowered CSV) against the
/// placement `stage_to_rank`: every value that crosses ranks is sent by
/// its producer. A forward (backward, or I) of stage `s` whose previous
/// (next) stage is on another rank needs that stage's `SEND_F` (`SEND_B`)
/// of the same microbatch somewhere in the schedule: sends and the
/// actions that receive them pair up per (stage, microbatch, direction).
///
/// The error names the rank, the step and the action that waits for a
/// value never sent, and shows the grid with its slot marked; an action
/// (or sub-action) on a stage the placement lacks is an error too.
///
/// ```
/// use ferry_schedule::{check_sends, Schedule};
///
/// // Stage 1 (rank 1) needs stage 0's activation: rank 0 sends it.
/// let ok = Schedule::from_csv("0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n")?;
/// assert!(check_sends(&ok, &[0, 1]).is_ok());
/// // Without rank 1's SEND_B0, stage 0's backward waits for nothing.
/// let bad = Schedule::from_csv("0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0\n")?;
/// let err = check_sends(&bad, &[0, 1]).unwrap_err();
/// assert_eq!((err.rank, err.step, err.action.to_string()), (0, 3, "0B0".to_string()));
/// assert!(err.to_string().contains("never sends it"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn check_sends(schedule: &Schedule, stage_to_rank: &[usize]) -> Result<(), ValidationError> {
    let stages = stage_to_rank.len();
    let fail = |rank: usize, step: usize, action: &Action, rule: String| ValidationError {
        rank,
        step,
        action: action.clone(),
        rule,
        grid: grid(schedule, rank, step),
    };
    // The sends in the schedule, by (stage, direction, microbatch), and the
    // values that cross ranks with the action (rank, step) that needs each.
    let mut sent: HashSet<(usize, ActionKind, usize)> = HashSet::new();
    let mut needed: Vec<(usize, usize, (usize, ActionKind, usize))> = Vec::new();
    for (rank, row) in schedule.ranks.iter().enumerate() {
        for (step, action) in row.iter().enumerate() {
            let Some(action) = action else { continue };
            let leaves = if action.sub_actions().is_empty() {
                std::slice::from_ref(action)
            } else {
                action.sub_actions()
            };
            for leaf in leaves {
                let stage = leaf.stage();
                if stage >= stages && (leaf.kind().is_compute() || leaf.kind().is_comm()) {
                    return Err(fail(
                        rank,
                        step,
                        action,
                        format!("stage {stage} is not placed (the placement has {stages} stages)"),
                    ));
                }
                let Some(mb) = leaf.microbatch() else {
                    continue;
                };
                match leaf.kind() {
                    kind @ (ActionKind::SendF | ActionKind::SendB) => {
                        sent.insert((stage, kind, mb));
                    }
                    ActionKind::Forward
                        if stage > 0 && stage_to_rank[stage - 1] != stage_to_rank[stage] =>
                    {
                        needed.push((rank, step, (stage - 1, ActionKind::SendF, mb)));
                    }
                    ActionKind::FullBackward | ActionKind::BackwardInput
                        if stage + 1 < stages
                            && stage_to_rank[stage + 1] != stage_to_rank[stage] =>
                    {
                        needed.push((rank, step, (stage + 1, ActionKind::SendB, mb)));
                    }
                    _ => {}
                }
            }
        }
    }
    for (rank, step, (stage, kind, mb)) in needed {
        if !sent.contains(&(stage, kind, mb)) {
            let Some(Some(action)) = schedule.ranks[rank].get(step) else {
                continue;
            };
            return Err(fail(
                rank,
                step,
                action,
                format!(
                    "it needs {} from stage {stage} on another rank, but the schedule never sends it",
                    Action::new(stage, kind, Some(mb))
                ),
            ));
        }
    }
    Ok(())
}

/// The schedule as a grid (one line per rank, `.` for idle), with the
/// slot at (`rank`, `step`) marked `>...<`.
pub fn grid(schedule: &Schedule, rank: usize, step: usize) -> String {
    let width = schedule
        .ranks
        .iter()
        .flatten()
        .flatten()
        .map(|a| a.to_string().len())
        .max()
        .unwrap_or(1)
        + 2;
    let mut out = String::new();
    for (r, row) in schedule.ranks.iter().enumerate() {
        out.push_str(&format!("rank {r}:"));
        let len = if r == rank {
            row.len().max(step + 1)
        } else {
            row.len()
        };
        for s in 0..len {
            let text = row
                .get(s)
                .cloned()
                .flatten()
                .map_or_else(|| ".".to_owned(), |a| a.to_string());
            let cell = if r == rank && s == step {
                format!(">{text}<")
            } else {
                text
            };
            out.push_str(&format!(" {cell:>width$}"));
        }
        out.push('\n');
    }
    out
}
