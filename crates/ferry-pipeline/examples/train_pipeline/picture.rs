//! Pictures of one measured step beside the simulator's prediction: one
//! SVG with both timelines on the same time axis, and a terminal rendering.

use std::fmt::Write as _;

use ferry_schedule::{ActionKind, TimedRun};

const TITLE_H: usize = 24;

/// One SVG: the measured step on top, the simulation below, each under a
/// title, both drawn on the same time axis (the longer makespan) so their
/// lengths compare at a glance.
pub(crate) fn side_by_side(measured: &TimedRun, simulated: &TimedRun, titles: [&str; 2]) -> String {
    let axis = measured.makespan.max(simulated.makespan);
    let pictures: Vec<String> = [measured, simulated]
        .into_iter()
        .enumerate()
        .map(|(i, run)| {
            let mut run = run.clone();
            run.makespan = axis;
            // Two pictures in one document: their ids must not collide.
            ferry_schedule::svg_timed(&run)
                .replace("id=\"bubble\"", &format!("id=\"bubble{i}\""))
                .replace("url(#bubble)", &format!("url(#bubble{i})"))
                .replace("id=\"rank-", &format!("id=\"picture{i}-rank-"))
        })
        .collect();
    let sizes: Vec<(usize, usize)> = pictures.iter().map(|p| size_of(p)).collect();
    let width = sizes.iter().map(|s| s.0).max().unwrap_or(0);
    let height: usize = sizes.iter().map(|s| s.1 + TITLE_H).sum();
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="monospace" font-size="13">"#
    );
    let _ = writeln!(
        out,
        r#"<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>"#
    );
    let mut y = 0;
    for ((picture, (_, h)), title) in pictures.iter().zip(&sizes).zip(titles) {
        let _ = writeln!(
            out,
            r#"<text x="10" y="{ty}" font-weight="bold">{title}</text>"#,
            ty = y + TITLE_H - 6,
            title = escape(title),
        );
        y += TITLE_H;
        // A nested <svg> placed at (0, y).
        let nested = picture.replacen("<svg ", &format!("<svg x=\"0\" y=\"{y}\" "), 1);
        out.push_str(&nested);
        y += h;
    }
    out.push_str("</svg>\n");
    out
}

