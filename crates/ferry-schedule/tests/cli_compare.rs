//! `ferry-schedule compare` and `show --costs`, run as a user would.

mod support;

use std::process::Output;

use support::{run, stderr, stdout};

#[test]
fn compare_prints_the_planners_table() {
    let out = run(&[
        "compare",
        "--ranks",
        "4",
        "--microbatches",
        "8",
        "--costs",
        "F=1,B=2,I=1,W=1",
        "--memory",
        "6",
    ]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].contains("4 ranks, 8 microbatches, memory 6"),
        "{text}"
    );
    assert!(lines[1].contains("makespan"), "{text}");
    // 7 generators x stages per rank 1 and 2.
    assert_eq!(lines.len(), 2 + 14, "{text}");
    assert!(lines[2].trim_start().starts_with("1 "), "{text}");
    assert!(lines[2].ends_with("yes"), "{text}");
    let gpipe = lines
        .iter()
        .find(|l| l.contains("ScheduleGPipe ") && !l.contains("single-stage"))
        .expect("GPipe row");
    assert!(
        gpipe.contains("33.000") && gpipe.ends_with("over"),
        "{gpipe}"
    );
    assert!(
        text.contains("requires exactly 2 stages per rank"),
        "{text}"
    );
}

#[test]
fn compare_takes_latency_and_stages_per_rank() {
    let base = [
        "compare",
        "--ranks",
        "4",
        "--microbatches",
        "8",
        "--memory",
        "100",
        "--stages-per-rank",
        "1",
    ];
    let free = run(&base);
    let mut slow_args = base.to_vec();
    slow_args.extend(["--latency", "0.5"]);
    let slow = run(&slow_args);
    assert!(
        free.status.success() && slow.status.success(),
        "{}",
        stderr(&slow)
    );
    let row = |out: &Output| {
        stdout(out)
            .lines()
            .find(|l| l.contains("ScheduleGPipe "))
            .map(str::to_owned)
            .expect("GPipe row")
    };
    // Default costs F=1, B=2: 33; latency 0.5 adds 2 x 3 x 0.5 = 3.
    assert!(row(&free).contains("33.000"), "{}", row(&free));
    assert!(row(&slow).contains("36.000"), "{}", row(&slow));
    assert!(stdout(&slow).contains("latency=0.5"));
    assert_eq!(stdout(&free).lines().count(), 2 + 7);
}

#[test]
fn compare_names_the_bad_cost_item() {
    let out = run(&[
        "compare",
        "--ranks",
        "4",
        "--microbatches",
        "8",
        "--costs",
        "F=1,B=x",
        "--memory",
        "6",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("cost B=x: not a number"),
        "{}",
        stderr(&out)
    );
    let out = run(&[
        "compare",
        "--ranks",
        "4",
        "--microbatches",
        "8",
        "--memory",
        "6",
        "--latency=-1",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("cost latency=-1: must be a finite number >= 0"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn show_with_costs_prints_makespan_bubble_and_peak() {
    let out = run(&[
        "show",
        "--schedule",
        "1f1b",
        "--ranks",
        "4",
        "--microbatches",
        "8",
        "--costs",
        "F=1,B=2",
    ]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(
        text.contains("makespan 33.000, bubble 27.3%, peak activations 4"),
        "{text}"
    );
    assert!(
        text.contains("rank 3: busy 24.000, bubble 27.3%, peak activations 1"),
        "{text}"
    );
}

#[test]
fn show_with_costs_draws_the_timed_run() {
    let dir =
        std::env::temp_dir().join(format!("ferry-schedule-cli-compare-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let (svg, trace) = (dir.join("timed.svg"), dir.join("timed.json"));
    let out = run(&[
        "show",
        "--schedule",
        "gpipe",
        "--ranks",
        "2",
        "--microbatches",
        "2",
        "--costs",
        "F=1,B=2",
        "--svg",
        svg.to_str().expect("utf-8 path"),
        "--trace",
        trace.to_str().expect("utf-8 path"),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc = std::fs::read_to_string(&svg).expect("svg written");
    let json = std::fs::read_to_string(&trace).expect("trace written");
    std::fs::remove_dir_all(&dir).expect("scratch removed");
    // Time across: 1F1 starts at 1 and ends at 2; 1B1 on rank 1 lasts 2.
    assert!(doc.contains("<title>0F1 [1, 2]</title>"), "{doc}");
    assert!(doc.contains("<title>1B1 [5, 7]</title>"), "{doc}");
    let value: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    let b = value["traceEvents"]
        .as_array()
        .expect("events")
        .iter()
        .find(|e| e["name"] == "1B1")
        .expect("1B1");
    assert_eq!(b["dur"].as_f64(), Some(2000.0));
}
