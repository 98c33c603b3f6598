//! Connecting a worker's endpoint: to the peer's worker address, or
//! through a listener and UCX's connection manager.

use std::ffi::c_void;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use super::drive::drive;
use super::pending::sleep_on_fd;
use super::shared::{close_listener, ep_failed, ConnRequest, Shared};
use super::{StopOnDrop, UcxLink, UcxWorker};
use crate::accept::RefusalWarnings;
use crate::ucx::sockaddr;
use crate::ucx::{status_text, sys};
use crate::{channel, TransportError};

/// The warning about connection requests rejected while waiting for the
/// peer's ([`UcxWorker::accept`]).
const REJECTED: &str = "rejected a UCX connection request that is not the peer's";

unsafe extern "C" fn conn_requested(request: sys::ucp_conn_request_h, arg: *mut c_void) {
    // SAFETY: `arg` is the `Shared` that owns the listener; the listener is
    // destroyed before the `Shared` is freed, and this runs inside
    // progress, under the state lock its owner holds (so only the
    // `requests` list is taken here).
    let shared = unsafe { &*(arg as *const Shared) };
    shared
        .requests
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(ConnRequest(request));
}

/// What one step of waiting for a connection request found.
pub(super) enum ListenStep {
    /// The peer's request, to accept.
    Accepted(ConnRequest),
    /// UCX has events pending: progress again.
    Busy,
    /// The worker is armed: sleep on its event fd.
    Armed,
}

impl UcxWorker {
    /// Connects to the peer's worker at `peer_address` and starts the
    /// progress task (on the current tokio runtime).
    pub(crate) fn connect(
        self,
        peer_address: &[u8],
        peer: &str,
    ) -> Result<UcxLink, TransportError> {
        self.connect_with(
            peer,
            "connecting to the peer's UCX worker",
            true,
            |params| {
                params.field_mask |= sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as u64;
                params.address = peer_address.as_ptr() as *const sys::ucp_address_t;
            },
        )
    }

    /// Connects to the peer's listener at `addr` ([`listen`](Self::listen)
    /// on its side) through UCX's connection manager, and starts the
    /// progress task (on the current tokio runtime).
    pub(crate) fn connect_to_listener(
        self,
        addr: SocketAddr,
        peer: &str,
    ) -> Result<UcxLink, TransportError> {
        let raw = socket2::SockAddr::from(addr);
        self.connect_with(
            peer,
            &format!("connecting to the peer's UCX listener at {addr}"),
            false,
            |params| {
                params.field_mask |=
                    (sys::UCP_EP_PARAM_FIELD_SOCK_ADDR | sys::UCP_EP_PARAM_FIELD_FLAGS) as u64;
                params.sockaddr = sockaddr::as_ucs(&raw);
                params.flags = sys::UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
            },
        )
    }

