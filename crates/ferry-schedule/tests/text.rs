//! The action text form: PyTorch's examples, typed errors, round trips.

use ferry_schedule::{Action, ActionKind, Placement, PlacementError, Schedule};
use proptest::prelude::*;

#[test]
fn pytorch_examples_parse_and_print() {
    let cases = [
        ("0F1", Action::new(0, ActionKind::Forward, Some(1))),
        ("2I0", Action::new(2, ActionKind::BackwardInput, Some(0))),
        ("1SEND_F0", Action::new(1, ActionKind::SendF, Some(0))),
        ("3RECV_B2", Action::new(3, ActionKind::RecvB, Some(2))),
        ("1UNSHARD", Action::per_stage(1, ActionKind::Unshard)),
        ("0REDUCE_GRAD", Action::per_stage(0, ActionKind::ReduceGrad)),
        (
            "12W34",
            Action::new(12, ActionKind::BackwardWeight, Some(34)),
        ),
        (
            "(0F3;3B1)OVERLAP_F_B",
            Action::compound(
                ActionKind::OverlapFB,
                vec![
                    Action::forward(0, 3),
                    Action::new(3, ActionKind::FullBackward, Some(1)),
                ],
            ),
        ),
    ];
    for (text, action) in cases {
        assert_eq!(text.parse::<Action>().as_ref(), Ok(&action), "{text}");
        assert_eq!(action.to_string(), text);
    }
    assert_eq!(Action::parse_slot("  "), Ok(None));
    assert_eq!(
        " 0F1 ".parse::<Action>().map(|a| a.to_string()).as_deref(),
        Ok("0F1")
    );
}

#[test]
fn malformed_text_names_text_and_expectation() {
    let cases = [
        ("F1", "does not start with a stage number"),
        ("0X1", "\"X\" is not an action kind"),
        ("0F", "F needs a microbatch number"),
        ("0UNSHARD1", "UNSHARD takes no microbatch number"),
        ("0F1x", "\"1x\" after the kind is not a microbatch number"),
        ("0OVERLAP_F_B", "OVERLAP_F_B needs sub-actions"),
        ("(0F1;1B0", "never closed"),
        ("(0F1;1B0)F", "F is not a compound kind"),
        ("(0F1;)OVERLAP_F_B", "a sub-action is empty"),
        ("(0F1;1Q0)OVERLAP_F_B", "sub-action \"1Q0\""),
        ("99999999999999999999999F0", "too large"),
        ("4294967296F0", "stage number 4294967296 is too large"),
        ("0F4294967295", "microbatch number 4294967295 is too large"),
        ("(0F1;4294967296B0)OVERLAP_F_B", "too large"),
        ("", "it is empty"),
    ];
    for (text, reason) in cases {
        let err = text.parse::<Action>().expect_err(text);
        let shown = err.to_string();
        assert!(shown.contains(reason), "{text}: {shown}");
        assert!(shown.contains(&format!("{:?}", text.trim())), "{shown}");
        assert!(
            shown.contains("expected [stage][kind][microbatch]"),
            "{shown}"
        );
    }
}

#[test]
fn largest_numbers_round_trip() {
    for text in ["4294967295F4294967294", "4294967295UNSHARD", "0B4294967294"] {
        let action: Action = text.parse().expect(text);
        assert_eq!(action.to_string(), text);
    }
    let action: Action = "4294967295F4294967294".parse().expect("largest");
    assert_eq!(action.stage(), ferry_schedule::MAX_STAGE);
    assert_eq!(action.microbatch(), Some(ferry_schedule::MAX_MICROBATCH));
}

#[test]
fn options_of_actions_stay_small() {
    // One slot per rank per step in a simulated timeline.
    assert!(std::mem::size_of::<Option<Action>>() <= 24);
}

