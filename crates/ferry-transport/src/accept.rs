//! Backing off a TCP accept loop that keeps failing, with a rate-limited
//! warning: shared by every accept loop of the workspace (the store
//! server, the RPC agent, the process group and checkpoint servers).
//!
//! Out of file descriptors (`EMFILE`, `ENFILE`) or memory, `accept` fails
//! again at once for as long as the condition lasts; a loop that only
//! logs and retries spins a core and floods the log. [`AcceptBackoff`]
//! is a pure state machine (it takes `now` and returns what to do): the
//! pause after each failure doubles from [`FIRST_ACCEPT_PAUSE`] up to
//! [`MAX_ACCEPT_PAUSE`] for resource exhaustion, and a warning is issued
//! for the first failure of a streak and then at most once every
//! [`ACCEPT_WARN_EVERY`], counting the failures it did not report. A
//! successful accept ends the streak.
//!
//! Refused connections are the other flood a listener must not log one
//! line each: an outsider can open thousands a second, each failing
//! authentication or sending bytes of another protocol. [`RefusalLog`] is
//! the pure state machine (again taking `now`) that warns about the first
//! refusal and then at most once every [`REFUSAL_WARN_EVERY`], with the
//! count of refusals since the last line and the latest one's peer and
//! reason; [`RefusalWarnings`] is its I/O shell, one per listener, shared
//! by the listener's connection tasks.
//!
//! Before a listener hands a fresh connection to its protocol, it can
//! wait for the peer's first message without reading it
//! ([`await_opening`]): a connection whose first bytes cannot open the
//! protocol ([`auth_opening`], [`handshake_opening`]) is refused at once,
//! and the wait is bounded on its own, whatever bounds the rest of the
//! protocol.

use std::fmt::Display;
use std::io;
#[cfg(not(loom))]
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

/// The pause after the first failed accept of a streak.
pub const FIRST_ACCEPT_PAUSE: Duration = Duration::from_millis(10);
/// The longest pause between two accepts while they keep failing.
pub const MAX_ACCEPT_PAUSE: Duration = Duration::from_secs(1);
/// The least time between two warnings about failed accepts.
pub const ACCEPT_WARN_EVERY: Duration = Duration::from_secs(10);

/// What to do after a failed accept: pause, and maybe warn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptAction {
    /// How long to wait before accepting again.
    pub pause: Duration,
    /// `Some(n)`: issue a warning now, reporting `n` failures since the
    /// last one (this one included). `None`: stay quiet.
    pub warn: Option<u64>,
}

/// The back-off state of one accept loop (see the [module](self) docs).
#[derive(Debug, Clone, Default)]
pub struct AcceptBackoff {
    /// The next pause; zero when no streak is under way.
    next_pause: Duration,
    /// When the last warning was issued.
    last_warning: Option<Instant>,
    /// Failures since the last warning.
    unreported: u64,
    /// Failures since this state was created.
    total_failures: u64,
}

/// Whether `e` means the process or system ran out of a resource, so
/// that the next accept would fail the same way at once.
pub fn is_resource_exhaustion(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

impl AcceptBackoff {
    /// A loop with no failure yet.
    pub fn new() -> AcceptBackoff {
        AcceptBackoff::default()
    }

    /// Records a failed accept at `now`. Resource exhaustion (see
    /// [`is_resource_exhaustion`]) doubles the pause up to
    /// [`MAX_ACCEPT_PAUSE`]; any other error (one connection that was
    /// reset before it was accepted) pauses [`FIRST_ACCEPT_PAUSE`].
    pub fn failed(&mut self, now: Instant, error: &io::Error) -> AcceptAction {
        self.total_failures += 1;
        self.unreported += 1;
        let pause = if is_resource_exhaustion(error) {
            let pause = self.next_pause.max(FIRST_ACCEPT_PAUSE);
            self.next_pause = (pause * 2).min(MAX_ACCEPT_PAUSE);
            pause
        } else {
            FIRST_ACCEPT_PAUSE
        };
        let due = self
            .last_warning
            .is_none_or(|at| now.saturating_duration_since(at) >= ACCEPT_WARN_EVERY);
        let warn = due.then(|| {
            self.last_warning = Some(now);
            std::mem::take(&mut self.unreported)
        });
        AcceptAction { pause, warn }
    }

    /// Records a successful accept: the next failure starts a new streak
    /// with the shortest pause (warnings stay rate-limited).
    pub fn succeeded(&mut self) {
        self.next_pause = Duration::ZERO;
    }

    /// Failed accepts since this state was created.
    pub fn failures(&self) -> u64 {
        self.total_failures
    }

    /// The I/O shell around [`failed`](Self::failed): records `error`,
    /// warns (naming the server, `what`) when due, then pauses.
    pub async fn pause_after(&mut self, what: &str, error: &io::Error) {
        let action = self.failed(Instant::now(), error);
        if let Some(failures) = action.warn {
            tracing::warn!(
                server = what,
                %error,
                failures,
                pause = ?action.pause,
                "accept failed; backing off (this warning is rate-limited)"
            );
        }
        tokio::time::sleep(action.pause).await;
    }
}

/// The least time between two warnings about the connections one
/// listener refused.
pub const REFUSAL_WARN_EVERY: Duration = Duration::from_secs(10);

/// One warning line about refused connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusalLine {
    /// Refusals since the previous line, the latest included (1: the line
    /// is about one refusal).
    pub refusals: u64,
    /// The latest refused peer (its address, as the listener names it).
    pub peer: String,
    /// Why the latest was refused.
    pub reason: String,
}