    /// Starts listening, on `ip` and a port the system picks, for the
    /// peer's client-server connection ([`connect_to_listener`] on its
    /// side), and returns the address the peer connects to; the worker then
    /// connects with [`accept`](Self::accept).
    ///
    /// Why: an endpoint UCX connects through its connection manager has its
    /// TCP lanes connected endpoint to endpoint, which lets UCX 1.13 keep
    /// zero-copy rendezvous (both sides' sockets close on a failure, so no
    /// memory registration needs invalidating) together with peer-failure
    /// handling. An endpoint created from a worker address with peer-failure
    /// handling gets neither over TCP, and its bulk data goes as fragments
    /// the receiver copies (`docs/reference/ucx.md`, Connecting).
    ///
    /// [`connect_to_listener`]: Self::connect_to_listener
    pub(crate) fn listen(&mut self, ip: IpAddr) -> Result<SocketAddr, TransportError> {
        let shared = &self.shared;
        let api = shared.api;
        let fail = |what: &str, status| TransportError::Unavailable {
            what: "UCX",
            reason: format!("{what}: {}", status_text(api, status)),
        };
        let raw = socket2::SockAddr::from(SocketAddr::new(ip, 0));
        // SAFETY: zeroed is a valid parameter block.
        let mut params: sys::ucp_listener_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = (sys::UCP_LISTENER_PARAM_FIELD_SOCK_ADDR
            | sys::UCP_LISTENER_PARAM_FIELD_CONN_HANDLER) as u64;
        params.sockaddr = sockaddr::as_ucs(&raw);
        params.conn_handler.cb = Some(conn_requested);
        params.conn_handler.arg = Arc::as_ptr(shared) as *mut c_void;
        let mut state = shared.lock();
        let mut listener: sys::ucp_listener_h = std::ptr::null_mut();
        // SAFETY: a live worker under the lock; the address outlives the
        // call; the handler's argument outlives the listener (destroyed
        // before the `Shared` is).
        let status = unsafe { api.ucp_listener_create(state.worker, &params, &mut listener) };
        if status != sys::UCS_OK {
            return Err(fail(
                &format!("listening for UCX connections on {ip} failed"),
                status,
            ));
        }
        state.listener = listener;
        // SAFETY: zeroed is a valid attribute block.
        let mut attr: sys::ucp_listener_attr_t = unsafe { std::mem::zeroed() };
        attr.field_mask = sys::UCP_LISTENER_ATTR_FIELD_SOCKADDR as u64;
        // SAFETY: a live listener; out-parameter.
        let status = unsafe { api.ucp_listener_query(listener, &mut attr) };
        let addr = if status == sys::UCS_OK {
            // SAFETY: UCX filled the `sockaddr_storage`.
            unsafe { sockaddr::parse(&raw const attr.sockaddr) }.ok_or_else(|| {
                TransportError::Unavailable {
                    what: "UCX",
                    reason: "the UCX listener's address is neither IPv4 nor IPv6".into(),
                }
            })
        } else {
            Err(fail("reading the UCX listener's address failed", status))
        };
        if addr.is_err() {
            close_listener(api, &mut state, &shared.requests);
        }
        addr
    }

    /// Waits, at most `timeout`, for the peer's connection on the listener
    /// ([`listen`](Self::listen)), accepts the first request that comes
    /// from `from` (the address of the peer's TCP connection; others are
    /// rejected, with warnings rate-limited by a [`RefusalWarnings`]: the
    /// first at once, the others counted into a line at most every 10 s
    /// and when this returns), closes the listener and starts the progress task. The
    /// probe that follows ([`UcxLink::probe`]) proves the endpoint reaches
    /// the peer of the handshake.
    pub(crate) async fn accept(
        self,
        from: IpAddr,
        peer: &str,
        timeout: Duration,
    ) -> Result<UcxLink, TransportError> {
        let shared = self.shared.clone();
        let api = shared.api;
        let rejected = RefusalWarnings::new("UCX listener", REJECTED);
        let wait = async {
            loop {
                match shared.take_conn_request(from, &rejected)? {
                    ListenStep::Accepted(request) => return Ok::<_, TransportError>(request),
                    // Events pending: progress again, letting other tasks
                    // run in between.
                    ListenStep::Busy => tokio::task::yield_now().await,
                    ListenStep::Armed => sleep_on_fd(shared.clone()).await,
                }
            }
        };
        let request =
            tokio::time::timeout(timeout, wait)
                .await
                .map_err(|_| TransportError::Channel {
                    channel: channel::UCX,
                    peer: peer.to_owned(),
                    reason: format!(
                        "the peer did not connect to this side's UCX listener within {timeout:?}"
                    ),
                })??;
        let link = self.connect_with(
            peer,
            "accepting the peer's UCX connection",
            false,
            |params| {
                params.field_mask |= sys::UCP_EP_PARAM_FIELD_CONN_REQUEST as u64;
                params.conn_request = request.0;
            },
        );
        // Requests that came after the accepted one are rejected.
        close_listener(api, &mut shared.lock(), &shared.requests);
        link
    }

