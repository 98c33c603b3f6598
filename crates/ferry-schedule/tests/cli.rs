//! The `ferry-schedule` binary, run as a user would.

mod support;

use std::path::{Path, PathBuf};

use support::{run, stderr, stdout};

fn golden(path: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(path)
        .to_string_lossy()
        .into_owned()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-schedule-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir.join(name)
}

#[test]
fn show_prints_the_grid_and_writes_svg_and_trace() {
    let svg = scratch("zbv.svg");
    let trace = scratch("zbv.json");
    let out = run(&[
        "show",
        "--schedule",
        "zbv",
        "--ranks",
        "4",
        "--stages-per-rank",
        "2",
        "--microbatches",
        "8",
        "--svg",
        svg.to_str().expect("utf-8"),
        "--trace",
        trace.to_str().expect("utf-8"),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("ScheduleZBVZeroBubble"), "{text}");
    for rank in 0..4 {
        assert!(text.contains(&format!("rank {rank}:")), "{text}");
    }
    assert!(
        text.contains("7F0") && text.contains("unit steps"),
        "{text}"
    );
    let drawn = std::fs::read_to_string(&svg).expect("svg written");
    assert_eq!(drawn.matches("<g class=\"rank\"").count(), 4);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).expect("trace written"))
            .expect("trace is JSON");
    assert!(json["traceEvents"].as_array().expect("events").len() > 4 * 48);
    std::fs::remove_file(svg).expect("remove svg");
    std::fs::remove_file(trace).expect("remove trace");
}

#[test]
fn show_reports_a_shape_the_schedule_refuses() {
    let out = run(&[
        "show",
        "--schedule",
        "1f1b",
        "--ranks",
        "4",
        "--microbatches",
        "2",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("must be greater than or equal to the number of stages"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn check_accepts_compute_only_and_lowered_csv() {
    // The runtime 1F1B order, lowered by the binary.
    let out = run(&["check", &golden("1f1b_r4_s1_m8.csv")]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("valid: 4 ranks, 4 stages, 8 microbatches (lowered)"),
        "{text}"
    );
    // A table with comms from PyTorch's `_add_send_recv`: the step count
    // PyTorch's simulator gives it (comms/steps.txt).
    let out = run(&["check", &golden("comms/interleaved1f1b_r2_s1_m4.csv")]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("21 unit steps"), "{}", stdout(&out));
}

#[test]
fn check_rejects_pytorchs_1f1b_table_with_the_validator_error() {
    let out = run(&["check", &golden("pytorch_table/1f1b_r2_s1_m4.csv")]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("B of microbatch 0 comes before its F"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn check_reports_malformed_and_missing_files() {
    let bad = scratch("bad.csv");
    std::fs::write(&bad, "0F0,0X1\r\n").expect("write");
    let out = run(&["check", bad.to_str().expect("utf-8")]);
    std::fs::remove_file(&bad).expect("remove bad.csv");
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("parsing") && stderr(&out).contains("0X1"),
        "{}",
        stderr(&out)
    );
    let out = run(&["check", "/nonexistent/ferry.csv"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("reading /nonexistent/ferry.csv"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn check_names_the_actions_of_a_deadlock() {
    // Rank 0 receives B1 before it sends F2; rank 1 receives F2 before it
    // sends B1: each waits for the other.
    let path = scratch("deadlock.csv");
    std::fs::write(
        &path,
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0F2,0SEND_F2,0B1,0RECV_B2,0B2\r\n\
         1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1RECV_F2,1B1,1SEND_B1,1F2,1B2,1SEND_B2\r\n",
    )
    .expect("write the CSV");
    let out = run(&["check", path.to_str().expect("utf-8 path")]);
    let _ = std::fs::remove_file(&path);
    assert!(!out.status.success(), "{}", stdout(&out));
    let err = stderr(&out);
    assert!(
        err.contains("rank 0 waits at 0RECV_B1 for 1SEND_B1 on rank 1")
            && err.contains("rank 1 waits at 1RECV_F2 for 0SEND_F2 on rank 0"),
        "{err}"
    );
}