#[test]
fn placements_match_pytorch() {
    assert_eq!(Placement::Loop.stage_to_rank(4, 2), Ok(vec![0, 1, 0, 1]));
    assert_eq!(Placement::V.stage_to_rank(4, 2), Ok(vec![0, 1, 1, 0]));
    assert_eq!(
        Placement::V.stage_to_rank(8, 4),
        Ok(vec![0, 1, 2, 3, 3, 2, 1, 0])
    );
    assert_eq!(Placement::V.stage_to_rank(6, 2), Ok(vec![0, 1, 1, 0, 0, 1]));
    assert_eq!(
        Placement::V.rank_to_stages(8, 4),
        Ok(vec![vec![0, 7], vec![1, 6], vec![2, 5], vec![3, 4]])
    );
    assert_eq!(Placement::V.rank_of(6, 8, 4), Ok(1));
    assert_eq!(
        Placement::V.stage_to_rank(5, 2),
        Err(PlacementError::UnevenV {
            stages: 5,
            ranks: 2
        })
    );
    assert_eq!(
        Placement::Loop.stage_to_rank(4, 0),
        Err(PlacementError::NoRanks)
    );
}

fn simple_action() -> impl Strategy<Value = Action> {
    let kinds: Vec<ActionKind> = ActionKind::ALL
        .into_iter()
        .filter(|k| !k.is_compound())
        .collect();
    (0usize..1000, proptest::sample::select(kinds), 0usize..1000)
        .prop_map(|(stage, kind, mb)| Action::new(stage, kind, kind.has_microbatch().then_some(mb)))
}

pub(crate) fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        4 => simple_action(),
        1 => proptest::collection::vec(simple_action(), 1..4)
            .prop_map(|subs| Action::compound(ActionKind::OverlapFB, subs)),
    ]
}

proptest! {
    #[test]
    fn text_round_trips(action in action()) {
        let text = action.to_string();
        prop_assert_eq!(text.parse::<Action>(), Ok(action));
    }

    #[test]
    fn parse_never_panics(text in "\\PC{0,40}") {
        // Whatever parses prints back to text that parses the same.
        if let Ok(action) = text.parse::<Action>() {
            prop_assert_eq!(action.to_string().parse::<Action>(), Ok(action));
        }
        if let Ok(schedule) = Schedule::from_csv(&text) {
            prop_assert_eq!(Schedule::from_csv(&schedule.to_csv()), Ok(schedule));
        }
    }

    #[test]
    fn slots_round_trip(slot in proptest::option::of(action()), pad in "[ \t]{0,2}") {
        let text = slot.as_ref().map_or_else(String::new, Action::to_string);
        prop_assert_eq!(Action::parse_slot(&format!("{pad}{text}{pad}")), Ok(slot));
    }

    #[test]
    fn parse_never_panics_on_near_misses(text in "[0-9(;)]{0,4}(F|B|I|W|SEND_F|RECV_B|UNSHARD|OVERLAP_F_B|X)?[0-9(;)]{0,4}") {
        if let Ok(action) = text.parse::<Action>() {
            prop_assert_eq!(action.to_string().parse::<Action>(), Ok(action));
        }
    }

    #[test]
    fn csv_round_trips(rows in proptest::collection::vec(
        proptest::collection::vec(proptest::option::of(action()), 0..6), 0..5)) {
        let schedule = Schedule::new(rows);
        let csv = schedule.to_csv();
        prop_assert_eq!(Schedule::from_csv(&csv), Ok(schedule));
    }
}

#[test]
fn generating_more_than_an_action_numbers_is_an_error() {
    use ferry_schedule::{GenerateError, ScheduleKind};
    let err = ScheduleKind::GPipe
        .generate(2, 1, ferry_schedule::MAX_MICROBATCH + 2)
        .expect_err("too many microbatches");
    assert!(matches!(err, GenerateError::TooLarge { .. }), "{err}");
    assert!(err.to_string().contains("at most"), "{err}");
    let err = ScheduleKind::LoopedBfs
        .generate(usize::MAX, 2, 4)
        .expect_err("too many stages");
    assert!(matches!(err, GenerateError::TooLarge { .. }), "{err}");
}
