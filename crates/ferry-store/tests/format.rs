//! The store's byte format (`ferry_store::format`): round trips, the
//! bytes postcard gives the same messages (the format's independent
//! reference), and malformed input, each refused with the error that
//! names what is wrong, never a panic.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use ferry_store::format::{
    self, Failure, FormatError, Request, RequestFrame, Response, ResponseFrame,
    LENGTH_PREFIX_BYTES, MAX_MESSAGE_BYTES,
};
use ferry_store::QuotaBound;
use proptest::prelude::*;

// ---------------------------------------------------------------------------
// Strategies
// ---------------------------------------------------------------------------

fn key() -> impl Strategy<Value = String> {
    // Multi-byte characters too.
    "[a-z0-9/_é€]{0,12}"
}

fn keys() -> impl Strategy<Value = Vec<String>> {
    prop::collection::vec(key(), 0..5)
}

fn value() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..300)
}

fn duration() -> impl Strategy<Value = Duration> {
    (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n))
}

fn bound() -> impl Strategy<Value = QuotaBound> {
    prop::sample::select(vec![
        QuotaBound::KeyBytes,
        QuotaBound::ValueBytes,
        QuotaBound::ConnectionKeys,
        QuotaBound::ConnectionBytes,
        QuotaBound::ConnectionWaits,
        QuotaBound::TotalKeys,
        QuotaBound::TotalBytes,
    ])
}

fn request() -> impl Strategy<Value = Request> {
    prop_oneof![
        (key(), value()).prop_map(|(key, value)| Request::Set { key, value }),
        (key(), duration()).prop_map(|(key, timeout)| Request::Get { key, timeout }),
        (keys(), duration()).prop_map(|(keys, timeout)| Request::Wait { keys, timeout }),
        (key(), any::<i64>()).prop_map(|(key, delta)| Request::Add { key, delta }),
        (key(), prop::option::of(value()), value()).prop_map(|(key, expected, desired)| {
            Request::CompareSet {
                key,
                expected,
                desired,
            }
        }),
        key().prop_map(|key| Request::Delete { key }),
        keys().prop_map(|keys| Request::Check { keys }),
    ]
}

fn failure() -> impl Strategy<Value = Failure> {
    prop_oneof![
        (keys(), duration()).prop_map(|(keys, after)| Failure::Timeout { keys, after }),
        key().prop_map(|key| Failure::NotACounter { key }),
        (key(), any::<i64>()).prop_map(|(key, delta)| Failure::Overflow { key, delta }),
        (bound(), key(), any::<u64>(), any::<u64>()).prop_map(|(bound, key, limit, requested)| {
            Failure::Quota {
                bound,
                key,
                limit,
                requested,
            }
        }),
        key().prop_map(Failure::Other),
    ]
}

fn response() -> impl Strategy<Value = Response> {
    prop_oneof![
        Just(Response::Done),
        value().prop_map(Response::Value),
        any::<i64>().prop_map(Response::Counter),
        any::<bool>().prop_map(Response::Bool),
        failure().prop_map(Response::Failed),
    ]
}

fn request_frame() -> impl Strategy<Value = RequestFrame> {
    (any::<u64>(), request()).prop_map(|(id, request)| RequestFrame { id, request })
}

fn response_frame() -> impl Strategy<Value = ResponseFrame> {
    (any::<u64>(), response()).prop_map(|(id, response)| ResponseFrame { id, response })
}

/// The body of an encoded frame.
fn body(frame: &[u8]) -> &[u8] {
    &frame[LENGTH_PREFIX_BYTES..]
}

// ---------------------------------------------------------------------------
// The reference: the same messages as serde types, through postcard
// ---------------------------------------------------------------------------

mod reference {
    use std::time::Duration;

    use serde::Serialize;

    #[derive(Serialize)]
    pub(crate) struct RequestFrame {
        pub(crate) id: u64,
        pub(crate) request: Request,
    }

