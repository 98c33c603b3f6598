//! The agent's connections: connecting to a peer lazily on the first call
//! and again after a failure, accepting peers' connections (handshake,
//! group membership), running a connection's reader and writer, and
//! failing a connection with the calls waiting on it.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use ferry_transport::accept::{
    auth_opening, await_opening, handshake_opening, OpeningError, RefusalWarnings,
};
use ferry_transport::auth::AUTH_FAILED;
use ferry_transport::{OutgoingMessage, PeerConnection, TransportError};
use ferry_wire::{Flags, PeerText};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn, Instrument};

use crate::outbox::{outbox, Outbox, OutboxQueue, Refusal};
use crate::protocol::Failure;
use crate::{RpcError, WorkerInfo};

use super::{Inner, Link, LinkInfo, RUNNING};

impl Inner {
    /// A message the writer task of a connection with `peer` kept back
    /// (queued before the handshake told the peer's limits and the
    /// selection): over the peer's limits, or with a tensor no selected
    /// channel carries. A request fails its call, never counted as sent; a
    /// reply is replaced by an error reply naming why.
    pub(super) fn refused(
        &self,
        peer: &WorkerInfo,
        message: OutgoingMessage,
        why: Refusal,
    ) -> Option<OutgoingMessage> {
        if message.flags.contains(Flags::REPLY) {
            return Some(match &why {
                Refusal::TooLarge(e) => self.result_too_large(peer, message.request_id, e),
                Refusal::NoChannel(e) => super::serving::error_reply(
                    message.request_id,
                    Failure::failed(format!("the result was not sent: {e}")),
                ),
            });
        }
        // Never sent (even if the call has timed out meanwhile).
        self.tally.not_sent(peer.id);
        let cancelled = self.calls.lock().cancel(message.request_id);
        if let Some(p) = cancelled {
            let worker = self.workers[p.to as usize].name.clone();
            p.slot.complete(Err(match why {
                Refusal::TooLarge(e) => RpcError::too_large(worker, p.function, e),
                Refusal::NoChannel(e) => RpcError::Transport(e.into()),
            }));
            self.call_done();
        }
        None
    }

    /// The link to `rank`, connecting lazily.
    pub(super) fn link(self: &Arc<Self>, rank: u32) -> Link {
        let mut links = self.links.lock();
        if let Some(l) = links.get(&rank) {
            if !l.outbox.is_closed() {
                return l.clone();
            }
        }
        let (outbox, rx) = outbox(self.handle.clone());
        let conn = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let link = Link {
            conn,
            outbox: outbox.clone(),
        };
        links.insert(rank, link.clone());
        let inner = self.clone();
        let span = self.span.clone();
        self.spawn_task(
            async move { inner.connect_and_serve(rank, conn, outbox, rx).await }.instrument(span),
        );
        link
    }

    /// Connects to `rank` if no link to it is up (shutdown's check of a
    /// peer whose connection ended: a live peer answers, a gone one
    /// refuses, see [`crate::tally::Liveness`]).
    pub(crate) fn probe(self: &Arc<Self>, rank: u32) {
        let _ = self.link(rank);
    }

    /// Connects to `rank` (connect, handshake and channel set-up within
    /// `init_timeout`, the peer answering as the worker the rendezvous
    /// table names), then serves the connection; a failure fails the link.
    pub(super) async fn connect_and_serve(
        self: Arc<Self>,
        rank: u32,
        conn: u64,
        outbox: Outbox,
        rx: OutboxQueue,
    ) {
        let peer = &self.workers[rank as usize];
        let addr = self.addrs[rank as usize];
        let connected = tokio::time::timeout(
            self.init_timeout,
            PeerConnection::connect(addr, &self.endpoint),
        )
        .await;
        let connection = match connected {
            Ok(Ok(c)) if c.peer.worker_name == peer.name && c.peer.rank == peer.id => c,
            Ok(Ok(c)) => {
                return self.fail_connection(
                    conn,
                    format!(
                        "{addr} answered as {:?} (rank {})",
                        PeerText::new(&c.peer.worker_name),
                        c.peer.rank
                    ),
                )
            }
            Ok(Err(e)) => {
                if matches!(&e, TransportError::Io { source, .. } if source.kind() == std::io::ErrorKind::ConnectionRefused)
                {
                    // Nothing listens there: the peer's process or agent is gone.
                    debug!(peer = %peer.name, "connection refused");
                    self.liveness.refused(rank);
                }
                return self.fail_connection(conn, e.to_string());
            }
            Err(_) => return self.fail_connection(conn, format!("connecting to {addr} timed out")),
        };
        debug!(peer = %peer.name, "connected");
        self.serve_connection(connection, conn, peer.clone(), outbox, rx)
            .await;
    }

