//! c10d `TCPStore` bytes (`ferry_store::c10d::wire`): round trips, the
//! streaming contract (every proper prefix of a message is "not whole
//! yet", a message followed by more bytes takes only its own), the bytes
//! PyTorch's client sends (captured from torch 2.13), malformed input
//! refused with the error naming what is wrong, never a panic, and the
//! incremental `QueryDecoder` giving the same queries however a stream is
//! cut.
#![allow(clippy::unwrap_used)]

use ferry_store::c10d::wire::{
    self, C10dFormatError, Query, Reply, ReplyKind, WaitReply, MAX_FIELD_BYTES, MAX_KEYS,
};
use proptest::prelude::*;

fn key() -> impl Strategy<Value = String> {
    "[a-z0-9/_é€]{0,12}"
}

fn keys() -> impl Strategy<Value = Vec<String>> {
    prop::collection::vec(key(), 0..5)
}

fn value() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..200)
}

fn query() -> impl Strategy<Value = Query> {
    prop_oneof![
        any::<u32>().prop_map(|magic| Query::Validate { magic }),
        (key(), value()).prop_map(|(key, value)| Query::Set { key, value }),
        (key(), value(), value()).prop_map(|(key, expected, desired)| Query::CompareSet {
            key,
            expected,
            desired
        }),
        key().prop_map(|key| Query::Get { key }),
        (key(), any::<i64>()).prop_map(|(key, delta)| Query::Add { key, delta }),
        keys().prop_map(|keys| Query::Check { keys }),
        keys().prop_map(|keys| Query::Wait { keys }),
        Just(Query::NumKeys),
        key().prop_map(|key| Query::DeleteKey { key }),
        (key(), value()).prop_map(|(key, value)| Query::Append { key, value }),
        keys().prop_map(|keys| Query::MultiGet { keys }),
        prop::collection::vec((key(), value()), 0..4)
            .prop_map(|entries| Query::MultiSet { entries }),
        Just(Query::CancelWait),
        any::<u32>().prop_map(|nonce| Query::Ping { nonce }),
        (key(), value()).prop_map(|(key, value)| Query::QueuePush { key, value }),
        key().prop_map(|key| Query::QueuePop { key }),
        key().prop_map(|key| Query::QueueLen { key }),
        Just(Query::ListKeys),
    ]
}

fn reply() -> impl Strategy<Value = (ReplyKind, Reply)> {
    prop_oneof![
        value().prop_map(|v| (ReplyKind::Value, Reply::Value(v))),
        any::<i64>().prop_map(|n| (ReplyKind::Int, Reply::Int(n))),
        any::<bool>().prop_map(|b| (ReplyKind::Check, Reply::Check(b))),
        prop::sample::select(vec![WaitReply::StopWaiting, WaitReply::WaitCanceled])
            .prop_map(|w| (ReplyKind::Wait, Reply::Wait(w))),
        prop::collection::vec(value(), 0..4)
            .prop_map(|vs| (ReplyKind::Values { count: vs.len() }, Reply::Values(vs))),
        any::<u32>().prop_map(|n| (ReplyKind::Nonce, Reply::Nonce(n))),
        keys().prop_map(|ks| (ReplyKind::Keys, Reply::Keys(ks))),
    ]
}

fn kinds() -> Vec<ReplyKind> {
    vec![
        ReplyKind::Value,
        ReplyKind::Int,
        ReplyKind::Check,
        ReplyKind::Wait,
        ReplyKind::Values { count: 3 },
        ReplyKind::Nonce,
        ReplyKind::Keys,
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn queries_round_trip_and_stream(q in query(), tail in value()) {
        let bytes = wire::encode_query(&q).unwrap();
        prop_assert_eq!(wire::decode_query(&bytes), Ok(Some((q.clone(), bytes.len()))));
        for cut in 0..bytes.len() {
            prop_assert_eq!(wire::decode_query(&bytes[..cut]), Ok(None), "cut at {}", cut);
        }
        let mut more = bytes.clone();
        more.extend_from_slice(&tail);
        prop_assert_eq!(wire::decode_query(&more), Ok(Some((q, bytes.len()))));
    }

    #[test]
    fn replies_round_trip_and_stream((kind, r) in reply(), tail in value()) {
        let bytes = wire::encode_reply(&r).unwrap();
        prop_assert_eq!(wire::decode_reply(kind, &bytes), Ok(Some((r.clone(), bytes.len()))));
        for cut in 0..bytes.len() {
            prop_assert_eq!(wire::decode_reply(kind, &bytes[..cut]), Ok(None));
        }
        let mut more = bytes.clone();
        more.extend_from_slice(&tail);
        prop_assert_eq!(wire::decode_reply(kind, &more), Ok(Some((r, bytes.len()))));
    }

    /// A stream of queries cut into pieces at arbitrary points (empty
    /// pieces included) decodes, piece by piece, to the same queries.
    #[test]
    fn a_stream_cut_anywhere_decodes_to_the_same_queries(
        queries in prop::collection::vec(query(), 0..8),
        cuts in prop::collection::vec(0usize..80, 0..40),
    ) {
        let stream: Vec<u8> =
            queries.iter().flat_map(|q| wire::encode_query(q).unwrap()).collect();
        let mut decoder = wire::QueryDecoder::default();
        let mut got = Vec::new();
        let mut rest = &stream[..];
        let mut cuts = cuts.into_iter();
        while !rest.is_empty() {
            let n = cuts.next().unwrap_or(rest.len()).min(rest.len());
            decoder.buffer().extend_from_slice(&rest[..n]);
            rest = &rest[n..];
            while let Some(q) = decoder.next_query().unwrap() {
                got.push(q);
            }
        }
        prop_assert_eq!(got, queries);
    }

    /// Arbitrary bytes fed one at a time: the queries decoded are the ones
    /// decoding the whole buffer gives, never a panic.
    #[test]
    fn arbitrary_bytes_fed_piecemeal_decode_as_a_whole(
        bytes in prop::collection::vec(any::<u8>(), 0..96),
    ) {
        let mut whole = Vec::new();
        let mut at = 0;
        while let Ok(Some((q, used))) = wire::decode_query(&bytes[at..]) {
            whole.push(q);
            at += used;
        }
        let mut decoder = wire::QueryDecoder::default();
        let mut got = Vec::new();
        'feed: for b in &bytes {
            decoder.buffer().push(*b);
            loop {
                match decoder.next_query() {
                    Ok(Some(q)) => got.push(q),
                    Ok(None) => break,
                    Err(_) => break 'feed,
                }
            }
        }
        prop_assert_eq!(got, whole);
    }

    /// Arbitrary bytes: `Ok(None)`, a message that encodes back to the
    /// bytes it took, or an error; never a panic.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        if let Ok(Some((q, used))) = wire::decode_query(&bytes) {
            prop_assert_eq!(wire::encode_query(&q).unwrap(), bytes[..used].to_vec());
        }
        for kind in kinds() {
            if let Ok(Some((r, used))) = wire::decode_reply(kind, &bytes) {
                prop_assert_eq!(wire::encode_reply(&r).unwrap(), bytes[..used].to_vec());
            }
        }
    }
}

