//! The accept loop of the TCP servers built on `ferry-transport`: the
//! process group's listener and the checkpoint server.

use std::future::Future;
use std::net::SocketAddr;

use ferry_transport::accept::AcceptBackoff;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tracing::{info_span, Instrument};

/// Accepts connections on `listener` until cancelled, running
/// `handle(stream, peer)` for each on a task of its own, in a `connection`
/// span naming the server (`what`) and the peer. The tasks live in a
/// [`JoinSet`], so cancelling the loop (aborting its task) cancels them all.
/// Failed accepts (out of file descriptors) back off with a rate-limited
/// warning ([`AcceptBackoff`]).
pub(crate) async fn accept_loop<F, Fut>(listener: TcpListener, what: &'static str, mut handle: F)
where
    F: FnMut(TcpStream, SocketAddr) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut connections = JoinSet::new();
    let mut backoff = AcceptBackoff::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    backoff.succeeded();
                    let span = info_span!("connection", server = what, %peer);
                    connections.spawn(handle(stream, peer).instrument(span));
                }
                Err(error) => backoff.pause_after(what, &error).await,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}
