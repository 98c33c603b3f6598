//! A deterministic two-endpoint driver for [`SetupMachine`]s: a connecting
//! and an accepting machine wired through an in-memory network with an
//! [`Adversary`] in between, their actions answered with canned results,
//! and a synthetic clock that jumps to the next bound only when nothing
//! else moves (no sleeps).
#![allow(clippy::unwrap_used, dead_code)]

use std::collections::VecDeque;
use std::time::Instant;

use ferry_transport::auth::records::Opener;
use ferry_transport::auth::{Protection, RecordReader, Secret};
use ferry_transport::setup_machine::{
    Action, Event, Outcome, Output, Role, SetupMachine, UcxWorkerInfo,
};
use ferry_transport::{channel, Endpoint, TransportError, UcxUnusable};
use ferry_wire::{ChannelOffer, Device, DeviceOffer, TransportOffer};

/// Which secret, if any, both ends hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Auth {
    None,
    Mac,
    Encrypt,
}

impl Auth {
    pub(crate) const ALL: [Auth; 3] = [Auth::None, Auth::Mac, Auth::Encrypt];
    pub(crate) const SEALED: [Auth; 2] = [Auth::Mac, Auth::Encrypt];

    pub(crate) fn secret(self) -> Option<Secret> {
        let s = Secret::new(b"the secret of the whole group".to_vec()).unwrap();
        match self {
            Auth::None => None,
            Auth::Mac => Some(s.with_protection(Protection::Mac)),
            Auth::Encrypt => Some(s.with_protection(Protection::Encrypt)),
        }
    }
}

/// What the two ends offer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Offers {
    /// TCP, tensors inline.
    Inline,
    /// TCP, tensors over `mpt` lanes.
    Mpt,
    /// The `shm` transport (frames leave TCP after the set-up).
    ShmTransport,
    /// TCP, tensors over the `ucx` channel (the UCX check runs).
    Ucx,
}

fn offer(name: &str, priority: i32) -> ChannelOffer {
    ChannelOffer {
        name: name.into(),
        priority,
        devices: vec![DeviceOffer {
            device: Device::Cpu,
            descriptor: "host-1".into(),
        }],
    }
}

/// An endpoint named `name` offering `offers`, holding `auth`'s secret.
pub(crate) fn endpoint(name: &str, rank: u32, offers: Offers, auth: Auth) -> Endpoint {
    let mut e = Endpoint::new(name, rank);
    let tcp = TransportOffer {
        name: channel::TCP.into(),
        priority: 0,
        descriptor: String::new(),
    };
    e.transports = vec![tcp];
    e.channels = vec![offer(channel::INLINE, 0)];
    match offers {
        Offers::Inline => {}
        Offers::Mpt => e.channels.push(offer(channel::MPT, 10)),
        Offers::ShmTransport => e.transports.push(TransportOffer {
            name: channel::SHM_TRANSPORT.into(),
            priority: 10,
            descriptor: "host-1".into(),
        }),
        Offers::Ucx => e.channels.push(offer(channel::UCX, 15)),
    }
    e.config.mpt_lanes = 3;
    e.auth = auth.secret();
    e
}

/// How the driver answers one side's actions.
#[derive(Debug, Clone)]
pub(crate) struct Canned {
    /// A UCX worker can be created (else: "UCX not available").
    pub(crate) ucx_worker: bool,
    /// The worker's transports detect a peer's failure (the accepting
    /// side then opens a listener).
    pub(crate) ucx_listen: bool,
    /// This side's UCX check result; `None`: the check never ends (a
    /// listener waiting for a peer that never connects).
    pub(crate) ucx_check: Option<Result<(), UcxUnusable>>,
    /// The set-up of shared memory and lanes ends (else it never does).
    pub(crate) setup: bool,
    /// Written after an outcome, as the connection's first writes
    /// (sealed with the outcome's sealer, with a secret).
    pub(crate) app_writes: Vec<Vec<u8>>,
}

impl Default for Canned {
    fn default() -> Self {
        Canned {
            ucx_worker: true,
            ucx_listen: true,
            ucx_check: Some(Ok(())),
            setup: true,
            app_writes: vec![b"first".to_vec(), b"second write".to_vec()],
        }
    }
}

