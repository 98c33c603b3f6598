//! Chrome-trace export: valid JSON, one track per rank, every action.

use ferry_schedule::{add_send_recv, chrome_trace, simulate_unit_steps, ScheduleKind};

#[test]
fn trace_has_every_action_on_its_rank_track() {
    let kind = ScheduleKind::ZbvZeroBubble;
    let placement = kind.placement().stage_to_rank(8, 4).expect("placement");
    let compute = kind.generate(4, 2, 8).expect("generates");
    let lowered = add_send_recv(&compute, &placement).expect("lowers");
    let timeline = simulate_unit_steps(&lowered, &placement)
        .expect("runs")
        .to_schedule();
    let json: serde_json::Value =
        serde_json::from_str(&chrome_trace(&timeline, 10)).expect("valid JSON");
    let events = json["traceEvents"].as_array().expect("events");
    let tracks = events.iter().filter(|e| e["ph"] == "M").count();
    assert_eq!(tracks, 4);
    let actions: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(
        actions.len(),
        lowered.ranks.iter().flatten().flatten().count()
    );
    for (rank, row) in timeline.ranks.iter().enumerate() {
        for (step, action) in row.iter().enumerate() {
            let Some(action) = action else { continue };
            let text = action.to_string();
            assert!(
                actions.iter().any(|e| e["name"] == text.as_str()
                    && e["tid"] == rank
                    && e["ts"] == step * 10),
                "{text} at rank {rank} step {step}"
            );
        }
    }
}
