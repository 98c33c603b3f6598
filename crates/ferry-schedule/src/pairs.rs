//! Flat tables for the lowering ([`crate::lower::add_send_recv`]) and the
//! unit-step simulator ([`crate::simulate_unit_steps`]): every (stage,
//! microbatch) pair an action of the schedule can ask about gets a number,
//! and each pair [`KINDS`] cells, one per kind readiness asks about (F,
//! B or I, RECV_F, RECV_B).
//!
//! Pairs are numbered densely (stage × microbatch) when that grid is small
//! enough for the schedule, else (e.g. microbatch numbers far apart) by a
//! map of the pairs present. The work is written once, generic over
//! [`Pairs`], so the dense case hashes nothing.

use std::cell::Cell;
use std::collections::HashMap;

use crate::action::{Action, ActionKind};
use crate::csv::Schedule;
use crate::done::leaves;

/// Cells per pair: what readiness asks about, F, B or I (always asked
/// together), RECV_F and RECV_B. (Sends are asked about by receives only,
/// with their place: the simulator keeps them apart.)
pub(crate) const KINDS: usize = 4;

/// The cell of a kind readiness asks about, within its pair.
#[inline]
pub(crate) fn kind_slot(kind: ActionKind) -> Option<usize> {
    Some(match kind {
        ActionKind::Forward => FORWARD,
        ActionKind::FullBackward | ActionKind::BackwardInput => BACKWARD,
        ActionKind::RecvF => RECV_F,
        ActionKind::RecvB => RECV_B,
        _ => return None,
    })
}

/// Cell slots within a pair.
pub(crate) const FORWARD: usize = 0;
pub(crate) const BACKWARD: usize = 1;
pub(crate) const RECV_F: usize = 2;
pub(crate) const RECV_B: usize = 3;

/// Dense tables are used while they hold at most this many cells per
/// action of the schedule (plus a constant).
const DENSE_CELLS_PER_ACTION: usize = 64;

/// Numbers (stage, microbatch slot) pairs: the slot is
/// [`crate::Action::microbatch_slot`] (0 for none). Every pair within one stage
/// of an action of the schedule, with that action's microbatch, has a
/// number below [`Pairs::len`].
pub(crate) trait Pairs {
    /// Why [`Pairs::cover`] cannot number a pair.
    type Miss;
    /// The number of `stage`'s pair with microbatch slot `mb`, if it has one.
    fn pair(&self, stage: usize, mb: usize) -> Option<usize>;
    /// How many pairs there are.
    fn len(&self) -> usize;
    /// Makes sure the pairs an action of `stage` with microbatch slot `mb`
    /// asks about are numbered: the new [`Pairs::len`] if it grew, `None`
    /// if they were already. A numbering made from the whole schedule
    /// already covers every action of it.
    #[inline(always)]
    fn cover(&self, _stage: usize, _mb: usize) -> Result<Option<usize>, Self::Miss> {
        Ok(None)
    }
}

/// Pairs as a stage × microbatch grid.
pub(crate) struct Dense {
    stages: usize,
    mbs: usize,
}

impl Pairs for Dense {
    type Miss = std::convert::Infallible;

    #[inline(always)]
    fn pair(&self, stage: usize, mb: usize) -> Option<usize> {
        (stage < self.stages && mb < self.mbs).then_some(stage * self.mbs + mb)
    }

    fn len(&self) -> usize {
        self.stages * self.mbs
    }
}

/// Pairs numbered by a map of those the schedule's actions can name.
pub(crate) struct Sparse {
    map: HashMap<(usize, usize), usize>,
}

impl Pairs for Sparse {
    type Miss = std::convert::Infallible;

    #[inline]
    fn pair(&self, stage: usize, mb: usize) -> Option<usize> {
        self.map.get(&(stage, mb)).copied()
    }

    fn len(&self) -> usize {
        self.map.len()
    }
}

/// A little fewer than the actions of a lowered schedule that name one
/// (stage, microbatch) pair (F, B or I and W, with their sends and
/// receives): sizes a [`Grid`] at first, a little too large rather than
/// too small.
const LOWERED_ACTIONS_PER_PAIR: usize = 5;

/// Pairs on a grid of the placement's stages (and one more) by
/// microbatch slots, microbatch-major so that the grid grows as larger
/// slots appear without renumbering: the unit-step simulator's numbering,
/// which needs no pass over the schedule before it runs. It cannot number
/// an action on a stage the placement lacks, nor microbatch numbers so far
/// apart that the grid would outgrow the dense limit ([`Uncovered`]).
pub(crate) struct Grid {
    /// Stages placed (actions on others are not covered).
    placed: usize,
    /// Stages on the grid: those placed and the one after.
    stages: usize,
    /// Microbatch slots on the grid so far.
    mbs: Cell<usize>,
    /// The most cells the grid may have.
    limit: usize,
}

/// An action a [`Grid`] cannot number.
#[derive(Debug)]
pub(crate) struct Uncovered;

impl Grid {
    /// A grid for a schedule of `slots` slots over `placed` stages, sized
    /// at first for the microbatches such a lowered schedule usually has
    /// (a forward, a backward, a send and a receive of each, or so, per
    /// stage), so that it seldom grows.
    pub(crate) fn new(placed: usize, slots: usize) -> Grid {
        let stages = placed.saturating_add(1);
        let limit = slots
            .saturating_mul(DENSE_CELLS_PER_ACTION)
            .saturating_add(1 << 12);
        let guess = (slots / stages / LOWERED_ACTIONS_PER_PAIR).saturating_add(1);
        let fits = guess
            .checked_mul(stages)
            .and_then(|n| n.checked_mul(KINDS))
            .is_some_and(|cells| cells <= limit);
        Grid {
            placed,
            stages,
            mbs: Cell::new(if fits { guess } else { 0 }),
            limit,
        }
    }
}

