//! The measured timeline of a step: when every action of every rank
//! started and ended, as a `ferry-schedule` [`TimedRun`] so that it draws
//! (SVG, Chrome trace) like the simulator's prediction.

use std::collections::BTreeMap;

use ferry_schedule::timed::{RankStats, Span, TimedRun};
use ferry_schedule::{simulate_timed, ActionKind, Costs, Schedule, StageCosts, TimedError};

use crate::protocol::StepReply;

/// A measured step, in milliseconds from the first action's start.
#[derive(Clone, Debug)]
pub struct Timeline {
    run: TimedRun,
    handoffs: Vec<HandOff>,
}

/// One value handed from a stage on one worker to a stage on another, as
/// the receiving rank saw it (microseconds; one host, one clock).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HandOff {
    /// The receiving stage.
    pub stage: usize,
    /// The microbatch.
    pub microbatch: usize,
    /// An activation (`true`) or a gradient.
    pub activation: bool,
    /// Whether the receiving action was already waiting when the value
    /// arrived (an idle receiver): then [`total_us`](Self::total_us) is
    /// the whole hand-off latency.
    pub idle: bool,
    /// Whether the receiving action was already waiting when the value
    /// was *sent* (a subset of [`idle`](Self::idle)): the receiver had
    /// nothing else to run for the whole hand-off, so its latency is the
    /// runtime's and the host's wake-up alone. An idle receiver that was
    /// still computing at the send may have had no core free to read the
    /// value before its action ended (two processes on two cores, say).
    pub waiting: bool,
    /// From the send to the value in the receiver's mailbox.
    pub transit_us: f64,
    /// From the value in the mailbox (or, if it came first, from the
    /// action asking for it) to the action starting: the receiver's wake-up.
    pub wake_us: f64,
    /// From the send to the start of the action that consumed it.
    pub total_us: f64,
}

/// The median and 90th percentile of the hand-offs to idle receivers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HandOffSummary {
    /// How many hand-offs found their receiver idle.
    pub count: usize,
    /// Median send-to-start latency, µs.
    pub median_us: f64,
    /// 90th percentile, µs.
    pub p90_us: f64,
    /// Median transit (send to mailbox), µs.
    pub transit_median_us: f64,
    /// Median wake-up (mailbox to start), µs.
    pub wake_median_us: f64,
}

impl Timeline {
    pub(crate) fn new(lowered: &Schedule, replies: &[StepReply]) -> Timeline {
        let origin = replies
            .iter()
            .flat_map(|r| r.spans.iter().map(|s| s.start_ns))
            .min()
            .unwrap_or(0);
        let ms = |ns: u64| ns.saturating_sub(origin) as f64 / 1e6;
        let mut spans = Vec::new();
        let mut ranks = Vec::new();
        for (rank, reply) in replies.iter().enumerate() {
            let row = &lowered.ranks[rank];
            let mut busy = 0.0;
            let mut finish: f64 = 0.0;
            let mut live = 0usize;
            let mut peak = 0usize;
            let rank_spans: Vec<Span> = reply
                .spans
                .iter()
                .map(|s| {
                    let span = Span {
                        step: s.index as usize,
                        start: ms(s.start_ns),
                        end: ms(s.end_ns),
                    };
                    if let Some(Some(action)) = row.get(span.step) {
                        let kinds: Vec<ActionKind> = if action.is_compound() {
                            action.sub_actions().iter().map(|a| a.kind()).collect()
                        } else {
                            vec![action.kind()]
                        };
                        if kinds.iter().any(|k| k.is_compute()) {
                            busy += span.end - span.start;
                        }
                        for k in kinds {
                            match k {
                                ActionKind::Forward => live += 1,
                                ActionKind::FullBackward | ActionKind::BackwardWeight => {
                                    live = live.saturating_sub(1)
                                }
                                _ => {}
                            }
                            peak = peak.max(live);
                        }
                    }
                    finish = finish.max(span.end);
                    span
                })
                .collect();
            spans.push(rank_spans);
            ranks.push((busy, finish, peak));
        }
        let makespan = ranks.iter().map(|r| r.1).fold(0.0, f64::max);
        let ranks = ranks
            .into_iter()
            .map(|(busy, finish, peak_activations)| RankStats {
                busy,
                finish,
                bubble: if makespan > 0.0 {
                    1.0 - busy / makespan
                } else {
                    0.0
                },
                peak_activations,
            })
            .collect();
        let us = |a: u64, b: u64| a.saturating_sub(b) as f64 / 1e3;
        let handoffs = replies
            .iter()
            .flat_map(|r| &r.handoffs)
            .filter(|h| h.started_ns != 0)
            .map(|h| HandOff {
                stage: h.stage as usize,
                microbatch: h.microbatch as usize,
                activation: h.forward,
                idle: h.asked_ns < h.received_ns,
                waiting: h.asked_ns <= h.sent_ns,
                transit_us: us(h.received_ns, h.sent_ns),
                wake_us: us(h.started_ns, h.received_ns.max(h.asked_ns)),
                total_us: us(h.started_ns, h.sent_ns),
            })
            .collect();
        Timeline {
            run: TimedRun {
                schedule: lowered.clone(),
                spans,
                ranks,
                makespan,
            },
            handoffs,
        }
    }

    /// Every value handed between stages on different workers in this step.
    pub fn handoffs(&self) -> &[HandOff] {
        &self.handoffs
    }

    /// The hand-off latency to idle receivers (from the send of a value to
    /// the start of the action that consumes it, when that action was
    /// already waiting), or `None` when no receiver waited.
    pub fn handoff_summary(&self) -> Option<HandOffSummary> {
        summarize(self.handoffs.iter().filter(|h| h.idle))
    }

