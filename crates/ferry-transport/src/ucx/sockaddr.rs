//! Socket addresses as UCX's connection manager reads and writes them
//! (`ucs_sock_addr_t`, and a `struct sockaddr_storage` it fills), for its
//! listener and client-server endpoints. The C layout is `socket2`'s.

use std::net::SocketAddr;

use socket2::SockAddr;

use super::sys;

/// The address as UCX takes it (`addr` in C's layout is
/// `SockAddr::from`'s); valid while `addr` is.
pub(crate) fn as_ucs(addr: &SockAddr) -> sys::ucs_sock_addr_t {
    sys::ucs_sock_addr_t {
        addr: addr.as_ptr().cast(),
        addrlen: addr.len(),
    }
}

// The bindings' `sockaddr_storage` is the platform's, which socket2 uses.
const _: () = assert!(
    std::mem::size_of::<sys::sockaddr_storage>() == std::mem::size_of::<libc::sockaddr_storage>()
);

/// The address in a `sockaddr_storage` UCX filled, or `None` for a family
/// other than IPv4 and IPv6.
///
/// # Safety
///
/// `storage` points to a `struct sockaddr_storage` (UCX's
/// `ucp_listener_attr_t::sockaddr` or `ucp_conn_request_attr_t::client_address`).
pub(crate) unsafe fn parse(storage: *const sys::sockaddr_storage) -> Option<SocketAddr> {
    // SAFETY: socket2 hands over a zeroed storage of the platform's size,
    // the same as `sys::sockaddr_storage` (asserted above); the caller
    // promises `storage` is one, and its family says how much is valid.
    let (_, addr) = unsafe {
        SockAddr::try_init(|out, _len| {
            std::ptr::copy_nonoverlapping(
                storage.cast::<u8>(),
                out.cast::<u8>(),
                std::mem::size_of::<sys::sockaddr_storage>(),
            );
            Ok(())
        })
    }
    .ok()?;
    addr.as_socket()
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

    use proptest::prelude::*;

    use socket2::SockAddr;

    use super::{as_ucs, parse};

    fn round_trip(addr: SocketAddr) -> Option<SocketAddr> {
        let raw = SockAddr::from(addr);
        let ucs = as_ucs(&raw);
        // SAFETY: points into `raw`, a `sockaddr_storage`, alive here.
        unsafe { parse(ucs.addr.cast()) }
    }

    proptest! {
        #[test]
        fn an_ipv4_address_comes_back_as_it_went(ip: [u8; 4], port: u16) {
            let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::from(ip)), port);
            prop_assert_eq!(round_trip(addr), Some(addr));
            prop_assert_eq!(as_ucs(&SockAddr::from(addr)).addrlen as usize, std::mem::size_of::<libc::sockaddr_in>());
        }

        #[test]
        fn an_ipv6_address_comes_back_as_it_went(ip: [u8; 16], port: u16, flow: u32, scope: u32) {
            let addr = SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(ip), port, flow, scope));
            prop_assert_eq!(round_trip(addr), Some(addr));
        }
    }

    #[test]
    fn the_port_is_in_network_byte_order() {
        let raw = SockAddr::from("127.0.0.1:4660".parse::<SocketAddr>().unwrap());
        // SAFETY: points into `raw`, which holds a `sockaddr_in`.
        let sin = unsafe { &*as_ucs(&raw).addr.cast::<libc::sockaddr_in>() };
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
