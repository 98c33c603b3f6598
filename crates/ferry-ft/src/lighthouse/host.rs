//! Which `Host` names the dashboard answers to: its guard against DNS
//! rebinding.
//!
//! A page of another site cannot read the dashboard, or the kill token in
//! it, while the browser sends that page's requests to the other site's
//! name. DNS rebinding gets past this: the other site's name is made to
//! resolve to the lighthouse's address, and the page then reads the
//! dashboard as if it were its own origin (and its `Origin` matches its
//! `Host`). Its requests still carry the other site's name in `Host`,
//! so the dashboard answers only names that are its own
//! ([`DashboardHosts`]).
//!
//! An IP address in `Host` cannot be rebound (the browser connects to the
//! address it names), so every IP address is answered, on any port: the
//! bound address, loopback, the machine's other addresses when bound to
//! `0.0.0.0` or `[::]`. Names are answered on any port too (a port forward
//! changes the port, not whose name it is): `localhost`, the machine's host
//! name, and the names the operator adds
//! ([`LighthouseOptions::allowed_hosts`](super::LighthouseOptions::allowed_hosts)).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Longest part of a refused `Host` value repeated in a refusal.
const SHOWN_CHARS: usize = 200;

/// A host name or IP address, as `Host` carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HostName {
    /// An IP address (IPv6 without its brackets).
    Ip(IpAddr),
    /// A name: ASCII, lower case, without a trailing dot.
    Dns(String),
}

/// `host[:port]` (RFC 9110's `Host`, or an URI's authority without user
/// information) split into the host and the port. The reason when it is
/// not one.
fn parse_authority(text: &str) -> Result<(HostName, Option<u16>), &'static str> {
    if text.is_empty() {
        return Err("empty");
    }
    let (host, port) = if let Some(rest) = text.strip_prefix('[') {
        let (inside, after) = rest
            .split_once(']')
            .ok_or("an IPv6 address without its closing `]`")?;
        let ip: Ipv6Addr = inside
            .parse()
            .map_err(|_| "not an IPv6 address between `[` and `]`")?;
        let port = match after {
            "" => None,
            _ => Some(
                after
                    .strip_prefix(':')
                    .ok_or("text after the IPv6 address's `]`")?,
            ),
        };
        (HostName::Ip(IpAddr::V6(ip)), port)
    } else {
        let (host, port) = match text.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (text, None),
        };
        let host = match host.parse::<Ipv4Addr>() {
            Ok(ip) => HostName::Ip(IpAddr::V4(ip)),
            Err(_) => HostName::Dns(dns_name(host)?),
        };
        (host, port)
    };
    let port = match port {
        None => None,
        Some(port) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => {
            Some(port.parse().map_err(|_| "a port over 65535")?)
        }
        // Also a bare IPv6 address: `::1`, `fe80::1`.
        Some(_) => return Err("a port that is not a number"),
    };
    Ok((host, port))
}

/// `name` as compared: lower case, without its trailing dot. The reason
/// when it cannot be a host name.
fn dns_name(name: &str) -> Result<String, &'static str> {
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() {
        return Err("no host name");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
    {
        return Err("characters a host name cannot have");
    }
    Ok(name.to_ascii_lowercase())
}

/// Why the dashboard refused a request's host.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum HostRefused {
    /// Neither a `Host` header nor an authority in the request's URI.
    #[error("the request names no host (no `Host` header)")]
    Missing,
    /// Several `Host` headers.
    #[error("the request has several `Host` headers")]
    Several,
    /// `Host` is not `host[:port]`.
    #[error("refused host {host:?}: {reason}")]
    Malformed {
        /// The `Host` value (its first 200 characters).
        host: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A name that is not the lighthouse's.
    #[error(
        "refused host {host:?}: not a name of this lighthouse (its operator can add one \
         with --allowed-host)"
    )]
    Foreign {
        /// The `Host` value (its first 200 characters).
        host: String,
    },
}

