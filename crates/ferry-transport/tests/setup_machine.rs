//! Two set-up machines, a connecting and an accepting one, through an
//! in-memory network (`setup_machine/driver.rs`) with an adversary in
//! between: the honest set-up in every flow (with and without a secret,
//! MAC and encrypted records, UCX kept or fallen back), and each attack
//! ending in the typed error it should give, with no outcome on its
//! victim. Time is a synthetic clock: bounds fire without sleeps.
#![allow(clippy::unwrap_used)]

#[path = "setup_machine/adversary.rs"]
mod adversary;
#[path = "setup_machine/driver.rs"]
mod driver;
#[path = "setup_machine/props.rs"]
mod props;

use ferry_transport::auth::{is_auth_failure, RecordError, AUTH_TIMEOUT};
use ferry_transport::setup_machine::{Role, SETUP_TIMEOUT};
use ferry_transport::{channel, TransportError, UcxUnusable};
use ferry_wire::{
    handshake_limits, ChannelChoice, Device, Flags, Frame, Handshake, MessageKind, WireError,
};

use adversary::{Attacker, How, Replayer};
use driver::{assert_agreed, endpoint, Auth, Canned, Net, Offers, Relay};

/// The data of the acceptor's and the connector's first writes after the
/// set-up (the driver's default).
const APP_DATA: &[u8] = b"firstsecond write";

fn net<A: driver::Adversary>(
    offers: Offers,
    auth: Auth,
    c: Canned,
    a: Canned,
    seed: u8,
    adversary: A,
) -> Net<A> {
    let ce = endpoint("connector", 1, offers, auth);
    let ae = endpoint("acceptor", 0, offers, auth);
    let mut n = Net::new((&ce, c), (&ae, a), seed, adversary);
    n.run();
    n
}

fn attack(offers: Offers, auth: Auth, adversary: Attacker) -> Net<Attacker> {
    net(
        offers,
        auth,
        Canned::default(),
        Canned::default(),
        1,
        adversary,
    )
}

/// Honest set-ups, each side's outcome checked against the other's.
fn honest(offers: Offers, auth: Auth, c: Canned, a: Canned) -> Net<Relay> {
    let mut n = net(offers, auth, c, a, 1, Relay);
    assert_agreed(n.connector.ok(), n.acceptor.ok());
    let sealed = auth != Auth::None;
    assert_eq!(n.connector.ok().session.is_some(), sealed);
    assert_eq!(n.connector.ok().opener.is_some(), sealed);
    let c_app = n.acceptor.canned.app_writes.concat();
    let a_app = n.connector.canned.app_writes.concat();
    assert_eq!(n.read_after(Role::Connect).unwrap(), c_app, "{auth:?}");
    assert_eq!(n.read_after(Role::Accept).unwrap(), a_app, "{auth:?}");
    n
}

fn integrity(e: &TransportError) -> &RecordError {
    match e {
        TransportError::Integrity { peer, source } => {
            assert!(!peer.is_empty());
            source
        }
        other => panic!("expected an integrity failure, got {other:?}"),
    }
}

fn handshake_reason(e: &TransportError) -> &str {
    match e {
        TransportError::Handshake { reason, .. } => reason,
        other => panic!("expected a handshake failure, got {other:?}"),
    }
}

#[test]
fn the_honest_set_up_agrees_on_both_sides_in_every_flow() {
    for auth in Auth::ALL {
        let n = honest(Offers::Inline, auth, Canned::default(), Canned::default());
        assert_eq!(n.connector.ok().agreement.transport, channel::TCP);
        assert_eq!(n.acceptor.actions, ["bind listeners", "run set-up"]);
        assert_eq!(n.connector.actions, ["run set-up"]);

        let n = honest(Offers::Mpt, auth, Canned::default(), Canned::default());
        assert!(n.connector.ok().agreement.uses(channel::MPT));
        let peer = &n.connector.ok().agreement.peer;
        assert!(peer.properties.iter().any(|(k, _)| k == "mpt.addr"));

        // On the shm transport nothing more travels on TCP.
        let quiet = Canned {
            app_writes: Vec::new(),
            ..Canned::default()
        };
        let n = honest(Offers::ShmTransport, auth, quiet.clone(), quiet);
        assert_eq!(n.acceptor.ok().agreement.transport, channel::SHM_TRANSPORT);
        assert!(n.acceptor.ok().agreement.needs_shm());
    }
}

