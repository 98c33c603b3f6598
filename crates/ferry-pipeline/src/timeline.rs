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
        Timeline {
            run: TimedRun {
                schedule: lowered.clone(),
                spans,
                ranks,
                makespan,
            },
        }
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
