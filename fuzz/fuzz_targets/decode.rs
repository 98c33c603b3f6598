//! Every ferry-wire decoder returns `Ok` or `Err` on arbitrary bytes; none panics.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = ferry_wire::Frame::decode(data, &ferry_wire::Limits::default());
    let _ = ferry_wire::Handshake::decode(data);
    let _ = ferry_wire::payload::decode::<(u32, String, Vec<Option<i64>>)>(data, vec![]);
});
