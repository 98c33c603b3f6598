//! SVG timeline: ranks down, unit steps across, one coloured box per
//! action with its microbatch number, idle steps drawn as grey bubbles.

use std::fmt::Write as _;

use crate::action::{Action, ActionKind};
use crate::csv::Schedule;

const CELL_W: usize = 30;
const CELL_H: usize = 26;
const LABEL_W: usize = 64;
const MARGIN: usize = 10;
const LEGEND_H: usize = 30;

/// The fill colour of an action kind.
pub(crate) fn fill(kind: ActionKind) -> &'static str {
    match kind {
        ActionKind::Forward => "#4c9be8",
        ActionKind::FullBackward => "#e8744c",
        ActionKind::BackwardInput => "#f2b13a",
        ActionKind::BackwardWeight => "#8bc34a",
        ActionKind::OverlapFB => "#9c6ade",
        ActionKind::SendF | ActionKind::SendB => "#b0bec5",
        ActionKind::RecvF | ActionKind::RecvB => "#cfd8dc",
        ActionKind::Unshard | ActionKind::Reshard | ActionKind::ReduceGrad => "#fff59d",
    }
}

/// The short text drawn in an action's box: the microbatch number, with
/// `s`/`r` before it for sends and receives, `RG`/`U`/`R` for per-stage
/// actions, and `Fm/Bn` for OVERLAP_F_B.
pub(crate) fn label(action: &Action) -> String {
    let mb = |a: &Action| a.microbatch().map(|m| m.to_string()).unwrap_or_default();
    match action.kind() {
        ActionKind::SendF | ActionKind::SendB => format!("s{}", mb(action)),
        ActionKind::RecvF | ActionKind::RecvB => format!("r{}", mb(action)),
        ActionKind::ReduceGrad => "RG".to_string(),
        ActionKind::Unshard => "U".to_string(),
        ActionKind::Reshard => "R".to_string(),
        ActionKind::OverlapFB => action
            .sub_actions()
            .iter()
            .map(mb)
            .collect::<Vec<_>>()
            .join("/"),
        _ => mb(action),
    }
}

/// Escapes text for XML character data and attribute values.
pub(crate) fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A timeline (one slot per unit step, as [`crate::Timeline::to_schedule`]
/// draws one, or any schedule) as a standalone SVG document: one
/// `<g class="rank">` group per rank, top to bottom; in it one box per
/// step, coloured by kind (F blue, B orange, I amber, W green,
/// OVERLAP_F_B purple, sends and receives grey, UNSHARD/RESHARD/
/// REDUCE_GRAD pale yellow) with the microbatch number inside and the
/// action's full text as its `<title>` tooltip; idle steps (and the steps
/// after a rank's last action) are hatched grey bubbles. A legend follows.
pub fn svg(timeline: &Schedule) -> String {
    let steps = timeline.ranks.iter().map(Vec::len).max().unwrap_or(0);
    let ranks = timeline.ranks.len();
    let width = (LABEL_W + steps * CELL_W).max(9 * 62) + 2 * MARGIN;
    let grid_h = ranks * CELL_H;
    let height = grid_h + LEGEND_H + 2 * MARGIN + CELL_H;
    let mut out = String::new();
    header(&mut out, width, height);
    // Step numbers across the top.
    for step in (0..steps).step_by(5) {
        let x = MARGIN + LABEL_W + step * CELL_W + CELL_W / 2;
        let _ = writeln!(
            out,
            r##"<text x="{x}" y="{y}" text-anchor="middle" fill="#666">{step}</text>"##,
            y = MARGIN + CELL_H / 2 + 4
        );
    }
    let top = MARGIN + CELL_H;
    for (rank, row) in timeline.ranks.iter().enumerate() {
        let y = top + rank * CELL_H;
        let _ = writeln!(out, r#"<g class="rank" id="rank-{rank}">"#);
        let _ = writeln!(
            out,
            r#"<text x="{x}" y="{ty}">rank {rank}</text>"#,
            x = MARGIN,
            ty = y + CELL_H / 2 + 4
        );
        for step in 0..steps {
            let x = MARGIN + LABEL_W + step * CELL_W;
            match row.get(step).and_then(Option::as_ref) {
                None => {
                    let _ = writeln!(
                        out,
                        r##"<rect class="bubble" x="{x}" y="{y}" width="{CELL_W}" height="{CELL_H}" fill="url(#bubble)" stroke="#ffffff"/>"##
                    );
                }
                Some(action) => {
                    let text = escape(&action.to_string());
                    let _ = writeln!(
                        out,
                        r##"<g class="action"><title>{text}</title><rect x="{x}" y="{y}" width="{CELL_W}" height="{CELL_H}" fill="{fill}" stroke="#ffffff"/><text x="{tx}" y="{ty}" text-anchor="middle">{label}</text></g>"##,
                        fill = fill(action.kind()),
                        tx = x + CELL_W / 2,
                        ty = y + CELL_H / 2 + 4,
                        label = escape(&label(action)),
                    );
                }
            }
        }
        out.push_str("</g>\n");
    }
    legend(&mut out, top + grid_h + MARGIN);
    out.push_str("</svg>\n");
    out
}

/// Opens an SVG picture of `width` x `height` on a white page, with the
/// hatched `bubble` pattern idle time is drawn in (shared by [`svg()`] and
/// the timed pictures).
pub(crate) fn header(out: &mut String, width: usize, height: usize) {
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="monospace" font-size="11">"#
    );
    out.push_str(concat!(
        r##"<defs><pattern id="bubble" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">"##,
        r##"<rect width="6" height="6" fill="#f4f4f4"/><line x1="0" y1="0" x2="0" y2="6" stroke="#d0d0d0" stroke-width="3"/></pattern></defs>"##,
        "\n"
    ));
    let _ = writeln!(
        out,
        r#"<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>"#
    );
}

pub(crate) fn legend(out: &mut String, y: usize) {
    let entries = [
        ("F", fill(ActionKind::Forward)),
        ("B", fill(ActionKind::FullBackward)),
        ("I", fill(ActionKind::BackwardInput)),
        ("W", fill(ActionKind::BackwardWeight)),
        ("F+B", fill(ActionKind::OverlapFB)),
        ("send", fill(ActionKind::SendF)),
        ("recv", fill(ActionKind::RecvF)),
        ("other", fill(ActionKind::ReduceGrad)),
        ("idle", "url(#bubble)"),
    ];
    out.push_str("<g class=\"legend\">\n");
    for (i, (name, colour)) in entries.iter().enumerate() {
        let x = MARGIN + i * 62;
        let _ = writeln!(
            out,
            r##"<rect x="{x}" y="{y}" width="14" height="14" fill="{colour}" stroke="#999"/><text x="{tx}" y="{ty}">{name}</text>"##,
            tx = x + 18,
            ty = y + 11
        );
    }
    out.push_str("</g>\n");
}