    #[derive(Serialize)]
    pub(crate) enum Request {
        Set {
            key: String,
            value: Vec<u8>,
        },
        Get {
            key: String,
            timeout: Duration,
        },
        Wait {
            keys: Vec<String>,
            timeout: Duration,
        },
        Add {
            key: String,
            delta: i64,
        },
        CompareSet {
            key: String,
            expected: Option<Vec<u8>>,
            desired: Vec<u8>,
        },
        Delete {
            key: String,
        },
        Check {
            keys: Vec<String>,
        },
    }

    #[derive(Serialize)]
    pub(crate) struct ResponseFrame {
        pub(crate) id: u64,
        pub(crate) response: Response,
    }

    #[derive(Serialize)]
    pub(crate) enum Response {
        Done,
        Value(Vec<u8>),
        Counter(i64),
        Bool(bool),
        Failed(Failure),
    }

    #[derive(Serialize)]
    pub(crate) enum Failure {
        Timeout {
            keys: Vec<String>,
            after: Duration,
        },
        NotACounter {
            key: String,
        },
        Overflow {
            key: String,
            delta: i64,
        },
        Quota {
            bound: Bound,
            key: String,
            limit: u64,
            requested: u64,
        },
        Other(String),
    }

    #[derive(Serialize)]
    pub(crate) enum Bound {
        KeyBytes,
        ValueBytes,
        ConnectionKeys,
        ConnectionBytes,
        ConnectionWaits,
        TotalKeys,
        TotalBytes,
    }
}

fn reference_request(f: &RequestFrame) -> reference::RequestFrame {
    use reference::Request as R;
    let request = match f.request.clone() {
        Request::Set { key, value } => R::Set { key, value },
        Request::Get { key, timeout } => R::Get { key, timeout },
        Request::Wait { keys, timeout } => R::Wait { keys, timeout },
        Request::Add { key, delta } => R::Add { key, delta },
        Request::CompareSet {
            key,
            expected,
            desired,
        } => R::CompareSet {
            key,
            expected,
            desired,
        },
        Request::Delete { key } => R::Delete { key },
        Request::Check { keys } => R::Check { keys },
    };
    reference::RequestFrame { id: f.id, request }
}

fn reference_response(f: &ResponseFrame) -> reference::ResponseFrame {
    use reference::{Bound as B, Failure as F, Response as R};
    let response = match f.response.clone() {
        Response::Done => R::Done,
        Response::Value(v) => R::Value(v),
        Response::Counter(n) => R::Counter(n),
        Response::Bool(b) => R::Bool(b),
        Response::Failed(failure) => R::Failed(match failure {
            Failure::Timeout { keys, after } => F::Timeout { keys, after },
            Failure::NotACounter { key } => F::NotACounter { key },
            Failure::Overflow { key, delta } => F::Overflow { key, delta },
            Failure::Quota {
                bound,
                key,
                limit,
                requested,
            } => F::Quota {
                bound: match bound {
                    QuotaBound::KeyBytes => B::KeyBytes,
                    QuotaBound::ValueBytes => B::ValueBytes,
                    QuotaBound::ConnectionKeys => B::ConnectionKeys,
                    QuotaBound::ConnectionBytes => B::ConnectionBytes,
                    QuotaBound::ConnectionWaits => B::ConnectionWaits,
                    QuotaBound::TotalKeys => B::TotalKeys,
                    QuotaBound::TotalBytes => B::TotalBytes,
                },
                key,
                limit,
                requested,
            },
            Failure::Other(m) => F::Other(m),
        }),
    };
    reference::ResponseFrame { id: f.id, response }
}