fn le64(n: u64) -> [u8; 8] {
    n.to_le_bytes()
}

/// The bytes torch 2.13's `TCPStore` client sends (captured with a proxy):
/// its connection handshake, and `store.set("a", "x")` (key `/a`).
#[test]
fn the_bytes_torchs_client_sends() {
    let handshake = [0x00, 0xce, 0xf7, 0x85, 0x3c, 0x0d, 0x19, 0x70, 0x00, 0x00];
    let (first, used) = wire::decode_query(&handshake).unwrap().unwrap();
    assert_eq!(
        first,
        Query::Validate {
            magic: wire::VALIDATION_MAGIC
        }
    );
    assert_eq!(
        wire::decode_query(&handshake[used..]).unwrap(),
        Some((Query::Ping { nonce: 0x7019 }, 5))
    );
    let mut set = vec![1];
    set.extend_from_slice(&le64(2));
    set.extend_from_slice(b"/a");
    set.extend_from_slice(&le64(1));
    set.extend_from_slice(b"x");
    assert_eq!(
        wire::encode_query(&Query::Set {
            key: "/a".into(),
            value: b"x".to_vec()
        })
        .unwrap(),
        set
    );
}

#[test]
fn malformed_input_names_what_is_wrong() {
    assert_eq!(
        wire::decode_query(&[18]),
        Err(C10dFormatError::UnknownQuery(18))
    );
    assert_eq!(
        wire::decode_query(&[200, 0, 0]),
        Err(C10dFormatError::UnknownQuery(200))
    );
    // A length over the limit is refused before its bytes arrive.
    let mut get = vec![3];
    get.extend_from_slice(&le64(MAX_FIELD_BYTES as u64 + 1));
    assert_eq!(
        wire::decode_query(&get),
        Err(C10dFormatError::TooLarge {
            field: "key",
            len: MAX_FIELD_BYTES as u64 + 1,
            limit: MAX_FIELD_BYTES
        })
    );
    let mut set = vec![1];
    set.extend_from_slice(&le64(1));
    set.push(b'k');
    set.extend_from_slice(&le64(u64::MAX));
    assert!(matches!(
        wire::decode_query(&set),
        Err(C10dFormatError::TooLarge { field: "value", .. })
    ));
    let mut wait = vec![6];
    wait.extend_from_slice(&le64(MAX_KEYS + 1));
    assert_eq!(
        wire::decode_query(&wait),
        Err(C10dFormatError::TooManyKeys {
            count: MAX_KEYS + 1,
            limit: MAX_KEYS
        })
    );
    let mut bad_key = vec![3];
    bad_key.extend_from_slice(&le64(2));
    bad_key.extend_from_slice(&[0xff, 0xfe]);
    assert_eq!(
        wire::decode_query(&bad_key),
        Err(C10dFormatError::NotUtf8 { field: "key" })
    );
    assert_eq!(
        wire::decode_reply(ReplyKind::Wait, &[7]),
        Err(C10dFormatError::BadReplyByte {
            field: "wait",
            byte: 7
        })
    );
    // A MULTI_SET whose many small entries add up past the whole-query
    // limit is refused, however the bytes arrive.
    let mut big = vec![11];
    big.extend_from_slice(&le64(MAX_KEYS));
    let entry_value = vec![0u8; 1 << 10];
    let mut entry = le64(0).to_vec();
    entry.extend_from_slice(&le64(entry_value.len() as u64));
    entry.extend_from_slice(&entry_value);
    while big.len() <= wire::MAX_QUERY_BYTES + 32 {
        big.extend_from_slice(&entry);
    }
    assert_eq!(
        wire::decode_query(&big),
        Err(C10dFormatError::QueryTooLarge {
            limit: wire::MAX_QUERY_BYTES
        })
    );
}

#[test]
fn oversized_messages_are_refused_by_the_encoder() {
    let value = vec![0u8; MAX_FIELD_BYTES + 1];
    assert!(matches!(
        wire::encode_query(&Query::Set {
            key: "k".into(),
            value: value.clone()
        }),
        Err(C10dFormatError::TooLarge { field: "value", .. })
    ));
    assert!(matches!(
        wire::encode_reply(&Reply::Value(value)),
        Err(C10dFormatError::TooLarge { field: "value", .. })
    ));
}