/// What an `allowed_hosts` entry that is not `NAME`, `NAME:PORT`, an IP
/// address or `IP:PORT` is refused with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("allowed host {entry:?} is not NAME or NAME:PORT: {reason}")]
pub struct BadAllowedHost {
    /// The entry as given.
    pub entry: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// The names the dashboard answers to (see the module's documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DashboardHosts {
    /// Names answered on the given port, or on any port when `None`.
    names: Vec<(String, Option<u16>)>,
}

impl DashboardHosts {
    /// `localhost`, `machine_hostname` (when known) and the operator's
    /// `allowed` entries (`NAME` for any port, `NAME:PORT` for one).
    pub(crate) fn new(
        machine_hostname: Option<&str>,
        allowed: &[String],
    ) -> Result<Self, BadAllowedHost> {
        let mut names = vec![("localhost".to_owned(), None)];
        if let Some(Ok(name)) = machine_hostname.map(dns_name) {
            names.push((name, None));
        }
        for entry in allowed {
            let bad = |reason| BadAllowedHost {
                entry: entry.clone(),
                reason,
            };
            match parse_authority(entry.trim()).map_err(bad)? {
                // Every IP address is answered already.
                (HostName::Ip(_), _) => {}
                (HostName::Dns(name), port) => names.push((name, port)),
            }
        }
        Ok(Self { names })
    }

    /// Whether a request whose `Host` header is `host` and whose URI's
    /// authority (HTTP/2's `:authority`, or an absolute-form HTTP/1
    /// target) is `authority` is for the dashboard: each of them that is
    /// there names it, and one of them is there.
    pub(crate) fn check(
        &self,
        host: Option<&str>,
        authority: Option<&str>,
    ) -> Result<(), HostRefused> {
        if host.is_none() && authority.is_none() {
            return Err(HostRefused::Missing);
        }
        for given in host.into_iter().chain(authority) {
            self.check_one(given)?;
        }
        Ok(())
    }