    /// Creates the endpoint (with what `fill` adds to its parameters) and
    /// starts the progress task (on the current tokio runtime). With
    /// `retry`, an endpoint with peer-failure handling that UCX finds no
    /// transport for is tried again without it; never for a connection
    /// request, which UCX releases when an endpoint cannot be made from it.
    fn connect_with(
        self,
        peer: &str,
        what: &str,
        retry: bool,
        fill: impl Fn(&mut sys::ucp_ep_params_t),
    ) -> Result<UcxLink, TransportError> {
        let UcxWorker {
            shared, peer_mode, ..
        } = self;
        let _ = shared.peer.set(peer.to_owned());
        let api = shared.api;
        {
            let mut state = shared.lock();
            // Peer failure handling where UCX's transports have it (its TCP
            // and network transports): without it, UCX 1.13 aborts the
            // process (an assertion in `ucp_ep_set_failed`) when a peer's
            // TCP endpoint fails. Its shared-memory transports have none:
            // with only those, the endpoint goes without (the peer's exit is
            // noticed on the connection's TCP socket, which the `ucx`
            // transport's reader watches, and by the frame stall timeout).
            let modes: &[sys::ucp_err_handling_mode_t] = if peer_mode && retry {
                &[
                    sys::UCP_ERR_HANDLING_MODE_PEER,
                    sys::UCP_ERR_HANDLING_MODE_NONE,
                ]
            } else if peer_mode {
                &[sys::UCP_ERR_HANDLING_MODE_PEER]
            } else {
                &[sys::UCP_ERR_HANDLING_MODE_NONE]
            };
            let mut status = sys::UCS_ERR_UNREACHABLE;
            let mut ep: sys::ucp_ep_h = std::ptr::null_mut();
            for &mode in modes {
                // SAFETY: zeroed is a valid parameter block.
                let mut params: sys::ucp_ep_params_t = unsafe { std::mem::zeroed() };
                params.field_mask = (sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                    | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER)
                    as u64;
                fill(&mut params);
                params.err_mode = mode;
                params.err_handler.cb = Some(ep_failed);
                params.err_handler.arg = Arc::as_ptr(&shared) as *mut c_void;
                // SAFETY: a live worker; what `fill` points to outlives the
                // call (UCX copies or unpacks it); the handler's argument
                // outlives the endpoint.
                status = unsafe { api.ucp_ep_create(state.worker, &params, &mut ep) };
                if status != sys::UCS_ERR_UNREACHABLE {
                    break;
                }
            }
            if status != sys::UCS_OK {
                return Err(TransportError::Channel {
                    channel: channel::UCX,
                    peer: peer.to_owned(),
                    reason: format!("{what} failed: {}", status_text(api, status)),
                });
            }
            state.ep = ep;
        }
        tokio::spawn(drive(shared.clone()));
        Ok(UcxLink {
            _handle: Arc::new(StopOnDrop(shared.clone())),
            shared,
        })
    }
}

impl Shared {
    /// One step of waiting for the peer's connection request: progresses
    /// the worker, then takes the first request from `from` among those the
    /// listener handed over (rejecting the others, each recorded in
    /// `rejected`), or arms the worker.
    fn take_conn_request(
        &self,
        from: IpAddr,
        rejected: &RefusalWarnings,
    ) -> Result<ListenStep, TransportError> {
        let api = self.api;
        let mut state = self.lock();
        if state.listener.is_null() {
            return Err(TransportError::Channel {
                channel: channel::UCX,
                peer: self.peer().to_owned(),
                reason: "this side's UCX worker is not listening".into(),
            });
        }
        self.progress(&mut state);
        let requests =
            std::mem::take(&mut *self.requests.lock().unwrap_or_else(|p| p.into_inner()));
        let mut accepted = None;
        let mut strangers = Vec::new();
        for request in requests {
            // SAFETY: zeroed is a valid attribute block.
            let mut attr: sys::ucp_conn_request_attr_t = unsafe { std::mem::zeroed() };
            attr.field_mask = sys::UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR as u64;
            // SAFETY: a request UCX handed over and not yet accepted or
            // rejected; out-parameter.
            let status = unsafe { api.ucp_conn_request_query(request.0, &mut attr) };
            let client = (status == sys::UCS_OK)
                // SAFETY: filled by UCX, as the query succeeded.
                .then(|| unsafe { sockaddr::parse(&raw const attr.client_address) })
                .flatten();
            if accepted.is_none()
                && client.is_some_and(|c| c.ip().to_canonical() == from.to_canonical())
            {
                accepted = Some(request);
            } else {
                strangers.push(client);
                // SAFETY: the listener that handed the request over is live;
                // rejected once.
                unsafe { api.ucp_listener_reject(state.listener, request.0) };
            }
        }
        let step = match accepted {
            Some(request) => ListenStep::Accepted(request),
            // SAFETY: a live worker, under the lock.
            None => match unsafe { api.ucp_worker_arm(state.worker) } {
                sys::UCS_ERR_BUSY => ListenStep::Busy,
                _ => ListenStep::Armed,
            },
        };
        // Warned about outside the worker's lock.
        drop(state);
        for client in strangers {
            let client = client.map_or_else(|| "an unknown address".to_owned(), |c| c.to_string());
            rejected.refused(client, format_args!("the peer's address is {from}"));
        }
        Ok(step)
    }
}

