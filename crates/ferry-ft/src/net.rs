//! The accept loop of the TCP servers built on `ferry-transport`: the
//! process group's listener and the checkpoint server.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tracing::{info_span, warn, Instrument};

/// How long [`accept_loop`] pauses after a failed accept, and only then.
/// Errors such as running out of file descriptors (`EMFILE`) come back at
/// once on the next accept: without the pause the loop would spin on them.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(10);

/// Accepts connections on `listener` until cancelled, running
/// `handle(stream, peer)` for each on a task of its own, in a `connection`
/// span naming the server (`what`) and the peer. The tasks live in a
/// [`JoinSet`], so cancelling the loop (aborting its task) cancels them all.
pub(crate) async fn accept_loop<F, Fut>(listener: TcpListener, what: &'static str, mut handle: F)
where
    F: FnMut(TcpStream, SocketAddr) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let span = info_span!("connection", server = what, %peer);
                    connections.spawn(handle(stream, peer).instrument(span));
                }
                Err(error) => {
                    warn!("{what}: accept failed: {error}");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}