/// One read's worth of what the network delivers, or the end of the
/// stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Piece {
    Bytes(Vec<u8>),
    Close,
}

/// What sits between the two sides.
pub(crate) trait Adversary {
    /// Side `from`'s `n`th write (counted from 0): what the other side
    /// gets to read, one read per piece.
    fn write(&mut self, from: Role, n: usize, bytes: Vec<u8>) -> Vec<Piece>;
    /// After side `from`'s `n`th write: what it sends that side itself
    /// (as if from its peer).
    fn back(&mut self, _from: Role, _n: usize) -> Vec<Piece> {
        Vec::new()
    }
    /// Nothing else moves: what it held back and lets through now.
    fn flush(&mut self, _from: Role) -> Vec<Piece> {
        Vec::new()
    }
}

/// Passes every write through unchanged, as one read.
pub(crate) struct Relay;

impl Adversary for Relay {
    fn write(&mut self, _: Role, _: usize, bytes: Vec<u8>) -> Vec<Piece> {
        vec![Piece::Bytes(bytes)]
    }
}

/// One side of the network.
pub(crate) struct Side {
    pub(crate) role: Role,
    pub(crate) machine: SetupMachine,
    pub(crate) canned: Canned,
    /// Answers not yet given to the machine.
    events: VecDeque<Event>,
    /// What reaches this side, read by read.
    pub(crate) inbox: VecDeque<Piece>,
    /// This side's writes (its transcript).
    pub(crate) writes: Vec<Vec<u8>>,
    /// The actions it asked for, by name.
    pub(crate) actions: Vec<&'static str>,
    pub(crate) outcome: Option<Result<Box<Outcome>, TransportError>>,
    /// When the outcome came (on the synthetic clock).
    pub(crate) ended_at: Option<Instant>,
}

impl Side {
    fn new(role: Role, local: &Endpoint, nonce: u8, canned: Canned, now: Instant) -> Side {
        let peer = match role {
            Role::Connect => "acceptor",
            Role::Accept => "connector",
        };
        Side {
            role,
            machine: SetupMachine::new(local, role, [nonce; 32], peer, now),
            canned,
            events: VecDeque::new(),
            inbox: VecDeque::new(),
            writes: Vec::new(),
            actions: Vec::new(),
            outcome: None,
            ended_at: None,
        }
    }

    /// The outcome, which must be a success.
    pub(crate) fn ok(&self) -> &Outcome {
        match &self.outcome {
            Some(Ok(o)) => o,
            other => panic!("{:?}: expected an outcome, got {other:?}", self.role),
        }
    }

    /// The error it ended with; panics if it reached an outcome or none.
    pub(crate) fn err(&self) -> &TransportError {
        match &self.outcome {
            Some(Err(e)) => e,
            other => panic!("{:?}: expected an error, got {other:?}", self.role),
        }
    }

    fn answer(&mut self, action: Action) {
        let name = answer(&self.canned, self.role, action, &mut self.events);
        self.actions.push(name);
    }
}

/// Answers `action` as `canned` says (into `events`, or not at all);
/// the action's name.
fn answer(
    canned: &Canned,
    role: Role,
    action: Action,
    events: &mut VecDeque<Event>,
) -> &'static str {
    let (name, event) = match action {
        Action::CreateUcxWorker { listen } => (
            "create UCX worker",
            Event::UcxWorker(match canned.ucx_worker {
                true => Ok(UcxWorkerInfo {
                    address: format!("ucx worker of {role:?}").into_bytes(),
                    may_detect_peer_failure: canned.ucx_listen,
                    listener: (listen && canned.ucx_listen)
                        .then(|| "127.0.0.1:4000".parse().unwrap()),
                }),
                false => Err(TransportError::Unavailable {
                    what: "UCX",
                    reason: "canned: no libucp".into(),
                }),
            }),
        ),
        Action::BindListeners { shm, mpt } => {
            let mut props = Vec::new();
            if shm {
                props.push(("shm.socket".to_owned(), "ferry/canned".to_owned()));
            }
            if mpt {
                props.push(("mpt.addr".to_owned(), "127.0.0.1:4001/7".to_owned()));
            }
            ("bind listeners", Event::ListenersBound(Ok(props)))
        }
        Action::UcxCheck { .. } => match &canned.ucx_check {
            Some(r) => ("UCX check", Event::UcxChecked(r.clone())),
            None => return "UCX check",
        },
        Action::AbandonUcxCheck => {
            events.retain(|e| !matches!(e, Event::UcxChecked(_)));
            return "abandon UCX check";
        }
        Action::RunSetup { .. } => match canned.setup {
            true => ("run set-up", Event::SetupDone(Ok(()))),
            false => return "run set-up",
        },
    };
    events.push_back(event);
    name
}

