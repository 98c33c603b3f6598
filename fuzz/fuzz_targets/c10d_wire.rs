//! c10d `TCPStore` bytes (`ferry_store::c10d::wire`): the query decoder
//! and the reply decoder for every reply kind return `Ok(None)`, a message
//! or a `C10dFormatError` on arbitrary bytes, none panics, and whatever
//! decodes encodes back to exactly the bytes it took. The incremental
//! `QueryDecoder`, fed the same bytes in pieces, yields the queries that
//! decoding the whole buffer query by query yields, and never panics.
#![no_main]

use ferry_store::c10d::wire::{self, QueryDecoder, ReplyKind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some((query, used))) = wire::decode_query(data) {
        assert!(used <= data.len());
        let bytes = wire::encode_query(&query).expect("a decoded query encodes");
        assert_eq!(bytes, &data[..used]);
    }
    incremental_matches_whole(data);
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

/// The queries of `data` decoded whole, one query after another, against
/// the same bytes fed to a `QueryDecoder` in pieces whose sizes come from
/// the data itself. (Errors may differ: the whole buffer can fail on a bad
/// field of a query the decoder is still waiting to see whole.)
fn incremental_matches_whole(data: &[u8]) {
    let mut whole = Vec::new();
    let mut at = 0;
    while let Ok(Some((query, used))) = wire::decode_query(&data[at..]) {
        whole.push(query);
        at += used;
    }
    let mut decoder = QueryDecoder::default();
    let mut pieces = Vec::new();
    let mut rest = data;
    let mut i = 0;
    'feed: while !rest.is_empty() {
        let size = (usize::from(data[i % data.len()]) % 17 + 1).min(rest.len());
        i += 1;
        decoder.buffer().extend_from_slice(&rest[..size]);
        rest = &rest[size..];
        loop {
            match decoder.next_query() {
                Ok(Some(query)) => pieces.push(query),
                Ok(None) => break,
                Err(_) => break 'feed,
            }
        }
    }
    assert_eq!(pieces, whole);
}
