//! [`Agreement`]: what both ends of a connection compute alike from the
//! two handshakes: the transport and each direction's channel per device
//! pair.

use ferry_wire::{ChannelChoice, ChannelOffer, Handshake, PeerText, TransportOffer};

use super::Endpoint;
use crate::channel;
use crate::selection::{select_channels, select_transport};
use crate::TransportError;

/// What the two ends agreed on in the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Agreement {
    /// The peer's handshake (after a UCX fallback, its second one).
    pub peer: Handshake,
    /// The channel per device pair of the tensors this side sends.
    pub outgoing: Vec<ChannelChoice>,
    /// The channel per device pair of the tensors this side receives.
    pub incoming: Vec<ChannelChoice>,
    /// The transport the frames travel on (`tcp`, `shm` or `ucx`).
    pub transport: &'static str,
}

impl Agreement {
    /// Both directions' channels and the transport, as both ends compute them.
    ///
    /// `cma` takes part only when the frames travel on the `shm` transport:
    /// its records then arrive through rings shared with exactly the process
    /// the kernel names at the other end of the Unix socket they were passed
    /// over (`SO_PEERCRED`), and that is the only process `cma` reads from.
    /// On TCP nothing ties the sender of a record to a process, so a peer
    /// whose frames come over TCP never gets `cma`.
    pub fn compute(local: &Endpoint, peer: Handshake) -> Result<Agreement, TransportError> {
        log_same_host_ruled_out(local, &peer);
        let transport = transport_name(select_transport(&local.transports, &peer.transports));
        let mine = channels_for(&local.channels, transport);
        let theirs = channels_for(&peer.channels, transport);
        Ok(Agreement {
            outgoing: select_channels(&mine, &theirs)?,
            incoming: select_channels(&theirs, &mine)?,
            transport,
            peer,
        })
    }

    /// Whether channel `name` carries tensors in either direction.
    pub fn uses(&self, name: &str) -> bool {
        self.outgoing
            .iter()
            .chain(&self.incoming)
            .any(|c| c.channel == name)
    }

    /// Whether the set-up needs the shared-memory socket (the `shm`
    /// transport or channel).
    pub fn needs_shm(&self) -> bool {
        self.transport == channel::SHM_TRANSPORT || self.uses(channel::SHM)
    }

    /// Whether the `ucx` transport or channel is selected.
    pub fn needs_ucx(&self) -> bool {
        self.transport == channel::UCX_TRANSPORT || self.uses(channel::UCX)
    }
}

/// Logs each same-host channel or transport both ends offer whose domain
/// descriptors differ, with the typed reason ([`channel::not_same_host`]):
/// why, say, two workers in separate PID namespaces do not use `shm`.
fn log_same_host_ruled_out(local: &Endpoint, peer: &Handshake) {
    let worker = PeerText::new(&peer.worker_name);
    for name in [channel::CMA, channel::SHM] {
        let descriptor = |offers: &[ChannelOffer]| {
            offers
                .iter()
                .find(|o| o.name == name)
                .and_then(|o| {
                    o.devices
                        .iter()
                        .find(|d| d.device == ferry_wire::Device::Cpu)
                })
                .map(|d| d.descriptor.clone())
        };
        if let (Some(a), Some(b)) = (descriptor(&local.channels), descriptor(&peer.channels)) {
            if let Some(reason) = channel::not_same_host(&a, &b) {
                tracing::info!(peer = %worker, channel = name, %reason, "same-host channel ruled out");
            }
        }
    }
    let transport = |offers: &[TransportOffer]| {
        offers
            .iter()
            .find(|o| o.name == channel::SHM_TRANSPORT)
            .map(|o| o.descriptor.clone())
    };
    if let (Some(a), Some(b)) = (transport(&local.transports), transport(&peer.transports)) {
        if let Some(reason) = channel::not_same_host(&a, &b) {
            tracing::info!(peer = %worker, transport = channel::SHM_TRANSPORT, %reason, "same-host transport ruled out");
        }
    }
}

/// The channel offers that may be selected over `transport`: without the
/// `shm` transport, `cma` is left out (see [`Agreement::compute`]).
fn channels_for(offers: &[ChannelOffer], transport: &str) -> Vec<ChannelOffer> {
    offers
        .iter()
        .filter(|o| transport == channel::SHM_TRANSPORT || o.name != channel::CMA)
        .cloned()
        .collect()
}

fn transport_name(name: Option<&str>) -> &'static str {
    match name {
        Some(channel::SHM_TRANSPORT) => channel::SHM_TRANSPORT,
        #[cfg(feature = "ucx")]
        Some(channel::UCX_TRANSPORT) => channel::UCX_TRANSPORT,
        _ => channel::TCP,
    }
}
