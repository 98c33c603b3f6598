//! The V-shaped schedules: ZBV zero bubble and DualPipeV (two stages per
//! rank, stage `r` and stage `2p - 1 - r` on rank `r`).

use std::collections::{HashMap, VecDeque};

use crate::action::{Action, ActionKind};

fn act(stage: usize, kind: ActionKind, mb: usize) -> Option<Action> {
    Some(Action::new(stage, kind, Some(mb)))
}

/// One rank of PyTorch's `ScheduleZBVZeroBubble`.
pub(super) fn zbv_rank(ranks: usize, micro: usize, rank: usize) -> Vec<Option<Action>> {
    use ActionKind::{BackwardInput as I, BackwardWeight as W, Forward as F};
    // Built for at least 2p - 1 microbatches; the extra ones become idle
    // steps.
    let padded = micro.max(2 * ranks - 1);
    let (chunk0, chunk1) = (rank, 2 * ranks - 1 - rank);
    let (mut f0, mut f1, mut b0, mut b1) = (0, 0, 0, 0);
    // Idle steps, then F, I and W of every (padded) microbatch on both
    // stages: allocated once.
    let mut row: Vec<Option<Action>> = Vec::with_capacity(rank + 6 * padded);
    row.resize(rank, None);
    for _ in 0..2 * (ranks - rank) - 1 {
        row.push(act(chunk0, F, f0));
        f0 += 1;
    }
    for _ in 0..rank {
        row.push(act(chunk1, F, f1));
        f1 += 1;
        row.push(act(chunk0, F, f0));
        f0 += 1;
    }
    for _ in 0..ranks - rank {
        row.push(act(chunk1, F, f1));
        f1 += 1;
        row.push(act(chunk1, I, b1));
        row.push(act(chunk1, W, b1));
        b1 += 1;
    }
    while f1 < f0 || f0 < padded {
        if f0 < padded {
            row.push(act(chunk0, F, f0));
            f0 += 1;
        }
        row.push(act(chunk0, I, b0));
        row.push(act(chunk0, W, b0));
        b0 += 1;
        row.push(act(chunk1, F, f1));
        f1 += 1;
        row.push(act(chunk1, I, b1));
        row.push(act(chunk1, W, b1));
        b1 += 1;
    }
    let w0 = b0;
    let w1 = b1;
    for _ in 0..rank {
        row.push(act(chunk0, I, b0));
        b0 += 1;
        row.push(act(chunk1, I, b1));
        b1 += 1;
    }
    let mut w0 = w0;
    for _ in 0..ranks - rank {
        row.push(act(chunk0, I, b0));
        b0 += 1;
        row.push(act(chunk0, W, w0));
        w0 += 1;
    }
    row.extend((w1..b1).map(|mb| act(chunk1, W, mb)));
    row.extend((w0..b0).map(|mb| act(chunk0, W, mb)));
    if padded == micro {
        // No padding microbatch was scheduled: nothing to drop.
        return row;
    }
    row.into_iter()
        .map(|slot| slot.filter(|a| a.microbatch().is_some_and(|mb| mb < micro)))
        .collect()
}

/// One rank of PyTorch's `ScheduleDualPipeV`, with OVERLAP_F_B actions.
pub(super) fn dualpipev_rank(ranks: usize, micro: usize, rank: usize) -> Vec<Option<Action>> {
    use ActionKind::{BackwardInput as I, Forward as F, FullBackward as B};
    let mut b = DualPipeBuilder::default();
    let (s0, s1) = (rank, 2 * ranks - 1 - rank);
    for _ in 0..(ranks - rank - 1) * 2 {
        b.add(s0, F);
    }
    for _ in 0..=rank {
        b.add(s0, F);
        b.add(s1, F);
    }
    for _ in 0..ranks - rank - 1 {
        b.add(s1, I);
        b.weight_if_pending();
        b.add(s1, F);
    }
    for i in 0..micro + rank + 1 - 2 * ranks {
        if i == 0 && rank == ranks - 1 {
            b.add(s0, F);
            b.add(s1, B);
        } else {
            b.overlap(s0, s1);
        }
        b.overlap(s1, s0);
    }
    for _ in 0..ranks - rank - 1 {
        b.add(s1, B);
        b.overlap(s1, s0);
    }
    let steps = rank + 1;
    let mut split = false;
    for i in 0..steps {
        if i == steps / 2 && rank % 2 == 1 {
            split = true;
        }
        b.add(s1, if split { I } else { B });
        if i == steps / 2 && rank % 2 == 0 {
            split = true;
        }
        b.add(s0, if split { I } else { B });
    }
    for _ in 0..ranks - rank - 1 {
        b.weight_if_pending();
        b.add(s0, if split { I } else { B });
    }
    for _ in 0..=rank {
        b.weight_if_pending();
    }
    b.row
}

/// Microbatch counters per (stage, kind) and the queue of W still owed,
/// as DualPipeV's construction keeps them (a B counts as an I and a W).
#[derive(Default)]
struct DualPipeBuilder {
    row: Vec<Option<Action>>,
    next: HashMap<(usize, ActionKind), usize>,
    weights: VecDeque<(usize, usize)>,
}

impl DualPipeBuilder {
    fn counter(&mut self, stage: usize, kind: ActionKind) -> &mut usize {
        self.next.entry((stage, kind)).or_default()
    }

    fn add(&mut self, stage: usize, kind: ActionKind) {
        let key = if kind == ActionKind::FullBackward {
            ActionKind::BackwardInput
        } else {
            kind
        };
        let mb = *self.counter(stage, key);
        self.row.push(act(stage, kind, mb));
        if kind == ActionKind::FullBackward {
            *self.counter(stage, ActionKind::BackwardInput) += 1;
            *self.counter(stage, ActionKind::BackwardWeight) += 1;
        } else {
            if kind == ActionKind::BackwardInput {
                self.weights.push_back((stage, mb));
            }
            *self.counter(stage, key) += 1;
        }
    }

    fn overlap(&mut self, forward_stage: usize, backward_stage: usize) {
        let f_mb = *self.counter(forward_stage, ActionKind::Forward);
        let b_mb = *self.counter(backward_stage, ActionKind::BackwardInput);
        self.row.push(Some(Action::compound(
            ActionKind::OverlapFB,
            vec![
                Action::forward(forward_stage, f_mb),
                Action::new(backward_stage, ActionKind::FullBackward, Some(b_mb)),
            ],
        )));
        *self.counter(forward_stage, ActionKind::Forward) += 1;
        *self.counter(backward_stage, ActionKind::BackwardInput) += 1;
        *self.counter(backward_stage, ActionKind::BackwardWeight) += 1;
    }

    fn weight_if_pending(&mut self) {
        if let Some((stage, mb)) = self.weights.pop_front() {
            self.row.push(act(stage, ActionKind::BackwardWeight, mb));
            *self.counter(stage, ActionKind::BackwardWeight) += 1;
        }
    }
}
