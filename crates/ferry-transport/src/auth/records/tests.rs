use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

const KEY: [u8; 32] = [7; 32];

fn any_protection() -> impl Strategy<Value = Protection> {
    prop_oneof![Just(Protection::Mac), Just(Protection::Encrypt)]
}

/// Seals each of `parts` as one record; returns the records' bytes.
fn seal_all(protection: Protection, parts: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut sealer = Sealer::new(KEY, protection);
    parts
        .iter()
        .map(|p| {
            let mut out = Vec::new();
            sealer.seal(&[p], &mut out);
            out
        })
        .collect()
}

/// Opens records in the order given; the data of each, or the first error.
fn open_all(protection: Protection, records: &[Vec<u8>]) -> Result<Vec<Vec<u8>>, RecordError> {
    let mut opener = Opener::new(KEY, protection);
    records
        .iter()
        .map(|r| {
            let mut r = r.clone();
            let range = opener.open(&mut r)?;
            Ok(r[range].to_vec())
        })
        .collect()
}

fn parts() -> impl Strategy<Value = Vec<Vec<u8>>> {
    proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 1..6)
}

proptest! {
    #[test]
    fn records_open_to_what_was_sealed(p in any_protection(), parts in parts()) {
        let records = seal_all(p, &parts);
        prop_assert_eq!(open_all(p, &records).unwrap(), parts);
    }

    #[test]
    fn encrypted_records_do_not_show_their_data(parts in parts()) {
        let records = seal_all(Protection::Encrypt, &parts);
        for (r, d) in records.iter().zip(&parts) {
            if d.len() >= 16 {
                prop_assert!(!r.windows(d.len()).any(|w| w == &d[..]));
            }
        }
    }

    #[test]
    fn any_altered_byte_is_refused(
        p in any_protection(),
        parts in parts(),
        which in any::<prop::sample::Index>(),
        at in any::<prop::sample::Index>(),
        flip in 1..=255u8,
    ) {
        let mut records = seal_all(p, &parts);
        let r = which.index(records.len());
        let i = at.index(records[r].len());
        records[r][i] ^= flip;
        let e = open_all(p, &records).unwrap_err();
        // A changed length prefix may also announce another size.
        prop_assert!(matches!(e, RecordError::Forged { seq } | RecordError::Truncated { seq } if seq == r as u64)
            || matches!(e, RecordError::TooLarge { .. }), "{e:?}");
    }

    #[test]
    fn a_dropped_reordered_or_replayed_record_is_refused(
        p in any_protection(),
        parts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..50), 2..6),
        which in any::<prop::sample::Index>(),
        how in 0..3u8,
    ) {
        let mut records = seal_all(p, &parts);
        let r = which.index(records.len() - 1);
        match how {
            0 => { records.remove(r); }
            1 => records.swap(r, r + 1),
            _ => { let again = records[r].clone(); records.insert(r + 1, again); }
        }
        let e = open_all(p, &records).unwrap_err();
        prop_assert!(matches!(e, RecordError::Forged { .. }), "{e:?}");
    }

    #[test]
    fn any_bytes_open_to_data_or_an_error(
        p in any_protection(),
        bytes in proptest::collection::vec(any::<u8>(), 0..200),
    ) {
        let mut opener = Opener::new(KEY, p);
        let mut b = bytes.clone();
        let _ = opener.open(&mut b);
    }
}

#[test]
fn a_record_of_the_other_direction_or_key_is_refused() {
    let mut out = Vec::new();
    Sealer::new(KEY, Protection::Mac).seal(&[b"call"], &mut out);
    let mut reflected = out.clone();
    assert_eq!(
        Opener::new([8; 32], Protection::Mac).open(&mut reflected),
        Err(RecordError::Forged { seq: 0 })
    );
    assert!(Opener::new(KEY, Protection::Encrypt)
        .open(&mut out)
        .is_err());
}

#[test]
fn an_oversized_length_is_refused_before_its_bytes() {
    let opener = Opener::new(KEY, Protection::Mac);
    let header = ((MAX_RECORD + 1) as u32).to_be_bytes();
    assert_eq!(
        opener.record_len(header),
        Err(RecordError::TooLarge {
            seq: 0,
            len: MAX_RECORD as u64 + 1
        })
    );
}

/// Writes `data` through a sealed writer in pieces of the given sizes
/// (cycled), and reads it back through a sealed reader in pieces of other
/// sizes, over a small in-memory pipe.
async fn through_a_pipe(
    p: Protection,
    data: &[u8],
    write_sizes: &[usize],
    read_size: usize,
) -> Vec<u8> {
    let (a, b) = tokio::io::duplex(4096);
    let mut w = RecordWriter::new(a, Some(Sealer::new(KEY, p)));
    let mut r = RecordReader::new(b, Some(Opener::new(KEY, p)));
    let writing = async {
        let mut at = 0;
        for size in write_sizes.iter().cycle() {
            if at == data.len() {
                break;
            }
            let end = (at + size.max(&1)).min(data.len());
            w.write_all(&data[at..end]).await.unwrap();
            at = end;
        }
        w.shutdown().await.unwrap();
    };
    let reading = async {
        let mut got = Vec::new();
        let mut buf = vec![0u8; read_size.max(1)];
        loop {
            let n = r.read(&mut buf).await.unwrap();
            if n == 0 {
                break got;
            }
            got.extend_from_slice(&buf[..n]);
        }
    };
    tokio::join!(writing, reading).1
}

#[tokio::test]
async fn a_stream_crosses_whole_in_any_cut() {
    let data: Vec<u8> = (0..(3 * MAX_RECORD + 12345))
        .map(|i| (i * 31 % 251) as u8)
        .collect();
    for p in [Protection::Mac, Protection::Encrypt] {
        for (writes, read) in [
            (vec![1, 7, 4096], 3),
            (vec![MAX_RECORD + 17], 100_000),
            (vec![10 * MAX_RECORD], 1 << 20),
        ] {
            assert_eq!(through_a_pipe(p, &data, &writes, read).await, data);
        }
    }
}

#[tokio::test]
async fn a_flipped_byte_on_the_way_fails_the_reader_and_keeps_failing() {
    let mut record = Vec::new();
    let mut sealer = Sealer::new(KEY, Protection::Mac);
    sealer.seal(&[b"first"], &mut record);
    let mut second = Vec::new();
    sealer.seal(&[b"second"], &mut second);
    second[5] ^= 1;
    record.extend_from_slice(&second);
    let mut r = RecordReader::new(&record[..], Some(Opener::new(KEY, Protection::Mac)));
    let mut buf = [0u8; 5];
    r.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"first");
    for _ in 0..2 {
        let e = r.read(&mut buf).await.unwrap_err();
        assert_eq!(RecordError::of(&e), Some(&RecordError::Forged { seq: 1 }));
    }
}

#[tokio::test]
async fn a_stream_cut_inside_a_record_is_truncated_not_ended() {
    let mut record = Vec::new();
    Sealer::new(KEY, Protection::Mac).seal(&[b"whole"], &mut record);
    record.truncate(record.len() - 1);
    let mut r = RecordReader::new(&record[..], Some(Opener::new(KEY, Protection::Mac)));
    let mut buf = [0u8; 8];
    let e = r.read(&mut buf).await.unwrap_err();
    assert_eq!(
        RecordError::of(&e),
        Some(&RecordError::Truncated { seq: 0 })
    );
    // Cut between records: a clean end.
    let mut r = RecordReader::new(&[][..], Some(Opener::new(KEY, Protection::Mac)));
    assert_eq!(r.read(&mut buf).await.unwrap(), 0);
}