/// The rate limit of one listener's warnings about refused connections (see
/// the [module](self) docs): the first refusal is reported at once, the
/// next ones at most once every [`REFUSAL_WARN_EVERY`], counted, with the
/// latest one's peer and reason. A pure state machine: the caller passes
/// `now` and writes the lines it returns.
#[derive(Debug, Clone, Default)]
pub struct RefusalLog {
    /// When the last line was issued.
    last_line: Option<Instant>,
    /// Refusals since the last line.
    unreported: u64,
    /// The latest refusal not reported yet: peer and reason.
    latest: Option<(String, String)>,
    /// Refusals since this log was created.
    total: u64,
}

impl RefusalLog {
    /// A log with no refusal yet.
    pub fn new() -> RefusalLog {
        RefusalLog::default()
    }

    /// Records a refusal of `peer` for `reason` at `now`: the line to
    /// write now, if one is due, else `None` (the refusal is counted
    /// into the next line).
    pub fn refused(
        &mut self,
        now: Instant,
        peer: &dyn Display,
        reason: &dyn Display,
    ) -> Option<RefusalLine> {
        self.total += 1;
        self.unreported += 1;
        self.latest = Some((peer.to_string(), reason.to_string()));
        self.due(now)
    }

    /// The summary of the refusals not reported yet, if there are some and
    /// [`REFUSAL_WARN_EVERY`] has passed since the last line at `now`.
    pub fn due(&mut self, now: Instant) -> Option<RefusalLine> {
        let due = self
            .last_line
            .is_none_or(|at| now.saturating_duration_since(at) >= REFUSAL_WARN_EVERY);
        if !due {
            return None;
        }
        let line = self.take()?;
        self.last_line = Some(now);
        Some(line)
    }

    /// When the refusals not reported yet are due to be summarized
    /// ([`due`](Self::due) returns their line from then on); `None` when
    /// every refusal has been reported.
    pub fn summary_due_at(&self) -> Option<Instant> {
        // Every refusal before the first line is in that line: with some
        // not reported yet, there was a line.
        self.last_line
            .filter(|_| self.unreported > 0)
            .map(|at| at + REFUSAL_WARN_EVERY)
    }

    /// The summary of the refusals not reported yet, due or not (when the
    /// listener goes away); `None` when every refusal has been reported.
    pub fn flush(&mut self) -> Option<RefusalLine> {
        self.take()
    }

    /// Refusals since this log was created.
    pub fn refusals(&self) -> u64 {
        self.total
    }

    fn take(&mut self) -> Option<RefusalLine> {
        if self.unreported == 0 {
            return None;
        }
        let (peer, reason) = self.latest.take().unwrap_or_default();
        Some(RefusalLine {
            refusals: std::mem::take(&mut self.unreported),
            peer,
            reason,
        })
    }
}