/// Two sides and the network between them.
pub(crate) struct Net<A> {
    pub(crate) connector: Side,
    pub(crate) acceptor: Side,
    pub(crate) adversary: A,
    pub(crate) start: Instant,
    pub(crate) now: Instant,
}

impl<A: Adversary> Net<A> {
    /// `connector` connecting to `acceptor` (nonces from `seed`), each
    /// answered with its canned results.
    pub(crate) fn new(
        connector: (&Endpoint, Canned),
        acceptor: (&Endpoint, Canned),
        seed: u8,
        adversary: A,
    ) -> Self {
        let start = Instant::now();
        Net {
            connector: Side::new(Role::Connect, connector.0, seed, connector.1, start),
            acceptor: Side::new(
                Role::Accept,
                acceptor.0,
                seed.wrapping_add(1),
                acceptor.1,
                start,
            ),
            adversary,
            start,
            now: start,
        }
    }

    pub(crate) fn side(&mut self, role: Role) -> &mut Side {
        match role {
            Role::Connect => &mut self.connector,
            Role::Accept => &mut self.acceptor,
        }
    }

    fn other(role: Role) -> Role {
        match role {
            Role::Connect => Role::Accept,
            Role::Accept => Role::Connect,
        }
    }

    /// Runs until both sides ended, or nothing moves and no bound is
    /// left (a side then still waits: its caller's bound applies).
    pub(crate) fn run(&mut self) -> &mut Self {
        for _ in 0..100_000 {
            if self.step() || self.flush() {
                continue;
            }
            let next = [&self.connector, &self.acceptor]
                .into_iter()
                .filter(|s| s.outcome.is_none())
                .filter_map(|s| s.machine.poll_timeout())
                .min();
            let Some(t) = next else {
                return self;
            };
            self.now = self.now.max(t);
            let now = self.now;
            for role in [Role::Connect, Role::Accept] {
                let side = self.side(role);
                if side.outcome.is_none() && side.machine.poll_timeout().is_some_and(|t| t <= now) {
                    side.machine.handle_timeout(now);
                }
            }
        }
        panic!("the set-up did not settle");
    }

    /// One round: outputs out, one answer and one read in, each side.
    fn step(&mut self) -> bool {
        let mut moved = false;
        for role in [Role::Connect, Role::Accept] {
            moved |= self.pump(role);
        }
        let now = self.now;
        for role in [Role::Connect, Role::Accept] {
            let side = self.side(role);
            if side.outcome.is_some() {
                continue;
            }
            if let Some(event) = side.events.pop_front() {
                side.machine.handle_event(now, event);
                moved = true;
            }
            if side.machine.wants_read() {
                match side.inbox.pop_front() {
                    Some(Piece::Bytes(b)) => side.machine.handle_bytes(now, &b),
                    Some(Piece::Close) => side.machine.handle_eof(now),
                    None => continue,
                }
                moved = true;
            }
        }
        moved
    }

    /// What the adversary held back, let through.
    fn flush(&mut self) -> bool {
        let mut moved = false;
        for role in [Role::Connect, Role::Accept] {
            let pieces = self.adversary.flush(role);
            moved |= !pieces.is_empty();
            self.side(Self::other(role)).inbox.extend(pieces);
        }
        moved
    }

