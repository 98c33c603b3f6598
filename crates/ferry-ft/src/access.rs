//! Who may talk to the lighthouse and the managers. torchft's clients
//! know no shared secret, so these servers offer what a gRPC client can
//! use: TLS ([`TlsIdentity`], a certificate and key; clients then connect
//! with `https://` and trust the certificate's CA) and an allow-list of
//! client networks ([`AllowList`]; a connection from elsewhere is closed
//! before a byte of it is read, with a warning naming its address, rate-
//! limited: at most one line every 10 s per server, counting the others).
//! Ferry's own clients of those servers (the rank's
//! [`ManagerClient`](crate::manager::ManagerClient), the manager's client
//! to the lighthouse) connect over TLS with a [`ClientTls`]: the CA
//! certificate to trust and, optionally, the name the server's
//! certificate must carry.
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

use ferry_transport::accept::RefusalWarnings;
use futures::stream::Stream;
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig};

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

/// The environment variable naming the PEM file of the CA certificate
/// Ferry's gRPC clients trust (see [`ClientTls::from_env`]).
pub const TLS_CA_ENV: &str = "FERRY_FT_TLS_CA";
/// The environment variable naming the server name to check the server's
/// certificate against (see [`ClientTls::from_env`]).
pub const TLS_DOMAIN_ENV: &str = "FERRY_FT_TLS_DOMAIN";

/// What a Ferry gRPC client trusts when it connects over TLS to a
/// lighthouse or manager serving with a [`TlsIdentity`]: the CA
/// certificate that signed the server's (the system's roots are not
/// consulted), and the name the certificate must carry when it is not the
/// address's host (e.g. `localhost` for `https://127.0.0.1:29510`).
///
/// ```
/// use ferry_ft::access::ClientTls;
///
/// # let ca_pem = Vec::new();
/// let tls = ClientTls::new(ca_pem).with_domain("lighthouse.internal");
/// assert_eq!(tls.domain.as_deref(), Some("lighthouse.internal"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientTls {
    /// The CA certificate(s) to trust (PEM).
    pub ca_pem: Vec<u8>,
    /// The name to check the server's certificate against (`None`: the
    /// address's host).
    pub domain: Option<String>,
}

impl ClientTls {
    /// Trusts the CA certificate(s) in `ca_pem`.
    pub fn new(ca_pem: impl Into<Vec<u8>>) -> Self {
        ClientTls {
            ca_pem: ca_pem.into(),
            domain: None,
        }
    }

    /// Sets [`domain`](Self::domain).
    pub fn with_domain(mut self, domain: impl Into<String>) -> Self {
        self.domain = Some(domain.into());
        self
    }

    /// Trusts the CA certificate(s) in the PEM file `ca`.
    pub fn from_file(ca: &Path) -> Result<Self, AccessError> {
        let ca_pem = std::fs::read(ca).map_err(|source| AccessError::Read {
            path: ca.display().to_string(),
            source,
        })?;
        Ok(ClientTls::new(ca_pem))
    }

    /// From the environment: the CA file named by `FERRY_FT_TLS_CA` and
    /// the name in `FERRY_FT_TLS_DOMAIN` (optional); `None` without
    /// `FERRY_FT_TLS_CA` (plain text, torchft's default).
    pub fn from_env() -> Result<Option<Self>, AccessError> {
        let Some(ca) = std::env::var_os(TLS_CA_ENV).filter(|v| !v.is_empty()) else {
            return Ok(None);
        };
        let mut tls = ClientTls::from_file(Path::new(&ca))?;
        if let Some(domain) = std::env::var(TLS_DOMAIN_ENV).ok().filter(|d| !d.is_empty()) {
            tls = tls.with_domain(domain);
        }
        Ok(Some(tls))
    }

    fn config(&self) -> ClientTlsConfig {
        let config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.ca_pem));
        match &self.domain {
            Some(d) => config.domain_name(d.clone()),
            None => config,
        }
    }
}

