//! Tensor channels this build knows, and the offers a worker makes.
//!
//! Only `inline` exists yet: tensor bytes follow the frame's payload on the
//! same connection. Faster channels (shared memory, CMA, multi-lane TCP)
//! slot in as further offers; selection picks per device pair.

use ferry_wire::{ChannelOffer, Device, DeviceOffer, TransportOffer};

use crate::TransportError;

/// The universal fallback channel: bytes follow the header on the connection.
pub const INLINE: &str = "inline";
/// The TCP transport.
pub const TCP: &str = "tcp";

/// Channels implemented in this build, highest default priority first.
pub const KNOWN_CHANNELS: &[&str] = &[INLINE];
/// Transports implemented in this build.
pub const KNOWN_TRANSPORTS: &[&str] = &[TCP];

/// The offer for one known channel with its default priority.
pub fn channel_offer(name: &str) -> Result<ChannelOffer, TransportError> {
    match name {
        INLINE => Ok(ChannelOffer {
            name: INLINE.into(),
            priority: 0,
            devices: vec![DeviceOffer {
                device: Device::Cpu,
                descriptor: "any".into(),
            }],
        }),
        other => Err(TransportError::Unknown {
            what: "channel",
            name: other.into(),
            known: KNOWN_CHANNELS.join(", "),
        }),
    }
}

/// The offer for one known transport.
pub fn transport_offer(name: &str) -> Result<TransportOffer, TransportError> {
    match name {
        TCP => Ok(TransportOffer {
            name: TCP.into(),
            priority: 0,
            descriptor: "any".into(),
        }),
        other => Err(TransportError::Unknown {
            what: "transport",
            name: other.into(),
            known: KNOWN_TRANSPORTS.join(", "),
        }),
    }
}

/// Offers for every known channel.
pub fn default_channels() -> Vec<ChannelOffer> {
    KNOWN_CHANNELS
        .iter()
        .map(|n| channel_offer(n).expect("known channel"))
        .collect()
}

/// Offers for every known transport.
pub fn default_transports() -> Vec<TransportOffer> {
    KNOWN_TRANSPORTS
        .iter()
        .map(|n| transport_offer(n).expect("known transport"))
        .collect()
}

/// Parses a comma-separated channel list (e.g. from an environment
/// variable), in the given order of preference: the first gets the highest
/// priority. Unknown names are an error listing the known ones.
pub fn parse_channels(list: &str) -> Result<Vec<ChannelOffer>, TransportError> {
    parse_list(list, channel_offer, |o, p| o.priority = p)
}

/// Parses a comma-separated transport list, like [`parse_channels`].
pub fn parse_transports(list: &str) -> Result<Vec<TransportOffer>, TransportError> {
    parse_list(list, transport_offer, |o, p| o.priority = p)
}

/// Offers for the names in `list`, prioritised by their order.
fn parse_list<T>(
    list: &str,
    offer: fn(&str) -> Result<T, TransportError>,
    set_priority: fn(&mut T, i32),
) -> Result<Vec<T>, TransportError> {
    let names: Vec<&str> = list
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let count = names.len() as i32;
    names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let mut o = offer(n)?;
            set_priority(&mut o, count - i as i32);
            Ok(o)
        })
        .collect()
}

pub(crate) fn not_implemented(name: &str) -> TransportError {
    TransportError::Unknown {
        what: "channel",
        name: name.into(),
        known: KNOWN_CHANNELS.join(", "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_names_list_the_known_ones() {
        let err = parse_channels("inline, cma").unwrap_err();
        assert_eq!(err.to_string(), "unknown channel \"cma\"; known: inline");
        let err = parse_transports("shm").unwrap_err();
        assert_eq!(err.to_string(), "unknown transport \"shm\"; known: tcp");
        assert_eq!(
            parse_channels("inline").unwrap(),
            default_channels()
                .into_iter()
                .map(|mut o| {
                    o.priority = 1;
                    o
                })
                .collect::<Vec<_>>()
        );
    }
}
