//! TCP keepalive and `TCP_USER_TIMEOUT` on Ferry's connections, so that a
//! peer cut off by a partition is noticed by the kernel within bounds
//! instead of by call timeouts (or after the kernel's ~15 minutes of
//! retransmissions).
//!
//! - Keepalive: after `idle` without traffic the kernel probes the peer
//!   every `interval`; `retries` unanswered probes close the connection.
//!   An idle connection to a vanished peer fails within
//!   `idle + interval × retries`.
//! - `TCP_USER_TIMEOUT`: data written but not acknowledged for
//!   `user_timeout` closes the connection (a busy connection, which
//!   keepalive does not probe). It also bounds the probing above.
//!
//! [`Endpoint::keepalive`](crate::Endpoint::keepalive) applies to a
//! connection's TCP socket and its `mpt` lanes, on both sides. The
//! connection's reader then fails with an I/O error (`Connection timed
//! out`), and an agent's calls waiting on it fail with `PeerUnreachable`.
//!
//! ```
//! use std::time::Duration;
//! use ferry_transport::{Endpoint, Keepalive};
//!
//! let mut endpoint = Endpoint::new("worker0", 0);
//! endpoint.keepalive = Keepalive {
//!     idle: Duration::from_secs(5),
//!     ..Keepalive::default()
//! };
//! assert!(endpoint.keepalive.validate().is_ok());
//! endpoint.keepalive = Keepalive::disabled();
//! ```

use std::os::fd::AsFd;
use std::time::Duration;

/// Keepalive and `TCP_USER_TIMEOUT` settings of a connection's TCP sockets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    /// Whether keepalive probes are sent at all.
    pub enabled: bool,
    /// Idle time before the first probe (`TCP_KEEPIDLE`), whole seconds, at least 1 s.
    pub idle: Duration,
    /// Time between probes (`TCP_KEEPINTVL`), whole seconds, at least 1 s.
    pub interval: Duration,
    /// Unanswered probes before the connection is closed (`TCP_KEEPCNT`), 1 to 127.
    pub retries: u32,
    /// How long written data may stay unacknowledged (`TCP_USER_TIMEOUT`);
    /// `Duration::ZERO` leaves the kernel's default (about 15 minutes).
    pub user_timeout: Duration,
}

/// Keepalive defaults: an idle connection to a vanished peer fails within
/// 30 s (15 s idle, then 3 probes 5 s apart), a busy one once 30 s of
/// written data stays unacknowledged.
impl Default for Keepalive {
    fn default() -> Self {
        Keepalive {
            enabled: true,
            idle: Duration::from_secs(15),
            interval: Duration::from_secs(5),
            retries: 3,
            user_timeout: Duration::from_secs(30),
        }
    }
}

/// Settings the kernel would refuse or round away.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid keepalive setting: {0}")]
pub struct KeepaliveError(String);

impl Keepalive {
    /// No keepalive probes and the kernel's default user timeout.
    pub fn disabled() -> Self {
        Keepalive {
            enabled: false,
            user_timeout: Duration::ZERO,
            ..Keepalive::default()
        }
    }

    /// Checks the bounds the kernel puts on each setting.
    pub fn validate(&self) -> Result<(), KeepaliveError> {
        let whole = |name: &str, d: Duration| {
            if d.subsec_nanos() != 0 || d.as_secs() == 0 || d.as_secs() > 32767 {
                Err(KeepaliveError(format!(
                    "{name} must be a whole number of seconds from 1 to 32767, not {d:?}"
                )))
            } else {
                Ok(())
            }
        };
        if self.enabled {
            whole("idle", self.idle)?;
            whole("interval", self.interval)?;
            if !(1..=127).contains(&self.retries) {
                return Err(KeepaliveError(format!(
                    "retries must be from 1 to 127, not {}",
                    self.retries
                )));
            }
        }
        if u32::try_from(self.user_timeout.as_millis()).is_err() {
            return Err(KeepaliveError(format!(
                "user_timeout {:?} does not fit in u32 milliseconds",
                self.user_timeout
            )));
        }
        Ok(())
    }

    /// Applies the settings to a TCP socket.
    pub fn apply(&self, socket: impl AsFd) -> std::io::Result<()> {
        use rustix::net::sockopt;
        let fd = socket.as_fd();
        self.validate()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        sockopt::set_socket_keepalive(fd, self.enabled)?;
        if self.enabled {
            sockopt::set_tcp_keepidle(fd, self.idle)?;
            sockopt::set_tcp_keepintvl(fd, self.interval)?;
            sockopt::set_tcp_keepcnt(fd, self.retries)?;
        }
        // Checked to fit by `validate`.
        let ms = u32::try_from(self.user_timeout.as_millis()).unwrap_or(u32::MAX);
        sockopt::set_tcp_user_timeout(fd, ms)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn settings_reach_the_socket() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let k = Keepalive {
            enabled: true,
            idle: Duration::from_secs(7),
            interval: Duration::from_secs(2),
            retries: 4,
            user_timeout: Duration::from_millis(9500),
        };
        k.apply(&s).unwrap();
        use rustix::net::sockopt;
        assert!(sockopt::socket_keepalive(&s).unwrap());
        assert_eq!(sockopt::tcp_keepidle(&s).unwrap(), Duration::from_secs(7));
        assert_eq!(sockopt::tcp_keepintvl(&s).unwrap(), Duration::from_secs(2));
        assert_eq!(sockopt::tcp_keepcnt(&s).unwrap(), 4);
        assert_eq!(sockopt::tcp_user_timeout(&s).unwrap(), 9500);
        Keepalive::disabled().apply(&s).unwrap();
        assert!(!sockopt::socket_keepalive(&s).unwrap());
        assert_eq!(sockopt::tcp_user_timeout(&s).unwrap(), 0);
    }

    #[test]
    fn bad_settings_are_refused_by_name() {
        let bad = |k: Keepalive| k.validate().unwrap_err().to_string();
        let d = Keepalive::default();
        assert_eq!(
            bad(Keepalive {
                idle: Duration::from_millis(1500),
                ..d
            }),
            "invalid keepalive setting: idle must be a whole number of seconds from 1 to 32767, not 1.5s"
        );
        assert!(bad(Keepalive {
            interval: Duration::ZERO,
            ..d
        })
        .contains("interval"));
        assert!(bad(Keepalive { retries: 0, ..d }).contains("retries"));
        assert!(bad(Keepalive {
            user_timeout: Duration::from_secs(u64::MAX / 2000),
            ..d
        })
        .contains("user_timeout"));
        // Disabled: the probe settings do not matter.
        assert!(Keepalive {
            retries: 0,
            ..Keepalive::disabled()
        }
        .validate()
        .is_ok());
    }
}
