//! The rule: which transport, and which channel per device pair, both
//! ends choose from their offers.

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;

use ferry_wire::{ChannelChoice, ChannelOffer, Device, TransportOffer};

use super::error::SelectionError;

/// One side's channel offers, indexed: name → (priority, device → descriptor).
type OfferIndex<'a> = BTreeMap<&'a str, (i32, BTreeMap<Device, &'a str>)>;

/// Indexes an offer list, rejecting duplicate channel names and devices.
fn index(offers: &[ChannelOffer]) -> Result<OfferIndex<'_>, SelectionError> {
    let mut out = OfferIndex::new();
    for offer in offers {
        let mut devices = BTreeMap::new();
        for d in &offer.devices {
            if devices.insert(d.device, d.descriptor.as_str()).is_some() {
                return Err(SelectionError::DuplicateDevice {
                    channel: offer.name.clone(),
                    device: d.device,
                });
            }
        }
        match out.entry(offer.name.as_str()) {
            Entry::Occupied(_) => {
                return Err(SelectionError::DuplicateChannel {
                    name: offer.name.clone(),
                })
            }
            Entry::Vacant(v) => {
                v.insert((offer.priority, devices));
            }
        }
    }
    Ok(out)
}

/// Whether the channel ranked (`rank`, `name`) beats the one ranked
/// (`best_rank`, `best_name`): a higher priority sum wins, then the
/// lexicographically smaller name.
fn outranks(rank: i64, name: &str, best_rank: i64, best_name: &str) -> bool {
    rank > best_rank || (rank == best_rank && name < best_name)
}

/// Chooses the transport for a connection by the channels' rule: the
/// highest summed priority among the transports both ends offer with equal
/// descriptors, ties broken by the smaller name. Symmetric, so both ends
/// compute the same. `None` when the two share no transport.
pub fn select_transport<'a>(
    local: &'a [TransportOffer],
    peer: &[TransportOffer],
) -> Option<&'a str> {
    let mut best: Option<(i64, &str)> = None;
    for l in local {
        for p in peer {
            if l.name != p.name || l.descriptor != p.descriptor {
                continue;
            }
            let rank = i64::from(l.priority) + i64::from(p.priority);
            if best.is_none_or(|(r, n)| outranks(rank, &l.name, r, n)) {
                best = Some((rank, &l.name));
            }
        }
    }
    best.map(|(_, name)| name)
}

/// Chooses, for every (source device, target device) pair, the channel that
/// carries tensors from the `sender`'s source device into the `receiver`'s
/// target device, by the rule in the [module documentation](super).
///
/// Pairs for which no channel qualifies are absent. The result is sorted by
/// (source, target) and does not depend on the order of either list.
///
/// # Errors
///
/// [`SelectionError::DuplicateChannel`] if either list names a channel twice;
/// [`SelectionError::DuplicateDevice`] if a channel offer lists a device
/// twice.
pub fn select_channels(
    sender: &[ChannelOffer],
    receiver: &[ChannelOffer],
) -> Result<Vec<ChannelChoice>, SelectionError> {
    let sender = index(sender)?;
    let receiver = index(receiver)?;
    let mut best: BTreeMap<(Device, Device), (i64, &str)> = BTreeMap::new();
    for (&name, (send_priority, send_devices)) in &sender {
        let Some((recv_priority, recv_devices)) = receiver.get(name) else {
            continue;
        };
        let rank = i64::from(*send_priority) + i64::from(*recv_priority);
        for (&source, send_descriptor) in send_devices {
            for (&target, recv_descriptor) in recv_devices {
                if send_descriptor != recv_descriptor {
                    continue;
                }
                match best.entry((source, target)) {
                    Entry::Vacant(v) => {
                        v.insert((rank, name));
                    }
                    Entry::Occupied(mut o) => {
                        let (best_rank, best_name) = *o.get();
                        if outranks(rank, name, best_rank, best_name) {
                            o.insert((rank, name));
                        }
                    }
                }
            }
        }
    }
    Ok(best
        .into_iter()
        .map(|((source, target), (_, name))| ChannelChoice {
            source,
            target,
            channel: name.to_owned(),
        })
        .collect())
}
