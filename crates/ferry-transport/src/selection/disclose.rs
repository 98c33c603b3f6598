//! What of its offers a worker shows a peer: only what the peer showed
//! already.

use ferry_wire::{ChannelOffer, TransportOffer};

/// What of `local`'s channel offers a peer that offered `peer` may see: the
/// devices whose descriptor equals one the peer gave for the same channel.
/// A descriptor names where a channel reaches (boot id, namespaces, user
/// ids), so an accepting worker reveals one only to a peer that showed it
/// already. Selection is unchanged by the filter: only equal descriptors
/// ever qualify, and priorities are kept.
pub fn disclosed_channels(local: &[ChannelOffer], peer: &[ChannelOffer]) -> Vec<ChannelOffer> {
    local
        .iter()
        .filter_map(|offer| {
            let theirs: Vec<&str> = peer
                .iter()
                .filter(|p| p.name == offer.name)
                .flat_map(|p| p.devices.iter().map(|d| d.descriptor.as_str()))
                .collect();
            let devices: Vec<_> = offer
                .devices
                .iter()
                .filter(|d| theirs.contains(&d.descriptor.as_str()))
                .cloned()
                .collect();
            (!devices.is_empty()).then(|| ChannelOffer {
                name: offer.name.clone(),
                priority: offer.priority,
                devices,
            })
        })
        .collect()
}

/// What of `local`'s transport offers a peer that offered `peer` may see:
/// those it offered too, with an equal descriptor (see
/// [`disclosed_channels`]).
pub fn disclosed_transports(
    local: &[TransportOffer],
    peer: &[TransportOffer],
) -> Vec<TransportOffer> {
    local
        .iter()
        .filter(|l| {
            peer.iter()
                .any(|p| p.name == l.name && p.descriptor == l.descriptor)
        })
        .cloned()
        .collect()
}
