//! Every ferry-wire decoder returns `Ok` or `Err` on arbitrary bytes; none panics.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = ferry_wire::Limits::default();
    let _ = ferry_wire::Frame::decode(data, &limits);
    let _ = ferry_wire::Handshake::decode(data);
    let _ = ferry_wire::payload::decode::<(u32, String, Vec<Option<i64>>)>(data, vec![]);
    // A sparse COO layout (its length in the first byte), checked against
    // the two descriptors that follow it.
    if let Some((&n, rest)) = data.split_first() {
        let (layout, rest) = rest.split_at(usize::from(n).min(rest.len()));
        if let Ok(layout) = ferry_wire::payload::decode::<ferry_wire::sparse::SparseCoo>(layout, vec![]) {
            if let Ok((indices, used)) = ferry_wire::TensorDescriptor::decode(rest, &limits) {
                if let Ok((values, _)) = ferry_wire::TensorDescriptor::decode(&rest[used..], &limits) {
                    let _ = layout.check(&indices, &values, &limits);
                }
            }
        }
    }
});