/// The rate-limited warnings about the connections one listener refuses:
/// the I/O shell of a [`RefusalLog`]. Clones share the log (hand one to
/// each connection task). Refusals counted but not reported yet are
/// summarized once they are due, by a timer task on the current tokio
/// runtime, or when the last clone is dropped (the listener went away).
///
/// Each line is a `WARN` event with the listener's message, and the
/// fields `server`, `peer` and `reason` (of the latest refusal) and
/// `refusals` (since the previous line).
#[cfg(not(loom))]
#[derive(Clone)]
pub struct RefusalWarnings {
    shared: Arc<RefusalShared>,
}

#[cfg(not(loom))]
struct RefusalShared {
    server: &'static str,
    message: &'static str,
    state: Mutex<RefusalState>,
}

#[cfg(not(loom))]
#[derive(Default)]
struct RefusalState {
    log: RefusalLog,
    /// A timer task will summarize what is not reported yet.
    timer: bool,
}

#[cfg(not(loom))]
impl std::fmt::Debug for RefusalWarnings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RefusalWarnings")
            .field("server", &self.shared.server)
            .field("refusals", &self.refusals())
            .finish()
    }
}

#[cfg(not(loom))]
impl RefusalWarnings {
    /// Warnings of the listener `server` (`"store server"`), each with
    /// `message` (`"refused a store client that failed authentication"`).
    pub fn new(server: &'static str, message: &'static str) -> RefusalWarnings {
        RefusalWarnings {
            shared: Arc::new(RefusalShared {
                server,
                message,
                state: Mutex::new(RefusalState::default()),
            }),
        }
    }

    /// Records that the listener refused `peer` for `reason`, and warns if
    /// a line is due.
    pub fn refused(&self, peer: impl Display, reason: impl Display) {
        let now = tokio::time::Instant::now().into_std();
        let mut state = self.shared.lock();
        if let Some(line) = state.log.refused(now, &peer, &reason) {
            drop(state);
            self.shared.warn(&line);
            return;
        }
        if !state.timer {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                state.timer = true;
                drop(state);
                let shared = Arc::downgrade(&self.shared);
                use tracing::Instrument;
                runtime.spawn(summarize_when_due(shared).in_current_span());
            }
        }
    }

    /// Refusals recorded so far.
    pub fn refusals(&self) -> u64 {
        self.shared.lock().log.refusals()
    }
}

#[cfg(not(loom))]
impl RefusalShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, RefusalState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn warn(&self, line: &RefusalLine) {
        let (server, message, refusals) = (self.server, self.message, line.refusals);
        let (peer, reason) = (&line.peer, &line.reason);
        if refusals == 1 {
            tracing::warn!(
                server,
                %peer,
                %reason,
                refusals,
                "{message} (rate-limited: further refusals are summarized every {REFUSAL_WARN_EVERY:?})"
            );
        } else {
            tracing::warn!(
                server,
                %peer,
                %reason,
                refusals,
                "{message}: {refusals} refusals since the last warning (peer and reason of the latest)"
            );
        }
    }
}

#[cfg(not(loom))]
impl Drop for RefusalShared {
    fn drop(&mut self) {
        let line = self.lock().log.flush();
        if let Some(line) = line {
            self.warn(&line);
        }
    }
}

/// The timer task of a [`RefusalWarnings`]: sleeps until the refusals not
/// reported yet are due, then summarizes them (unless the warnings are
/// gone, which summarized them on the way out).
#[cfg(not(loom))]
async fn summarize_when_due(shared: Weak<RefusalShared>) {
    loop {
        let at = {
            let Some(shared) = shared.upgrade() else {
                return;
            };
            let mut state = shared.lock();
            match state.log.summary_due_at() {
                Some(at) => at,
                None => {
                    state.timer = false;
                    return;
                }
            }
        };
        tokio::time::sleep_until(at.into()).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let now = tokio::time::Instant::now().into_std();
        let mut state = shared.lock();
        if let Some(line) = state.log.due(now) {
            state.timer = false;
            drop(state);
            shared.warn(&line);
            return;
        }
    }
}

/// How a connection's first bytes look to the protocol that must open it
/// (the verdict of a judge passed to [`await_opening`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Opening {
    /// The first message is not all there yet: it needs at least this
    /// many bytes in all.
    NeedAtLeast(usize),
    /// The first message is all there.
    Complete,
    /// These bytes cannot open the protocol: refuse the connection now.
    Refuse(String),
}

