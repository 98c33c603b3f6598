//! c10d `TCPStore` bytes (`ferry_store::c10d::wire`): the query decoder
//! and the reply decoder for every reply kind return `Ok(None)`, a message
//! or a `C10dFormatError` on arbitrary bytes, none panics, and whatever
//! decodes encodes back to exactly the bytes it took.
#![no_main]

use ferry_store::c10d::wire::{self, ReplyKind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some((query, used))) = wire::decode_query(data) {
        assert!(used <= data.len());
        let bytes = wire::encode_query(&query).expect("a decoded query encodes");
        assert_eq!(bytes, &data[..used]);
    }
    let count = data.first().map_or(0, |b| usize::from(*b % 8));
    for kind in [
        ReplyKind::Value,
        ReplyKind::Int,
        ReplyKind::Check,
        ReplyKind::Wait,
        ReplyKind::Values { count },
        ReplyKind::Nonce,
        ReplyKind::Keys,
    ] {
        if let Ok(Some((reply, used))) = wire::decode_reply(kind, data) {
            let bytes = wire::encode_reply(&reply).expect("a decoded reply encodes");
            assert_eq!(bytes, &data[..used]);
        }
    }
});