#[test]
fn the_ucx_check_keeps_ucx_or_falls_back_on_both_sides_alike() {
    for auth in Auth::ALL {
        // Both checks pass: UCX stays.
        let n = honest(Offers::Ucx, auth, Canned::default(), Canned::default());
        assert!(n.connector.ok().agreement.uses(channel::UCX));
        assert!(n.connector.ok().ucx_fallback.is_none());
        assert_eq!(
            n.connector.actions,
            ["create UCX worker", "UCX check", "run set-up"]
        );
        assert_eq!(
            n.acceptor.actions,
            [
                "create UCX worker",
                "bind listeners",
                "UCX check",
                "run set-up"
            ]
        );
        // The acceptor named its listener; the connector offered to use one.
        let to_connector = &n.connector.ok().agreement.peer;
        assert!(to_connector.ucx_address.is_some());

        // The connector's check fails: both fall back, the acceptor binds
        // again for the selection without UCX.
        let failing = Canned {
            ucx_check: Some(Err(UcxUnusable::Exchange("no probe".into()))),
            ..Canned::default()
        };
        let n = honest(Offers::Ucx, auth, failing.clone(), Canned::default());
        for side in [n.connector.ok(), n.acceptor.ok()] {
            assert!(!side.agreement.uses(channel::UCX));
        }
        let why = n.connector.ok().ucx_fallback.clone().unwrap();
        assert_eq!(why.local, Some(UcxUnusable::Exchange("no probe".into())));
        assert_eq!(why.peer, None);
        let why = n.acceptor.ok().ucx_fallback.clone().unwrap();
        assert_eq!(why.peer, Some(UcxUnusable::Exchange("no probe".into())));
        assert_eq!(
            n.acceptor
                .actions
                .iter()
                .filter(|a| **a == "bind listeners")
                .count(),
            2
        );

        // The acceptor's check waits for a peer that never connects; the
        // connector's failed verdict ends it at once.
        let waiting = Canned {
            ucx_check: None,
            ..Canned::default()
        };
        let n = honest(Offers::Ucx, auth, failing, waiting);
        assert!(n.acceptor.actions.contains(&"abandon UCX check"));
        let why = n.acceptor.ok().ucx_fallback.clone().unwrap();
        assert!(
            matches!(&why.local, Some(UcxUnusable::Endpoint(t)) if t.contains("failed first")),
            "{why}"
        );
        assert_eq!(n.acceptor.ended_at, Some(n.start), "no time passed");

        // No UCX worker on one side: its offers are withdrawn, no check.
        for (c, a) in [(false, true), (true, false)] {
            let canned = |worker| Canned {
                ucx_worker: worker,
                ..Canned::default()
            };
            let n = honest(Offers::Ucx, auth, canned(c), canned(a));
            assert!(!n.connector.ok().agreement.uses(channel::UCX));
            assert!(n.connector.ok().ucx_fallback.is_none());
            assert!(!n.acceptor.actions.contains(&"UCX check"));
        }
    }
}

#[test]
fn an_altered_authentication_message_fails_authentication_on_both_sides() {
    for auth in Auth::SEALED {
        // The challenge's proof: the connector refuses it.
        let n = attack(
            Offers::Inline,
            auth,
            Attacker::one(Role::Accept, 0, How::Alter { at: 40 }),
        );
        let e = n.connector.err();
        assert!(is_auth_failure(e), "{e}");
        assert!(e.to_string().contains("proof does not match"), "{e}");
        assert!(is_auth_failure(n.acceptor.err()));

        // The connector's proof: the acceptor refuses it, and says so.
        let n = attack(
            Offers::Inline,
            auth,
            Attacker::one(Role::Connect, 1, How::Alter { at: 10 }),
        );
        assert!(n
            .acceptor
            .err()
            .to_string()
            .contains("proof does not match"));
        assert!(n.connector.err().to_string().contains("refused"));
    }
}

