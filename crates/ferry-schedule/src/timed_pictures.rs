//! Pictures of a duration-aware run ([`crate::simulate_timed`]): a
//! Chrome trace and an SVG timeline with time, not steps, across.

use std::fmt::Write as _;

use crate::svg::{escape, fill, header, label, legend};
use crate::timed::TimedRun;
use crate::trace::colour;

const ROW_H: usize = 26;
const LABEL_W: usize = 64;
const MARGIN: usize = 10;
const LEGEND_H: usize = 30;
/// The width the time axis aims for, in pixels.
const TARGET_W: f64 = 1200.0;

/// A timed run as Chrome-trace JSON (Perfetto, `chrome://tracing`): one
/// track (`tid`) per rank; one complete event per action that takes time
/// (F, B, I, W, OVERLAP_F_B, UNSHARD, RESHARD, REDUCE_GRAD), named by its
/// text (microbatch included) and coloured by kind; one instant event
/// per send and receive. One time unit of the costs is `us_per_unit`
/// microseconds of the trace (rounded to nanoseconds).
pub fn chrome_trace_timed(run: &TimedRun, us_per_unit: f64) -> String {
    let mut events = Vec::new();
    for rank in 0..run.spans.len() {
        events.push(format!(
            r#"{{"name":"thread_name","ph":"M","pid":0,"tid":{rank},"args":{{"name":"rank {rank}"}}}}"#
        ));
    }
    for (rank, action, start, end) in run.actions() {
        let ts = nanos(start * us_per_unit);
        let kind = action.kind();
        let mut event = String::new();
        if kind.is_comm() {
            let _ = write!(
                event,
                r#"{{"name":"{action}","cat":"{kind}","ph":"i","s":"t","pid":0,"tid":{rank},"ts":{ts}}}"#
            );
        } else {
            let _ = write!(
                event,
                r#"{{"name":"{action}","cat":"{kind}","ph":"X","pid":0,"tid":{rank},"ts":{ts},"dur":{dur},"cname":"{colour}"}}"#,
                dur = nanos((end - start) * us_per_unit),
                colour = colour(kind),
            );
        }
        events.push(event);
    }
    format!("{{\"traceEvents\":[\n{}\n]}}\n", events.join(",\n"))
}

/// A timed run as a standalone SVG document: ranks down, time across
/// (scaled so the makespan is about 1200 pixels, with a time axis), one
/// `<g class="rank">` group per rank holding one box per action that
/// takes time, as wide as its duration, coloured as [`crate::svg()`]
/// colours kinds, with the microbatch number inside where it fits and
/// the action's text, start and end as its `<title>` tooltip. Idle time
/// shows as the hatched row behind the boxes. Sends and receives take no
/// time on a rank and are not drawn.
pub fn svg_timed(run: &TimedRun) -> String {
    let ranks = run.spans.len();
    let scale = if run.makespan > 0.0 {
        TARGET_W / run.makespan
    } else {
        1.0
    };
    let axis_w = (run.makespan * scale).ceil() as usize;
    let width = (LABEL_W + axis_w).max(9 * 62) + 2 * MARGIN;
    let top = MARGIN + ROW_H;
    let height = top + ranks * ROW_H + LEGEND_H + 2 * MARGIN;
    let x_of = |t: f64| MARGIN as f64 + LABEL_W as f64 + t * scale;
    let mut out = String::new();
    header(&mut out, width, height);
    // Time axis: about ten ticks at a round step.
    let tick = tick_step(run.makespan);
    let ticks = if tick > 0.0 {
        (run.makespan / tick + 1e-9).floor() as usize
    } else {
        0
    };
    for i in 0..=ticks {
        let t = i as f64 * tick;
        let _ = writeln!(
            out,
            r##"<text x="{x:.1}" y="{y}" text-anchor="middle" fill="#666">{t}</text>"##,
            x = x_of(t),
            y = MARGIN + ROW_H / 2 + 4,
            t = (t * 1e6).round() / 1e6,
        );
    }
    for rank in 0..ranks {
        let y = top + rank * ROW_H;
        let _ = writeln!(out, r#"<g class="rank" id="rank-{rank}">"#);
        let _ = writeln!(
            out,
            r#"<text x="{MARGIN}" y="{ty}">rank {rank}</text>"#,
            ty = y + ROW_H / 2 + 4
        );
        let _ = writeln!(
            out,
            r##"<rect class="bubble" x="{x}" y="{y}" width="{axis_w}" height="{ROW_H}" fill="url(#bubble)"/>"##,
            x = MARGIN + LABEL_W,
        );
        for span in &run.spans[rank] {
            let Some(Some(action)) = run.schedule.ranks[rank].get(span.step) else {
                continue;
            };
            if action.kind().is_comm() || span.end <= span.start {
                continue;
            }
            let (x, w) = (x_of(span.start), (span.end - span.start) * scale);
            let text = escape(&action.to_string());
            let mut inner = String::new();
            if w >= 14.0 {
                let _ = write!(
                    inner,
                    r#"<text x="{tx:.1}" y="{ty}" text-anchor="middle">{l}</text>"#,
                    tx = x + w / 2.0,
                    ty = y + ROW_H / 2 + 4,
                    l = escape(&label(action)),
                );
            }
            let _ = writeln!(
                out,
                r##"<g class="action"><title>{text} [{s}, {e}]</title><rect x="{x:.2}" y="{y}" width="{w:.2}" height="{ROW_H}" fill="{fill}" stroke="#ffffff"/>{inner}</g>"##,
                s = span.start,
                e = span.end,
                fill = fill(action.kind()),
            );
        }
        out.push_str("</g>\n");
    }
    legend(&mut out, top + ranks * ROW_H + MARGIN);
    out.push_str("</svg>\n");
    out
}

/// Microseconds rounded to whole nanoseconds (no float noise in traces).
fn nanos(us: f64) -> f64 {
    (us * 1000.0).round() / 1000.0
}

/// A round tick step (1, 2 or 5 times a power of ten) giving about ten
/// ticks over `span`.
fn tick_step(span: f64) -> f64 {
    if span <= 0.0 || !span.is_finite() {
        return 0.0;
    }
    let raw = span / 10.0;
    let power = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|&step| step >= raw)
        .unwrap_or(10.0 * power)
}
