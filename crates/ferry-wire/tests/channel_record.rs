//! Tensor-channel bytes: records and release lists
//! (`ferry_wire::channel_record`) and `mpt` lane headers
//! (`ferry_wire::mpt_lane`): round trips, streams cut anywhere, and
//! malformed input refused with the error that names it, never a panic.
#![allow(clippy::unwrap_used)]

use ferry_wire::channel_record::{
    encode_release, release_len, ChannelRecord, CmaRecord, CudaIpcRecord, CudaStagedRecord, Mode,
    MptRecord, Prelude, RecordError, RecordFormat, ReleaseList, UcxRecord, RELEASE_TOKEN_LEN,
};
use ferry_wire::mpt_lane::{ChunkHeader, LaneError, LaneHello, LANE_MAGIC};
use ferry_wire::WireError;
use proptest::prelude::*;

const FORMATS: [RecordFormat; 6] = [
    RecordFormat::Cma,
    RecordFormat::Shm,
    RecordFormat::Mpt,
    RecordFormat::Ucx,
    RecordFormat::CudaIpc,
    RecordFormat::CudaStaged,
];

fn device() -> impl Strategy<Value = ferry_wire::Device> {
    prop_oneof![
        Just(ferry_wire::Device::Cpu),
        any::<u16>().prop_map(ferry_wire::Device::Cuda)
    ]
}

fn record() -> impl Strategy<Value = ChannelRecord> {
    prop_oneof![
        (any::<u64>(), any::<u64>())
            .prop_map(|(addr, token)| ChannelRecord::Cma(CmaRecord { addr, token })),
        Just(ChannelRecord::Shm),
        any::<u64>().prop_map(|seq| ChannelRecord::Mpt(MptRecord { seq })),
        any::<u64>().prop_map(|seq| ChannelRecord::Ucx(UcxRecord { seq })),
        (
            any::<u64>(),
            device(),
            prop::collection::vec(any::<u8>(), CudaIpcRecord::HANDLES_LEN)
        )
            .prop_map(|(token, target, h)| {
                let mut handles = [0u8; CudaIpcRecord::HANDLES_LEN];
                handles.copy_from_slice(&h);
                ChannelRecord::CudaIpc(CudaIpcRecord {
                    token,
                    target,
                    handles,
                })
            }),
        device().prop_map(|target| ChannelRecord::CudaStaged(CudaStagedRecord { target })),
    ]
}

