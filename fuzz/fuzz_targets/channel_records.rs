//! Tensor-channel bytes (`ferry_wire::channel_record`: records and release
//! lists; `ferry_wire::mpt_lane`: lane hellos and chunk headers): every decoder returns `Ok` or a `RecordError` on arbitrary bytes, none
//! panics, and whatever decodes encodes back to the bytes it came from.
#![no_main]

use ferry_wire::channel_record::{ChannelRecord, Prelude, RecordFormat, ReleaseList};
use ferry_wire::mpt_lane::{ChunkHeader, LaneHello, CHUNK_HEADER_LEN, HELLO_LEN};
use libfuzzer_sys::fuzz_target;

const FORMATS: [RecordFormat; 6] = [
    RecordFormat::Cma,
    RecordFormat::Shm,
    RecordFormat::Mpt,
    RecordFormat::Ucx,
    RecordFormat::CudaIpc,
    RecordFormat::CudaStaged,
];

fuzz_target!(|data: &[u8]| {
    for format in FORMATS {
        if let Ok(Some((prelude, used))) = Prelude::decode(format, data) {
            let mut out = Vec::new();
            prelude.encode_into(&mut out);
            assert_eq!(out, data[..used]);
        }
        if let Ok(record) = ChannelRecord::decode(format, data) {
            let mut out = Vec::new();
            record.encode_into(&mut out);
            assert_eq!(out, data);
        }
    }
    if let Some(head) = data.first_chunk::<HELLO_LEN>() {
        if let Ok(hello) = LaneHello::decode(head) {
            assert_eq!(&hello.encode(), head);
        }
    }
    if let Some(head) = data.first_chunk::<CHUNK_HEADER_LEN>() {
        assert_eq!(&ChunkHeader::decode(head).encode(), head);
    }
    if let Ok(list) = ReleaseList::decode(data) {
        let tokens: Vec<u64> = list.tokens().collect();
        let mut out = Vec::new();
        ferry_wire::channel_record::encode_release(&tokens, &mut out);
        assert_eq!(out, data);
    }
});