/// Why [`await_opening`] gave up on a connection.
#[derive(Debug, thiserror::Error)]
pub enum OpeningError {
    /// The first bytes cannot open the listener's protocol.
    #[error("not a connection of this listener's protocol: {0}")]
    Refused(String),
    /// The peer closed the connection before its first message was in.
    #[error("the peer closed the connection before its first message")]
    Closed,
    /// The socket failed.
    #[error("reading the first message failed: {0}")]
    Io(#[from] io::Error),
}

/// How many of a connection's first bytes a judge of [`await_opening`]
/// sees (enough for a frame header and an authentication header).
pub const OPENING_PEEK_BYTES: usize = 64;

/// A first message longer than this counts as arrived once this much of
/// it is queued: a socket's receive buffer may hold no more before this
/// side reads.
pub const OPENING_QUEUED_ENOUGH: usize = 16 << 10;

/// Waits until the peer's first message is queued on `stream`, reading
/// nothing off it (the protocol then reads it as if this had not run).
/// `judge` looks at the first bytes (at most [`OPENING_PEEK_BYTES`]) and
/// says how long the message is ([`Opening`]): bytes it refuses end the
/// wait at once, as does the peer closing the connection. The caller
/// bounds the wait (`tokio::time::timeout`): without one, a peer that
/// sends nothing holds it for ever.
///
/// The wait sleeps while no new bytes arrive (it is woken by the socket,
/// never by polling).
#[cfg(not(loom))]
pub async fn await_opening(
    stream: &tokio::net::TcpStream,
    judge: impl Fn(&[u8]) -> Opening,
) -> Result<(), OpeningError> {
    use tokio::io::Interest;
    let mut first = [0u8; OPENING_PEEK_BYTES];
    loop {
        let ready = stream.ready(Interest::READABLE).await?;
        // Returning `WouldBlock` from the closure clears the readiness, so
        // the next `ready` sleeps until more bytes arrive (unless some
        // arrived meanwhile).
        let verdict = stream.try_io(Interest::READABLE, || {
            let (seen, _) =
                rustix::net::recv(stream, &mut first[..], rustix::net::RecvFlags::PEEK)?;
            if seen == 0 {
                return Ok(Err(OpeningError::Closed));
            }
            let need = match judge(&first[..seen]) {
                Opening::Complete => return Ok(Ok(())),
                Opening::Refuse(why) => return Ok(Err(OpeningError::Refused(why))),
                Opening::NeedAtLeast(need) => need.min(OPENING_QUEUED_ENOUGH),
            };
            let queued = if seen >= need {
                seen as u64
            } else {
                rustix::io::ioctl_fionread(stream)?
            };
            if queued >= need as u64 {
                Ok(Ok(()))
            } else if ready.is_read_closed() {
                // Closed with the message incomplete: no more will come.
                Ok(Err(OpeningError::Closed))
            } else {
                Err(io::ErrorKind::WouldBlock.into())
            }
        });
        match verdict {
            Ok(verdict) => return verdict,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(OpeningError::Io(e)),
        }
    }
}

/// The judge ([`await_opening`]) of a connection that must open with the
/// authentication handshake ([`crate::auth`]): its first message is the
/// connecting side's `Hello`, and bytes that cannot start a handshake
/// message (anything not opening with `FRYA`: another protocol, such as
/// c10d's `VALIDATE`, or a peer without a secret) are refused as soon as
/// the first of them differs.
#[cfg(not(loom))]
pub fn auth_opening(first: &[u8]) -> Opening {
    use crate::auth::message::{AuthMessage, HEADER_LEN};
    match AuthMessage::decode(first) {
        Err(e) => Opening::Refuse(e.to_string()),
        Ok(Some(_)) => Opening::Complete,
        Ok(None) => match first.get(..HEADER_LEN).and_then(|h| h.try_into().ok()) {
            Some(header) => match AuthMessage::body_len(header) {
                Ok(body) => Opening::NeedAtLeast(HEADER_LEN + body),
                Err(e) => Opening::Refuse(e.to_string()),
            },
            None => Opening::NeedAtLeast(HEADER_LEN),
        },
    }
}

/// The judge ([`await_opening`]) of a connection that opens with a Ferry
/// handshake frame ([`ferry_wire::Handshake`], within
/// [`ferry_wire::handshake_limits`]), as a [`crate::PeerConnection`]
/// without a secret does: anything else (a byte of the frame magic, the
/// version or the kind that differs, a length over the limits) is refused
/// as soon as it is in.
pub fn handshake_opening(first: &[u8]) -> Opening {
    use ferry_wire::{FrameHeader, MessageKind, HEADER_LEN, MAGIC, WIRE_VERSION};
    let seen = first.len().min(MAGIC.len());
    if first[..seen] != MAGIC[..seen] {
        return Opening::Refuse(format!(
            "not a Ferry frame (first bytes {:02x?})",
            &first[..seen]
        ));
    }
    if first.get(MAGIC.len()).is_some_and(|&v| v != WIRE_VERSION) {
        return Opening::Refuse(format!(
            "Ferry wire version {}, this build speaks {WIRE_VERSION}",
            first[MAGIC.len()]
        ));
    }
    let Some(header) = first.get(..HEADER_LEN).and_then(|h| h.try_into().ok()) else {
        return Opening::NeedAtLeast(HEADER_LEN);
    };
    match FrameHeader::decode(header, &ferry_wire::handshake_limits()) {
        Err(e) => Opening::Refuse(e.to_string()),
        Ok(h) if h.kind != MessageKind::HANDSHAKE => {
            Opening::Refuse(format!("expected a handshake, got a {} frame", h.kind))
        }
        Ok(h) => Opening::NeedAtLeast(HEADER_LEN + h.body_len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn emfile() -> io::Error {
        io::Error::from_raw_os_error(libc::EMFILE)
    }

    #[test]
    fn exhaustion_doubles_the_pause_up_to_the_cap_and_success_resets_it() {
        let mut b = AcceptBackoff::new();
        let now = Instant::now();
        let pauses: Vec<Duration> = (0..10).map(|_| b.failed(now, &emfile()).pause).collect();
        assert_eq!(pauses[0], FIRST_ACCEPT_PAUSE);
        assert_eq!(pauses[1], FIRST_ACCEPT_PAUSE * 2);
        assert!(pauses.windows(2).all(|w| w[1] >= w[0]));
        assert_eq!(*pauses.last().unwrap(), MAX_ACCEPT_PAUSE);
        b.succeeded();
        assert_eq!(b.failed(now, &emfile()).pause, FIRST_ACCEPT_PAUSE);
        assert_eq!(b.failures(), 11);
        let reset = io::Error::from(io::ErrorKind::ConnectionAborted);
        assert_eq!(b.failed(now, &reset).pause, FIRST_ACCEPT_PAUSE);
    }

    #[test]
    fn warnings_are_rate_limited_and_count_what_they_skipped() {
        let mut b = AcceptBackoff::new();
        let t0 = Instant::now();
        assert_eq!(b.failed(t0, &emfile()).warn, Some(1));
        let quiet = (1..1000)
            .map(|i| b.failed(t0 + Duration::from_millis(i), &emfile()).warn)
            .filter(Option::is_some)
            .count();
        assert_eq!(quiet, 0);
        assert_eq!(b.failed(t0 + ACCEPT_WARN_EVERY, &emfile()).warn, Some(1000));
    }

    fn refuse(log: &mut RefusalLog, at: Instant, i: u64) -> Option<RefusalLine> {
        log.refused(
            at,
            &format_args!("10.0.0.1:{i}"),
            &format_args!("reason {i}"),
        )
    }

    #[test]
    fn the_first_refusal_is_reported_at_once_and_the_rest_every_ten_seconds() {
        let mut log = RefusalLog::new();
        let t0 = Instant::now();
        assert_eq!(log.summary_due_at(), None);
        assert_eq!(
            refuse(&mut log, t0, 0),
            Some(RefusalLine {
                refusals: 1,
                peer: "10.0.0.1:0".into(),
                reason: "reason 0".into()
            })
        );
        assert_eq!(log.summary_due_at(), None, "everything is reported");
        // 26,799 more within 8 s (the flood the review saw): no line.
        for i in 1..26_800u64 {
            let at = t0 + Duration::from_micros(i * 298);
            assert_eq!(refuse(&mut log, at, i), None, "refusal {i}");
        }
        assert_eq!(log.summary_due_at(), Some(t0 + REFUSAL_WARN_EVERY));
        assert_eq!(
            log.due(t0 + REFUSAL_WARN_EVERY - Duration::from_nanos(1)),
            None
        );
        // Due at 10 s: one summary counting them all, naming the latest.
        let line = log.due(t0 + REFUSAL_WARN_EVERY).unwrap();
        assert_eq!(
            line,
            RefusalLine {
                refusals: 26_799,
                peer: "10.0.0.1:26799".into(),
                reason: "reason 26799".into()
            }
        );
        assert_eq!(log.due(t0 + REFUSAL_WARN_EVERY * 5), None, "nothing left");
        assert_eq!(log.refusals(), 26_800);
    }

    #[test]
    fn a_refusal_after_a_quiet_spell_is_reported_at_once_with_those_before_it() {
        let mut log = RefusalLog::new();
        let t0 = Instant::now();
        assert!(refuse(&mut log, t0, 0).is_some());
        assert_eq!(refuse(&mut log, t0 + Duration::from_secs(1), 1), None);
        assert_eq!(refuse(&mut log, t0 + Duration::from_secs(2), 2), None);
        // No timer ran: the next refusal, 10 s after the line, carries them.
        let line = refuse(&mut log, t0 + REFUSAL_WARN_EVERY, 3).unwrap();
        assert_eq!((line.refusals, line.peer.as_str()), (3, "10.0.0.1:3"));
        // Long after, a lone refusal is a line of its own.
        let line = refuse(&mut log, t0 + REFUSAL_WARN_EVERY * 10, 4).unwrap();
        assert_eq!((line.refusals, line.reason.as_str()), (1, "reason 4"));
        // Within 10 s of that one: counted, then flushed on the way out.
        assert_eq!(refuse(&mut log, t0 + REFUSAL_WARN_EVERY * 10, 5), None);
        let line = log.flush().unwrap();
        assert_eq!((line.refusals, line.peer.as_str()), (1, "10.0.0.1:5"));
        assert_eq!(log.flush(), None);
        assert_eq!(log.refusals(), 6);
    }

    #[test]
    fn at_most_one_line_per_window_whatever_the_rate() {
        // One refusal every millisecond for a minute, the due summary
        // taken whenever it is due (as the timer does): 1 + 6 lines, no
        // refusal lost.
        let mut log = RefusalLog::new();
        let t0 = Instant::now();
        let mut lines = Vec::new();
        for i in 0..60_000u64 {
            let at = t0 + Duration::from_millis(i);
            if let Some(due) = log.summary_due_at().filter(|&due| due <= at) {
                lines.extend(log.due(due));
            }
            lines.extend(refuse(&mut log, at, i));
        }
        lines.extend(log.flush());
        assert_eq!(lines.len(), 7, "{lines:?}");
        assert_eq!(lines.iter().map(|l| l.refusals).sum::<u64>(), 60_000);
    }

    #[test]
    fn the_auth_judge_refuses_other_protocols_at_the_first_differing_byte() {
        use crate::auth::message::{AuthMessage, HEADER_LEN, NONCE_LEN};
        // c10d's VALIDATE query (QueryType 0, then its magic): 5 bytes,
        // fewer than a handshake header.
        let validate = [0x00, 0xCE, 0xF7, 0x85, 0x3C];
        for cut in 1..=validate.len() {
            assert!(matches!(auth_opening(&validate[..cut]), Opening::Refuse(_)));
        }
        assert!(matches!(
            auth_opening(b"GET / HTTP/1.1"),
            Opening::Refuse(_)
        ));
        assert!(
            matches!(auth_opening(b"FRY\x01"), Opening::Refuse(_)),
            "a frame"
        );
        let hello = AuthMessage::Hello { nonce: [7; 32] }.encode();
        assert_eq!(auth_opening(&hello[..1]), Opening::NeedAtLeast(HEADER_LEN));
        assert_eq!(auth_opening(&hello[..4]), Opening::NeedAtLeast(HEADER_LEN));
        assert_eq!(
            auth_opening(&hello[..HEADER_LEN + 3]),
            Opening::NeedAtLeast(HEADER_LEN + NONCE_LEN)
        );
        assert_eq!(auth_opening(&hello), Opening::Complete);
    }

    #[test]
    fn the_handshake_judge_wants_the_whole_frame_and_refuses_anything_else() {
        use ferry_wire::{Flags, FrameHeader, MessageKind, HEADER_LEN};
        let header = |kind, payload_len| {
            FrameHeader {
                kind,
                flags: Flags::NONE,
                request_id: 0,
                payload_len,
                descriptors_len: 0,
                tensor_count: 0,
            }
            .encode()
        };
        let h = header(MessageKind::HANDSHAKE, 300);
        assert_eq!(handshake_opening(&h[..2]), Opening::NeedAtLeast(HEADER_LEN));
        assert_eq!(
            handshake_opening(&h),
            Opening::NeedAtLeast(HEADER_LEN + 300)
        );
        assert!(
            matches!(handshake_opening(b"FRYA"), Opening::Refuse(_)),
            "auth"
        );
        assert!(matches!(handshake_opening(&[0x00]), Opening::Refuse(_)));
        let request = header(MessageKind::REQUEST, 10);
        assert!(matches!(handshake_opening(&request), Opening::Refuse(_)));
        let huge = header(MessageKind::HANDSHAKE, 256 << 20);
        assert!(matches!(handshake_opening(&huge), Opening::Refuse(_)));
    }

    /// A connected pair over 127.0.0.1: (the client's end, the accepted end).
    async fn pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        (client.unwrap(), accepted.unwrap().0)
    }

    #[tokio::test]
    async fn an_opening_sent_in_pieces_is_awaited_whole_and_left_unread() {
        use crate::auth::message::AuthMessage;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut client, mut accepted) = pair().await;
        let hello = AuthMessage::Hello { nonce: [9; 32] }.encode();
        let write = async {
            for piece in hello.chunks(5) {
                client.write_all(piece).await.unwrap();
                client.flush().await.unwrap();
                tokio::task::yield_now().await;
            }
        };
        let (awaited, ()) = tokio::join!(await_opening(&accepted, auth_opening), write);
        awaited.unwrap();
        // Nothing was read off the socket: the protocol reads it all.
        let mut got = vec![0u8; hello.len()];
        accepted.read_exact(&mut got).await.unwrap();
        assert_eq!(got, hello);
    }

    #[tokio::test]
    async fn other_bytes_are_refused_at_once_and_a_close_ends_the_wait() {
        use tokio::io::AsyncWriteExt;
        // c10d's VALIDATE: refused before a whole header is in.
        let (mut client, accepted) = pair().await;
        client
            .write_all(&[0x00, 0xCE, 0xF7, 0x85, 0x3C])
            .await
            .unwrap();
        let e = await_opening(&accepted, auth_opening).await.unwrap_err();
        assert!(matches!(e, OpeningError::Refused(_)), "{e}");
        // Part of a handshake frame, then the peer closes.
        let (mut client, accepted) = pair().await;
        client.write_all(b"FRY\x01\x01").await.unwrap();
        client.shutdown().await.unwrap();
        let e = await_opening(&accepted, handshake_opening)
            .await
            .unwrap_err();
        assert!(matches!(e, OpeningError::Closed), "{e}");
        // Nothing at all, then the peer closes.
        let (client, accepted) = pair().await;
        drop(client);
        let e = await_opening(&accepted, handshake_opening)
            .await
            .unwrap_err();
        assert!(matches!(e, OpeningError::Closed), "{e}");
    }

    /// Refusals through the shell: the first is written at once, the rest
    /// wait for the timer task it armed (or for the drop, on the way out).
    #[tokio::test]
    async fn the_shell_arms_one_timer_for_what_it_did_not_write() {
        let warnings = RefusalWarnings::new("test server", "refused a test client");
        assert!(!warnings.shared.lock().timer);
        for i in 0..100 {
            warnings.refused(format_args!("10.0.0.1:{i}"), "bad bytes");
        }
        assert_eq!(warnings.refusals(), 100);
        assert!(warnings.shared.lock().timer, "a timer waits for the rest");
        let left = warnings.shared.lock().log.clone().flush().unwrap();
        assert_eq!((left.refusals, left.peer.as_str()), (99, "10.0.0.1:99"));
        let clone = warnings.clone();
        drop(warnings);
        assert_eq!(clone.refusals(), 100, "clones share the log");
    }
}
