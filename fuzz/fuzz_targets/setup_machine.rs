//! A connection's set-up machine (`ferry_transport::setup_machine`) fed
//! arbitrary bytes in reads of any size, in either role, with and without
//! a secret, its actions answered at once: it asks for more, reaches an
//! outcome or fails with a typed error, never panics. Without the secret
//! nothing authenticates; after an honest authentication (a hand-run peer
//! holding the secret seals the bytes into records), the records never
//! fail their check, and what is in them decides the rest.
#![no_main]

use std::collections::VecDeque;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use ferry_transport::auth::{self, AuthMessage, Protection, Secret, SessionKey};
use ferry_transport::setup_machine::{
    Action, Event, Outcome, Output, Role, SetupMachine, UcxWorkerInfo,
};
use ferry_transport::{channel, Endpoint, TransportError};
use ferry_wire::{ChannelOffer, Device, DeviceOffer, TransportOffer};
use libfuzzer_sys::fuzz_target;

fn secret(protection: Protection) -> Secret {
    Secret::new(b"fuzzing-secret-of-the-group".to_vec())
        .unwrap()
        .with_protection(protection)
}

/// Endpoints without a secret, with MAC and with encrypted records, each
/// offering every flow (shm transport, mpt, ucx, inline); built once.
fn endpoints() -> &'static [Endpoint; 3] {
    static ENDPOINTS: OnceLock<[Endpoint; 3]> = OnceLock::new();
    ENDPOINTS.get_or_init(|| {
        let offer = |name: &str, priority| ChannelOffer {
            name: name.into(),
            priority,
            devices: vec![DeviceOffer {
                device: Device::Cpu,
                descriptor: "host".into(),
            }],
        };
        let make = |auth: Option<Secret>| {
            let mut e = Endpoint::new("fuzzed", 1);
            e.transports = vec![
                TransportOffer {
                    name: channel::TCP.into(),
                    priority: 0,
                    descriptor: String::new(),
                },
                TransportOffer {
                    name: channel::SHM_TRANSPORT.into(),
                    priority: 10,
                    descriptor: "host".into(),
                },
            ];
            e.channels = vec![
                offer(channel::INLINE, 0),
                offer(channel::MPT, 10),
                offer(channel::UCX, 15),
            ];
            e.auth = auth;
            e
        };
        [
            make(None),
            make(Some(secret(Protection::Mac))),
            make(Some(secret(Protection::Encrypt))),
        ]
    })
}

/// The answer to `action`, as a shell whose actions all succeed gives it.
fn answer(action: Action) -> Option<Event> {
    Some(match action {
        Action::CreateUcxWorker { listen } => Event::UcxWorker(Ok(UcxWorkerInfo {
            address: b"worker".to_vec(),
            may_detect_peer_failure: true,
            listener: listen.then(|| "127.0.0.1:4000".parse().unwrap()),
        })),
        Action::BindListeners { .. } => Event::ListenersBound(Ok(Vec::new())),
        Action::UcxCheck { .. } => Event::UcxChecked(Ok(())),
        Action::AbandonUcxCheck => return None,
        Action::RunSetup { .. } => Event::SetupDone(Ok(())),
    })
}

/// Drains `m`'s outputs, answering its actions: what it wrote, and its
/// end if it came.
fn drain(
    m: &mut SetupMachine,
    now: Instant,
) -> (Vec<u8>, Option<Result<Box<Outcome>, TransportError>>) {
    let mut events = VecDeque::new();
    let mut written = Vec::new();
    loop {
        while let Some(output) = m.poll_output() {
            match output {
                Output::Transmit(b) => written.extend_from_slice(&b),
                Output::Action(a) => events.extend(answer(a)),
                Output::Done(done) => return (written, Some(done)),
            }
        }
        match events.pop_front() {
            Some(e) => m.handle_event(now, e),
            None => return (written, None),
        }
    }
}

/// Authenticates `m` with a hand-run peer holding `secret`: the peer's
/// session.
fn authenticate(m: &mut SetupMachine, role: Role, secret: &Secret, now: Instant) -> SessionKey {
    let peer_role = match role {
        Role::Connect => Role::Accept,
        Role::Accept => Role::Connect,
    };
    let mut peer = auth::Handshake::new(peer_role, secret.key().clone(), [9; 32]);
    let mut to_machine = peer.start().map(|m| m.encode()).unwrap_or_default();
    loop {
        m.handle_bytes(now, &to_machine);
        let (written, end) = drain(m, now);
        assert!(end.is_none(), "the honest authentication failed");
        let mut rest = &written[..];
        to_machine = Vec::new();
        while let Ok(Some((message, used))) = AuthMessage::decode(rest) {
            rest = &rest[used..];
            let step = peer.receive(message);
            if let Some(send) = step.send {
                to_machine.extend(send.encode());
            }
            if let Some(outcome) = step.outcome {
                let session = outcome.expect("the machine's proof is valid");
                // The peer's last message (the acceptor's verdict).
                m.handle_bytes(now, &to_machine);
                return session;
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let role = if mode & 1 == 0 {
        Role::Connect
    } else {
        Role::Accept
    };
    let which = usize::from((mode >> 1) & 3) % 3;
    let inside = mode & 8 != 0 && which != 0;
    let read = usize::from(mode >> 4) * 7 + 1;
    let local = &endpoints()[which];
    let now = Instant::now();
    let mut m = SetupMachine::new(local, role, [3; 32], "fuzzer", now);
    // With `inside`, the bytes travel in valid records after an honest
    // authentication; else they are what the peer sends first.
    let bytes = match (inside, &local.auth) {
        (true, Some(secret)) => {
            let session = authenticate(&mut m, role, secret, now);
            let mut sealer = session.sealer();
            let mut sealed = Vec::new();
            for part in rest.chunks(read * 3) {
                sealer.seal(&[part], &mut sealed);
            }
            sealed
        }
        _ => rest.to_vec(),
    };
    let mut end = drain(&mut m, now).1;
    for piece in bytes.chunks(read) {
        if end.is_some() {
            break;
        }
        m.handle_bytes(now, piece);
        end = drain(&mut m, now).1;
    }
    if end.is_none() {
        if mode & 4 != 0 {
            m.handle_eof(now);
        } else if let Some(t) = m.poll_timeout() {
            m.handle_timeout(t + Duration::from_secs(1));
        }
        end = drain(&mut m, now).1;
    }
    match end {
        Some(Ok(_)) => assert!(
            local.auth.is_none() || inside,
            "authenticated without the secret"
        ),
        Some(Err(TransportError::Integrity { .. })) => {
            assert!(!inside, "the peer's own records failed their check")
        }
        Some(Err(_)) | None => {}
    }
});