    fn check_one(&self, given: &str) -> Result<(), HostRefused> {
        let shown = || given.chars().take(SHOWN_CHARS).collect::<String>();
        let (name, port) = parse_authority(given).map_err(|reason| HostRefused::Malformed {
            host: shown(),
            reason,
        })?;
        let ours = match name {
            HostName::Ip(_) => true,
            HostName::Dns(name) => self.names.iter().any(|(allowed, allowed_port)| {
                *allowed == name && allowed_port.is_none_or(|p| Some(p) == port)
            }),
        };
        if ours {
            Ok(())
        } else {
            Err(HostRefused::Foreign { host: shown() })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(allowed: &[&str]) -> DashboardHosts {
        let allowed: Vec<String> = allowed.iter().map(|s| (*s).to_owned()).collect();
        DashboardHosts::new(Some("Node-7"), &allowed).expect("valid entries")
    }

    fn ok(hosts: &DashboardHosts, host: &str) -> bool {
        hosts.check(Some(host), None).is_ok()
    }

    #[test]
    fn ip_addresses_are_answered_on_any_port() {
        let h = hosts(&[]);
        for host in [
            "127.0.0.1:29510",
            "127.0.0.1",
            "10.1.2.3:8080",
            "0.0.0.0:1",
            "[::1]:29510",
            "[::1]",
            "[0:0:0:0:0:0:0:1]:29510",
            "[fe80::1]:80",
            "[::ffff:127.0.0.1]:5",
        ] {
            assert!(ok(&h, host), "{host}");
        }
    }

    #[test]
    fn loopback_and_machine_names_any_case() {
        let h = hosts(&[]);
        for host in [
            "localhost:29510",
            "LOCALHOST:29510",
            "localhost",
            "localhost.:29510",
            "node-7:29510",
            "NODE-7",
            "Node-7:1",
        ] {
            assert!(ok(&h, host), "{host}");
        }
        // Names that only look like them.
        for host in [
            "localhost.evil.example:29510",
            "evil-localhost:29510",
            "node-7.evil.example:29510",
            "node-77:29510",
        ] {
            assert_eq!(
                h.check(Some(host), None),
                Err(HostRefused::Foreign {
                    host: host.to_owned()
                }),
                "{host}"
            );
        }
    }

    #[test]
    fn rebound_names_are_refused() {
        let h = hosts(&[]);
        let refused = h.check(Some("evil.example:29510"), None).unwrap_err();
        assert!(
            refused.to_string().contains("evil.example:29510"),
            "{refused}"
        );
        assert!(refused.to_string().contains("--allowed-host"), "{refused}");
        assert!(!ok(&h, "evil.example"));
        // Without a known machine name, only localhost and IP addresses.
        let bare = DashboardHosts::new(None, &[]).unwrap();
        assert!(!ok(&bare, "node-7:29510"));
        assert!(ok(&bare, "localhost:29510"));
    }

    #[test]
    fn configured_names_with_and_without_port() {
        let h = hosts(&["Dash.Example", "proxy.example:8080", " spaced.example "]);
        assert!(ok(&h, "dash.example:29510"));
        assert!(ok(&h, "DASH.EXAMPLE"));
        assert!(ok(&h, "dash.example.:1"));
        assert!(ok(&h, "proxy.example:8080"));
        assert!(!ok(&h, "proxy.example:8081"));
        assert!(!ok(&h, "proxy.example"));
        assert!(ok(&h, "spaced.example:1"));
        assert!(!ok(&h, "sub.dash.example:29510"));
        // IP entries add nothing (every IP address is answered) but are valid.
        assert!(DashboardHosts::new(None, &["10.0.0.1:80".to_owned(), "[::1]".to_owned()]).is_ok());
    }

    #[test]
    fn bad_entries_are_refused() {
        for entry in [
            "", "a b", "x:", "x:port", "x:70000", "::1", "[::1", "[::1]x", "[nope]", "http://x",
            "x/y", "u@x",
        ] {
            let error = DashboardHosts::new(None, &[entry.to_owned()]).unwrap_err();
            assert_eq!(error.entry, entry);
            assert!(error.to_string().contains("NAME:PORT"), "{error}");
        }
    }

    #[test]
    fn malformed_or_missing_host_is_refused() {
        let h = hosts(&[]);
        assert_eq!(h.check(None, None), Err(HostRefused::Missing));
        for host in [
            "",
            "::1",
            "[::1",
            "[::1]:x",
            "localhost:",
            "localhost:+80",
            "localhost:65536",
            "localhost:80:80",
            "evil.example@localhost:80",
            "localhost/x",
            "lоcalhost",
        ] {
            assert!(
                matches!(
                    h.check(Some(host), None),
                    Err(HostRefused::Malformed { .. })
                ),
                "{host}"
            );
        }
        assert!(ok(&h, "localhost:65535"));
        assert!(ok(&h, "localhost:0"));
    }

    #[test]
    fn uri_authority_is_checked_too() {
        let h = hosts(&[]);
        // HTTP/2: only `:authority`.
        assert!(h.check(None, Some("127.0.0.1:29510")).is_ok());
        assert!(h.check(None, Some("evil.example:29510")).is_err());
        // Both: each must be ours.
        assert!(h.check(Some("localhost:1"), Some("127.0.0.1:1")).is_ok());
        assert!(h
            .check(Some("localhost:1"), Some("evil.example:1"))
            .is_err());
        assert!(h
            .check(Some("evil.example:1"), Some("localhost:1"))
            .is_err());
    }

    #[test]
    fn a_long_host_is_shown_shortened() {
        let h = hosts(&[]);
        let long = "a".repeat(1000);
        let Err(HostRefused::Foreign { host }) = h.check(Some(&long), None) else {
            panic!("refused as foreign");
        };
        assert_eq!(host.len(), SHOWN_CHARS);
    }
}