#[test]
fn an_altered_byte_of_a_sealed_handshake_fails_its_record() {
    for auth in Auth::SEALED {
        for (from, at) in [(Role::Connect, 12), (Role::Accept, 12), (Role::Connect, 70)] {
            let mut n = attack(
                Offers::Inline,
                auth,
                Attacker::one(from, 2, How::Alter { at }),
            );
            let victim = n.side(match from {
                Role::Connect => Role::Accept,
                Role::Accept => Role::Connect,
            });
            assert_eq!(
                integrity(victim.err()),
                &RecordError::Forged { seq: 0 },
                "{auth:?}"
            );
        }
        // The length prefix: refused before the record is read.
        let n = attack(
            Offers::Inline,
            auth,
            Attacker::one(Role::Connect, 2, How::Alter { at: 0 }),
        );
        assert!(matches!(
            integrity(n.acceptor.err()),
            RecordError::TooLarge { seq: 0, .. }
        ));
    }
}

#[test]
fn without_a_secret_an_altered_frame_header_is_malformed() {
    let n = attack(
        Offers::Inline,
        Auth::None,
        Attacker::one(Role::Connect, 0, How::Alter { at: 0 }),
    );
    assert!(matches!(
        n.acceptor.err(),
        TransportError::Malformed {
            source: WireError::BadMagic { .. },
            ..
        }
    ));
}

#[test]
fn a_replayed_transcript_does_not_authenticate() {
    for auth in Auth::ALL {
        let recorded = net(
            Offers::Inline,
            auth,
            Canned::default(),
            Canned::default(),
            1,
            Relay,
        );
        let transcript = recorded.connector.writes.clone();
        // A fresh acceptor (other nonces) hears the old connector.
        let n = net(
            Offers::Inline,
            auth,
            Canned::default(),
            Canned::default(),
            9,
            Replayer::new(transcript),
        );
        match auth {
            Auth::None => {
                // Nothing authenticates a peer without a secret: the old
                // handshake is taken as it is.
                n.acceptor.ok();
            }
            _ => {
                let e = n.acceptor.err();
                assert!(is_auth_failure(e), "{e}");
                assert!(e.to_string().contains("proof does not match"), "{e}");
            }
        }
    }
}

#[test]
fn a_record_from_an_earlier_session_is_forged() {
    for auth in Auth::SEALED {
        let recorded = net(
            Offers::Inline,
            auth,
            Canned::default(),
            Canned::default(),
            1,
            Relay,
        );
        let old = recorded.connector.writes[2].clone();
        // The authentication passes through; the handshake record is the
        // old session's.
        let n = net(
            Offers::Inline,
            auth,
            Canned::default(),
            Canned::default(),
            5,
            Attacker::one(Role::Connect, 2, How::Replace(old)),
        );
        assert_eq!(integrity(n.acceptor.err()), &RecordError::Forged { seq: 0 });
    }
}

/// A whole record of 16 bytes with a zero tag, as an outsider makes one.
fn fake_record(auth: Auth) -> Vec<u8> {
    let tag = match auth {
        Auth::Encrypt => 16,
        _ => 32,
    };
    let mut r = 16u32.to_be_bytes().to_vec();
    r.extend_from_slice(b"injected frame!!");
    r.extend(std::iter::repeat_n(0, tag));
    r
}

#[test]
fn bytes_injected_after_the_handshake_fail_before_anything_runs() {
    for auth in Auth::SEALED {
        let n = attack(
            Offers::Inline,
            auth,
            Attacker::one(Role::Accept, 2, How::Inject(fake_record(auth))),
        );
        assert_eq!(
            integrity(n.connector.err()),
            &RecordError::Forged { seq: 1 }
        );
    }
    // Without a secret on the shm transport nothing may follow on TCP.
    let n = attack(
        Offers::ShmTransport,
        Auth::None,
        Attacker::one(Role::Accept, 0, How::Inject(b"stray".to_vec())),
    );
    assert_eq!(
        handshake_reason(n.connector.err()),
        "5 bytes arrived on TCP after the handshake"
    );
    // Without a secret on TCP, nothing tells them from the peer's: they
    // are the first bytes the connection reads.
    let mut n = attack(
        Offers::Inline,
        Auth::None,
        Attacker::one(Role::Accept, 0, How::Inject(b"stray".to_vec())),
    );
    let read = n.read_after(Role::Connect).unwrap();
    assert_eq!(read, [&b"stray"[..], APP_DATA].concat());
}

