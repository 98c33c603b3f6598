//! The MAC that binds a tensor's bytes sent outside an authenticated
//! connection's records (the `ucx` channel) to the sealed frame that
//! announces them: keyed BLAKE3 over the transfer's sequence number, the
//! length and the bytes, under a key of the sending direction (see
//! [`SessionKey::tensor_keys`](crate::auth::SessionKey)).

/// Bytes of the MAC.
pub(crate) const TENSOR_MAC_LEN: usize = blake3::OUT_LEN;

/// The MAC of transfer `seq` carrying `bytes`.
pub(crate) fn tag(key: &[u8; 32], seq: u64, bytes: &[u8]) -> [u8; TENSOR_MAC_LEN] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(&seq.to_be_bytes());
    h.update(&(bytes.len() as u64).to_be_bytes());
    h.update(bytes);
    *h.finalize().as_bytes()
}

/// Whether `theirs` is the MAC of transfer `seq` carrying `bytes`
/// (compared in constant time).
pub(crate) fn verify(
    key: &[u8; 32],
    seq: u64,
    bytes: &[u8],
    theirs: &[u8; TENSOR_MAC_LEN],
) -> bool {
    blake3::Hash::from(tag(key, seq, bytes)) == blake3::Hash::from(*theirs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn a_tag_verifies_only_its_own_transfer(
            bytes in proptest::collection::vec(any::<u8>(), 0..300),
            seq in any::<u64>(),
            flip in any::<prop::sample::Index>(),
        ) {
            let key = [9u8; 32];
            let t = tag(&key, seq, &bytes);
            prop_assert!(verify(&key, seq, &bytes, &t));
            prop_assert!(!verify(&key, seq.wrapping_add(1), &bytes, &t));
            prop_assert!(!verify(&[8u8; 32], seq, &bytes, &t));
            if !bytes.is_empty() {
                let mut altered = bytes.clone();
                altered[flip.index(bytes.len())] ^= 1;
                prop_assert!(!verify(&key, seq, &altered, &t));
            }
        }
    }
}
