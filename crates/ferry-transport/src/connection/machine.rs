//! A connection's set-up as a pure state machine: bytes and events in,
//! bytes, actions and finally an outcome out, with `now` on every input.
//! [`PeerConnection`](super::PeerConnection)'s I/O shell drives it; tests
//! drive two of them through an in-memory network.
//!
//! The set-up, after the TCP connection is open:
//!
//! 1. with a secret, the authentication handshake
//!    ([`auth::Handshake`](crate::auth::Handshake)), within
//!    [`AUTH_TIMEOUT`]; from then on every byte either way travels in
//!    records sealed with the session's keys ([`crate::auth::records`]);
//! 2. the connecting side's handshake frame (its offers, after creating
//!    its UCX worker when it offers UCX: [`Action::CreateUcxWorker`]);
//! 3. the accepting side computes the [`Agreement`], creates its UCX
//!    worker if UCX is selected, binds what the set-up needs
//!    ([`Action::BindListeners`]) and replies with its handshake and
//!    selection, which the connecting side verifies;
//! 4. when UCX is selected, the UCX check ([`Action::UcxCheck`]): each
//!    side sends a second handshake with its result (`ucx.check`), and
//!    should either have failed, both compute the selection again
//!    without UCX (the accepting side binds again and names the new
//!    listeners in its second handshake);
//! 5. the set-up of shared memory and lanes ([`Action::RunSetup`]; the
//!    accepting side waits at most `SETUP_TIMEOUT`, 30 s, for the peer).
//!
//! A frame that starts arriving must keep arriving: after its last byte,
//! the rest comes within the handshake limits' `frame_stall_timeout`
//! ([`poll_timeout`](SetupMachine::poll_timeout)). Between frames the
//! machine sets no bound: its caller does (the RPC agent's
//! `init_timeout`).
//!
//! Failures are typed: an authentication failure is a
//! [`TransportError::Handshake`] whose reason starts with
//! [`AUTH_FAILED`]; a record that fails its
//! check is [`TransportError::Integrity`]; a frame that is not a
//! handshake's is [`TransportError::Malformed`] or a
//! [`TransportError::Handshake`]; the peer closing inside a frame is
//! [`TransportError::Closed`].

mod inbound;
mod types;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use ferry_wire::{handshake_limits, Flags, Frame, Handshake, MessageKind};

use super::{
    check_text, parse_check, property, warn_fallback, Endpoint, UcxFallback, UcxUnusable,
    MAX_MPT_LANES, PROP_MPT_LANES, PROP_UCX_CHECK, PROP_UCX_CLIENT_SERVER, PROP_UCX_LISTENER,
};
use crate::auth::message::NONCE_LEN;
use crate::auth::records::{Sealer, MAX_RECORD};
use crate::auth::{AuthError, SessionKey, AUTH_FAILED, AUTH_TIMEOUT};
use crate::selection::verify;
use crate::{channel, TransportError};
use inbound::{FrameFail, Inbound};

pub use super::agreement::Agreement;
pub use crate::auth::Role;
pub use types::{Action, Event, Outcome, Output, UcxWorkerInfo};

/// How long the accepting side waits for the connecting side to finish
/// setting up shared memory or lanes ([`Action::RunSetup`]).
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the set-up stands.
enum State {
    /// The authentication handshake runs.
    Authenticating(crate::auth::Handshake),
    /// Connecting side: its UCX worker is being created.
    ConnectorUcxWorker,
    /// Connecting side: its handshake is out; the reply is awaited.
    AwaitReply,
    /// Connecting side: the UCX check runs.
    ConnectorUcxCheck(Box<Agreement>),
    /// Connecting side: its check result is out; the peer's is awaited.
    AwaitVerdict {
        agreement: Box<Agreement>,
        mine: Result<(), UcxUnusable>,
    },
    /// Accepting side: the peer's handshake is awaited.
    AwaitHandshake,
    /// Accepting side: its UCX worker is being created.
    AcceptorUcxWorker(Box<Agreement>),
    /// Accepting side: listeners are being bound; `fallback` holds this
    /// side's check result after a failed UCX check (the second reply).
    Binding {
        agreement: Box<Agreement>,
        fallback: Option<String>,
    },
    /// Accepting side: its UCX check runs and the peer's result is
    /// awaited, in whichever order they come.
    AcceptorUcxCheck {
        agreement: Box<Agreement>,
        mine: Option<Result<(), UcxUnusable>>,
        verdict: Option<Box<Handshake>>,
    },
    /// The set-up of shared memory and lanes runs.
    SettingUp(Box<Agreement>),
    /// Done, or failed.
    Finished,
}

