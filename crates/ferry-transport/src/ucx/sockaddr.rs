//! Socket addresses in the C layout UCX's connection manager reads and
//! writes (`struct sockaddr_in`/`sockaddr_in6` inside a
//! `sockaddr_storage`), for its listener and client-server endpoints.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use super::sys;

/// A socket address in C's layout, owned, for UCX to read.
pub(crate) struct RawSockAddr {
    storage: libc::sockaddr_storage,
    len: libc::socklen_t,
}

impl RawSockAddr {
    /// `addr` in C's layout.
    pub(crate) fn new(addr: SocketAddr) -> Self {
        // SAFETY: all zeroes is a valid `sockaddr_storage`.
        let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let len = match addr {
            SocketAddr::V4(a) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from_ne_bytes(a.ip().octets()),
                    },
                    sin_zero: [0; 8],
                };
                // SAFETY: `sockaddr_storage` is larger than and aligned for
                // every socket address type.
                unsafe { std::ptr::write((&raw mut storage).cast(), sin) };
                std::mem::size_of::<libc::sockaddr_in>()
            }
            SocketAddr::V6(a) => {
                let sin6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: a.port().to_be(),
                    sin6_flowinfo: a.flowinfo(),
                    sin6_addr: libc::in6_addr {
                        s6_addr: a.ip().octets(),
                    },
                    sin6_scope_id: a.scope_id(),
                };
                // SAFETY: as above.
                unsafe { std::ptr::write((&raw mut storage).cast(), sin6) };
                std::mem::size_of::<libc::sockaddr_in6>()
            }
        };
        RawSockAddr {
            storage,
            len: len as libc::socklen_t,
        }
    }

    /// The address as UCX takes it; valid while `self` is.
    pub(crate) fn as_ucs(&self) -> sys::ucs_sock_addr_t {
        sys::ucs_sock_addr_t {
            addr: (&raw const self.storage).cast(),
            addrlen: self.len,
        }
    }
}

/// The address in a `sockaddr_storage` UCX filled, or `None` for a family
/// other than IPv4 and IPv6.
///
/// # Safety
///
/// `storage` points to a `struct sockaddr_storage` (UCX's
/// `ucp_listener_attr_t::sockaddr` or `ucp_conn_request_attr_t::client_address`).
pub(crate) unsafe fn parse(storage: *const sys::sockaddr_storage) -> Option<SocketAddr> {
    // SAFETY: the caller's promise; `sockaddr_storage` has the same layout
    // in UCX's bindings and in libc (the platform's).
    let storage = unsafe { &*storage.cast::<libc::sockaddr_storage>() };
    match i32::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: a `sockaddr_storage` of family AF_INET holds a
            // `sockaddr_in`, and is aligned for it.
            let sin =
                unsafe { &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()),
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, for AF_INET6 and `sockaddr_in6`.
            let sin6 = unsafe {
                &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
            };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

    use proptest::prelude::*;

    use super::{parse, RawSockAddr};

    fn round_trip(addr: SocketAddr) -> Option<SocketAddr> {
        let raw = RawSockAddr::new(addr);
        let ucs = raw.as_ucs();
        // SAFETY: points into `raw`, a `sockaddr_storage`, alive here.
        unsafe { parse(ucs.addr.cast()) }
    }

    proptest! {
        #[test]
        fn an_ipv4_address_comes_back_as_it_went(ip: [u8; 4], port: u16) {
            let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::from(ip)), port);
            prop_assert_eq!(round_trip(addr), Some(addr));
            prop_assert_eq!(RawSockAddr::new(addr).as_ucs().addrlen as usize, std::mem::size_of::<libc::sockaddr_in>());
        }

        #[test]
        fn an_ipv6_address_comes_back_as_it_went(ip: [u8; 16], port: u16, flow: u32, scope: u32) {
            let addr = SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(ip), port, flow, scope));
            prop_assert_eq!(round_trip(addr), Some(addr));
        }
    }

    #[test]
    fn the_port_is_in_network_byte_order() {
        let raw = RawSockAddr::new("127.0.0.1:4660".parse().unwrap());
        // SAFETY: points into `raw`, which holds a `sockaddr_in`.
        let sin = unsafe { &*raw.as_ucs().addr.cast::<libc::sockaddr_in>() };
        assert_eq!(sin.sin_port.to_ne_bytes(), [0x12, 0x34]);
        assert_eq!(sin.sin_addr.s_addr.to_ne_bytes(), [127, 0, 0, 1]);
    }

    #[test]
    fn another_family_is_none() {
        // SAFETY: all zeroes is a valid `sockaddr_storage`.
        let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        storage.ss_family = libc::AF_UNIX as libc::sa_family_t;
        // SAFETY: a `sockaddr_storage`, alive here.
        assert_eq!(unsafe { parse((&raw const storage).cast()) }, None);
    }
}