/// Why a client endpoint could not be made from an address.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// Not a URI tonic takes.
    #[error("not a valid address: {0}")]
    Invalid(#[source] tonic::transport::Error),
    /// An `https://` address, but no CA certificate to trust was given.
    #[error("an https:// address needs a CA certificate to trust (ClientTls, or {TLS_CA_ENV})")]
    HttpsWithoutTls,
    /// A CA certificate was given for a plain `http://` address.
    #[error("TLS is configured but the address is plain http:// (use https:// or host:port)")]
    TlsOverHttp,
    /// tonic refused the TLS configuration.
    #[error("TLS configuration refused: {0}")]
    Tls(#[source] tonic::transport::Error),
}

/// A client endpoint for `address`: over TLS trusting `tls` when given
/// (`host:port` then means `https://host:port`), plain text otherwise
/// (`host:port` means `http://host:port`). The URI the endpoint uses is
/// returned with it.
pub(crate) fn client_endpoint(
    address: &str,
    tls: Option<&ClientTls>,
) -> Result<(Endpoint, String), EndpointError> {
    let uri = match (address.split_once("://"), tls) {
        (None, Some(_)) => format!("https://{address}"),
        (None, None) => format!("http://{address}"),
        (Some((scheme, _)), Some(_)) if scheme.eq_ignore_ascii_case("http") => {
            return Err(EndpointError::TlsOverHttp)
        }
        (Some((scheme, _)), None) if scheme.eq_ignore_ascii_case("https") => {
            return Err(EndpointError::HttpsWithoutTls)
        }
        (Some(_), _) => address.to_owned(),
    };
    let endpoint = Endpoint::from_shared(uri.clone()).map_err(EndpointError::Invalid)?;
    let endpoint = match tls {
        Some(t) => endpoint
            .tls_config(t.config())
            .map_err(EndpointError::Tls)?,
        None => endpoint,
    };
    Ok((endpoint, uri))
}

/// The TLS failure in `error`'s chain (an untrusted certificate, a name
/// that does not match, a peer that does not speak TLS), as rustls words
/// it; `None` when the error is not about TLS.
pub(crate) fn tls_failure(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(tls.to_string());
        }
        // An `io::Error` hides the error it wraps from `source()`.
        if let Some(inner) = e.downcast_ref::<io::Error>().and_then(|io| io.get_ref()) {
            if let Some(tls) = inner.downcast_ref::<rustls::Error>() {
                return Some(tls.to_string());
            }
        }
        next = e.source();
    }
    None
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
    /// server (`what`) and the client's address. The warnings are
    /// rate-limited ([`RefusalWarnings`]): the first at once, then at most
    /// one line every 10 s counting the refusals since the last (the rest
    /// when the stream is dropped), so an outsider opening thousands of
    /// connections cannot flood the log.
    pub(crate) fn incoming(
        &self,
        listener: TcpListener,
        what: &'static str,
    ) -> impl Stream<Item = io::Result<TcpStream>> + Send + 'static {
        let allow = self.allow.clone();
        let refusals = RefusalWarnings::new(what, "refused a client outside the allowed networks");
        futures::stream::unfold(
            (listener, allow, refusals),
            move |(listener, allow, refusals)| async move {
                loop {
                    let accepted: io::Result<(TcpStream, SocketAddr)> = listener.accept().await;
                    match accepted {
                        Ok((stream, peer)) if allow.allows(peer.ip()) => {
                            let _ = stream.set_nodelay(true);
                            return Some((Ok(stream), (listener, allow, refusals)));
                        }
                        Ok((stream, peer)) => {
                            drop(stream);
                            refusals.refused(peer, "not in the allowed networks");
                        }
                        Err(e) => return Some((Err(e), (listener, allow, refusals))),
                    }
                }
            },
        )
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

    #[test]
    fn client_addresses_take_the_scheme_tls_asks_for() {
        let uri = |a: &str, tls: Option<&ClientTls>| client_endpoint(a, tls).map(|(_, u)| u);
        let tls = ClientTls::new(Vec::new());
        assert_eq!(uri("host:1", None).unwrap(), "http://host:1");
        assert_eq!(uri("http://host:1", None).unwrap(), "http://host:1");
        assert_eq!(uri("host:1", Some(&tls)).unwrap(), "https://host:1");
        assert_eq!(uri("https://host:1", Some(&tls)).unwrap(), "https://host:1");
        assert!(matches!(
            uri("https://host:1", None),
            Err(EndpointError::HttpsWithoutTls)
        ));
        assert!(matches!(
            uri("HTTP://host:1", Some(&tls)),
            Err(EndpointError::TlsOverHttp)
        ));
        assert!(matches!(
            uri("http://ho st:1", None),
            Err(EndpointError::Invalid(_))
        ));
    }
}