impl State {
    fn name(&self) -> &'static str {
        match self {
            State::Authenticating(_) => "authenticating",
            State::ConnectorUcxWorker | State::AcceptorUcxWorker(_) => "creating a UCX worker",
            State::AwaitReply => "awaiting the peer's reply",
            State::ConnectorUcxCheck(_) => "running the UCX check",
            State::AwaitVerdict { .. } => "awaiting the peer's UCX check result",
            State::AwaitHandshake => "awaiting the peer's handshake",
            State::Binding { .. } => "binding listeners",
            State::AcceptorUcxCheck { .. } => "running the UCX check",
            State::SettingUp(_) => "setting up channels",
            State::Finished => "finished",
        }
    }
}

/// One side's connection set-up (see the [module](self) docs).
pub struct SetupMachine {
    /// This side's offers (without UCX once its offers are withdrawn).
    local: Endpoint,
    role: Role,
    /// Names the peer in errors.
    peer: String,
    state: State,
    inbound: Inbound,
    sealer: Option<Sealer>,
    session: Option<SessionKey>,
    ucx_worker: Option<UcxWorkerInfo>,
    ucx_fallback: Option<UcxFallback>,
    auth_deadline: Option<Instant>,
    setup_deadline: Option<Instant>,
    outputs: VecDeque<Output>,
}

impl SetupMachine {
    /// The set-up of `local`'s side in `role`, with `local.auth`'s secret
    /// if it has one and this side's fresh `auth_nonce` (never used
    /// twice; unused without a secret). `peer` names the peer in errors
    /// (its address: nothing it said is known yet).
    pub fn new(
        local: &Endpoint,
        role: Role,
        auth_nonce: [u8; NONCE_LEN],
        peer: impl Into<String>,
        now: Instant,
    ) -> SetupMachine {
        let peer = peer.into();
        let mut m = SetupMachine {
            local: local.clone(),
            role,
            inbound: Inbound::new(peer.clone()),
            peer,
            state: State::Finished,
            sealer: None,
            session: None,
            ucx_worker: None,
            ucx_fallback: None,
            auth_deadline: None,
            setup_deadline: None,
            outputs: VecDeque::new(),
        };
        match &local.auth {
            Some(secret) => {
                let handshake = crate::auth::Handshake::new(role, secret.key().clone(), auth_nonce);
                if let Some(hello) = handshake.start() {
                    m.transmit(hello.encode());
                }
                m.state = State::Authenticating(handshake);
                m.auth_deadline = Some(now + AUTH_TIMEOUT);
            }
            None => m.authenticated(now),
        }
        m
    }

    /// Takes bytes read from the peer.
    pub fn handle_bytes(&mut self, now: Instant, bytes: &[u8]) {
        if self.is_finished() {
            return;
        }
        self.inbound.push(now, bytes);
        self.drive(now);
    }

    /// The peer closed its side of the connection.
    pub fn handle_eof(&mut self, now: Instant) {
        if self.is_finished() {
            return;
        }
        self.inbound.close();
        self.drive(now);
    }

    /// Reading from or writing to the peer failed.
    pub fn handle_io_error(&mut self, _now: Instant, error: std::io::Error) {
        match self.state {
            State::Finished => {}
            State::Authenticating(_) => self.auth_fail(AuthError::Io(error)),
            _ => {
                let peer = self.peer.clone();
                self.fail(TransportError::Io {
                    peer,
                    source: error,
                })
            }
        }
    }

    /// Takes the result of an [`Action`].
    pub fn handle_event(&mut self, now: Instant, event: Event) {
        if self.is_finished() {
            return;
        }
        if let Err(e) = self.on_event(now, event) {
            self.fail(e);
        }
    }