fn prelude() -> impl Strategy<Value = (RecordFormat, Prelude)> {
    prop_oneof![
        prop::sample::select(FORMATS.to_vec()).prop_map(|f| (f, Prelude::Inline)),
        record().prop_map(|r| (r.format(), Prelude::Channel(r))),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn records_round_trip(record in record()) {
        let mut out = Vec::new();
        record.encode_into(&mut out);
        prop_assert_eq!(out.len(), record.format().len());
        prop_assert_eq!(ChannelRecord::decode(record.format(), &out), Ok(record));
    }

    /// A prelude is decoded once whole, whatever follows it, and is
    /// incomplete (never wrong) before.
    #[test]
    fn preludes_round_trip_and_wait_for_their_bytes(
        (format, prelude) in prelude(),
        after in prop::collection::vec(any::<u8>(), 0..20),
    ) {
        let mut out = Vec::new();
        prelude.encode_into(&mut out);
        for cut in 0..out.len() {
            prop_assert_eq!(Prelude::decode(format, &out[..cut]), Ok(None));
        }
        let whole = out.len();
        out.extend_from_slice(&after);
        prop_assert_eq!(Prelude::decode(format, &out), Ok(Some((prelude, whole))));
    }

    #[test]
    fn release_lists_round_trip(tokens in prop::collection::vec(any::<u64>(), 0..64)) {
        let mut out = vec![0xaa]; // appended after what is there
        encode_release(&tokens, &mut out);
        prop_assert_eq!(out.len(), 1 + release_len(tokens.len()));
        let list = ReleaseList::decode(&out[1..]).unwrap();
        prop_assert_eq!(list.len(), tokens.len());
        prop_assert_eq!(list.tokens().collect::<Vec<_>>(), tokens);
    }

    #[test]
    fn partial_tokens_are_refused(len in 0usize..200) {
        let bytes = vec![0u8; len];
        let decoded = ReleaseList::decode(&bytes);
        if len % RELEASE_TOKEN_LEN == 0 {
            prop_assert_eq!(decoded.unwrap().len(), len / RELEASE_TOKEN_LEN);
        } else {
            prop_assert_eq!(decoded, Err(RecordError::ReleaseLength { len }));
        }
    }

    #[test]
    fn lane_headers_round_trip(nonce: u64, index: u32, count: u32, seq: u64, offset: u64, len: u64) {
        let hello = LaneHello { nonce, index, count };
        prop_assert_eq!(LaneHello::decode(&hello.encode()), Ok(hello));
        let chunk = ChunkHeader { seq, offset, len };
        prop_assert_eq!(ChunkHeader::decode(&chunk.encode()), chunk);
    }

    /// Any hello not starting with the magic is refused, naming what came.
    #[test]
    fn lane_hellos_need_the_magic(bytes in prop::array::uniform24(any::<u8>())) {
        let decoded = LaneHello::decode(&bytes);
        if bytes[..8] == LANE_MAGIC {
            prop_assert!(decoded.is_ok());
        } else {
            let mut found = [0u8; 8];
            found.copy_from_slice(&bytes[..8]);
            prop_assert_eq!(decoded, Err(LaneError::BadMagic { found }));
        }
    }

    /// Arbitrary bytes give `Ok` or a `RecordError`, never a panic.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..40)) {
        for format in FORMATS {
            let _ = Prelude::decode(format, &bytes);
            let _ = ChannelRecord::decode(format, &bytes);
        }
        if let Ok(list) = ReleaseList::decode(&bytes) {
            prop_assert_eq!(list.tokens().count(), bytes.len() / RELEASE_TOKEN_LEN);
        }
    }
}

#[test]
fn lane_headers_are_little_endian_and_fixed() {
    let hello = LaneHello {
        nonce: 0x0102_0304_0506_0708,
        index: 3,
        count: 4,
    };
    let mut expected = b"FERRYLN1".to_vec();
    expected.extend_from_slice(&[8, 7, 6, 5, 4, 3, 2, 1, 3, 0, 0, 0, 4, 0, 0, 0]);
    assert_eq!(hello.encode().to_vec(), expected);
    let mut bad = hello.encode();
    bad[7] = b'2'; // another version
    assert_eq!(
        LaneHello::decode(&bad),
        Err(LaneError::BadMagic {
            found: *b"FERRYLN2"
        })
    );
    let chunk = ChunkHeader {
        seq: 1,
        offset: 2,
        len: 3,
    };
    let mut expected = [0u8; 24];
    expected[0] = 1;
    expected[8] = 2;
    expected[16] = 3;
    assert_eq!(chunk.encode(), expected);
}

#[test]
fn the_bytes_are_little_endian_and_fixed() {
    let cma = CmaRecord {
        addr: 0x0102_0304_0506_0708,
        token: 9,
    };
    assert_eq!(
        cma.encode(),
        [8, 7, 6, 5, 4, 3, 2, 1, 9, 0, 0, 0, 0, 0, 0, 0]
    );
    assert_eq!(
        MptRecord { seq: 0x0a0b }.encode(),
        [0x0b, 0x0a, 0, 0, 0, 0, 0, 0]
    );
    let mut out = Vec::new();
    Prelude::Inline.encode_into(&mut out);
    Prelude::Channel(ChannelRecord::Shm).encode_into(&mut out);
    assert_eq!(out, [Mode::INLINE_BYTE, Mode::CHANNEL_BYTE]);
    assert_eq!(Mode::INLINE_BYTE, 0);
    assert_eq!(Mode::CHANNEL_BYTE, 1);
    let mut out = Vec::new();
    encode_release(&[1, 2], &mut out);
    assert_eq!(out, [1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]);
}