    /// The per-stage costs of this step (ms): the median duration of each
    /// stage's F, B, I and W actions. Links cost nothing, so simulating
    /// these costs gives what the step would take with free communication
    /// and no runtime overhead. (A compute action's measured span includes
    /// any wait for its input, which the median mostly leaves out.)
    pub fn measured_costs(&self) -> Costs {
        let mut per_stage: BTreeMap<usize, [Vec<f64>; 4]> = BTreeMap::new();
        for (_, action, start, end) in self.run.actions() {
            if action.is_compound() {
                continue;
            }
            let slot = match action.kind() {
                ActionKind::Forward => 0,
                ActionKind::FullBackward => 1,
                ActionKind::BackwardInput => 2,
                ActionKind::BackwardWeight => 3,
                _ => continue,
            };
            per_stage.entry(action.stage()).or_default()[slot].push(end - start);
        }
        let median = |v: &mut Vec<f64>| -> Option<f64> {
            if v.is_empty() {
                return None;
            }
            v.sort_by(f64::total_cmp);
            Some(v[v.len() / 2])
        };
        let mut costs = Costs::uniform(0.0, 0.0, 0.0, 0.0);
        for (stage, mut lists) in per_stage {
            let forward = median(&mut lists[0]).unwrap_or(0.0);
            let input = median(&mut lists[2]);
            let weight = median(&mut lists[3]);
            let backward =
                median(&mut lists[1]).unwrap_or(input.unwrap_or(0.0) + weight.unwrap_or(0.0));
            costs.stage_overrides.insert(
                stage,
                StageCosts {
                    forward,
                    backward,
                    backward_input: input.unwrap_or(backward / 2.0),
                    backward_weight: weight.unwrap_or(backward / 2.0),
                },
            );
        }
        costs
    }

    /// The duration-aware simulation of this step's schedule with its own
    /// [`measured_costs`](Self::measured_costs): what the step would take
    /// with no overhead beyond the compute.
    pub fn simulated(&self, stage_to_rank: &[usize]) -> Result<TimedRun, TimedError> {
        simulate_timed(&self.run.schedule, stage_to_rank, &self.measured_costs())
    }

    /// The measured step as a `ferry-schedule` timed run (time unit: ms).
    pub fn timed_run(&self) -> &TimedRun {
        &self.run
    }

    /// The step's wall time, in milliseconds, from the first action's start
    /// to the last one's end.
    pub fn makespan_ms(&self) -> f64 {
        self.run.makespan
    }

    /// The fraction of rank time not spent computing.
    pub fn bubble(&self) -> f64 {
        self.run.bubble()
    }

    /// An SVG picture: one row per rank, one box per action where it ran.
    pub fn svg(&self) -> String {
        ferry_schedule::svg_timed(&self.run)
    }

    /// A Chrome trace (`chrome://tracing`, Perfetto) of the step.
    pub fn chrome_trace(&self) -> String {
        ferry_schedule::chrome_trace_timed(&self.run, 1000.0)
    }
}

/// The summary of `handoffs` (see [`Timeline::handoff_summary`]); public
/// through [`HandOffSummary::of`] for hand-offs gathered over many steps.
fn summarize<'a>(handoffs: impl Iterator<Item = &'a HandOff>) -> Option<HandOffSummary> {
    let list: Vec<&HandOff> = handoffs.collect();
    if list.is_empty() {
        return None;
    }
    let quantile = |mut v: Vec<f64>, q: f64| {
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * q).round() as usize]
    };
    let total: Vec<f64> = list.iter().map(|h| h.total_us).collect();
    Some(HandOffSummary {
        count: list.len(),
        median_us: quantile(total.clone(), 0.5),
        p90_us: quantile(total, 0.9),
        transit_median_us: quantile(list.iter().map(|h| h.transit_us).collect(), 0.5),
        wake_median_us: quantile(list.iter().map(|h| h.wake_us).collect(), 0.5),
    })
}

impl HandOffSummary {
    /// The summary of the idle-receiver hand-offs among `handoffs` (for
    /// example those of many steps' timelines).
    pub fn of<'a>(handoffs: impl IntoIterator<Item = &'a HandOff>) -> Option<HandOffSummary> {
        summarize(handoffs.into_iter().filter(|h| h.idle))
    }

    /// The summary of the hand-offs among `handoffs` whose receiver was
    /// already waiting at the send ([`HandOff::waiting`]).
    pub fn of_waiting<'a>(
        handoffs: impl IntoIterator<Item = &'a HandOff>,
    ) -> Option<HandOffSummary> {
        summarize(handoffs.into_iter().filter(|h| h.waiting))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handoff(idle: bool, waiting: bool, total_us: f64) -> HandOff {
        HandOff {
            stage: 1,
            microbatch: 0,
            activation: true,
            idle,
            waiting,
            transit_us: total_us - 5.0,
            wake_us: 5.0,
            total_us,
        }
    }

    #[test]
    fn summaries_count_idle_receivers_and_those_waiting_at_the_send() {
        let all = [
            handoff(false, false, 900.0),
            handoff(true, false, 400.0),
            handoff(true, false, 300.0),
            handoff(true, true, 60.0),
            handoff(true, true, 40.0),
            handoff(true, true, 50.0),
        ];
        let idle = HandOffSummary::of(&all).expect("idle hand-offs");
        assert_eq!(idle.count, 5);
        assert_eq!(idle.median_us, 60.0);
        let waiting = HandOffSummary::of_waiting(&all).expect("waiting hand-offs");
        assert_eq!(waiting.count, 3);
        assert_eq!(waiting.median_us, 50.0);
        assert_eq!(waiting.p90_us, 60.0);
        assert_eq!(waiting.transit_median_us, 45.0);
        assert!(HandOffSummary::of_waiting(&all[..3]).is_none());
    }
}
