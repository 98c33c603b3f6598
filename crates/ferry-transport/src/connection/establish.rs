//! [`PeerConnection`]'s set-up shell around the [`SetupMachine`]: it
//! writes what the machine emits, reads from the peer while the machine
//! waits for bytes, performs its actions (the UCX worker and check, the
//! listeners, the set-up of shared memory and lanes, which run while the
//! shell goes on reading) and sleeps until the machine's next bound. The
//! protocol, its bounds and its errors are the machine's.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::time::Instant;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::machine::{Action, Event, Output, Role, SetupMachine, UcxWorkerInfo};
use super::setup::{accept_setup, connect_setup, fresh_nonce, Setup};
use super::{
    bind_listeners, ucx_check, Endpoint, Listeners, PeerConnection, UcxLink, UcxUnusable, UcxWorker,
};
use crate::auth::message::NONCE_LEN;
use crate::TransportError;

/// Bytes read from the socket at a time.
const READ_CHUNK: usize = 64 << 10;

/// An action that runs while the shell reads: its result.
enum Finished {
    Ucx(Result<UcxLink, UcxUnusable>),
    Setup(Box<Result<Setup, TransportError>>),
}

/// The action running, if any.
type Running<'a> = Option<Pin<Box<dyn Future<Output = Finished> + Send + 'a>>>;

/// What the shell holds for the machine.
#[derive(Default)]
struct Held {
    worker: Option<UcxWorker>,
    link: Option<UcxLink>,
    listeners: Listeners,
    setup: Option<Setup>,
}

/// What woke the shell.
enum Wake {
    Finished(Finished),
    Read(std::io::Result<usize>),
    Timeout,
}

/// The machine's clock: tokio's (paused in tests that pause it).
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// The running action's result; never, with none running.
async fn finished(running: &mut Running<'_>) -> Finished {
    match running {
        Some(action) => action.as_mut().await,
        None => std::future::pending().await,
    }
}

/// Fresh random bytes for the authentication.
fn auth_nonce() -> std::io::Result<[u8; NONCE_LEN]> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut nonce)
        .map_err(|e| std::io::Error::other(format!("no random bytes: {e}")))?;
    Ok(nonce)
}

/// This side's UCX worker ([`Action::CreateUcxWorker`]), with a listener
/// for the peer when asked and its transports can detect a peer's failure
/// (one that cannot be opened leaves the peer the worker's address).
fn create_worker(
    local: &Endpoint,
    listen: bool,
    local_ip: IpAddr,
    peer_ip: Option<IpAddr>,
    held: &mut Held,
) -> Result<UcxWorkerInfo, TransportError> {
    let mut worker = UcxWorker::new(local.config.ucx_tls.as_deref(), local.config.spin)?;
    let may_detect_peer_failure = worker.may_detect_peer_failure();
    let mut listener: Option<SocketAddr> = None;
    if listen && may_detect_peer_failure && peer_ip.is_some() {
        match worker.listen(local_ip) {
            Ok(addr) => listener = Some(addr),
            Err(e) => tracing::warn!(
                error = %e,
                "no UCX listener: the peer connects to the worker address"
            ),
        }
    }
    let info = UcxWorkerInfo {
        address: worker.address().to_vec(),
        may_detect_peer_failure,
        listener,
    };
    held.worker = Some(worker);
    Ok(info)
}