/// The `width` and `height` attributes of an SVG document's root.
fn size_of(svg: &str) -> (usize, usize) {
    let attr = |name: &str| {
        let key = format!(" {name}=\"");
        svg.find(&key)
            .and_then(|at| {
                let rest = &svg[at + key.len()..];
                rest[..rest.find('"')?].parse().ok()
            })
            .unwrap_or(0)
    };
    (attr("width"), attr("height"))
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A timed run in `columns` characters of time per rank, on an axis of
/// `axis` time units: each action that takes time is its kind and
/// microbatch (`F3`, `B0`, `I2`, `W1`) followed by its kind in lower case
/// for as long as it lasts; `.` is idle. With `colour`, ANSI colours by
/// kind as in the SVG (F blue, B orange, I amber, W green).
pub(crate) fn text(run: &TimedRun, axis: f64, columns: usize, colour: bool) -> String {
    let scale = if axis > 0.0 {
        columns as f64 / axis
    } else {
        0.0
    };
    let mut out = String::new();
    for (rank, spans) in run.spans.iter().enumerate() {
        let mut cells: Vec<(char, Option<ActionKind>)> = vec![('.', None); columns];
        for span in spans {
            let Some(Some(action)) = run.schedule.ranks[rank].get(span.step) else {
                continue;
            };
            let kind = action.kind();
            if kind.is_comm() || span.end <= span.start {
                continue;
            }
            let first = ((span.start * scale).floor() as usize).min(columns.saturating_sub(1));
            let last = ((span.end * scale).round() as usize).clamp(first + 1, columns);
            let letter = letter(kind);
            let label: Vec<char> = match action.microbatch() {
                Some(mb) => format!("{letter}{mb}").chars().collect(),
                None => vec![letter],
            };
            for (i, cell) in cells[first..last].iter_mut().enumerate() {
                let c = label
                    .get(i)
                    .copied()
                    .unwrap_or_else(|| letter.to_ascii_lowercase());
                *cell = (c, Some(kind));
            }
        }
        let _ = write!(out, "  rank {rank} |");
        let mut current = None;
        for (c, kind) in cells {
            if colour && kind != current {
                out.push_str(ansi(kind));
                current = kind;
            }
            out.push(c);
        }
        if colour && current.is_some() {
            out.push_str(ansi(None));
        }
        out.push_str("|\n");
    }
    out
}

fn letter(kind: ActionKind) -> char {
    match kind {
        ActionKind::Forward => 'F',
        ActionKind::FullBackward => 'B',
        ActionKind::BackwardInput => 'I',
        ActionKind::BackwardWeight => 'W',
        ActionKind::OverlapFB => 'O',
        _ => '*',
    }
}

fn ansi(kind: Option<ActionKind>) -> &'static str {
    match kind {
        None => "\x1b[0m",
        Some(ActionKind::Forward) => "\x1b[30;48;5;75m",
        Some(ActionKind::FullBackward) => "\x1b[30;48;5;209m",
        Some(ActionKind::BackwardInput) => "\x1b[30;48;5;214m",
        Some(ActionKind::BackwardWeight) => "\x1b[30;48;5;113m",
        Some(_) => "\x1b[30;48;5;141m",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_schedule::{simulate_timed, Costs, Placement, ScheduleKind};

    fn run(costs: &str) -> TimedRun {
        let compute = ScheduleKind::OneFOneB.generate(2, 1, 2).unwrap();
        let placement = Placement::Loop.stage_to_rank(2, 2).unwrap();
        simulate_timed(&compute, &placement, &costs.parse::<Costs>().unwrap()).unwrap()
    }

    #[test]
    fn the_terminal_rendering_puts_every_action_at_its_time() {
        // 1F1B, 2 ranks, 2 microbatches, F = 1, B = 2 (makespan 9):
        // rank 0 runs F0 0..1, F1 1..2, B0 4..6, B1 7..9; rank 1 runs
        // F0 1..2, B0 2..4, F1 4..5, B1 5..7.
        let r = run("F=1,B=2");
        assert_eq!(r.makespan, 9.0);
        // Two columns per time unit: labels, then the kind in lower case.
        assert_eq!(
            text(&r, r.makespan, 18, false),
            "  rank 0 |F0F1....B0bb..B1bb|\n  rank 1 |..F0B0bbF1B1bb....|\n"
        );
        // One column per unit: a label is cut to the action's length.
        assert_eq!(
            text(&r, r.makespan, 9, false),
            "  rank 0 |FF..B0.B1|\n  rank 1 |.FB0FB1..|\n"
        );
        // On a longer axis the run ends early, idle after.
        assert_eq!(
            text(&r, 18.0, 18, false),
            "  rank 0 |FF..B0.B1.........|\n  rank 1 |.FB0FB1...........|\n"
        );
        // Colours: one escape where the kind changes, reset at the end.
        let coloured = text(&r, r.makespan, 9, true);
        assert!(coloured.starts_with("  rank 0 |\x1b[30;48;5;75mFF\x1b[0m..\x1b[30;48;5;209mB0"));
        assert!(coloured.contains("B1\x1b[0m|\n"));
    }

    #[test]
    fn the_svg_holds_both_pictures_on_one_axis_with_distinct_ids() {
        let fast = run("F=1,B=2");
        let slow = run("F=2,B=4");
        let svg = side_by_side(&slow, &fast, ["measured", "simulated <pred>"]);
        assert_eq!(svg.matches("<svg ").count(), 3);
        assert_eq!(svg.matches("</svg>").count(), 3);
        assert!(svg.contains("id=\"bubble0\"") && svg.contains("id=\"bubble1\""));
        assert!(!svg.contains("url(#bubble)"));
        assert!(svg.contains("simulated &lt;pred&gt;"));
        // Same axis: both nested pictures are as wide.
        let widths: Vec<&str> = svg
            .match_indices("<svg x=\"0\"")
            .map(|(at, _)| {
                let rest = &svg[at..];
                let w = rest.find(" width=\"").unwrap() + 8;
                &rest[w..w + rest[w..].find('"').unwrap()]
            })
            .collect();
        assert_eq!(widths.len(), 2);
        assert_eq!(widths[0], widths[1]);
    }
}
