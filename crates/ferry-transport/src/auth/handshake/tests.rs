use proptest::prelude::*;

use super::*;
use crate::auth::message::tests::any_message;
use crate::auth::Secret;

fn key(s: &str) -> Key {
    Secret::new(format!("{s:0>16}").into_bytes())
        .unwrap()
        .key()
        .clone()
}

/// One side's outcome of a handshake, if it finished.
type Outcome = Option<Result<SessionKey, AuthError>>;

/// Runs an honest exchange, returning both outcomes and the transcript.
fn exchange(
    a_key: Key,
    c_key: Key,
    a_nonce: [u8; 32],
    c_nonce: [u8; 32],
) -> (Outcome, Outcome, Vec<AuthMessage>) {
    let mut acceptor = Handshake::new(Role::Accept, a_key, a_nonce);
    let mut connector = Handshake::new(Role::Connect, c_key, c_nonce);
    assert!(acceptor.start().is_none());
    let mut transcript = Vec::new();
    let (mut a_out, mut c_out) = (None, None);
    let mut to_acceptor = connector.start();
    let mut to_connector = None;
    while to_acceptor.is_some() || to_connector.is_some() {
        if let Some(m) = to_acceptor.take() {
            transcript.push(m.clone());
            let step = acceptor.receive(m);
            to_connector = step.send;
            a_out = a_out.or(step.outcome);
        } else if let Some(m) = to_connector.take() {
            transcript.push(m.clone());
            let step = connector.receive(m);
            to_acceptor = step.send;
            c_out = c_out.or(step.outcome);
        }
    }
    (a_out, c_out, transcript)
}

#[test]
fn the_same_secret_authenticates_both_sides_with_one_session_key() {
    let (a, c, transcript) = exchange(key("s"), key("s"), [1; 32], [2; 32]);
    let (a, c) = (a.unwrap().unwrap(), c.unwrap().unwrap());
    assert_eq!(a.shared, c.shared);
    // Each side's sending key is the other's receiving key, and the two
    // directions differ.
    assert_eq!(a.send, c.recv);
    assert_eq!(a.recv, c.send);
    assert_ne!(a.send, a.recv);
    assert_eq!(transcript.len(), 4);
    // Neither the secret nor the session key crosses the wire.
    for m in &transcript {
        let bytes = m.encode();
        assert!(!bytes.windows(16).any(|w| w == &b"000000000000000s"[..]));
        for k in [&a.shared, &a.send, &a.recv] {
            assert!(!bytes.windows(32).any(|w| w == &k[..]));
        }
    }
    // Fresh nonces give a fresh session key.
    let (again, _, _) = exchange(key("s"), key("s"), [3; 32], [2; 32]);
    assert_ne!(again.unwrap().unwrap().shared, a.shared);
}

#[test]
fn another_secret_fails_on_both_sides() {
    let (a, c, _) = exchange(key("s"), key("t"), [1; 32], [2; 32]);
    // The connecting side sees the acceptor's proof is wrong and stops:
    // the acceptor never hears a proof, so it finishes nothing.
    assert!(matches!(c, Some(Err(AuthError::BadProof))));
    assert!(a.is_none());
}

#[test]
fn a_forged_proof_is_refused() {
    let mut acceptor = Handshake::new(Role::Accept, key("s"), [1; 32]);
    acceptor.receive(AuthMessage::Hello { nonce: [2; 32] });
    let step = acceptor.receive(AuthMessage::Proof { tag: [0; 32] });
    assert_eq!(step.send, Some(AuthMessage::Refused));
    assert!(matches!(step.outcome, Some(Err(AuthError::BadProof))));
    assert!(acceptor.is_finished());
}

#[test]
fn a_replayed_handshake_is_refused_by_an_acceptor_with_a_fresh_nonce() {
    let (_, _, transcript) = exchange(key("s"), key("s"), [1; 32], [2; 32]);
    let mut acceptor = Handshake::new(Role::Accept, key("s"), [9; 32]);
    // The outsider replays the connecting side's messages.
    let step = acceptor.receive(transcript[0].clone());
    assert!(step.outcome.is_none());
    let step = acceptor.receive(transcript[2].clone());
    assert!(matches!(step.outcome, Some(Err(AuthError::BadProof))));
}