impl PeerConnection {
    /// Connects to `addr` and runs the handshake as the connecting side.
    pub async fn connect(addr: SocketAddr, local: &Endpoint) -> Result<Self, TransportError> {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| TransportError::Io {
                peer: addr.to_string(),
                source: e,
            })?;
        Self::establish(stream, local, Role::Connect).await
    }

    /// Runs the handshake as the accepting side on a socket from a listener.
    pub async fn accept(stream: TcpStream, local: &Endpoint) -> Result<Self, TransportError> {
        Self::establish(stream, local, Role::Accept).await
    }

    async fn establish(
        mut stream: TcpStream,
        local: &Endpoint,
        role: Role,
    ) -> Result<Self, TransportError> {
        let peer_addr = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "unknown peer".into());
        let io_err = |source| TransportError::Io {
            peer: peer_addr.clone(),
            source,
        };
        stream.set_nodelay(true).map_err(io_err)?;
        // A partitioned peer is noticed by the kernel within bounds.
        local.keepalive.apply(&stream).map_err(io_err)?;
        let local_ip = stream.local_addr().map_err(io_err)?.ip();
        let peer_ip = stream.peer_addr().ok().map(|a| a.ip());
        let fail = |reason: String| TransportError::Handshake {
            peer: peer_addr.clone(),
            reason,
        };
        let nonce = fresh_nonce();
        let secret_nonce = match &local.auth {
            Some(_) => auth_nonce().map_err(|e| {
                let e = crate::auth::AuthError::Io(e);
                fail(format!("{}: {e}", crate::auth::AUTH_FAILED))
            })?,
            None => [0; NONCE_LEN],
        };
        let mut machine = SetupMachine::new(local, role, secret_nonce, peer_addr.clone(), now());
        let mut held = Held::default();
        let mut running: Running<'_> = None;
        let mut buf = vec![0u8; READ_CHUNK];
        let outcome = 'set_up: loop {
            while let Some(output) = machine.poll_output() {
                match output {
                    Output::Transmit(bytes) => {
                        // After a failure the bytes are a courtesy (a
                        // refusal): the connection closes either way.
                        if let Err(e) = stream.write_all(&bytes).await {
                            machine.handle_io_error(now(), e);
                        }
                    }
                    Output::Action(Action::CreateUcxWorker { listen }) => {
                        let worker = create_worker(local, listen, local_ip, peer_ip, &mut held);
                        machine.handle_event(now(), Event::UcxWorker(worker));
                    }
                    Output::Action(Action::BindListeners { shm, mpt }) => {
                        held.listeners = Listeners::default();
                        let bound = bind_listeners(shm, mpt, nonce, local_ip).await;
                        let bound = bound.map(|(props, listeners)| {
                            held.listeners = listeners;
                            props
                        });
                        machine.handle_event(now(), Event::ListenersBound(bound));
                    }
                    Output::Action(Action::UcxCheck { peer, accept }) => {
                        let worker = held.worker.take();
                        let from = peer_ip.filter(|_| accept);
                        running = Some(Box::pin(async move {
                            Finished::Ucx(ucx_check(worker, &peer, nonce, from).await)
                        }));
                    }
                    Output::Action(Action::AbandonUcxCheck) => running = None,
                    Output::Action(Action::RunSetup { agreement, session }) => {
                        let fail = &fail;
                        let listeners = std::mem::take(&mut held.listeners);
                        running = Some(match role {
                            Role::Connect => Box::pin(async move {
                                let setup =
                                    connect_setup(&agreement, local, session.as_ref(), fail);
                                Finished::Setup(Box::new(setup.await))
                            }),
                            Role::Accept => Box::pin(async move {
                                let setup = accept_setup(
                                    &agreement,
                                    listeners.shm,
                                    listeners.lanes,
                                    nonce,
                                    session.as_ref(),
                                    fail,
                                );
                                Finished::Setup(Box::new(setup.await))
                            }),
                        });
                    }
                    Output::Done(done) => break 'set_up done?,
                }
            }
            let deadline = machine.poll_timeout();
            let reading = machine.wants_read();
            if running.is_none() && !reading && deadline.is_none() {
                // The machine always waits for something: this is a bug.
                return Err(fail("the connection set-up waits for nothing".into()));
            }
            let sleep = deadline.map_or_else(tokio::time::Instant::now, |d| {
                tokio::time::Instant::from_std(d)
            });
            let woke = tokio::select! {
                f = finished(&mut running) => Wake::Finished(f),
                r = stream.read(&mut buf), if reading => Wake::Read(r),
                () = tokio::time::sleep_until(sleep), if deadline.is_some() => Wake::Timeout,
            };
            match woke {
                Wake::Finished(f) => {
                    running = None;
                    let event = match f {
                        Finished::Ucx(checked) => Event::UcxChecked(checked.map(|link| {
                            held.link = Some(link);
                        })),
                        Finished::Setup(setup) => Event::SetupDone((*setup).map(|setup| {
                            held.setup = Some(setup);
                        })),
                    };
                    machine.handle_event(now(), event);
                }
                Wake::Read(Ok(0)) => machine.handle_eof(now()),
                Wake::Read(Ok(n)) => machine.handle_bytes(now(), &buf[..n]),
                Wake::Read(Err(e)) => machine.handle_io_error(now(), e),
                Wake::Timeout => machine.handle_timeout(now()),
            }
        };
        drop(running);
        let setup = held.setup.take().unwrap_or_default();
        let link = held.link.take();
        Self::assemble(stream, local, *outcome, setup, link, &peer_addr)
    }
}
