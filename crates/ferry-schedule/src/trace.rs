//! Chrome-trace JSON export (opens in Perfetto or `chrome://tracing`).

use std::fmt::Write as _;

use crate::action::ActionKind;
use crate::csv::Schedule;

/// The trace colour name of an action kind.
pub(crate) fn colour(kind: ActionKind) -> &'static str {
    match kind {
        ActionKind::Forward => "good",
        ActionKind::FullBackward => "bad",
        ActionKind::BackwardInput => "terrible",
        ActionKind::BackwardWeight => "yellow",
        ActionKind::OverlapFB => "olive",
        ActionKind::SendF | ActionKind::SendB | ActionKind::RecvF | ActionKind::RecvB => "grey",
        ActionKind::Unshard | ActionKind::Reshard | ActionKind::ReduceGrad => "white",
    }
}

/// A unit-step timeline (one slot per step, as [`crate::Timeline::to_schedule`]
/// draws one, or any schedule) as Chrome-trace JSON: one track (`tid`) per
/// rank, one complete event per action named by its text (microbatch
/// included), coloured by kind, `step_us` microseconds per step; idle
/// steps leave gaps.
pub fn chrome_trace(timeline: &Schedule, step_us: u64) -> String {
    let mut events = Vec::new();
    for (rank, row) in timeline.ranks.iter().enumerate() {
        events.push(format!(
            r#"{{"name":"thread_name","ph":"M","pid":0,"tid":{rank},"args":{{"name":"rank {rank}"}}}}"#
        ));
        for (step, action) in row.iter().enumerate() {
            let Some(action) = action else { continue };
            let mut event = String::new();
            let _ = write!(
                event,
                r#"{{"name":"{action}","cat":"{kind}","ph":"X","pid":0,"tid":{rank},"ts":{ts},"dur":{step_us},"cname":"{colour}"}}"#,
                kind = action.kind(),
                ts = step as u64 * step_us,
                colour = colour(action.kind()),
            );
            events.push(event);
        }
    }
    format!("{{\"traceEvents\":[\n{}\n]}}\n", events.join(",\n"))
}