impl Pairs for Grid {
    type Miss = Uncovered;

    #[inline(always)]
    fn pair(&self, stage: usize, mb: usize) -> Option<usize> {
        (stage < self.stages && mb < self.mbs.get()).then_some(mb * self.stages + stage)
    }

    fn len(&self) -> usize {
        self.stages * self.mbs.get()
    }

    #[inline(always)]
    fn cover(&self, stage: usize, mb: usize) -> Result<Option<usize>, Uncovered> {
        if stage >= self.placed {
            return Err(Uncovered);
        }
        if mb < self.mbs.get() {
            return Ok(None);
        }
        let fits = |mbs: usize| {
            mbs.checked_mul(self.stages)
                .and_then(|n| n.checked_mul(KINDS))
                .is_some_and(|cells| cells <= self.limit)
        };
        let needed = mb.checked_add(1).ok_or(Uncovered)?;
        let mbs = self.mbs.get();
        let grown = needed.max(mbs.saturating_add(mbs / 2));
        let mbs = if fits(grown) {
            grown
        } else if fits(needed) {
            needed
        } else {
            return Err(Uncovered);
        };
        self.mbs.set(mbs);
        Ok(Some(self.len()))
    }
}

/// The numbering for one schedule.
pub(crate) enum Numbering {
    /// A stage × microbatch grid.
    Dense(Dense),
    /// A map of the pairs present.
    Sparse(Sparse),
}

/// Numbers the pairs of every action of `schedule` (sub-actions included)
/// and their neighbour stages.
pub(crate) fn number(schedule: &Schedule) -> Numbering {
    let mut extent = Extent::default();
    for row in &schedule.ranks {
        extent.count += row.len();
        for a in row.iter().flatten() {
            if let Some((stage, _, mb)) = a.simple_parts() {
                extent.stages = extent.stages.max(stage);
                extent.mbs = extent.mbs.max(mb);
            } else {
                for leaf in a.sub_actions() {
                    extent.count += 1;
                    extent.add(leaf);
                }
            }
        }
    }
    extent.number(schedule)
}

/// The largest stage and microbatch slot of a schedule's simple actions,
/// gathered while walking it, and how many slots and leaves it has.
#[derive(Default)]
pub(crate) struct Extent {
    pub(crate) stages: usize,
    pub(crate) mbs: usize,
    /// Slots and sub-actions walked (sizes the dense grid's limit).
    pub(crate) count: usize,
}

impl Extent {
    /// Takes the simple `leaf` into account.
    #[inline]
    pub(crate) fn add(&mut self, leaf: &Action) {
        self.stages = self.stages.max(leaf.stage());
        self.mbs = self.mbs.max(leaf.microbatch_slot());
    }

    /// The numbering of `schedule`, every simple action of which was added.
    pub(crate) fn number(self, schedule: &Schedule) -> Numbering {
        // Lookups reach one stage further than any action names.
        let (stages, mbs) = (self.stages.saturating_add(2), self.mbs.saturating_add(1));
        let limit = self
            .count
            .saturating_mul(DENSE_CELLS_PER_ACTION)
            .saturating_add(1 << 12);
        let dense = stages
            .checked_mul(mbs)
            .and_then(|n| n.checked_mul(KINDS))
            .is_some_and(|len| len <= limit);
        if dense {
            return Numbering::Dense(Dense { stages, mbs });
        }
        let mut map = HashMap::new();
        for a in schedule.ranks.iter().flatten().flatten() {
            for leaf in leaves(a) {
                let (stage, mb) = (leaf.stage(), leaf.microbatch_slot());
                let near = [stage.checked_sub(1), Some(stage), stage.checked_add(1)];
                for s in near.into_iter().flatten() {
                    let next = map.len();
                    map.entry((s, mb)).or_insert(next);
                }
            }
        }
        Numbering::Sparse(Sparse { map })
    }
}

/// Widens a stage-major grid of `stages` rows of `mbs` microbatch slots so
/// that microbatch `mb` (at least `mbs`) fits: by half again at least, to
/// at most `limit` cells in all. Returns the new row length, or `None` when
/// `mb` cannot fit within `limit` (the fast paths then give up).
pub(crate) fn widen_to_fit<T: Copy>(
    grid: &mut Vec<T>,
    stages: usize,
    mbs: usize,
    mb: usize,
    limit: usize,
    fill: T,
) -> Option<usize> {
    let grown = (mb + 1).max(mbs + mbs / 2).min(limit / stages);
    if mb >= grown {
        return None;
    }
    widen(grid, stages, mbs, grown, fill);
    Some(grown)
}

/// Widens a stage-major grid of `stages` rows of `old` microbatch slots
/// each to rows of `new` slots (filled with `fill`), keeping every entry
/// at its (stage, microbatch): the fast paths' tables, laid out so that a
/// stage's successive microbatches are side by side.
fn widen<T: Copy>(grid: &mut Vec<T>, stages: usize, old: usize, new: usize, fill: T) {
    let mut wider = vec![fill; stages * new];
    for (to, from) in wider.chunks_exact_mut(new).zip(grid.chunks_exact(old)) {
        to[..old].copy_from_slice(from);
    }
    *grid = wider;
}
