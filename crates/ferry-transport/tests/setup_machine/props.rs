//! Property tests over the machine's input: any bytes, in any split, end
//! in a request for more, an outcome or a typed error, never a panic; and
//! the honest exchange succeeds however its bytes are cut into reads.
#![allow(clippy::unwrap_used)]

use std::sync::LazyLock;
use std::time::{Duration, Instant};

use ferry_transport::auth::{self, is_auth_failure, AuthMessage};
use ferry_transport::setup_machine::{Role, SetupMachine};
use ferry_transport::{Endpoint, TransportError};
use ferry_wire::{Flags, Frame, MessageKind};
use proptest::prelude::*;

use super::adversary::Splitter;
use super::driver::{assert_agreed, drain, endpoint, Auth, Canned, Net, Offers};

/// Endpoints built once (building one probes the host).
static ENDPOINTS: LazyLock<Vec<(Auth, Endpoint)>> = LazyLock::new(|| {
    Auth::ALL
        .into_iter()
        .map(|a| (a, endpoint("fuzzed", 3, Offers::Ucx, a)))
        .collect()
});

fn local(auth: Auth) -> &'static Endpoint {
    &ENDPOINTS.iter().find(|(a, _)| *a == auth).unwrap().1
}

fn any_auth() -> impl Strategy<Value = Auth> {
    prop_oneof![Just(Auth::None), Just(Auth::Mac), Just(Auth::Encrypt)]
}

fn any_role() -> impl Strategy<Value = Role> {
    prop_oneof![Just(Role::Connect), Just(Role::Accept)]
}

/// `bytes` cut into reads of `sizes` in turn.
fn pieces<'a>(bytes: &'a [u8], sizes: &'a [usize]) -> impl Iterator<Item = &'a [u8]> + 'a {
    let mut at = 0;
    let mut k = 0;
    std::iter::from_fn(move || {
        if at >= bytes.len() {
            return None;
        }
        let n = sizes[k % sizes.len()].min(bytes.len() - at);
        k += 1;
        at += n;
        Some(&bytes[at - n..at])
    })
}

/// Feeds `reads` to `m` (answering its actions), then maybe the end of
/// the stream and a late clock: its end, if it came.
fn feed<'a>(
    m: &mut SetupMachine,
    role: Role,
    reads: impl Iterator<Item = &'a [u8]>,
    eof: bool,
    now: Instant,
) -> Option<Result<(), TransportError>> {
    let mut end = drain(m, role, now).1;
    for read in reads {
        if end.is_some() {
            break;
        }
        m.handle_bytes(now, read);
        end = drain(m, role, now).1;
    }
    if end.is_none() && eof {
        m.handle_eof(now);
        end = drain(m, role, now).1;
    }
    if end.is_none() {
        if let Some(t) = m.poll_timeout() {
            m.handle_timeout(t + Duration::from_secs(1));
            end = drain(m, role, now).1;
        }
    }
    end.map(|r| r.map(|_| ()))
}

/// The accepting machine authenticated by a hand-run connector: the
/// machine and the session the connector holds.
fn authenticated_acceptor(auth: Auth, now: Instant) -> (SetupMachine, auth::SessionKey) {
    let secret = auth.secret().unwrap();
    let mut m = SetupMachine::new(local(auth), Role::Accept, [5; 32], "peer", now);
    let mut peer = auth::Handshake::new(Role::Connect, secret.key().clone(), [6; 32]);
    let mut to_machine = peer.start().unwrap().encode();
    loop {
        m.handle_bytes(now, &to_machine);
        let (written, end) = drain(&mut m, Role::Accept, now);
        assert!(end.is_none());
        let (message, _) = AuthMessage::decode(&written).unwrap().unwrap();
        let step = peer.receive(message);
        if let Some(Ok(session)) = step.outcome {
            return (m, session);
        }
        to_machine = step.send.unwrap().encode();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_bytes_in_any_split_end_in_more_an_outcome_or_a_typed_error(
        auth in any_auth(),
        role in any_role(),
        bytes in proptest::collection::vec(any::<u8>(), 0..600),
        sizes in proptest::collection::vec(1usize..64, 1..8),
        eof in any::<bool>(),
    ) {
        let now = Instant::now();
        let mut m = SetupMachine::new(local(auth), role, [1; 32], "peer", now);
        let end = feed(&mut m, role, pieces(&bytes, &sizes), eof, now);
        match (&end, auth) {
            (None, _) => prop_assert!(!m.is_finished() || eof),
            // No bytes of an outsider authenticate.
            (Some(Ok(())), Auth::Mac | Auth::Encrypt) => prop_assert!(false, "authenticated"),
            (Some(Err(e)), Auth::Mac | Auth::Encrypt) => prop_assert!(is_auth_failure(e), "{e}"),
            (Some(_), Auth::None) => {}
        }
    }

    #[test]
    fn any_frames_in_valid_records_end_in_more_or_a_typed_error(
        auth in prop_oneof![Just(Auth::Mac), Just(Auth::Encrypt)],
        payload in proptest::collection::vec(any::<u8>(), 0..400),
        framed in any::<bool>(),
        kind in prop_oneof![Just(MessageKind::HANDSHAKE), Just(MessageKind::REQUEST)],
        records in proptest::collection::vec(1usize..200, 1..6),
        sizes in proptest::collection::vec(1usize..64, 1..8),
        eof in any::<bool>(),
    ) {
        let now = Instant::now();
        let (mut m, session) = authenticated_acceptor(auth, now);
        // The bytes: a frame around the payload, or the payload alone.
        let data = match framed {
            true => Frame::encode(kind, Flags::NONE, 0, &[], &payload, &[]),
            false => payload.clone(),
        };
        let mut sealer = session.sealer();
        let mut sealed = Vec::new();
        for part in pieces(&data, &records) {
            sealer.seal(&[part], &mut sealed);
        }
        let end = feed(&mut m, Role::Accept, pieces(&sealed, &sizes), eof, now);
        if let Some(Err(e)) = &end {
            // The records are the peer's own: never an integrity failure.
            prop_assert!(!matches!(e, TransportError::Integrity { .. }), "{e}");
        }
    }

    #[test]
    fn the_honest_exchange_succeeds_however_its_bytes_are_split(
        auth in any_auth(),
        offers in prop_oneof![Just(Offers::Inline), Just(Offers::Mpt), Just(Offers::Ucx)],
        sizes in proptest::collection::vec(1usize..80, 1..6),
    ) {
        let ce = endpoint("connector", 1, offers, auth);
        let ae = endpoint("acceptor", 0, offers, auth);
        let mut n = Net::new(
            (&ce, Canned::default()),
            (&ae, Canned::default()),
            1,
            Splitter::new(sizes),
        );
        n.run();
        assert_agreed(n.connector.ok(), n.acceptor.ok());
        let app = Canned::default().app_writes.concat();
        prop_assert_eq!(n.read_after(Role::Connect).unwrap(), app.clone());
        prop_assert_eq!(n.read_after(Role::Accept).unwrap(), app);
    }
}
