//! The store's message format (`ferry_store::format`): every decoder returns
//! `Ok` or a `FormatError` on arbitrary bytes, none panics, and whatever
//! decodes encodes back to the same bytes.
#![no_main]

use ferry_store::format;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(frame) = format::decode_request(data) {
        let bytes = format::encode_request(&frame).expect("a decoded request encodes");
        assert_eq!(
            format::decode_request(&bytes[format::LENGTH_PREFIX_BYTES..]),
            Ok(frame)
        );
    }
    if let Ok(frame) = format::decode_response(data) {
        let bytes = format::encode_response(&frame).expect("a decoded response encodes");
        assert_eq!(
            format::decode_response(&bytes[format::LENGTH_PREFIX_BYTES..]),
            Ok(frame)
        );
    }
    if let Ok(Some((body, used))) = format::split_frame(data) {
        assert!(used <= data.len() && body.len() + format::LENGTH_PREFIX_BYTES == used);
        let _ = format::decode_request(body);
    }
});
