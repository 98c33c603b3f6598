//! The costs text (`--costs`), property-tested: any text parses or gives
//! a typed error naming an item of it, and written costs read back.

use ferry_schedule::{CostError, Costs};
use proptest::prelude::*;

fn item_of(err: &CostError) -> &str {
    match err {
        CostError::MissingEquals { item }
        | CostError::NotANumber { item }
        | CostError::UnknownKey { item, .. }
        | CostError::BadOverride { item, .. }
        | CostError::Twice { item, .. }
        | CostError::Negative { item }
        | CostError::NotPositive { item } => item,
    }
}

proptest! {
    /// Arbitrary text never panics; an error names an item as the text
    /// writes it.
    #[test]
    fn any_text_parses_or_names_its_bad_item(text in "[FBIWlatencyUNSHARD@=,.0-9x -]{0,40}") {
        match text.parse::<Costs>() {
            Ok(costs) => prop_assert!(costs.check().is_ok()),
            Err(err) => {
                let item = item_of(&err);
                prop_assert!(text.contains(item), "{err} for {text:?}");
                let prefix = format!("cost {item}:");
                prop_assert!(err.to_string().starts_with(&prefix), "{} for {:?}", err, text);
            }
        }
    }

    /// Values written as items read back exactly, with per-stage and
    /// per-boundary overrides, and B = I + W when B is not written.
    #[test]
    fn written_costs_read_back(
        f in 0.0f64..100.0,
        b in proptest::option::of(0.0f64..100.0),
        i in 0.0f64..100.0,
        w in 0.0f64..100.0,
        latency in 0.0f64..10.0,
        stage in 0usize..16,
        stage_f in 0.0f64..100.0,
        boundary in 0usize..16,
        bandwidth in 0.001f64..1e9,
    ) {
        let mut text = format!("F={f},I={i},W={w},latency={latency},F@{stage}={stage_f},bandwidth@{boundary}={bandwidth},bytes=8");
        if let Some(b) = b {
            text.push_str(&format!(",B={b}"));
        }
        let costs: Costs = text.parse().map_err(|e| TestCaseError::fail(format!("{e}")))?;
        let base = costs.stage(stage + 1);
        prop_assert_eq!(base.forward, f);
        prop_assert_eq!(base.backward_input, i);
        prop_assert_eq!(base.backward_weight, w);
        prop_assert_eq!(base.backward, b.unwrap_or(i + w));
        let over = costs.stage(stage);
        prop_assert_eq!(over.forward, stage_f);
        prop_assert_eq!(over.backward, base.backward);
        prop_assert_eq!(costs.transfer(boundary), latency + 8.0 / bandwidth);
        prop_assert_eq!(costs.transfer(boundary + 1), latency);
    }
}

proptest! {
    /// Costs print as text that parses back to equal costs.
    #[test]
    fn costs_print_and_parse_back(
        f in 0.0f64..100.0,
        b in 0.0f64..100.0,
        latency in 0.0f64..10.0,
        bandwidth in proptest::option::of(0.001f64..1e9),
        bytes in 0.0f64..1e6,
        reduce in 0.0f64..5.0,
        stages in proptest::collection::btree_map(0usize..32, (0.0f64..10.0, 0.0f64..10.0), 0..4),
        links in proptest::collection::btree_map(0usize..32, (0.0f64..10.0, proptest::option::of(0.001f64..1e9)), 0..4),
    ) {
        let mut costs = Costs::uniform(f, b, b / 2.0, b / 3.0).with_latency(latency);
        if let Some(bw) = bandwidth {
            costs.link.bandwidth = bw;
        }
        costs.activation_bytes = bytes;
        costs.reduce_grad = reduce;
        for (stage, (f, b)) in stages {
            costs.stage_overrides.insert(stage, Costs::uniform(f, b, 0.5, 0.25).stage);
        }
        for (boundary, (latency, bw)) in links {
            costs.link_overrides.insert(
                boundary,
                ferry_schedule::Link { latency, bandwidth: bw.unwrap_or(f64::INFINITY) },
            );
        }
        let text = costs.to_string();
        let back: Costs = text.parse().map_err(|e| TestCaseError::fail(format!("{e}: {text}")))?;
        prop_assert_eq!(back, costs, "{}", text);
    }
}

/// Overrides start from the defaults whatever the order of the items,
/// and one key given twice (even spelled differently) is refused.
#[test]
fn overrides_start_from_the_defaults_in_any_order() {
    let a: Costs = "latency@1=2,bandwidth=10,F@2=3,F=4,B=5"
        .parse()
        .expect("costs");
    let b: Costs = "B=5,F=4,bandwidth=10,latency@1=2,F@2=3"
        .parse()
        .expect("costs");
    assert_eq!(a, b);
    assert_eq!(a.link(1).bandwidth, 10.0);
    assert_eq!(a.stage(2).backward, 5.0);
    let err = "F@1=1,F@01=2".parse::<Costs>().expect_err("twice");
    assert_eq!(err.to_string(), "cost F@01=2: F@1 is given twice");
}