    /// Runs a handshaken connection until it closes: a writer task drains
    /// the outbox, this task reads frames and dispatches them.
    pub(super) async fn serve_connection(
        self: &Arc<Self>,
        connection: PeerConnection,
        conn: u64,
        peer: WorkerInfo,
        outbox: Outbox,
        rx: OutboxQueue,
    ) {
        debug!(
            peer = %peer.name,
            transport = connection.transport,
            channels = ?connection.outgoing_channels(),
            "connection established"
        );
        self.liveness.up(peer.id);
        self.link_info.lock().insert(
            peer.id,
            LinkInfo {
                transport: connection.transport,
                outgoing: connection.outgoing_channels().to_vec(),
                incoming: connection.incoming_channels().to_vec(),
                ucx_fallback: connection.ucx_fallback.clone(),
            },
        );
        let releases = connection.writer.release_signal();
        let mut reader = connection.reader;
        rx.install(connection.writer).await;
        let me = self.clone();
        let peer_of_writer = peer.clone();
        let writer_task = self.handle.spawn(
            async move {
                let refused = |m, e| me.refused(&peer_of_writer, m, e);
                if let Err(e) = rx.drain(releases, refused).await {
                    me.fail_connection(conn, e.to_string());
                }
            }
            .in_current_span(),
        );
        loop {
            match reader.read().await {
                Ok(Some(msg)) => {
                    if self.on_message(&peer, conn, msg, &outbox) {
                        // The message woke or spawned a task, which tokio
                        // runs on this thread after this one returns: if
                        // the next read finds nothing, it lets that task
                        // run before it spins for what the task may cause.
                        reader.stream_mut().yield_before_spin();
                    }
                }
                Ok(None) => {
                    self.fail_connection(conn, "the connection was closed".into());
                    break;
                }
                Err(e) => {
                    if self.state.load(Ordering::SeqCst) == RUNNING {
                        warn!(peer = %peer.name, error = %e, "connection failed");
                    }
                    self.fail_connection(conn, e.to_string());
                    break;
                }
            }
        }
        self.liveness.ended(peer.id);
        drop(outbox);
        writer_task.abort();
    }

    /// Fails every call waiting on connection `conn` and forgets the link.
    pub(super) fn fail_connection(&self, conn: u64, reason: String) {
        {
            let mut links = self.links.lock();
            links.retain(|_, l| l.conn != conn);
        }
        let failed = self.calls.lock().connection_failed(conn, &reason);
        for f in failed {
            self.fail(f);
        }
    }
}

/// The accept task: takes peers' connections (backing off when out of
/// descriptors) and serves each one that handshakes in time as a member of
/// the group: its first message (the handshake frame, or with a secret the
/// authentication `Hello`) within `handshake_timeout`, the rest of the
/// handshake and the channels' set-up within `init_timeout`. Refused
/// connections are warned about at most once every 10 s, counted
/// ([`RefusalWarnings`]).
pub(super) async fn accept_loop(inner: Arc<Inner>, listener: TcpListener) {
    let mut backoff = ferry_transport::accept::AcceptBackoff::new();
    let refusals = RefusalWarnings::new("rpc agent", "rejected a connection");
    loop {
        let (stream, addr) = match listener.accept().await {
            Ok(s) => {
                backoff.succeeded();
                s
            }
            Err(e) => {
                // Out of descriptors: back off instead of spinning.
                backoff.pause_after("rpc agent", &e).await;
                continue;
            }
        };
        let inner2 = inner.clone();
        let refusals = refusals.clone();
        inner.spawn_task(
            async move {
                match inner2.accept_connection(stream).await {
                    Ok(connection) => {
                        let peer = inner2.workers[connection.peer.rank as usize].clone();
                        let (outbox, rx) = outbox(inner2.handle.clone());
                        let conn = inner2.next_conn.fetch_add(1, Ordering::Relaxed);
                        inner2
                            .serve_connection(connection, conn, peer, outbox, rx)
                            .await;
                    }
                    Err(why) => refusals.refused(addr, why),
                }
            }
            .in_current_span(),
        );
    }
}

impl Inner {
    /// Establishes a connection a peer opened: waits (for at most
    /// `handshake_timeout`) until the peer's first message is in, reading
    /// nothing, so that a silent connection or one speaking another
    /// protocol is dropped early, then runs the accepting side of the
    /// handshake within `init_timeout` (authentication has its own 10 s,
    /// channel set-up its own bounds). The peer must be a worker of the
    /// group. The error is why the connection is refused.
    async fn accept_connection(&self, stream: TcpStream) -> Result<PeerConnection, String> {
        let first_message = if self.endpoint.auth.is_some() {
            auth_opening
        } else {
            handshake_opening
        };
        match tokio::time::timeout(
            self.handshake_timeout,
            await_opening(&stream, first_message),
        )
        .await
        {
            Ok(Ok(())) => {}
            // With a secret, the first bytes are not a handshake's: the
            // peer fails authentication (its warning says so).
            Ok(Err(e @ OpeningError::Refused(_))) if self.endpoint.auth.is_some() => {
                return Err(format!("{AUTH_FAILED}: {e}"))
            }
            Ok(Err(e)) => return Err(e.to_string()),
            Err(_) => {
                return Err(format!(
                    "no handshake within {:?} (handshake_timeout)",
                    self.handshake_timeout
                ))
            }
        }
        let connection = match tokio::time::timeout(
            self.init_timeout,
            PeerConnection::accept(stream, &self.endpoint),
        )
        .await
        {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(e.to_string()),
            Err(_) => return Err("handshake timed out".into()),
        };
        let rank = connection.peer.rank;
        let known = self
            .workers
            .get(rank as usize)
            .is_some_and(|w| w.name == connection.peer.worker_name);
        if !known {
            return Err(format!(
                "from a worker outside the group: name={:?} rank={rank}",
                PeerText::new(&connection.peer.worker_name)
            ));
        }
        Ok(connection)
    }
}
