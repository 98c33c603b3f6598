//! Properties of `tree::flatten` / `tree::unflatten`: any value round-trips
//! with its tensors in order, and any bytes with any tensors give a value
//! or an error, never a panic.
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::BTreeMap;

use ferry_tch::tree::{flatten, unflatten};
use ferry_tch::Tensor;
use proptest::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
enum Node {
    Leaf(Tensor),
    Pair(Box<Node>, Box<Node>),
    Tagged {
        tag: String,
        value: Option<Tensor>,
        n: u64,
    },
    Map(BTreeMap<u8, Tensor>),
}

fn tensor(seed: u8, len: usize) -> Tensor {
    Tensor::from(tch::Tensor::from_slice(&vec![f32::from(seed); len]))
}

fn node() -> impl Strategy<Value = Node> {
    let leaf = prop_oneof![
        (any::<u8>(), 0usize..4).prop_map(|(s, l)| Node::Leaf(tensor(s, l))),
        (".{0,8}", proptest::option::of(any::<u8>()), any::<u64>()).prop_map(|(tag, v, n)| {
            Node::Tagged {
                tag,
                value: v.map(|s| tensor(s, 1)),
                n,
            }
        }),
        proptest::collection::btree_map(any::<u8>(), any::<u8>(), 0..3)
            .prop_map(|m| Node::Map(m.into_iter().map(|(k, s)| (k, tensor(s, 2))).collect())),
    ];
    leaf.prop_recursive(4, 16, 2, |inner| {
        (inner.clone(), inner).prop_map(|(a, b)| Node::Pair(Box::new(a), Box::new(b)))
    })
}

/// The first value of every tensor, in serialisation order.
fn firsts(node: &Node, out: &mut Vec<Option<f64>>) {
    let first = |t: &Tensor| (t.numel() > 0).then(|| t.double_value(&[0]));
    match node {
        Node::Leaf(t) => out.push(first(t)),
        Node::Pair(a, b) => {
            firsts(a, out);
            firsts(b, out);
        }
        Node::Tagged { value, .. } => out.extend(value.iter().map(first)),
        Node::Map(m) => out.extend(m.values().map(first)),
    }
}

proptest! {
    #[test]
    fn values_round_trip_with_their_tensors_in_order(value in node()) {
        let flat = flatten(&value).unwrap();
        let mut want = Vec::new();
        firsts(&value, &mut want);
        prop_assert_eq!(flat.tensors.len(), want.len());
        let back: Node = unflatten(&flat.bytes, flat.tensors).unwrap();
        let mut got = Vec::new();
        firsts(&back, &mut got);
        prop_assert_eq!(got, want);
    }

    #[test]
    fn any_bytes_and_tensors_give_a_value_or_an_error(
        bytes in proptest::collection::vec(any::<u8>(), 0..64),
        tensors in 0usize..5,
    ) {
        let list = (0..tensors).map(|i| tch::Tensor::from_slice(&[i as f32])).collect();
        let _ = unflatten::<Node>(&bytes, list);
        // The thread is still usable afterwards.
        let flat = flatten(&Node::Leaf(tensor(1, 1))).unwrap();
        prop_assert_eq!(flat.tensors.len(), 1);
    }
}