    /// Side `role`'s outputs: writes through the adversary, actions
    /// answered, the outcome kept (then the connection's first writes,
    /// or, after a failure, the end of its stream).
    fn pump(&mut self, role: Role) -> bool {
        let mut moved = false;
        while let Some(output) = self.side(role).machine.poll_output() {
            moved = true;
            match output {
                Output::Transmit(bytes) => self.send(role, bytes),
                Output::Action(action) => self.side(role).answer(action),
                Output::Done(done) => {
                    let now = self.now;
                    let side = self.side(role);
                    side.ended_at = Some(now);
                    let failed = done.is_err();
                    side.outcome = Some(done);
                    if failed {
                        // Its socket closes: the peer reads the end after
                        // what is on its way.
                        self.side(Self::other(role)).inbox.push_back(Piece::Close);
                    } else {
                        self.write_app(role);
                    }
                }
            }
        }
        moved
    }

    fn send(&mut self, role: Role, bytes: Vec<u8>) {
        let side = self.side(role);
        side.writes.push(bytes.clone());
        let n = side.writes.len() - 1;
        let pieces = self.adversary.write(role, n, bytes);
        self.side(Self::other(role)).inbox.extend(pieces);
        let back = self.adversary.back(role, n);
        self.side(role).inbox.extend(back);
    }

    /// The connection's first writes after an outcome, as its record
    /// writer would make them.
    fn write_app(&mut self, role: Role) {
        let side = self.side(role);
        let writes = side.canned.app_writes.clone();
        let Some(Ok(outcome)) = side.outcome.as_mut() else {
            return;
        };
        let mut sealed = Vec::new();
        for data in writes {
            let bytes = match outcome.sealer.as_mut() {
                Some(s) => {
                    let mut out = Vec::new();
                    s.seal(&[&data], &mut out);
                    out
                }
                None => data,
            };
            sealed.push(bytes);
        }
        for bytes in sealed {
            self.send(role, bytes);
        }
    }

    /// Everything side `role`'s connection reads after its set-up: what
    /// the set-up left (continued through
    /// [`RecordReader::with_buffered`]) and what is still on its way.
    pub(crate) fn read_after(&mut self, role: Role) -> Result<Vec<u8>, std::io::Error> {
        let side = self.side(role);
        let rest: Vec<u8> = side
            .inbox
            .iter()
            .filter_map(|p| match p {
                Piece::Bytes(b) => Some(b.clone()),
                Piece::Close => None,
            })
            .flatten()
            .collect();
        let Some(Ok(outcome)) = side.outcome.as_mut() else {
            panic!("{role:?} reached no outcome");
        };
        let opener: Option<Opener> = outcome.opener.take();
        read_all(RecordReader::with_buffered(
            &rest[..],
            opener,
            &outcome.plain,
            &outcome.sealed,
        ))
    }
}

/// Reads `r` to its end.
fn read_all(mut r: RecordReader<&[u8]>) -> Result<Vec<u8>, std::io::Error> {
    use tokio::io::AsyncReadExt;
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async move {
        let mut out = Vec::new();
        r.read_to_end(&mut out).await?;
        Ok(out)
    })
}

/// Both sides agree: each one's outgoing channels are the other's
/// incoming, on the same transport.
pub(crate) fn assert_agreed(c: &Outcome, a: &Outcome) {
    assert_eq!(c.agreement.outgoing, a.agreement.incoming);
    assert_eq!(c.agreement.incoming, a.agreement.outgoing);
    assert_eq!(c.agreement.transport, a.agreement.transport);
    assert_eq!(c.session.is_some(), a.session.is_some());
    assert_eq!(c.ucx_fallback.is_some(), a.ucx_fallback.is_some());
}

/// Drives one machine alone: drains its outputs, answering every action
/// at once with [`Canned::default`]'s results; returns what it wrote and
/// its end, if it came.
pub(crate) fn drain(
    machine: &mut SetupMachine,
    role: Role,
    now: Instant,
) -> (Vec<u8>, Option<Result<Box<Outcome>, TransportError>>) {
    let canned = Canned::default();
    let mut events = VecDeque::new();
    let mut written = Vec::new();
    loop {
        while let Some(output) = machine.poll_output() {
            match output {
                Output::Transmit(b) => written.extend_from_slice(&b),
                Output::Action(action) => {
                    answer(&canned, role, action, &mut events);
                }
                Output::Done(done) => return (written, Some(done)),
            }
        }
        match events.pop_front() {
            Some(e) => machine.handle_event(now, e),
            None => return (written, None),
        }
    }
}