// ---------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn requests_round_trip(frame in request_frame()) {
        let bytes = format::encode_request(&frame).unwrap();
        let (body, used) = format::split_frame(&bytes).unwrap().unwrap();
        prop_assert_eq!(used, bytes.len());
        prop_assert_eq!(format::decode_request(body).unwrap(), frame);
    }

    #[test]
    fn responses_round_trip(frame in response_frame()) {
        let bytes = format::encode_response(&frame).unwrap();
        let (body, used) = format::split_frame(&bytes).unwrap().unwrap();
        prop_assert_eq!(used, bytes.len());
        prop_assert_eq!(format::decode_response(body).unwrap(), frame);
    }

    #[test]
    fn request_bytes_are_postcards(frame in request_frame()) {
        let bytes = format::encode_request(&frame).unwrap();
        let reference = postcard::to_allocvec(&reference_request(&frame)).unwrap();
        prop_assert_eq!(body(&bytes), &reference[..]);
    }

    #[test]
    fn response_bytes_are_postcards(frame in response_frame()) {
        let bytes = format::encode_response(&frame).unwrap();
        let reference = postcard::to_allocvec(&reference_response(&frame)).unwrap();
        prop_assert_eq!(body(&bytes), &reference[..]);
    }

    /// Every proper prefix of a message ends inside a field.
    #[test]
    fn cut_messages_are_truncated(req in request_frame(), resp in response_frame()) {
        let req = format::encode_request(&req).unwrap();
        let req = body(&req);
        for cut in 0..req.len() {
            let err = format::decode_request(&req[..cut]).unwrap_err();
            prop_assert!(matches!(err, FormatError::Truncated { .. }), "{:?}", err);
        }
        let resp = format::encode_response(&resp).unwrap();
        let resp = body(&resp);
        for cut in 0..resp.len() {
            let err = format::decode_response(&resp[..cut]).unwrap_err();
            prop_assert!(matches!(err, FormatError::Truncated { .. }), "{:?}", err);
        }
    }

    #[test]
    fn trailing_bytes_are_counted(frame in request_frame(), extra in prop::collection::vec(any::<u8>(), 1..10)) {
        let bytes = format::encode_request(&frame).unwrap();
        let mut long = body(&bytes).to_vec();
        long.extend_from_slice(&extra);
        prop_assert_eq!(
            format::decode_request(&long),
            Err(FormatError::TrailingBytes { count: extra.len() })
        );
    }

    /// A frame split anywhere is incomplete until its last byte arrives.
    #[test]
    fn split_frames_wait_for_the_whole_frame(frame in request_frame(), more in value()) {
        let bytes = format::encode_request(&frame).unwrap();
        for cut in 0..bytes.len() {
            prop_assert_eq!(format::split_frame(&bytes[..cut]).unwrap(), None);
        }
        let mut stream = bytes.clone();
        stream.extend_from_slice(&more);
        let (body, used) = format::split_frame(&stream).unwrap().unwrap();
        prop_assert_eq!(used, bytes.len());
        prop_assert_eq!(format::decode_request(body).unwrap(), frame);
    }

    /// Arbitrary bytes give `Ok` or a `FormatError`, never a panic.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = format::decode_request(&bytes);
        let _ = format::decode_response(&bytes);
        let _ = format::split_frame(&bytes);
    }
}

// ---------------------------------------------------------------------------
// Malformed input, case by case
// ---------------------------------------------------------------------------

#[test]
fn the_bytes_of_a_check_of_no_keys() {
    // id 0, opcode 6, no keys: what the server test sends raw.
    assert_eq!(
        format::decode_request(&[0, 6, 0]).unwrap(),
        RequestFrame {
            id: 0,
            request: Request::Check { keys: vec![] }
        }
    );
    assert_eq!(
        format::decode_request(&[0, 6, 0, 0xff]),
        Err(FormatError::TrailingBytes { count: 1 })
    );
}

#[test]
fn unknown_opcodes_are_named() {
    assert_eq!(
        format::decode_request(&[1, 7]),
        Err(FormatError::UnknownOpcode {
            kind: "request",
            opcode: 7
        })
    );
    assert_eq!(
        format::decode_request(&[1, 0xff, 0x01]),
        Err(FormatError::UnknownOpcode {
            kind: "request",
            opcode: 255
        })
    );
    assert_eq!(
        format::decode_response(&[1, 5]),
        Err(FormatError::UnknownOpcode {
            kind: "response",
            opcode: 5
        })
    );
    assert_eq!(
        format::decode_response(&[1, 4, 5]),
        Err(FormatError::UnknownOpcode {
            kind: "failure",
            opcode: 5
        })
    );
    assert_eq!(
        format::decode_response(&[1, 4, 3, 7, 0, 0, 0]),
        Err(FormatError::UnknownOpcode {
            kind: "quota bound",
            opcode: 7
        })
    );
}

