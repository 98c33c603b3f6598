//! The validator's rules, each with its error text, and every generated
//! schedule (compute-only and lowered) accepted.

use ferry_schedule::{add_send_recv, validate, Schedule, ScheduleKind};

fn reject(csv: &str, micro: usize) -> String {
    let schedule = Schedule::from_csv(csv).expect("parses");
    validate(&schedule, micro).expect_err(csv).to_string()
}

#[test]
fn every_generated_schedule_is_valid() {
    for kind in ScheduleKind::ALL {
        for (ranks, per_rank, micro) in [(2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8)] {
            let Ok(compute) = kind.generate(ranks, per_rank, micro) else {
                continue;
            };
            if kind == ScheduleKind::OneFOneB {
                continue; // PyTorch's table skips F0 on the last rank
            }
            validate(&compute, micro).unwrap_or_else(|e| panic!("{kind}: {e}"));
            let placement = kind
                .placement()
                .stage_to_rank(ranks * per_rank, ranks)
                .expect("placement");
            let lowered = add_send_recv(&compute, &placement).expect("lowers");
            validate(&lowered, micro).unwrap_or_else(|e| panic!("{kind} lowered: {e}"));
        }
    }
}

#[test]
fn pytorch_1f1b_table_fails_as_pytorch_says() {
    // PyTorch's `_get_pipeline_order` table, kept by gen.py; Ferry's
    // generator produces the runtime order instead (valid, see above).
    let compute =
        Schedule::from_csv(include_str!("golden/pytorch_table/1f1b_r2_s1_m4.csv")).expect("parses");
    let err = validate(&compute, 4).expect_err("last rank starts at F1");
    assert_eq!(err.rank, 1, "{err}");
    assert!(
        err.to_string()
            .contains("B of microbatch 0 comes before its F"),
        "{err}"
    );
}

#[test]
fn each_rule_has_its_error() {
    let text = reject("0F0,0F0\r\n", 1);
    assert!(
        text.contains("rank 0, step 1, action 0F0: stage 0 already ran F for microbatch 0"),
        "{text}"
    );
    assert!(text.contains(">0F0<"), "{text}");
    let text = reject("0B0,0F0\r\n", 1);
    assert!(
        text.contains("B of microbatch 0 comes before its F"),
        "{text}"
    );
    let text = reject("0F0,0W0,0I0\r\n", 1);
    assert!(
        text.contains("W of microbatch 0 comes before its I"),
        "{text}"
    );
    let text = reject("0F0\r\n0F1\r\n", 2);
    assert!(
        text.contains("rank 1, step 0, action 0F1: stage 0 already runs on rank 0"),
        "{text}"
    );
    let text = reject("0F0\r\n", 2);
    assert!(
        text.contains("stage 0 never runs F for microbatch 1"),
        "{text}"
    );
    let text = reject("0F0,0SEND_F0\r\n1F0\r\n", 1);
    assert!(text.contains("no receive pairs with this send"), "{text}");
    let text = reject("0F0\r\n1RECV_F0,1F0\r\n", 1);
    assert!(
        text.contains("rank 1, step 0, action 1RECV_F0: no send pairs with this receive"),
        "{text}"
    );
    let text = reject("0F5\r\n", 1);
    assert!(text.contains("microbatch 5 is out of range"), "{text}");
}

#[test]
fn a_w_after_a_full_b_is_refused_at_build() {
    // The shape of PyTorch's `zb1p_2rank_2stagep_compute.csv` artifact:
    // stage 2's microbatch 0 runs a full B, and later a W. PyTorch refuses
    // it before running ("Backward Weight ... without first running
    // Backward Input"); a runtime would find no state for the W.
    let csv = "0F0,2F0,2B0,0B0,2W0\r\n1F0,3F0,3I0,1I0,3W0,1W0\r\n";
    let schedule = Schedule::from_csv(csv).expect("parses");
    let err = validate(&schedule, 1).expect_err("W after a full B");
    assert_eq!((err.rank, err.step), (0, 4), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("W of microbatch 0 follows a full B"),
        "{text}"
    );
    assert!(text.contains(">2W0<"), "{text}");
    // The same with an I in place of the full B is valid.
    let ok = "0F0,2F0,2I0,0B0,2W0\r\n1F0,3F0,3I0,1I0,3W0,1W0\r\n";
    validate(&Schedule::from_csv(ok).expect("parses"), 1).expect("I then W");
}

#[test]
fn check_sends_names_the_action_waiting_for_a_value_never_sent() {
    use ferry_schedule::check_sends;
    // Rank 1's F0 needs stage 0's activation (stage 0 is on rank 0), but
    // rank 0 never sends it: the error names rank 1, step 1, 1F0.
    let csv = "0F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n";
    let schedule = Schedule::from_csv(csv).expect("parses");
    let err = check_sends(&schedule, &[0, 1]).expect_err("no SEND_F");
    assert_eq!(
        (err.rank, err.step, err.action.to_string()),
        (1, 1, "1F0".to_string())
    );
    assert!(
        err.rule.contains("needs 0SEND_F0 from stage 0") && err.rule.contains("never sends it"),
        "{err}"
    );
    assert!(err.grid.contains(">1F0<"), "{}", err.grid);
    // With the send, the value crosses: accepted. Two stages on one rank
    // exchange nothing, so need no send.
    let sent = Schedule::from_csv("0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n")
        .expect("parses");
    check_sends(&sent, &[0, 1]).expect("every crossing value is sent");
    let local = Schedule::from_csv("0F0,1F0,1B0,0B0\n").expect("parses");
    check_sends(&local, &[0, 0]).expect("nothing crosses ranks");
    // A backward whose gradient comes from another rank, never sent.
    let no_grad =
        Schedule::from_csv("0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0\n").expect("parses");
    let err = check_sends(&no_grad, &[0, 1]).expect_err("no SEND_B");
    assert_eq!((err.rank, err.step), (0, 3), "{err}");
    assert!(err.rule.contains("needs 1SEND_B0 from stage 1"), "{err}");
    // Every lowered published schedule sends what crosses ranks.
    for kind in ScheduleKind::ALL {
        let Ok(compute) = kind.generate(4, 2, 8).or_else(|_| kind.generate(4, 1, 8)) else {
            continue;
        };
        let stages = compute
            .ranks
            .iter()
            .flatten()
            .flatten()
            .map(|a| a.stage())
            .max()
            .unwrap_or(0)
            + 1;
        let placement = kind
            .placement()
            .stage_to_rank(stages, 4)
            .expect("placement");
        let lowered = add_send_recv(&compute, &placement).expect("lowers");
        check_sends(&lowered, &placement).unwrap_or_else(|e| panic!("{kind}: {e}"));
    }
}

#[test]
fn check_sends_rejects_an_unplaced_stage() {
    let schedule = Schedule::from_csv("0F0,3F0\n").expect("parses");
    let err = ferry_schedule::check_sends(&schedule, &[0, 0]).expect_err("stage 3");
    assert_eq!((err.rank, err.step), (0, 1), "{err}");
    assert!(err.rule.contains("stage 3 is not placed"), "{err}");
}
