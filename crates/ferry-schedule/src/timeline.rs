//! [`Timeline`]: when each action of a lowered schedule runs, as the
//! unit-step simulator ([`crate::simulate_unit_steps`]) found it.

use crate::action::Action;
use crate::csv::Schedule;

/// The step of every slot of a lowered schedule, rank after rank (an idle
/// slot's entry is never read): 32 bits each when every step fits, which
/// halves what the simulator writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Steps {
    /// Steps below `u32::MAX`.
    Narrow(Vec<u32>),
    /// Any step.
    Wide(Vec<usize>),
}

impl Steps {
    /// The step of slot `i`.
    #[inline]
    fn get(&self, i: usize) -> usize {
        match self {
            Steps::Narrow(at) => at[i] as usize,
            Steps::Wide(at) => at[i],
        }
    }
}

/// One entry of [`Steps`]: `u32` or `usize`.
pub(crate) trait Step: Copy {
    /// The entry for `step` (which fits: the simulator picks the width).
    fn of(step: u64) -> Self;
    /// The entries as [`Steps`].
    fn steps(at: Vec<Self>) -> Steps;
}

impl Step for u32 {
    #[inline]
    fn of(step: u64) -> u32 {
        step as u32
    }

    fn steps(at: Vec<u32>) -> Steps {
        Steps::Narrow(at)
    }
}

impl Step for usize {
    #[inline]
    fn of(step: u64) -> usize {
        step as usize
    }

    fn steps(at: Vec<usize>) -> Steps {
        Steps::Wide(at)
    }
}

/// A simulated run of a lowered schedule: the step every action of it
/// runs at, per rank, kept beside the schedule it borrows (one number per
/// action, not one slot per rank per step).
///
/// [`Timeline::to_schedule`] draws it as a [`Schedule`] with one slot per
/// step (`None` for a stall), the form [`crate::svg()`],
/// [`crate::chrome_trace`] and the CSV export take.
///
/// ```
/// use ferry_schedule::{add_send_recv, simulate_unit_steps, Placement, ScheduleKind};
///
/// let compute = ScheduleKind::OneFOneB.generate(2, 1, 2)?;
/// let placement = Placement::Loop.stage_to_rank(2, 2)?;
/// let lowered = add_send_recv(&compute, &placement)?;
/// let timeline = simulate_unit_steps(&lowered, &placement)?;
/// // Rank 0 sends in step 1; rank 1, after it in the same step, receives.
/// let (step, action) = timeline.rank(1).next().expect("rank 1 runs");
/// assert_eq!((step, action.to_string().as_str()), (1, "1RECV_F0"));
/// assert_eq!(timeline.steps(), timeline.to_schedule().ranks.iter().map(Vec::len).max().unwrap());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timeline<'a> {
    lowered: &'a Schedule,
    /// Where each rank's slots start in `at` (one more entry at the end).
    offsets: Vec<usize>,
    /// The step of every slot of `lowered`, rank after rank.
    at: Steps,
    steps: usize,
}

impl<'a> Timeline<'a> {
    pub(crate) fn new(
        lowered: &'a Schedule,
        offsets: Vec<usize>,
        at: Steps,
        steps: usize,
    ) -> Timeline<'a> {
        Timeline {
            lowered,
            offsets,
            at,
            steps,
        }
    }

    /// The number of steps the run takes (one more than the last step any
    /// action runs at; 0 without actions).
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        self.lowered.ranks.len()
    }

    /// The lowered schedule that was simulated.
    pub fn lowered(&self) -> &'a Schedule {
        self.lowered
    }

    /// The actions of `rank` in the order it runs them, each with its
    /// step (increasing); nothing for a rank that does not exist.
    pub fn rank(&self, rank: usize) -> impl Iterator<Item = (usize, &'a Action)> + '_ {
        let row = self.lowered.ranks.get(rank).map_or(&[][..], Vec::as_slice);
        let start = match self.offsets.get(rank..rank + 2) {
            Some(&[start, _]) => start,
            _ => 0,
        };
        row.iter()
            .enumerate()
            .filter_map(move |(i, slot)| Some((self.at.get(start + i), slot.as_ref()?)))
    }

    /// The run drawn as a schedule: one slot per step on every rank,
    /// `None` while the rank stalls; each row ends with its last action.
    pub fn to_schedule(&self) -> Schedule {
        let rows = (0..self.ranks())
            .map(|rank| {
                let len = self.rank(rank).last().map_or(0, |(step, _)| step + 1);
                let mut line = Vec::with_capacity(len);
                for (step, action) in self.rank(rank) {
                    line.resize(step, None);
                    line.push(Some(action.clone()));
                }
                line
            })
            .collect();
        Schedule::new(rows)
    }
}