#[test]
fn malformed_records_are_named() {
    for mode in 2..=u8::MAX {
        assert_eq!(Mode::decode(mode), Err(RecordError::UnknownMode { mode }));
        assert_eq!(
            Prelude::decode(RecordFormat::Cma, &[mode; 17]),
            Err(RecordError::UnknownMode { mode })
        );
    }
    assert_eq!(
        ChannelRecord::decode(RecordFormat::Cma, &[0; 15]),
        Err(RecordError::RecordLength {
            channel: "cma",
            expected: 16,
            got: 15
        })
    );
    assert_eq!(
        ChannelRecord::decode(RecordFormat::Mpt, &[0; 9]),
        Err(RecordError::RecordLength {
            channel: "mpt",
            expected: 8,
            got: 9
        })
    );
    assert_eq!(
        ChannelRecord::decode(RecordFormat::Shm, &[0]),
        Err(RecordError::RecordLength {
            channel: "shm",
            expected: 0,
            got: 1
        })
    );
}

#[test]
fn errors_read_as_what_was_wrong() {
    // The transport reports these as `WireError`s.
    let e: WireError = RecordError::UnknownMode { mode: 7 }.into();
    assert_eq!(e.to_string(), "channel record: unknown mode 7");
    let e: WireError = ReleaseList::decode(&[0; 9]).unwrap_err().into();
    assert_eq!(
        e.to_string(),
        "channel record: a release list of 9 bytes does not hold whole 8-byte tokens"
    );
}

#[test]
fn cuda_records_refuse_bytes_that_name_no_device() {
    for bytes in [[2u8, 0, 0], [0, 1, 0], [255, 7, 7]] {
        let tag = bytes[0];
        let index = u16::from_le_bytes([bytes[1], bytes[2]]);
        let staged = [&b"CDS1"[..], &bytes].concat();
        assert_eq!(
            ChannelRecord::decode(RecordFormat::CudaStaged, &staged),
            Err(RecordError::Device { tag, index })
        );
        let mut ipc = [0u8; CudaIpcRecord::LEN];
        ipc[..4].copy_from_slice(b"CDI1");
        ipc[4..7].copy_from_slice(&bytes);
        assert_eq!(
            ChannelRecord::decode(RecordFormat::CudaIpc, &ipc),
            Err(RecordError::Device { tag, index })
        );
    }
    let err = ChannelRecord::decode(RecordFormat::CudaStaged, b"CDS1\x02\0\0").unwrap_err();
    assert_eq!(
        err.to_string(),
        "a CUDA record names no device: tag 2, index 0"
    );
}

/// Another channel's record where a CUDA one was expected (the two ends'
/// device maps disagree) is refused, never read as a CUDA record.
#[test]
fn another_channels_record_is_not_taken_for_a_cuda_one() {
    let mpt = [1u8, 0, 0, 0, 0, 0, 0, 0]; // an mpt or ucx record, seq 1
    let ipc = CudaIpcRecord {
        token: 0,
        target: ferry_wire::Device::Cuda(0),
        handles: [0; CudaIpcRecord::HANDLES_LEN],
    }
    .encode();
    assert_eq!(
        ChannelRecord::decode(RecordFormat::CudaStaged, &mpt[..CudaStagedRecord::LEN]),
        Err(RecordError::NotCuda {
            channel: "cuda_staged"
        })
    );
    assert_eq!(
        ChannelRecord::decode(RecordFormat::CudaStaged, &ipc[..CudaStagedRecord::LEN]),
        Err(RecordError::NotCuda {
            channel: "cuda_staged"
        })
    );
    let staged = CudaStagedRecord {
        target: ferry_wire::Device::Cuda(0),
    }
    .encode();
    let mut padded = [0u8; CudaIpcRecord::LEN];
    padded[..staged.len()].copy_from_slice(&staged);
    let err = ChannelRecord::decode(RecordFormat::CudaIpc, &padded).unwrap_err();
    assert_eq!(
        err,
        RecordError::NotCuda {
            channel: "cuda_ipc"
        }
    );
    assert!(err.to_string().contains("device maps agree"), "{err}");
}