#[test]
fn records_reordered_or_dropped_at_the_end_of_the_handshake_are_forged() {
    for auth in Auth::SEALED {
        // The reply and the acceptor's first two records, held and
        // delivered in one read: swapped, or the first dropped.
        for order in [vec![0, 2, 1], vec![0, 2]] {
            let n = attack(
                Offers::Inline,
                auth,
                Attacker::one(Role::Accept, 2, How::Hold { count: 3, order }),
            );
            assert_eq!(
                integrity(n.connector.err()),
                &RecordError::Forged { seq: 1 }
            );
        }
    }
    // Without a secret they pass, reordered.
    let mut n = attack(
        Offers::Inline,
        Auth::None,
        Attacker::one(
            Role::Accept,
            0,
            How::Hold {
                count: 3,
                order: vec![0, 2, 1],
            },
        ),
    );
    assert_eq!(n.read_after(Role::Connect).unwrap(), b"second writefirst");
}

#[test]
fn a_dropped_authentication_message_ends_at_the_authentication_bound() {
    for auth in Auth::SEALED {
        // The acceptor's verdict never arrives.
        let n = attack(
            Offers::Inline,
            auth,
            Attacker::one(Role::Accept, 1, How::Drop),
        );
        let e = n.connector.err();
        assert!(is_auth_failure(e), "{e}");
        assert!(e.to_string().contains("did not finish within"), "{e}");
        assert_eq!(n.connector.ended_at, Some(n.start + AUTH_TIMEOUT));
        // Its peer then sees the connection close before a handshake.
        assert_eq!(
            handshake_reason(n.acceptor.err()),
            "connection closed before the handshake"
        );
    }
}

#[test]
fn a_truncated_stream_fails_where_it_ends() {
    for auth in Auth::SEALED {
        // Inside the hello.
        let n = attack(
            Offers::Inline,
            auth,
            Attacker::one(Role::Connect, 0, How::Truncate { keep: 3 }),
        );
        assert!(is_auth_failure(n.acceptor.err()), "{}", n.acceptor.err());
        // Inside the handshake's record.
        let n = attack(
            Offers::Inline,
            auth,
            Attacker::one(Role::Connect, 2, How::Truncate { keep: 20 }),
        );
        assert!(matches!(n.acceptor.err(), TransportError::Closed { .. }));
    }
    // Without a secret: inside the frame, or before it.
    let n = attack(
        Offers::Inline,
        Auth::None,
        Attacker::one(Role::Connect, 0, How::Truncate { keep: 20 }),
    );
    assert!(matches!(n.acceptor.err(), TransportError::Closed { .. }));
    let n = attack(
        Offers::Inline,
        Auth::None,
        Attacker::one(Role::Connect, 0, How::Truncate { keep: 0 }),
    );
    assert_eq!(
        handshake_reason(n.acceptor.err()),
        "connection closed before the handshake"
    );
}

