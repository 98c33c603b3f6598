//! # ferry-schedule
//!
//! Pipeline schedules as data, sans-IO (no tokio, no libtorch, no sockets).
//! A pipeline schedule is one list of [`Action`]s per rank: which stage runs
//! which kind of work (forward, backward, sends, receives, ...) on which
//! microbatch, step by step, with `None` for an idle step.
//!
//! The text form of an action is exactly PyTorch's
//! (`torch.distributed.pipelining`): `0F1`, `2I0`, `1SEND_F0`, `3RECV_B2`,
//! `1UNSHARD`, `0REDUCE_GRAD`, `(0F3;3B1)OVERLAP_F_B`; and a [`Schedule`]
//! reads and writes PyTorch's CSV form (`_dump_csv` / `_load_csv`) byte for
//! byte, so a schedule drawn with PyTorch's tools runs in Ferry, and the
//! reverse.
//!
//! ## Layout
//!
//! - [`action`]: [`ActionKind`], [`Action`], parsing and printing.
//! - [`placement`]: which rank owns which stage ([`Placement::Loop`],
//!   [`Placement::V`]).
//! - [`csv`]: [`Schedule`] and its CSV import and export.
//! - [`lower`]: [`add_send_recv`], PyTorch's SEND/RECV insertion;
//!   [`add_unshard_reshard`], FSDP's UNSHARD/RESHARD with a prefetch window;
//!   [`defer_recvs`], receives moved late with a deadlock-free rule.
//! - [`simulate`]: [`simulate_unit_steps`], the unit-step simulator
//!   (PyTorch's `_simulate_comms_compute`, plus UNSHARD, RESHARD,
//!   REDUCE_GRAD, OVERLAP_F_B) with [`Deadlock`] detection; it returns a
//!   [`Timeline`] (the step of every action, drawn with
//!   [`Timeline::to_schedule`]).
//! - [`deadlock`]: [`check_deadlock`], rejects a lowered schedule that
//!   cannot finish before it runs, naming the actions that wait on each
//!   other (buffered or rendezvous sends, [`CommModel`]).
//! - [`validate`](mod@validate): [`validate()`], the rules every schedule must keep,
//!   with errors that show the grid and mark the offending slot;
//!   [`check_sends`], every value that crosses ranks in a schedule with
//!   its own comms is sent.
//! - [`trace`]: [`chrome_trace`], Chrome-trace JSON (Perfetto); and
//!   [`validate::grid`] for a compact terminal rendering.
//! - [`svg`](mod@svg): [`svg()`], an SVG timeline (ranks down, steps across,
//!   bubbles visible).
//! - [`generate`]: the schedules PyTorch ships ([`ScheduleKind`]), equal
//!   to PyTorch 2.13's compute-only tables slot for slot; GPipe and 1F1B
//!   in the order PyTorch's runtime executes them.
//! - [`cost`]: [`Costs`], the duration model (F, B, I, W per stage,
//!   latency and bandwidth per stage boundary, UNSHARD/RESHARD/
//!   REDUCE_GRAD) and its text form `F=1,B=2,I=1,W=1,latency=0.1`.
//! - [`timed`]: [`simulate_timed`], the duration-aware simulator
//!   (event-driven, O(actions)): per-action start and end, each rank's
//!   busy time, bubble and peak live activations, the makespan.
//! - [`timed_pictures`]: [`svg_timed`] and [`chrome_trace_timed`], the
//!   timed run with time across.
//! - [`planner`]: [`plan`], every schedule at every stages-per-rank ranked
//!   by simulated makespan within a memory limit ([`plan_table`]).
//!
//! The `ferry-schedule` binary wraps these: `show` (grid, `--svg`,
//! `--trace`, `--costs` for the timed run), `check` (validate and simulate
//! a PyTorch CSV) and `compare` (the planner's table).
//!
//! ## Example
//!
//! ```
//! use ferry_schedule::{Action, ActionKind, Placement, Schedule};
//!
//! let a: Action = "1SEND_F0".parse()?;
//! assert_eq!(a, Action::new(1, ActionKind::SendF, Some(0)));
//! assert_eq!(a.to_string(), "1SEND_F0");
//!
//! let overlap: Action = "(0F3;3B1)OVERLAP_F_B".parse()?;
//! assert_eq!(overlap.sub_actions().len(), 2);
//!
//! // 4 stages on 2 ranks in a V: stage 3 comes back to rank 0.
//! assert_eq!(Placement::V.stage_to_rank(4, 2)?, vec![0, 1, 1, 0]);
//!
//! let schedule = Schedule::from_csv("0F0,,0B0\r\n,1F0,1B0\r\n")?;
//! assert_eq!(schedule.to_csv(), "0F0,,0B0\r\n,1F0,1B0\r\n");
//!
//! // 1F1B on 4 ranks, 8 microbatches, F = 1 and B = 2: the bubble is
//! // (p - 1) / (m + p - 1) and at most p activations are live per rank.
//! use ferry_schedule::{simulate_timed, Costs, ScheduleKind};
//! let compute = ScheduleKind::OneFOneB.generate(4, 1, 8)?;
//! let placement = Placement::Loop.stage_to_rank(4, 4)?;
//! let run = simulate_timed(&compute, &placement, &"F=1,B=2".parse::<Costs>()?)?;
//! assert_eq!(run.makespan, 33.0);
//! assert!((run.bubble() - 3.0 / 11.0).abs() < 1e-12);
//! assert_eq!(run.peak_activations(), 4);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod action;
pub mod cost;
pub mod csv;
pub mod deadlock;
mod done;
pub mod generate;
pub mod lower;
mod pairs;
pub mod placement;
pub mod planner;
mod prefetch;
pub mod simulate;
pub mod svg;
pub mod timed;
pub mod timed_pictures;
pub mod timeline;
pub mod trace;
pub mod validate;

pub use action::{Action, ActionKind, ParseActionError, MAX_MICROBATCH, MAX_STAGE};
pub use cost::{CostError, Costs, Link, StageCosts};
pub use csv::{CsvError, Schedule};
pub use deadlock::{check_deadlock, check_deadlock_with, partner, CommModel, DeadlockError, Wait};
pub use generate::{GenerateError, ScheduleKind};
pub use lower::{add_reduce_grad, add_send_recv, merge_input_weight, LowerError};
pub use lower::{add_unshard_reshard, defer_recvs, DeferOptions, DEFAULT_MAX_ACTIVE_STAGES};
pub use placement::{Placement, PlacementError};
pub use planner::{plan, plan_table, PlanRequest, PlanRow, PlanStats};
pub use simulate::{simulate_unit_steps, steps, Deadlock};
pub use svg::svg;
pub use timed::{simulate_timed, RankStats, Span, TimedError, TimedRun, Waiting};
pub use timed_pictures::{chrome_trace_timed, svg_timed};
pub use timeline::Timeline;
pub use trace::chrome_trace;
pub use validate::{check_sends, grid, validate, ValidationError};