    /// Time has come to `now`: fails the set-up if a bound ran out (see
    /// [`poll_timeout`](Self::poll_timeout)).
    pub fn handle_timeout(&mut self, now: Instant) {
        let due = |t: Option<Instant>| t.is_some_and(|t| t <= now);
        if matches!(self.state, State::Authenticating(_)) && due(self.auth_deadline) {
            self.auth_fail(AuthError::Timeout(AUTH_TIMEOUT));
        } else if self.reads_frames() && due(self.stall_deadline()) {
            let e = self.inbound.stalled();
            self.fail(e);
        } else if matches!(self.state, State::SettingUp(_)) && due(self.setup_deadline) {
            let e = self.error("the peer did not finish setting up its channels".into());
            self.fail(e);
        }
    }

    /// When [`handle_timeout`](Self::handle_timeout) is due next: the end
    /// of the authentication's 10 s, of a started frame's stall timeout,
    /// or of the accepting side's wait for the peer's set-up. `None`: no
    /// bound now.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            State::Authenticating(_) => self.auth_deadline,
            State::SettingUp(_) => self.setup_deadline,
            _ if self.reads_frames() => self.stall_deadline(),
            _ => None,
        }
    }

    /// The next output: bytes to write, an action, or the end.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    /// Whether the machine waits for bytes from the peer now (the shell
    /// reads only then: during an action, whatever the peer sends waits
    /// in the socket).
    pub fn wants_read(&self) -> bool {
        let waiting = matches!(self.state, State::Authenticating(_)) || self.reads_frames();
        waiting && !self.inbound.closed()
    }

    /// Whether the set-up ended (its [`Output::Done`] may still wait in
    /// [`poll_output`](Self::poll_output)).
    pub fn is_finished(&self) -> bool {
        matches!(self.state, State::Finished)
    }

    /// Whether the state waits for a handshake frame.
    fn reads_frames(&self) -> bool {
        matches!(
            self.state,
            State::AwaitReply
                | State::AwaitVerdict { .. }
                | State::AwaitHandshake
                | State::AcceptorUcxCheck { verdict: None, .. }
        )
    }

    fn stall_deadline(&self) -> Option<Instant> {
        self.inbound
            .stall_deadline(handshake_limits().frame_stall_timeout)
    }

    /// Uses what the bytes in give, as far as the state takes them.
    fn drive(&mut self, now: Instant) {
        loop {
            let progressed = if matches!(self.state, State::Authenticating(_)) {
                self.authenticate(now)
            } else if self.reads_frames() {
                self.read_frame(now)
            } else {
                false
            };
            if !progressed {
                return;
            }
        }
    }

    /// One authentication message, if one is in.
    fn authenticate(&mut self, now: Instant) -> bool {
        let message = match self.inbound.auth_message() {
            Ok(Some(m)) => m,
            Ok(None) => {
                if self.inbound.closed() {
                    self.auth_fail(AuthError::Io(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the peer closed the connection",
                    )));
                }
                return false;
            }
            Err(e) => {
                self.auth_fail(e.into());
                return false;
            }
        };
        let State::Authenticating(handshake) = &mut self.state else {
            return false;
        };
        let step = handshake.receive(message);
        if let Some(m) = step.send {
            self.transmit(m.encode());
        }
        match step.outcome {
            None => true,
            Some(Ok(session)) => {
                self.auth_deadline = None;
                self.inbound.seal(session.opener());
                self.sealer = Some(session.sealer());
                self.session = Some(session);
                self.authenticated(now);
                true
            }
            Some(Err(e)) => {
                self.auth_fail(e);
                false
            }
        }
    }

    /// One handshake frame, if one is in.
    fn read_frame(&mut self, now: Instant) -> bool {
        match self.inbound.handshake() {
            Ok(Some(h)) => {
                if let Err(e) = self.on_handshake(now, h) {
                    self.fail(e);
                }
                !self.is_finished()
            }
            Ok(None) => false,
            Err(FrameFail::ClosedBefore) => {
                let e = self.error("connection closed before the handshake".into());
                self.fail(e);
                false
            }
            Err(FrameFail::Error(e)) => {
                self.fail(e);
                false
            }
        }
    }

    /// The peer is authenticated (or there is no secret): the Ferry
    /// handshake starts.
    fn authenticated(&mut self, _now: Instant) {
        match self.role {
            Role::Connect if self.local.offers_ucx() => {
                // UCX is offered only with a worker whose address can be
                // sent; one that cannot be created drops the offers.
                self.act(Action::CreateUcxWorker { listen: false });
                self.state = State::ConnectorUcxWorker;
            }
            Role::Connect => self.send_first_handshake(),
            Role::Accept => self.state = State::AwaitHandshake,
        }
    }

    /// The `mpt.lanes` property: how many lanes per direction the
    /// connecting side opens.
    fn lane_props(&self) -> Vec<(String, String)> {
        let lanes = self.local.config.mpt_lanes.clamp(1, MAX_MPT_LANES);
        vec![(PROP_MPT_LANES.to_owned(), lanes.to_string())]
    }

    /// The connecting side's first handshake.
    fn send_first_handshake(&mut self) {
        let mut props = self.lane_props();
        let worker = self.ucx_worker.as_ref();
        if worker.is_some_and(|w| w.may_detect_peer_failure) {
            props.push((PROP_UCX_CLIENT_SERVER.into(), "1".into()));
        }
        let address = worker.map(|w| w.address.clone());
        let h = self.local.handshake(None, Vec::new(), props, address);
        match self.send_handshake(h) {
            Ok(()) => self.state = State::AwaitReply,
            Err(e) => self.fail(e),
        }
    }

    fn on_handshake(&mut self, now: Instant, peer: Handshake) -> Result<(), TransportError> {
        match std::mem::replace(&mut self.state, State::Finished) {
            State::AwaitReply => {
                let agreement = Agreement::compute(&self.local, peer)?;
                verify(&agreement.outgoing, &agreement.peer.selection)?;
                if agreement.needs_ucx() {
                    self.act(Action::UcxCheck {
                        peer: Box::new(agreement.peer.clone()),
                        accept: false,
                    });
                    self.state = State::ConnectorUcxCheck(Box::new(agreement));
                } else {
                    self.run_setup(now, agreement);
                }
                Ok(())
            }
            State::AwaitVerdict { agreement, mine } => {
                let theirs = parse_check(&peer, &|r| self.error(r))?;
                match (mine, theirs) {
                    (Ok(()), None) => self.run_setup(now, *agreement),
                    (mine, theirs) => {
                        self.fall_back(&agreement.peer, mine.err(), theirs);
                        let agreement = Agreement::compute(&self.local, peer)?;
                        verify(&agreement.outgoing, &agreement.peer.selection)?;
                        self.run_setup(now, agreement);
                    }
                }
                Ok(())
            }
            State::AwaitHandshake => {
                let agreement = Agreement::compute(&self.local, peer)?;
                if agreement.needs_ucx() {
                    let listen = property(&agreement.peer, PROP_UCX_CLIENT_SERVER) == Some("1");
                    self.act(Action::CreateUcxWorker { listen });
                    self.state = State::AcceptorUcxWorker(Box::new(agreement));
                } else {
                    self.bind(agreement, None);
                }
                Ok(())
            }
            State::AcceptorUcxCheck {
                agreement,
                mine,
                verdict: None,
            } => {
                // The peer's verdict may come first: a listener waits for
                // a connection that a peer whose endpoint failed never
                // makes, so this side's check then ends at once.
                let theirs = parse_check(&peer, &|r| self.error(r))?;
                let mine = match (mine, theirs) {
                    (None, Some(_)) => {
                        self.act(Action::AbandonUcxCheck);
                        Some(Err(UcxUnusable::Endpoint(
                            "not connected: the peer's UCX check failed first".into(),
                        )))
                    }
                    (mine, _) => mine,
                };
                self.state = State::AcceptorUcxCheck {
                    agreement,
                    mine,
                    verdict: Some(Box::new(peer)),
                };
                self.resolve_ucx_check(now)
            }
            other => {
                let e = self.error(format!("a handshake frame while {}", other.name()));
                Err(e)
            }
        }
    }

    fn on_event(&mut self, now: Instant, event: Event) -> Result<(), TransportError> {
        match (std::mem::replace(&mut self.state, State::Finished), event) {
            (State::ConnectorUcxWorker, Event::UcxWorker(worker)) => {
                self.take_worker(worker);
                self.send_first_handshake();
                Ok(())
            }
            (State::AcceptorUcxWorker(agreement), Event::UcxWorker(worker)) => {
                let agreement = if self.take_worker(worker) {
                    *agreement
                } else {
                    // Selected without UCX: the peer sees no UCX offer in
                    // the reply and computes the same.
                    Agreement::compute(&self.local, agreement.peer)?
                };
                self.bind(agreement, None);
                Ok(())
            }
            (
                State::Binding {
                    agreement,
                    fallback,
                },
                Event::ListenersBound(bound),
            ) => {
                let mut props = bound.map_err(|source| TransportError::Io {
                    peer: self.peer.clone(),
                    source,
                })?;
                match fallback {
                    Some(check) => {
                        props.push((PROP_UCX_CHECK.into(), check));
                        self.reply(&agreement, props, false)?;
                        self.run_setup(now, *agreement);
                    }
                    None => {
                        let listener = self.ucx_worker.as_ref().and_then(|w| w.listener);
                        if let Some(addr) = listener {
                            props.push((PROP_UCX_LISTENER.into(), addr.to_string()));
                        }
                        self.reply(&agreement, props, true)?;
                        if agreement.needs_ucx() {
                            self.act(Action::UcxCheck {
                                peer: Box::new(agreement.peer.clone()),
                                accept: listener.is_some(),
                            });
                            self.state = State::AcceptorUcxCheck {
                                agreement,
                                mine: None,
                                verdict: None,
                            };
                        } else {
                            self.run_setup(now, *agreement);
                        }
                    }
                }
                Ok(())
            }
            (State::ConnectorUcxCheck(agreement), Event::UcxChecked(mine)) => {
                let mut props = self.lane_props();
                props.push((PROP_UCX_CHECK.into(), check_text(&mine)));
                let h = self.local.handshake(None, Vec::new(), props, None);
                self.send_handshake(h)?;
                self.state = State::AwaitVerdict { agreement, mine };
                self.drive(now);
                Ok(())
            }
            (
                State::AcceptorUcxCheck {
                    agreement,
                    mine,
                    verdict,
                },
                Event::UcxChecked(result),
            ) => {
                // After an abandoned check, a late result changes nothing.
                let mine = mine.or(Some(result));
                self.state = State::AcceptorUcxCheck {
                    agreement,
                    mine,
                    verdict,
                };
                self.resolve_ucx_check(now)?;
                self.drive(now);
                Ok(())
            }
            (State::SettingUp(agreement), Event::SetupDone(done)) => {
                done?;
                self.finish(*agreement)
            }
            (state, event) => {
                let what = match event {
                    Event::UcxWorker(_) => "a UCX worker",
                    Event::ListenersBound(_) => "bound listeners",
                    Event::UcxChecked(_) => "a UCX check result",
                    Event::SetupDone(_) => "a set-up result",
                };
                Err(self.error(format!(
                    "the shell answered with {what} while {}",
                    state.name()
                )))
            }
        }
    }

    /// Keeps the UCX worker, or withdraws this side's UCX offers without
    /// one: whether there is one.
    fn take_worker(&mut self, worker: Result<UcxWorkerInfo, TransportError>) -> bool {
        match worker {
            Ok(w) => {
                self.ucx_worker = Some(w);
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "UCX offers withdrawn from this connection");
                self.local = self.local.without_ucx();
                false
            }
        }
    }

    /// The accepting side binds what `agreement` needs set up.
    fn bind(&mut self, agreement: Agreement, fallback: Option<String>) {
        self.act(Action::BindListeners {
            shm: agreement.needs_shm(),
            mpt: agreement.uses(channel::MPT),
        });
        self.state = State::Binding {
            agreement: Box::new(agreement),
            fallback,
        };
    }

    /// The accepting side's reply: its handshake with the selection
    /// (and, the first time, its UCX worker's address).
    fn reply(
        &mut self,
        agreement: &Agreement,
        props: Vec<(String, String)>,
        first: bool,
    ) -> Result<(), TransportError> {
        let address = match first {
            true => self.ucx_worker.as_ref().map(|w| w.address.clone()),
            false => None,
        };
        let h = self.local.handshake(
            Some(&agreement.peer),
            agreement.incoming.clone(),
            props,
            address,
        );
        self.send_handshake(h)
    }

    /// The accepting side, once both check results are in: keeps UCX, or
    /// falls back and binds for the selection without it.
    fn resolve_ucx_check(&mut self, now: Instant) -> Result<(), TransportError> {
        let State::AcceptorUcxCheck {
            mine: Some(_),
            verdict: Some(_),
            ..
        } = &self.state
        else {
            return Ok(());
        };
        let State::AcceptorUcxCheck {
            agreement,
            mine: Some(mine),
            verdict: Some(verdict),
        } = std::mem::replace(&mut self.state, State::Finished)
        else {
            return Ok(());
        };
        let theirs = parse_check(&verdict, &|r| self.error(r))?;
        match (mine, theirs) {
            (Ok(()), None) => {
                let props = vec![(PROP_UCX_CHECK.into(), check_text(&Ok(())))];
                self.reply(&agreement, props, false)?;
                self.run_setup(now, *agreement);
            }
            (mine, theirs) => {
                let text = check_text(&mine);
                self.fall_back(&agreement.peer, mine.err(), theirs);
                let agreement = Agreement::compute(&self.local, *verdict)?;
                self.bind(agreement, Some(text));
            }
        }
        Ok(())
    }

    /// UCX is unusable with this peer: recorded, logged, and this side's
    /// offers withdrawn.
    fn fall_back(
        &mut self,
        peer: &Handshake,
        local: Option<UcxUnusable>,
        theirs: Option<UcxUnusable>,
    ) {
        let why = UcxFallback {
            local,
            peer: theirs,
        };
        warn_fallback(peer, &why);
        self.ucx_fallback = Some(why);
        self.local = self.local.without_ucx();
    }

    fn run_setup(&mut self, now: Instant, agreement: Agreement) {
        if self.role == Role::Accept {
            self.setup_deadline = Some(now + SETUP_TIMEOUT);
        }
        self.act(Action::RunSetup {
            agreement: Box::new(agreement.clone()),
            session: self.session.as_ref().map(SessionKey::key),
        });
        self.state = State::SettingUp(Box::new(agreement));
    }

    /// The set-up is done: the outcome, unless bytes that must not be
    /// there arrived, or a record that came with the last frame is forged.
    fn finish(&mut self, agreement: Agreement) -> Result<(), TransportError> {
        // On the `shm` and `ucx` transports frames travel elsewhere: both
        // ends send nothing more on TCP.
        let buffered = self.inbound.buffered();
        if agreement.transport != channel::TCP && buffered > 0 {
            return Err(self.error(format!(
                "{buffered} bytes arrived on TCP after the handshake"
            )));
        }
        self.inbound.open_whole_records()?;
        let inbound = std::mem::replace(&mut self.inbound, Inbound::new(String::new()));
        let (opener, plain, sealed) = inbound.finish();
        self.outputs.push_back(Output::Done(Ok(Box::new(Outcome {
            agreement,
            session: self.session.take(),
            opener,
            sealer: self.sealer.take(),
            plain,
            sealed,
            ucx_fallback: self.ucx_fallback.take(),
        }))));
        self.state = State::Finished;
        Ok(())
    }

    /// Queues a handshake frame (sealed, with a secret).
    fn send_handshake(&mut self, h: Handshake) -> Result<(), TransportError> {
        let payload = h.encode()?;
        let frame = Frame::encode(MessageKind::HANDSHAKE, Flags::NONE, 0, &[], &payload, &[]);
        let bytes = match self.sealer.as_mut() {
            Some(sealer) => {
                let mut out = Vec::with_capacity(frame.len() + 64);
                for part in frame.chunks(MAX_RECORD) {
                    sealer.seal(&[part], &mut out);
                }
                out
            }
            None => frame,
        };
        self.transmit(bytes);
        Ok(())
    }

    fn transmit(&mut self, bytes: Vec<u8>) {
        self.outputs.push_back(Output::Transmit(bytes));
    }

    fn act(&mut self, action: Action) {
        self.outputs.push_back(Output::Action(action));
    }

    fn error(&self, reason: String) -> TransportError {
        TransportError::Handshake {
            peer: self.peer.clone(),
            reason,
        }
    }

    fn auth_fail(&mut self, e: AuthError) {
        let e = self.error(format!("{AUTH_FAILED}: {e}"));
        self.fail(e);
    }

    /// Ends the set-up with `e`. Bytes queued stay (a refusal is a
    /// courtesy the peer may still read); actions queued go.
    fn fail(&mut self, e: TransportError) {
        self.state = State::Finished;
        self.auth_deadline = None;
        self.setup_deadline = None;
        self.outputs.retain(|o| !matches!(o, Output::Action(_)));
        self.outputs.push_back(Output::Done(Err(e)));
    }
}

#[cfg(test)]
mod tests;
