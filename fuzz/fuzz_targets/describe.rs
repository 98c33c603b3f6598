//! A function's description as a peer sends it (`ferry.describe`'s reply):
//! decoding any bytes gives a value or an error; a decoded shape is either
//! refused by `OwnedShape::check` or checked, and a checked one prints
//! (every node, the signature) in bounded time and encodes back to the
//! bytes it took.
#![no_main]

use ferry_rpc::describe::Description;
use ferry_wire::payload;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(description) = payload::decode::<Description>(data, vec![]) else {
        return;
    };
    let shapes = [&description.args, &description.result];
    if shapes.iter().any(|s| s.check().is_err()) {
        return;
    }
    let _ = description.signature_text();
    for shape in shapes {
        for node in 0..shape.nodes().len() as u32 {
            let _ = shape.node_text(node);
        }
    }
    let encoded = payload::encode(&description).expect("a decoded description encodes");
    let again: Description = payload::decode(&encoded.payload, vec![]).expect("and decodes");
    assert_eq!(again, description);
});