#[test]
fn a_stalled_stream_fails_at_its_bound() {
    let stall = handshake_limits().frame_stall_timeout;
    for auth in Auth::SEALED {
        // Inside the authentication: its 10 s.
        let n = attack(
            Offers::Inline,
            auth,
            Attacker::one(Role::Connect, 1, How::Stall { keep: 10 }),
        );
        assert!(n
            .acceptor
            .err()
            .to_string()
            .contains("did not finish within"));
        assert_eq!(n.acceptor.ended_at, Some(n.start + AUTH_TIMEOUT));
        // Inside the handshake's record: the frame stall timeout.
        let n = attack(
            Offers::Inline,
            auth,
            Attacker::one(Role::Connect, 2, How::Stall { keep: 20 }),
        );
        assert!(matches!(
            n.acceptor.err(),
            TransportError::Stalled { after, .. } if *after == stall
        ));
        assert_eq!(n.acceptor.ended_at, Some(n.start + stall));
    }
    // Without a secret: the header is in, the payload stops.
    let n = attack(
        Offers::Inline,
        Auth::None,
        Attacker::one(Role::Connect, 0, How::Stall { keep: 40 }),
    );
    match n.acceptor.err() {
        TransportError::Stalled {
            waiting_for, got, ..
        } => {
            assert!(
                waiting_for.contains("payload of a handshake frame"),
                "{waiting_for}"
            );
            assert_eq!(*got, 8);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_peer_that_never_finishes_its_set_up_is_given_up_on() {
    for auth in Auth::ALL {
        let never = Canned {
            setup: false,
            ..Canned::default()
        };
        let n = net(Offers::Mpt, auth, Canned::default(), never, 1, Relay);
        assert_eq!(
            handshake_reason(n.acceptor.err()),
            "the peer did not finish setting up its channels"
        );
        assert_eq!(n.acceptor.ended_at, Some(n.start + SETUP_TIMEOUT));
        // The connector's own set-up ended: it reached its outcome.
        n.connector.ok();
    }
}

fn frame(kind: MessageKind, payload: &[u8]) -> Vec<u8> {
    Frame::encode(kind, Flags::NONE, 0, &[], payload, &[])
}

#[test]
fn the_first_bytes_must_be_a_handshake() {
    // A request frame instead.
    let n = attack(
        Offers::Inline,
        Auth::None,
        Attacker::one(
            Role::Connect,
            0,
            How::Replace(frame(MessageKind::REQUEST, b"call")),
        ),
    );
    assert!(handshake_reason(n.acceptor.err()).contains("expected a handshake, got a"));
    // A header announcing more than a handshake: refused at the header.
    let mut big = frame(MessageKind::HANDSHAKE, b"");
    big[16..20].copy_from_slice(&(1u32 << 30).to_le_bytes());
    let n = attack(
        Offers::Inline,
        Auth::None,
        Attacker::one(Role::Connect, 0, How::Replace(big[..32].to_vec())),
    );
    assert!(matches!(
        n.acceptor.err(),
        TransportError::Malformed {
            source: WireError::TooLarge { .. },
            ..
        }
    ));
    // With a secret, a frame where the hello belongs fails authentication.
    for auth in Auth::SEALED {
        let n = attack(
            Offers::Inline,
            auth,
            Attacker::one(
                Role::Connect,
                0,
                How::Replace(frame(MessageKind::HANDSHAKE, b"hi")),
            ),
        );
        let e = n.acceptor.err();
        assert!(is_auth_failure(e), "{e}");
        assert!(
            e.to_string().contains("not an authentication handshake"),
            "{e}"
        );
    }
}

/// The acceptor's honest reply (no secret), changed by `f`.
fn forged_reply(offers: Offers, f: impl Fn(&mut Handshake)) -> Vec<u8> {
    let honest = net(
        offers,
        Auth::None,
        Canned::default(),
        Canned::default(),
        1,
        Relay,
    );
    let bytes = &honest.acceptor.writes[0];
    let (frame_in, _) = Frame::decode(bytes, &handshake_limits()).unwrap();
    let mut h = Handshake::decode(frame_in.payload).unwrap();
    f(&mut h);
    frame(MessageKind::HANDSHAKE, &h.encode().unwrap())
}

#[test]
fn without_a_secret_a_forged_reply_is_caught_where_it_disagrees() {
    // A selection the connector did not compute.
    let reply = forged_reply(Offers::Inline, |h| {
        h.selection = vec![ChannelChoice {
            source: Device::Cpu,
            target: Device::Cpu,
            channel: channel::MPT.into(),
        }]
    });
    let n = attack(
        Offers::Inline,
        Auth::None,
        Attacker::one(Role::Accept, 0, How::Replace(reply)),
    );
    assert!(matches!(n.connector.err(), TransportError::Selection(_)));
    // A UCX check result that is none of the three.
    let honest = net(
        Offers::Ucx,
        Auth::None,
        Canned::default(),
        Canned::default(),
        1,
        Relay,
    );
    let (verdict, _) = Frame::decode(&honest.connector.writes[1], &handshake_limits()).unwrap();
    let mut h = Handshake::decode(verdict.payload).unwrap();
    for (k, v) in &mut h.properties {
        if k == "ucx.check" {
            *v = "maybe".into();
        }
    }
    let forged = frame(MessageKind::HANDSHAKE, &h.encode().unwrap());
    let n = attack(
        Offers::Ucx,
        Auth::None,
        Attacker::one(Role::Connect, 1, How::Replace(forged)),
    );
    assert!(handshake_reason(n.acceptor.err()).contains("is none of ok"));
}

#[test]
fn a_connection_with_no_bound_between_frames_waits_for_its_caller() {
    // The connector's handshake never comes: the acceptor waits with no
    // bound of its own (the RPC agent's init_timeout applies).
    let n = attack(
        Offers::Inline,
        Auth::None,
        Attacker::one(Role::Connect, 0, How::Drop),
    );
    assert!(n.acceptor.outcome.is_none());
    assert!(n.acceptor.machine.poll_timeout().is_none());
    assert!(n.acceptor.machine.wants_read());
    assert!(n.connector.outcome.is_none());
}