#[cfg(test)]
mod tests {
    use std::fmt::{self, Write as _};
    use std::net::{IpAddr, Ipv4Addr};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Level, Metadata, Subscriber};

    use super::{sleep_on_fd, ListenStep, UcxWorker, REJECTED};
    use crate::accept::RefusalWarnings;

    /// Keeps this thread's `WARN` events, one line each: the message, then
    /// `name=value` for each field.
    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<String>>>);

    struct Line(String);

    impl Visit for Line {
        fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
            let _ = match field.name() {
                "message" => write!(self.0, " {value:?}"),
                name => write!(self.0, " {name}={value:?}"),
            };
        }
    }

    impl Subscriber for Capture {
        fn enabled(&self, metadata: &Metadata<'_>) -> bool {
            *metadata.level() <= Level::WARN
        }
        fn new_span(&self, _: &Attributes<'_>) -> Id {
            Id::from_u64(1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, event: &Event<'_>) {
            let mut line = Line(String::new());
            event.record(&mut line);
            self.0.lock().unwrap().push(line.0);
        }
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }

    /// The `refusals=N` field of a line.
    fn refusals(line: &str) -> u64 {
        let at = line.find("refusals=").unwrap() + "refusals=".len();
        let digits: String = line[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().unwrap()
    }

    /// 32 workers connect to a listener whose peer is expected from
    /// another address: each request is rejected, and the rejections are
    /// warned about in a few lines (the first at once, the rest when the
    /// wait ends) whose `refusals=` add up to 32, not a line each. The
    /// listener's loop runs on this test's thread, where the capture is
    /// the default subscriber.
    #[tokio::test]
    async fn requests_that_are_not_the_peers_give_a_few_lines_counting_them_all() {
        const STRANGERS: u64 = 32;
        if let Err(reason) = crate::ucx::viability() {
            eprintln!("skipped: {reason}");
            return;
        }
        // Tracing caches whether a statement is enabled when it is first
        // hit: register the warnings' statements before the capture, which
        // then counts them in (another test's thread may hit them too).
        let warm = RefusalWarnings::new("UCX listener", REJECTED);
        warm.refused("nobody", "warming up");
        warm.refused("nobody", "warming up");
        drop(warm);
        let capture = Capture::default();
        let _default = tracing::subscriber::set_default(capture.clone());

        let spin = Duration::from_micros(20);
        let mut listening = UcxWorker::new(Some("tcp"), spin).unwrap();
        let here = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let addr = listening.listen(here).unwrap();
        let strangers: Vec<_> = (0..STRANGERS)
            .map(|i| {
                let worker = UcxWorker::new(Some("tcp"), spin).unwrap();
                worker
                    .connect_to_listener(addr, &format!("stranger {i}"))
                    .unwrap()
            })
            .collect();
        let elsewhere = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
        let rejected = RefusalWarnings::new("UCX listener", REJECTED);
        let shared = listening.shared.clone();
        let wait = async {
            while rejected.refusals() < STRANGERS {
                match shared.take_conn_request(elsewhere, &rejected).unwrap() {
                    ListenStep::Accepted(_) => panic!("accepted a stranger's request"),
                    ListenStep::Busy => tokio::task::yield_now().await,
                    ListenStep::Armed => sleep_on_fd(shared.clone()).await,
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(120), wait)
            .await
            .expect("every stranger's request arrived");
        assert_eq!(rejected.refusals(), STRANGERS);
        // The rest are summarized as the wait's warnings go.
        drop(rejected);

        let all = capture.0.lock().unwrap().clone();
        let text = all.join("\n");
        let lines: Vec<&String> = all.iter().filter(|l| l.contains(REJECTED)).collect();
        assert!(
            (1..=3).contains(&lines.len()),
            "{} lines for {STRANGERS} rejections:\n{text}",
            lines.len()
        );
        assert_eq!(
            lines.iter().map(|l| refusals(l)).sum::<u64>(),
            STRANGERS,
            "{text}"
        );
        assert_eq!(refusals(lines[0]), 1, "{text}");
        assert!(lines[0].contains("peer=127.0.0.1:"), "{text}");
        assert!(lines[0].contains("127.0.0.2"), "{text}");
        drop(strangers);
        drop(listening);
    }
}