#[test]
fn the_acceptors_own_proof_reflected_back_is_refused() {
    let mut acceptor = Handshake::new(Role::Accept, key("s"), [1; 32]);
    let step = acceptor.receive(AuthMessage::Hello { nonce: [1; 32] });
    let Some(AuthMessage::Challenge { tag, .. }) = step.send else {
        panic!("no challenge")
    };
    let step = acceptor.receive(AuthMessage::Proof { tag });
    assert!(matches!(step.outcome, Some(Err(AuthError::BadProof))));
}

#[test]
fn a_refusal_fails_the_connecting_side() {
    let mut connector = Handshake::new(Role::Connect, key("s"), [2; 32]);
    let mut acceptor = Handshake::new(Role::Accept, key("s"), [1; 32]);
    let challenge = acceptor.receive(connector.start().unwrap()).send.unwrap();
    connector.receive(challenge);
    let step = connector.receive(AuthMessage::Refused);
    assert!(matches!(step.outcome, Some(Err(AuthError::Refused))));
}

proptest! {
    /// An outsider who does not hold the secret, sending any messages
    /// (including ones captured from earlier handshakes, duplicated or
    /// reordered), never gets an acceptor to authenticate it, and the
    /// acceptor finishes at the first message out of place.
    #[test]
    fn no_sequence_of_messages_without_the_secret_is_accepted(
        nonce in any::<[u8; 32]>(),
        captured_nonces in any::<([u8; 32], [u8; 32])>(),
        picks in proptest::collection::vec((0usize..4, any_message()), 1..8),
    ) {
        let (_, _, transcript) = exchange(key("s"), key("s"), captured_nonces.0, captured_nonces.1);
        prop_assume!(nonce != captured_nonces.0);
        let mut acceptor = Handshake::new(Role::Accept, key("s"), nonce);
        for (i, (pick, random)) in picks.into_iter().enumerate() {
            let m = if pick < 3 { transcript[pick].clone() } else { random };
            let step = acceptor.receive(m);
            match step.outcome {
                Some(Ok(_)) => prop_assert!(false, "an outsider was accepted"),
                Some(Err(_)) => {
                    prop_assert!(acceptor.is_finished());
                    // Nothing is accepted after the end either.
                    let after = acceptor.receive(transcript[2].clone());
                    let unexpected = matches!(after.outcome, Some(Err(AuthError::Unexpected { .. })));
                    prop_assert!(unexpected, "accepted a message after the end");
                    break;
                }
                None => prop_assert!(i == 0, "only a first hello leaves the acceptor waiting"),
            }
        }
    }

    /// Honest messages delivered duplicated or out of order end the
    /// handshake with an error on the acceptor, never a success.
    #[test]
    fn duplicated_or_reordered_honest_messages_fail_cleanly(
        order in proptest::collection::vec(0usize..2, 1..5),
    ) {
        let mut acceptor = Handshake::new(Role::Accept, key("s"), [7; 32]);
        let mut connector = Handshake::new(Role::Connect, key("s"), [8; 32]);
        let hello = connector.start().unwrap();
        let challenge = acceptor.receive(hello.clone()).send.unwrap();
        let proof = connector.receive(challenge).send.unwrap();
        let honest = [hello, proof];
        let mut fresh = Handshake::new(Role::Accept, key("s"), [7; 32]);
        let expected = [0usize, 1];
        let mut accepted = false;
        for (i, &k) in order.iter().enumerate() {
            let step = fresh.receive(honest[k].clone());
            if let Some(outcome) = step.outcome {
                accepted = outcome.is_ok();
                prop_assert_eq!(accepted, order[..=i] == expected[..]);
                break;
            }
        }
        prop_assert!(!accepted || order[..2] == expected[..]);
    }
}

#[test]
fn sides_that_disagree_on_the_protection_fail_the_handshake() {
    let e = Secret::new(format!("{:0>16}", "s").into_bytes())
        .unwrap()
        .with_protection(crate::auth::Protection::Encrypt)
        .key()
        .clone();
    let (a, c, _) = exchange(key("s"), e.clone(), [1; 32], [2; 32]);
    assert!(matches!(c, Some(Err(AuthError::BadProof))), "{c:?}");
    assert!(a.is_none() || matches!(a, Some(Err(_))));
    let (a, c, _) = exchange(e.clone(), e, [1; 32], [2; 32]);
    let (a, c) = (a.unwrap().unwrap(), c.unwrap().unwrap());
    assert_eq!(a.protection(), crate::auth::Protection::Encrypt);
    assert_eq!(a.send, c.recv);
}
