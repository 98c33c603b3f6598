//! UNSHARD / RESHARD with a prefetch window, as PyTorch's
//! `_add_unshard_reshard`.

use std::collections::BTreeSet;
use std::num::NonZeroUsize;

use crate::action::{Action, ActionKind};
use crate::csv::Schedule;

/// PyTorch's default window: three active stages (one forward, one
/// backward and one being prefetched).
pub const DEFAULT_MAX_ACTIVE_STAGES: NonZeroUsize = NonZeroUsize::MIN.saturating_add(2);

/// Adds FSDP's UNSHARD (gather a stage's parameters) and RESHARD (free
/// them) to every rank of a compute-only schedule, as PyTorch's
/// `_add_unshard_reshard(compute_actions, max_active_stages)`.
///
/// Before each action, the rank looks ahead at the next
/// `max_active_stages` distinct stages it will compute (its prefetch
/// window): it RESHARDs every active stage outside the window (in
/// increasing stage order), then UNSHARDs every stage of the window not
/// yet active (in the order they will run), then runs the action. After
/// its last action it RESHARDs what is still active. A stage is therefore
/// unsharded ahead of its first use within the window and resharded as
/// soon as it leaves the window or after its last use.
///
/// As in PyTorch, an OVERLAP_F_B counts the stages of all its sub-actions
/// at once, so a window that ends inside one may hold one stage more than
/// `max_active_stages`. Idle steps are dropped. PyTorch evicts in the
/// iteration order of a Python `set` of stage indices, which is increasing
/// order for stage indices below 8 (where the two are checked equal,
/// `tests/unshard.rs`).
///
/// ```
/// use ferry_schedule::{add_unshard_reshard, Schedule, DEFAULT_MAX_ACTIVE_STAGES};
/// use std::num::NonZeroUsize;
///
/// let rank = Schedule::from_csv("0F0,2F0,0B0,2B0\r\n")?;
/// let one = NonZeroUsize::MIN;
/// assert_eq!(
///     add_unshard_reshard(&rank, one).to_csv(),
///     "0UNSHARD,0F0,0RESHARD,2UNSHARD,2F0,2RESHARD,0UNSHARD,0B0,0RESHARD,2UNSHARD,2B0,2RESHARD\r\n"
/// );
/// assert_eq!(
///     add_unshard_reshard(&rank, DEFAULT_MAX_ACTIVE_STAGES).to_csv(),
///     "0UNSHARD,2UNSHARD,0F0,2F0,0B0,0RESHARD,2B0,2RESHARD\r\n"
/// );
/// # Ok::<(), ferry_schedule::CsvError>(())
/// ```
pub fn add_unshard_reshard(schedule: &Schedule, max_active_stages: NonZeroUsize) -> Schedule {
    Schedule::new(
        schedule
            .ranks
            .iter()
            .map(|row| unshard_reshard_row(row, max_active_stages.get()))
            .collect(),
    )
}

/// The stages an action computes on, in order, without repeats: the
/// sub-actions' for an OVERLAP_F_B, else its own.
fn stages_of(action: &Action) -> Vec<usize> {
    if action.kind() != ActionKind::OverlapFB && action.sub_actions().is_empty() {
        return vec![action.stage()];
    }
    let mut out: Vec<usize> = Vec::new();
    for sub in action.sub_actions() {
        if !out.contains(&sub.stage()) {
            out.push(sub.stage());
        }
    }
    out
}

/// The prefetch window before each action: the first `count` distinct
/// stages from that action on (extended to the end of an OVERLAP_F_B).
fn windows(actions: &[&Action], count: usize) -> Vec<Vec<usize>> {
    // Every stage still to come, by first use, with the index of the
    // action that first uses it; built from the end.
    let mut upcoming: Vec<(usize, usize)> = Vec::new();
    let mut out = vec![Vec::new(); actions.len()];
    for (i, action) in actions.iter().enumerate().rev() {
        let stages = stages_of(action);
        upcoming.retain(|(s, _)| !stages.contains(s));
        upcoming.splice(0..0, stages.into_iter().map(|s| (s, i)));
        let mut window = Vec::with_capacity(count + 1);
        for (k, &(stage, first)) in upcoming.iter().enumerate() {
            window.push(stage);
            let group_ends = upcoming.get(k + 1).is_none_or(|&(_, next)| next != first);
            if window.len() >= count && group_ends {
                break;
            }
        }
        out[i] = window;
    }
    out
}

fn unshard_reshard_row(row: &[Option<Action>], count: usize) -> Vec<Option<Action>> {
    let actions: Vec<&Action> = row.iter().flatten().collect();
    let windows = windows(&actions, count);
    let mut active: BTreeSet<usize> = BTreeSet::new();
    let mut out = Vec::with_capacity(actions.len() * 2);
    for (action, window) in actions.into_iter().zip(windows) {
        let evict: Vec<usize> = active
            .iter()
            .copied()
            .filter(|s| !window.contains(s))
            .collect();
        for stage in evict {
            active.remove(&stage);
            out.push(Some(Action::per_stage(stage, ActionKind::Reshard)));
        }
        for stage in window {
            if active.insert(stage) {
                out.push(Some(Action::per_stage(stage, ActionKind::Unshard)));
            }
        }
        out.push(Some(action.clone()));
    }
    out.extend(
        active
            .into_iter()
            .map(|stage| Some(Action::per_stage(stage, ActionKind::Reshard))),
    );
    out
}
