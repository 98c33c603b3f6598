//! Pictures of a timed run: the SVG (well-formed, one group per rank,
//! every timed action drawn at its time) and the Chrome trace.

use ferry_schedule::{
    add_send_recv, chrome_trace_timed, simulate_timed, svg_timed, Costs, ScheduleKind, TimedRun,
};

fn zbv_run() -> TimedRun {
    let kind = ScheduleKind::ZbvZeroBubble;
    let compute = kind.generate(4, 2, 8).expect("generates");
    let placement = kind.placement().stage_to_rank(8, 4).expect("placement");
    let costs: Costs = "F=1,B=2,I=1,W=1,latency=0.2".parse().expect("costs");
    // Lowered, so that the run has sends and receives to leave out.
    let lowered = add_send_recv(&compute, &placement).expect("lowers");
    simulate_timed(&lowered, &placement, &costs).expect("runs")
}

/// Tags close in order and attribute quotes balance.
fn balanced(doc: &str) -> Result<(), String> {
    let mut stack: Vec<&str> = Vec::new();
    let mut rest = doc;
    while let Some(open) = rest.find('<') {
        let close = rest[open..].find('>').ok_or("unclosed tag")? + open;
        let tag = &rest[open + 1..close];
        if let Some(name) = tag.strip_prefix('/') {
            let top = stack.pop().ok_or(format!("</{name}> closes nothing"))?;
            if top != name {
                return Err(format!("</{name}> closes <{top}>"));
            }
        } else {
            if tag.matches('"').count() % 2 != 0 {
                return Err(format!("unbalanced quotes in {tag:?}"));
            }
            let name = tag.split_whitespace().next().ok_or("empty tag")?;
            if !tag.ends_with('/') {
                stack.push(name);
            }
        }
        rest = &rest[close + 1..];
    }
    if stack.is_empty() {
        Ok(())
    } else {
        Err(format!("unclosed {stack:?}"))
    }
}

#[test]
fn timed_svg_draws_every_timed_action_in_its_rank_group() {
    let run = zbv_run();
    let doc = svg_timed(&run);
    balanced(&doc).unwrap_or_else(|e| panic!("{e}"));
    assert!(doc.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    let groups: Vec<&str> = doc.split("<g class=\"rank\"").skip(1).collect();
    assert_eq!(groups.len(), 4);
    for (rank, group) in groups.iter().enumerate() {
        let group = &group[..group.find("\n</g>").expect("group ends")];
        let mut drawn = 0;
        for (r, action, start, end) in run.actions() {
            if r != rank || action.kind().is_comm() {
                continue;
            }
            let title = format!("<title>{action} [{start}, {end}]</title>");
            assert!(group.contains(&title), "rank {rank}: {title} missing");
            drawn += 1;
        }
        assert_eq!(
            group.matches("<g class=\"action\">").count(),
            drawn,
            "rank {rank}"
        );
        // Sends and receives take no time and are not drawn.
        assert!(!group.contains("SEND_F"), "rank {rank}");
        // Idle time shows: the hatched row behind the boxes.
        assert!(group.contains("fill=\"url(#bubble)\""));
    }
}

#[test]
fn timed_svg_scales_time_across() {
    let run = zbv_run();
    let doc = svg_timed(&run);
    // The box of the first action on rank 0 starts at time 0, at the
    // left edge of the time axis (margin 10 + label 64), one unit wide.
    let first = doc.split("<g class=\"action\">").nth(1).expect("an action");
    assert!(
        first.starts_with("<title>0F0 [0, 1]</title><rect x=\"74.00\""),
        "{first}"
    );
    let scale = 1200.0 / run.makespan;
    assert!(first.contains(&format!("width=\"{scale:.2}\"")), "{first}");
}

#[test]
fn timed_trace_has_a_track_per_rank_and_every_action() {
    let run = zbv_run();
    let json = chrome_trace_timed(&run, 1000.0);
    let value: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
    let events = value["traceEvents"].as_array().expect("events");
    let tracks = events.iter().filter(|e| e["ph"] == "M").count();
    assert_eq!(tracks, 4);
    assert!(
        events.iter().any(|e| e["ph"] == "i"),
        "sends and receives are instants"
    );
    let actions: Vec<_> = run.actions().collect();
    assert_eq!(events.len(), 4 + actions.len());
    for (rank, action, start, end) in actions {
        let name = action.to_string();
        let event = events
            .iter()
            .find(|e| e["name"] == name.as_str() && e["tid"] == rank)
            .unwrap_or_else(|| panic!("{name} on rank {rank}"));
        let near =
            |v: &serde_json::Value, t: f64| v.as_f64().is_some_and(|x| (x - t).abs() <= 1e-3);
        assert!(near(&event["ts"], start * 1000.0), "{name}: {event}");
        if action.kind().is_comm() {
            assert_eq!(event["ph"], "i");
        } else {
            assert_eq!(event["ph"], "X");
            assert!(
                near(&event["dur"], (end - start) * 1000.0),
                "{name}: {event}"
            );
        }
    }
}
