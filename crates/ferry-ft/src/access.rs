//! Who may talk to the lighthouse and the managers. torchft's clients
//! know no shared secret, so these servers offer what a gRPC client can
//! use: TLS ([`TlsIdentity`], a certificate and key; clients then connect
//! with `https://` and trust the certificate's CA) and an allow-list of
//! client networks ([`AllowList`]; a connection from elsewhere is closed
//! before a byte of it is read, with a warning naming its address).
//!
//! ```
//! use ferry_ft::access::{Access, AllowList};
//!
//! let allow: AllowList = "10.0.0.0/8,127.0.0.1/32".parse()?;
//! assert!(allow.allows("10.1.2.3".parse()?));
//! assert!(!allow.allows("192.168.0.1".parse()?));
//! let access = Access::default().with_allow(allow);
//! assert!(access.tls.is_none());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::str::FromStr;

use futures::stream::Stream;
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tracing::warn;

/// Why an allow-list or TLS material was refused.
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    /// Not `ADDRESS/PREFIX` (or a bare address) with a prefix that fits.
    #[error("{0:?} is not a network (ADDRESS/PREFIX, e.g. 10.0.0.0/8 or fd00::/8)")]
    BadNetwork(String),
    /// A certificate or key file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: io::Error,
    },
    /// tonic refused the TLS configuration.
    #[error("TLS configuration refused: {0}")]
    Tls(#[from] tonic::transport::Error),
}

/// One client network: an address and a prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Network {
    addr: IpAddr,
    prefix: u8,
}

impl Network {
    /// Whether `ip` lies in this network (an IPv4-mapped IPv6 address
    /// counts as its IPv4 address).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl FromStr for Network {
    type Err = AccessError;

    fn from_str(s: &str) -> Result<Self, AccessError> {
        let bad = || AccessError::BadNetwork(s.to_owned());
        let (addr, prefix) = match s.trim().split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s.trim(), None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| bad())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p.parse::<u8>().map_err(|_| bad())?,
            None => max,
        };
        if prefix > max {
            return Err(bad());
        }
        Ok(Network { addr, prefix })
    }
}

impl fmt::Display for Network {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// The client networks a server accepts; empty: every client.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowList(Vec<Network>);

impl AllowList {
    /// Accepts clients from `networks` only (empty: everyone).
    pub fn new(networks: Vec<Network>) -> Self {
        AllowList(networks)
    }

    /// Whether a client at `ip` is accepted.
    pub fn allows(&self, ip: IpAddr) -> bool {
        self.0.is_empty() || self.0.iter().any(|n| n.contains(ip))
    }

    /// The networks (empty: everyone).
    pub fn networks(&self) -> &[Network] {
        &self.0
    }
}

impl FromStr for AllowList {
    type Err = AccessError;

    /// Comma-separated networks, e.g. `10.0.0.0/8,127.0.0.1`.
    fn from_str(s: &str) -> Result<Self, AccessError> {
        s.split(',')
            .filter(|p| !p.trim().is_empty())
            .map(Network::from_str)
            .collect::<Result<Vec<_>, _>>()
            .map(AllowList)
    }
}

/// A server's TLS certificate chain and private key, in PEM. Its `Debug`
/// does not show the key.
#[derive(Clone, PartialEq, Eq)]
pub struct TlsIdentity {
    /// The certificate chain (PEM).
    pub cert_pem: Vec<u8>,
    /// The private key (PEM).
    pub key_pem: Vec<u8>,
}

impl TlsIdentity {
    /// Reads the certificate chain and key from PEM files.
    pub fn from_files(cert: &Path, key: &Path) -> Result<Self, AccessError> {
        let read = |p: &Path| {
            std::fs::read(p).map_err(|source| AccessError::Read {
                path: p.display().to_string(),
                source,
            })
        };
        Ok(TlsIdentity {
            cert_pem: read(cert)?,
            key_pem: read(key)?,
        })
    }
}

impl fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsIdentity")
            .field("cert_pem", &format_args!("{} bytes", self.cert_pem.len()))
            .finish_non_exhaustive()
    }
}

/// Who may talk to a server: TLS, and the client networks allowed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Access {
    /// Serve over TLS with this identity (`None`: plain text, torchft's
    /// default).
    pub tls: Option<TlsIdentity>,
    /// The client networks accepted (empty: every one).
    pub allow: AllowList,
}

impl Access {
    /// Sets [`tls`](Self::tls).
    pub fn with_tls(mut self, tls: TlsIdentity) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Sets [`allow`](Self::allow).
    pub fn with_allow(mut self, allow: AllowList) -> Self {
        self.allow = allow;
        self
    }

    /// A server builder that serves over TLS when [`tls`](Self::tls) is set.
    pub(crate) fn server(&self) -> Result<Server, AccessError> {
        let builder = Server::builder();
        Ok(match &self.tls {
            Some(t) => builder.tls_config(
                ServerTlsConfig::new().identity(Identity::from_pem(&t.cert_pem, &t.key_pem)),
            )?,
            None => builder,
        })
    }

    /// The connections of `listener` from allowed clients, with
    /// `TCP_NODELAY`; others are closed unread with a warning naming the
    /// server (`what`) and the client's address.
    pub(crate) fn incoming(
        &self,
        listener: TcpListener,
        what: &'static str,
    ) -> impl Stream<Item = io::Result<TcpStream>> + Send + 'static {
        let allow = self.allow.clone();
        futures::stream::unfold((listener, allow), move |(listener, allow)| async move {
            loop {
                let accepted: io::Result<(TcpStream, SocketAddr)> = listener.accept().await;
                match accepted {
                    Ok((stream, peer)) if allow.allows(peer.ip()) => {
                        let _ = stream.set_nodelay(true);
                        return Some((Ok(stream), (listener, allow)));
                    }
                    Ok((_, peer)) => {
                        warn!(server = what, %peer, "refused a client outside the allowed networks");
                    }
                    Err(e) => return Some((Err(e), (listener, allow))),
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn networks_parse_and_contain_what_they_should() {
        let n: Network = "10.0.0.0/8".parse().unwrap();
        assert!(n.contains("10.255.0.1".parse().unwrap()));
        assert!(!n.contains("11.0.0.1".parse().unwrap()));
        assert!(n.contains("::ffff:10.0.0.1".parse().unwrap()));
        let all: Network = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("203.0.113.9".parse().unwrap()));
        assert!(!all.contains("::1".parse().unwrap()));
        let one: Network = "fd00::1".parse().unwrap();
        assert!(one.contains("fd00::1".parse().unwrap()));
        assert!(!one.contains("fd00::2".parse().unwrap()));
        for bad in ["10.0.0.0/33", "::/129", "host/8", "10.0.0.0/x", ""] {
            assert!(bad.parse::<Network>().is_err(), "{bad}");
        }
        assert!(AllowList::default().allows("192.0.2.1".parse().unwrap()));
        let list: AllowList = "127.0.0.1, fd00::/8".parse().unwrap();
        assert!(list.allows("127.0.0.1".parse().unwrap()));
        assert!(!list.allows("127.0.0.2".parse().unwrap()));
        assert_eq!(list.networks()[1].to_string(), "fd00::/8");
    }
}
