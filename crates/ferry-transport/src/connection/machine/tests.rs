//! The machine's own steps, one side at a time: the outputs it gives at
//! each point of the set-up. (Two machines talking, through an adversary,
//! are `tests/setup_machine.rs`'s.)
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use ferry_wire::{ChannelOffer, Device, DeviceOffer, Flags, Frame, MessageKind, TransportOffer};

use super::*;
use crate::auth::Secret;

fn endpoint(name: &str, channels: &[&str], secret: bool) -> Endpoint {
    let mut e = Endpoint::new(name, 0);
    e.transports = vec![TransportOffer {
        name: channel::TCP.into(),
        priority: 0,
        descriptor: String::new(),
    }];
    e.channels = channels
        .iter()
        .map(|c| ChannelOffer {
            name: (*c).into(),
            priority: if *c == channel::INLINE { 0 } else { 10 },
            devices: vec![DeviceOffer {
                device: Device::Cpu,
                descriptor: "host".into(),
            }],
        })
        .collect();
    e.auth = secret.then(|| Secret::new(b"0123456789abcdef0123".to_vec()).unwrap());
    e
}

fn outputs(m: &mut SetupMachine) -> Vec<Output> {
    std::iter::from_fn(|| m.poll_output()).collect()
}

fn transmitted(outs: &[Output]) -> Vec<u8> {
    outs.iter()
        .filter_map(|o| match o {
            Output::Transmit(b) => Some(b.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

fn frame(h: &Handshake) -> Vec<u8> {
    Frame::encode(
        MessageKind::HANDSHAKE,
        Flags::NONE,
        0,
        &[],
        &h.encode().unwrap(),
        &[],
    )
}

#[test]
fn without_a_secret_the_connecting_side_speaks_first() {
    let now = Instant::now();
    let mut c = SetupMachine::new(
        &endpoint("c", &["inline"], false),
        Role::Connect,
        [1; 32],
        "a",
        now,
    );
    let outs = outputs(&mut c);
    assert_eq!(outs.len(), 1, "{outs:?}");
    let bytes = transmitted(&outs);
    let (f, used) = Frame::decode(&bytes, &handshake_limits()).unwrap();
    assert_eq!(used, bytes.len());
    assert_eq!(Handshake::decode(f.payload).unwrap().worker_name, "c");
    assert!(c.wants_read());
    assert_eq!(c.poll_timeout(), None, "no bound between frames");
}

#[test]
fn the_accepting_side_binds_replies_and_sets_up() {
    let now = Instant::now();
    let local = endpoint("a", &["inline"], false);
    let mut a = SetupMachine::new(&local, Role::Accept, [2; 32], "c", now);
    assert!(outputs(&mut a).is_empty());
    let peer = endpoint("c", &["inline"], false).handshake(None, Vec::new(), Vec::new(), None);
    let bytes = frame(&peer);
    // Byte by byte: nothing happens before the last one.
    for b in &bytes[..bytes.len() - 1] {
        a.handle_bytes(now, std::slice::from_ref(b));
        assert!(outputs(&mut a).is_empty());
        assert!(a.poll_timeout().is_some(), "a started frame is bounded");
    }
    a.handle_bytes(now, &bytes[bytes.len() - 1..]);
    let outs = outputs(&mut a);
    assert!(
        matches!(
            outs[..],
            [Output::Action(Action::BindListeners {
                shm: false,
                mpt: false
            })]
        ),
        "{outs:?}"
    );
    a.handle_event(now, Event::ListenersBound(Ok(Vec::new())));
    let outs = outputs(&mut a);
    assert!(matches!(outs[0], Output::Transmit(_)), "{outs:?}");
    assert!(
        matches!(outs[1], Output::Action(Action::RunSetup { .. })),
        "{outs:?}"
    );
    assert_eq!(a.poll_timeout(), Some(now + SETUP_TIMEOUT));
    a.handle_event(now, Event::SetupDone(Ok(())));
    match outputs(&mut a).pop() {
        Some(Output::Done(Ok(outcome))) => {
            assert_eq!(outcome.agreement.transport, channel::TCP);
            assert!(outcome.opener.is_none() && outcome.plain.is_empty());
        }
        other => panic!("{other:?}"),
    }
    assert!(a.is_finished());
}

#[test]
fn the_accepting_sides_wait_for_the_set_up_is_bounded() {
    let now = Instant::now();
    let local = endpoint("a", &["inline"], false);
    let mut a = SetupMachine::new(&local, Role::Accept, [2; 32], "c", now);
    let peer = endpoint("c", &["inline"], false).handshake(None, Vec::new(), Vec::new(), None);
    a.handle_bytes(now, &frame(&peer));
    a.handle_event(now, Event::ListenersBound(Ok(Vec::new())));
    outputs(&mut a);
    a.handle_timeout(now + SETUP_TIMEOUT - Duration::from_millis(1));
    assert!(outputs(&mut a).is_empty());
    a.handle_timeout(now + SETUP_TIMEOUT);
    match outputs(&mut a).pop() {
        Some(Output::Done(Err(TransportError::Handshake { reason, .. }))) => {
            assert!(reason.contains("did not finish setting up"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn with_a_secret_the_first_bytes_are_the_hello_and_the_bound_is_auth_timeout() {
    let now = Instant::now();
    let mut c = SetupMachine::new(
        &endpoint("c", &["inline"], true),
        Role::Connect,
        [1; 32],
        "a",
        now,
    );
    let bytes = transmitted(&outputs(&mut c));
    assert_eq!(
        crate::auth::AuthMessage::decode(&bytes).unwrap(),
        Some((
            crate::auth::AuthMessage::Hello { nonce: [1; 32] },
            bytes.len()
        ))
    );
    assert_eq!(c.poll_timeout(), Some(now + AUTH_TIMEOUT));
    c.handle_timeout(now + AUTH_TIMEOUT);
    match outputs(&mut c).pop() {
        Some(Output::Done(Err(e))) => assert!(crate::auth::is_auth_failure(&e), "{e}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_answer_the_state_does_not_wait_for_fails_the_set_up() {
    let now = Instant::now();
    let mut a = SetupMachine::new(
        &endpoint("a", &["inline"], false),
        Role::Accept,
        [0; 32],
        "c",
        now,
    );
    a.handle_event(now, Event::SetupDone(Ok(())));
    match outputs(&mut a).pop() {
        Some(Output::Done(Err(TransportError::Handshake { reason, .. }))) => {
            assert!(
                reason.contains("while awaiting the peer's handshake"),
                "{reason}"
            )
        }
        other => panic!("{other:?}"),
    }
}