#[test]
fn bad_fields_are_named() {
    // A `set` whose key is not UTF-8.
    assert_eq!(
        format::decode_request(&[1, 0, 1, 0xff, 0]),
        Err(FormatError::NotUtf8 { field: "key" })
    );
    // A `compare_set` whose expected value has tag 2.
    assert_eq!(
        format::decode_request(&[1, 4, 1, b'k', 2]),
        Err(FormatError::BadTag {
            field: "expected value",
            tag: 2
        })
    );
    // A `bool` answer of 2.
    assert_eq!(
        format::decode_response(&[1, 3, 2]),
        Err(FormatError::BadTag {
            field: "answer",
            tag: 2
        })
    );
    // A `get` timeout of 1 s and 10⁹ ns.
    let mut get = vec![1, 1, 1, b'k', 1];
    get.extend_from_slice(&[0x80, 0x94, 0xeb, 0xdc, 0x03]); // 1_000_000_000
    assert_eq!(
        format::decode_request(&get),
        Err(FormatError::BadNanos {
            field: "timeout",
            nanos: 1_000_000_000
        })
    );
    // Nanoseconds beyond u32.
    let mut get = vec![1, 1, 1, b'k', 1];
    get.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x1f]);
    assert_eq!(
        format::decode_request(&get),
        Err(FormatError::BadVarint { field: "timeout" })
    );
    // An id varint of eleven bytes.
    assert_eq!(
        format::decode_request(&[0x80; 11]),
        Err(FormatError::BadVarint {
            field: "request id"
        })
    );
}

#[test]
fn absurd_lengths_and_counts_are_refused_before_allocating() {
    let max = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01];
    // A `set` value of u64::MAX bytes.
    let mut set = vec![1, 0, 1, b'k'];
    set.extend_from_slice(&max);
    assert_eq!(
        format::decode_request(&set),
        Err(FormatError::Truncated {
            field: "value",
            needed: u64::MAX,
            available: 0
        })
    );
    // A `check` of u64::MAX keys.
    let mut check = vec![1, 6];
    check.extend_from_slice(&max);
    assert_eq!(
        format::decode_request(&check),
        Err(FormatError::Truncated {
            field: "keys",
            needed: u64::MAX,
            available: 0
        })
    );
}

#[test]
fn frames_over_the_limit_are_refused() {
    let over = u32::try_from(MAX_MESSAGE_BYTES + 1).unwrap().to_le_bytes();
    assert_eq!(
        format::split_frame(&over),
        Err(FormatError::TooLarge {
            len: MAX_MESSAGE_BYTES as u64 + 1,
            limit: MAX_MESSAGE_BYTES
        })
    );
    assert_eq!(
        format::body_len(u32::MAX.to_le_bytes()),
        Err(FormatError::TooLarge {
            len: u64::from(u32::MAX),
            limit: MAX_MESSAGE_BYTES
        })
    );
    let at = u32::try_from(MAX_MESSAGE_BYTES).unwrap().to_le_bytes();
    assert_eq!(format::body_len(at), Ok(MAX_MESSAGE_BYTES));

    let big = RequestFrame {
        id: 0,
        request: Request::Set {
            key: "k".into(),
            value: vec![0; MAX_MESSAGE_BYTES],
        },
    };
    assert!(matches!(
        format::encode_request(&big),
        Err(FormatError::TooLarge { limit, .. }) if limit == MAX_MESSAGE_BYTES
    ));
    let big = ResponseFrame {
        id: 0,
        response: Response::Value(vec![0; MAX_MESSAGE_BYTES]),
    };
    assert!(matches!(
        format::encode_response(&big),
        Err(FormatError::TooLarge { .. })
    ));
}

#[test]
fn errors_read_as_what_was_wrong() {
    let text = format::decode_request(&[1, 0, 1, 0xff, 0])
        .unwrap_err()
        .to_string();
    assert_eq!(text, "the key of a store message is not UTF-8");
    let text = format::decode_request(&[1, 9]).unwrap_err().to_string();
    assert_eq!(text, "unknown store request opcode 9");
}
