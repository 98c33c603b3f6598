//! Per-device-pair channel selection, computed alike by both ends.
//!
//! Each worker's [`Handshake`](ferry_wire::Handshake) lists the tensor
//! channels it offers ([`ChannelOffer`]): a name, a priority, and for every
//! local device the channel serves, a *domain descriptor*. For one direction
//! of a connection (sender → receiver), [`select_channels`] picks, for every
//! (source device, target device) pair, the channel that carries tensors
//! from the sender's `source` device into the receiver's `target` device.
//!
//! # The rule (TensorPipe's)
//!
//! A channel *qualifies* for the pair (`source`, `target`) when
//!
//! 1. both sides offer a channel of that name,
//! 2. the sender offers it for `source` and the receiver offers it for
//!    `target`, and
//! 3. the two device descriptors are equal (the domain-descriptor rule: e.g.
//!    a same-host channel puts the boot id and namespace in its descriptor, so
//!    it only connects processes that share them).
//!
//! Among the qualifying channels the best-ranked one is chosen. The rank of a
//! channel is the **sum of the priorities both sides gave it** (computed
//! without overflow), higher first; equal sums are broken by the channel
//! **name, lexicographically smallest first**. The sum is symmetric, so the
//! two ends compute the same choice even when they list different priorities
//! for the same channel, and the choice for (`source`, `target`) when `A`
//! sends to `B` is the choice for (`target`, `source`) when `B` sends to `A`
//! with the roles swapped.
//!
//! A pair for which no channel qualifies is absent from the result; looking
//! it up with [`Selection::channel_for`] gives [`SelectionError::NoChannel`].
//! The result is sorted by (source, target) and does not depend on the order
//! of the offer lists.
//!
//! Both ends of a connection compute the selection for each direction; the
//! accepting side sends its result in its handshake reply and the connecting
//! side checks it with [`verify`], so a disagreement (a different build, a
//! different rule) fails the connection instead of corrupting tensors.
//!
//! ```
//! use ferry_transport::selection::{select_channels, Selection};
//! use ferry_wire::{ChannelOffer, Device, DeviceOffer};
//!
//! let offer = |name: &str, priority: i32, descriptor: &str| ChannelOffer {
//!     name: name.into(),
//!     priority,
//!     devices: vec![DeviceOffer { device: Device::Cpu, descriptor: descriptor.into() }],
//! };
//! // Both workers offer a same-host channel and `inline`, but they run on
//! // different hosts: the same-host channel's descriptors differ.
//! let sender = [offer("shm", 20, "boot-A"), offer("inline", 0, "any")];
//! let receiver = [offer("shm", 20, "boot-B"), offer("inline", 0, "any")];
//! let selection = Selection::new(select_channels(&sender, &receiver)?);
//! assert_eq!(selection.channel_for(Device::Cpu, Device::Cpu)?, "inline");
//! assert!(selection.channel_for(Device::Cpu, Device::Cuda(0)).is_err());
//! # Ok::<(), ferry_transport::selection::SelectionError>(())
//! ```

use std::cmp::Ordering;
use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::fmt;

use ferry_wire::{ChannelChoice, ChannelOffer, Device, PeerText, TransportOffer};

/// Why a channel selection could not be computed, used or agreed on.
///
/// The fields holding the source device are spelled `r#source` in the
/// definition so that `thiserror` does not take them for the error's cause
/// (it treats a field plainly named `source` as one); everywhere else they
/// are written `source` as usual, e.g. `SelectionError::NoChannel { source,
/// target }`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectionError {
    /// One side's offer list names the same channel more than once.
    #[error(
        "channel {:?} is offered more than once in one worker's channel list",
        PeerText::new(.name)
    )]
    DuplicateChannel {
        /// The channel named twice.
        name: String,
    },
    /// One channel offer lists the same device more than once.
    #[error(
        "the offer of channel {:?} lists device {device} more than once",
        PeerText::new(.channel)
    )]
    DuplicateDevice {
        /// The channel whose offer is malformed.
        channel: String,
        /// The device listed twice.
        device: Device,
    },
    /// No channel qualifies for this (source device, target device) pair.
    #[error(
        "no channel carries tensors from {source} on the sender to {target} on the receiver: \
         no channel offered by both workers serves these devices with equal descriptors"
    )]
    NoChannel {
        /// Device of the tensor on the sending worker.
        r#source: Device,
        /// Device of the destination on the receiving worker.
        target: Device,
    },
    /// The two ends of a connection computed different selections.
    #[error(
        "the two ends disagree on the channel for {source} -> {target}: this worker chose {}, \
         the peer chose {}",
        Choice(.local),
        Choice(.remote)
    )]
    Mismatch {
        /// Source device of the first pair (in (source, target) order) on
        /// which the two selections differ.
        r#source: Device,
        /// Target device of that pair.
        target: Device,
        /// The channel this end chose for the pair, if any.
        local: Option<String>,
        /// The channel the peer chose for the pair, if any.
        remote: Option<String>,
    },
    /// A selection list names the same (source, target) pair more than once.
    #[error("the channel selection names the pair {source} -> {target} more than once")]
    DuplicatePair {
        /// Source device of the pair.
        r#source: Device,
        /// Target device of the pair.
        target: Device,
    },
}

/// Shows a possibly absent choice in an error message.
struct Choice<'a>(&'a Option<String>);

impl fmt::Display for Choice<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(name) => write!(f, "channel {:?}", PeerText::new(name)),
            None => f.write_str("no channel"),
        }
    }
}

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

/// Chooses, for every (source device, target device) pair, the channel that
/// carries tensors from the `sender`'s source device into the `receiver`'s
/// target device, by the rule in the [module documentation](self).
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

/// Sorts choices by (source, target), rejecting a pair named twice.
fn canonical(choices: &[ChannelChoice]) -> Result<Vec<&ChannelChoice>, SelectionError> {
    let mut sorted: Vec<&ChannelChoice> = choices.iter().collect();
    sorted.sort_by_key(|c| (c.source, c.target));
    if let Some(w) = sorted
        .windows(2)
        .find(|w| (w[0].source, w[0].target) == (w[1].source, w[1].target))
    {
        return Err(SelectionError::DuplicatePair {
            source: w[0].source,
            target: w[0].target,
        });
    }
    Ok(sorted)
}

/// Checks that this end's selection for a connection direction (`local`)
/// equals the one the peer computed and sent in its handshake (`remote`).
///
/// The lists are compared as maps from (source, target) to channel, so their
/// order does not matter.
///
/// # Errors
///
/// [`SelectionError::Mismatch`] naming the first pair, in (source, target)
/// order, that the two lists map differently (including a pair only one list
/// has); [`SelectionError::DuplicatePair`] if either list names a pair twice.
pub fn verify(local: &[ChannelChoice], remote: &[ChannelChoice]) -> Result<(), SelectionError> {
    let local = canonical(local)?;
    let remote = canonical(remote)?;
    let (mut l, mut r) = (local.iter().peekable(), remote.iter().peekable());
    loop {
        let (pair, a, b) = match (l.peek().copied(), r.peek().copied()) {
            (None, None) => return Ok(()),
            (Some(a), None) => (a, Some(a), None),
            (None, Some(b)) => (b, None, Some(b)),
            (Some(a), Some(b)) => match (a.source, a.target).cmp(&(b.source, b.target)) {
                Ordering::Less => (a, Some(a), None),
                Ordering::Greater => (b, None, Some(b)),
                Ordering::Equal => (a, Some(a), Some(b)),
            },
        };
        if a.is_some() {
            l.next();
        }
        if b.is_some() {
            r.next();
        }
        let local = a.map(|c| &c.channel);
        let remote = b.map(|c| &c.channel);
        if local != remote {
            return Err(SelectionError::Mismatch {
                source: pair.source,
                target: pair.target,
                local: local.cloned(),
                remote: remote.cloned(),
            });
        }
    }
}

/// The channel selection for one direction of a connection: which channel
/// carries tensors for each (source device, target device) pair.
///
/// The default is the empty selection (every lookup fails), which is what a
/// connection uses before its handshake has fixed the real one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    /// Sorted by (source, target), at most one entry per pair.
    choices: Vec<ChannelChoice>,
}

impl Selection {
    /// Wraps a list of choices, e.g. the result of [`select_channels`].
    ///
    /// The choices are sorted by (source, target); should a pair appear more
    /// than once (which [`select_channels`] never produces, and [`verify`]
    /// rejects), its first occurrence wins.
    pub fn new(mut choices: Vec<ChannelChoice>) -> Self {
        choices.sort_by_key(|c| (c.source, c.target));
        choices.dedup_by_key(|c| (c.source, c.target));
        Self { choices }
    }

    /// Computes the selection for tensors going from `sender` to `receiver`
    /// with [`select_channels`].
    ///
    /// # Errors
    ///
    /// As [`select_channels`].
    pub fn compute(
        sender: &[ChannelOffer],
        receiver: &[ChannelOffer],
    ) -> Result<Self, SelectionError> {
        select_channels(sender, receiver).map(|choices| Self { choices })
    }

    /// The name of the channel chosen for tensors on the sender's `source`
    /// device going to the receiver's `target` device.
    ///
    /// # Errors
    ///
    /// [`SelectionError::NoChannel`] naming both devices if no channel was
    /// chosen for the pair.
    pub fn channel_for(&self, source: Device, target: Device) -> Result<&str, SelectionError> {
        self.choices
            .binary_search_by_key(&(source, target), |c| (c.source, c.target))
            .map(|i| self.choices[i].channel.as_str())
            .map_err(|_| SelectionError::NoChannel { source, target })
    }

    /// All choices, sorted by (source, target).
    pub fn choices(&self) -> &[ChannelChoice] {
        &self.choices
    }

    /// The choices, sorted by (source, target), e.g. to put in a handshake.
    pub fn into_choices(self) -> Vec<ChannelChoice> {
        self.choices
    }

    /// Checks this selection against the one the peer sent, as [`verify`].
    ///
    /// # Errors
    ///
    /// As [`verify`].
    pub fn verify(&self, remote: &[ChannelChoice]) -> Result<(), SelectionError> {
        verify(&self.choices, remote)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_wire::DeviceOffer;

    const HOST: &str = "boot-A/ns-1";

    fn offer(name: &str, priority: i32, devices: &[(Device, &str)]) -> ChannelOffer {
        ChannelOffer {
            name: name.to_owned(),
            priority,
            devices: devices
                .iter()
                .map(|&(device, descriptor)| DeviceOffer {
                    device,
                    descriptor: descriptor.to_owned(),
                })
                .collect(),
        }
    }

    fn cpu(name: &str, priority: i32, descriptor: &str) -> ChannelOffer {
        offer(name, priority, &[(Device::Cpu, descriptor)])
    }

    /// A same-host worker's offers: cma > shm > mpt > inline.
    fn host_offers(host: &str) -> Vec<ChannelOffer> {
        vec![
            cpu("inline", 0, "any"),
            cpu("mpt", 10, "tcp"),
            cpu("cma", 30, host),
            cpu("shm", 20, host),
        ]
    }

    fn choice(source: Device, target: Device, channel: &str) -> ChannelChoice {
        ChannelChoice {
            source,
            target,
            channel: channel.to_owned(),
        }
    }

    fn cpu_channel(sender: &[ChannelOffer], receiver: &[ChannelOffer]) -> String {
        let s = Selection::compute(sender, receiver).expect("valid offers");
        s.channel_for(Device::Cpu, Device::Cpu)
            .expect("a channel")
            .to_owned()
    }

    #[test]
    fn highest_common_channel_wins() {
        assert_eq!(cpu_channel(&host_offers(HOST), &host_offers(HOST)), "cma");
        assert_eq!(
            select_channels(&host_offers(HOST), &host_offers(HOST)).expect("valid"),
            vec![choice(Device::Cpu, Device::Cpu, "cma")]
        );
    }

    #[test]
    fn descriptor_mismatch_falls_back() {
        // cma needs the same namespace; shm only the same boot id.
        let sender = [
            cpu("cma", 30, "boot-A/ns-1"),
            cpu("shm", 20, "boot-A"),
            cpu("inline", 0, "any"),
        ];
        let receiver = [
            cpu("cma", 30, "boot-A/ns-2"),
            cpu("shm", 20, "boot-A"),
            cpu("inline", 0, "any"),
        ];
        assert_eq!(cpu_channel(&sender, &receiver), "shm");
        // Different hosts: only the host-independent channels remain.
        assert_eq!(
            cpu_channel(&host_offers("boot-A"), &host_offers("boot-B")),
            "mpt"
        );
    }

    #[test]
    fn channel_offered_by_one_side_is_skipped() {
        let receiver = [cpu("shm", 20, HOST), cpu("inline", 0, "any")];
        assert_eq!(cpu_channel(&host_offers(HOST), &receiver), "shm");
        assert_eq!(cpu_channel(&receiver, &host_offers(HOST)), "shm");
    }

    #[test]
    fn device_pairs_choose_independently() {
        let gpu_host = || {
            vec![
                offer("cuda_ipc", 50, &[(Device::Cuda(0), "boot-A/gpu-bus-1")]),
                offer(
                    "cuda_staged",
                    5,
                    &[(Device::Cuda(0), "any"), (Device::Cuda(1), "any")],
                ),
                cpu("shm", 20, "boot-A"),
                cpu("inline", 0, "any"),
            ]
        };
        let sel = Selection::compute(&gpu_host(), &gpu_host()).expect("valid");
        assert_eq!(
            sel.channel_for(Device::Cuda(0), Device::Cuda(0))
                .expect("a channel"),
            "cuda_ipc"
        );
        assert_eq!(
            sel.channel_for(Device::Cpu, Device::Cpu)
                .expect("a channel"),
            "shm"
        );
        assert_eq!(
            sel.channel_for(Device::Cuda(0), Device::Cuda(1))
                .expect("a channel"),
            "cuda_staged"
        );
        assert_eq!(
            sel.channel_for(Device::Cuda(1), Device::Cuda(0))
                .expect("a channel"),
            "cuda_staged"
        );
        // No channel links host memory and a GPU here.
        assert_eq!(
            sel.channel_for(Device::Cpu, Device::Cuda(0)),
            Err(SelectionError::NoChannel {
                source: Device::Cpu,
                target: Device::Cuda(0)
            })
        );
        // Sorted by (source, target).
        let pairs: Vec<_> = sel.choices().iter().map(|c| (c.source, c.target)).collect();
        let mut sorted = pairs.clone();
        sorted.sort();
        assert_eq!(pairs, sorted);
        assert_eq!(pairs.len(), 5);
    }

    #[test]
    fn differing_priorities_use_the_sum_in_both_roles() {
        // A prefers shm, B prefers mpt; sums: shm 20+5 = 25, mpt 1+30 = 31.
        let a = [cpu("shm", 20, HOST), cpu("mpt", 1, "tcp")];
        let b = [cpu("shm", 5, HOST), cpu("mpt", 30, "tcp")];
        assert_eq!(cpu_channel(&a, &b), "mpt");
        assert_eq!(cpu_channel(&b, &a), "mpt");

        // Asymmetric devices: A sends from cuda:0 into B's cpu and back.
        let a = [
            offer("staged", 1, &[(Device::Cuda(0), "x")]),
            offer("direct", 9, &[(Device::Cuda(0), "x")]),
        ];
        let b = [
            offer("staged", 10, &[(Device::Cpu, "x")]),
            offer("direct", 0, &[(Device::Cpu, "x")]),
        ];
        let ab = select_channels(&a, &b).expect("valid");
        let ba = select_channels(&b, &a).expect("valid");
        assert_eq!(ab, vec![choice(Device::Cuda(0), Device::Cpu, "staged")]);
        assert_eq!(ba, vec![choice(Device::Cpu, Device::Cuda(0), "staged")]);
    }

    #[test]
    fn ties_break_by_name() {
        let a = [
            cpu("zeta", 10, "d"),
            cpu("alpha", 5, "d"),
            cpu("mu", 10, "d"),
        ];
        let b = [cpu("mu", 0, "d"), cpu("zeta", 0, "d"), cpu("alpha", 5, "d")];
        // All sums are 10: the smallest name wins, whatever the list order.
        assert_eq!(cpu_channel(&a, &b), "alpha");
        assert_eq!(cpu_channel(&b, &a), "alpha");
    }

    #[test]
    fn priority_sum_does_not_overflow() {
        let a = [cpu("big", i32::MAX, "d"), cpu("small", i32::MAX - 1, "d")];
        assert_eq!(cpu_channel(&a, &a), "big");
        let low = [cpu("neg", i32::MIN, "d"), cpu("zero", 0, "d")];
        assert_eq!(cpu_channel(&low, &low), "zero");
    }

    #[test]
    fn empty_offers_give_empty_selection() {
        for (s, r) in [
            (Vec::new(), Vec::new()),
            (host_offers(HOST), Vec::new()),
            (Vec::new(), host_offers(HOST)),
        ] {
            let sel = Selection::compute(&s, &r).expect("valid");
            assert!(sel.choices().is_empty());
            let err = sel
                .channel_for(Device::Cpu, Device::Cpu)
                .expect_err("no channel");
            assert_eq!(
                err,
                SelectionError::NoChannel {
                    source: Device::Cpu,
                    target: Device::Cpu
                }
            );
            assert!(err.to_string().contains("from cpu"), "{err}");
        }
        assert!(Selection::default()
            .channel_for(Device::Cuda(3), Device::Cpu)
            .expect_err("no channel")
            .to_string()
            .contains("from cuda:3 on the sender to cpu on the receiver"));
    }

    #[test]
    fn duplicate_names_are_rejected() {
        let dup = [
            cpu("shm", 20, HOST),
            cpu("inline", 0, "any"),
            cpu("shm", 1, HOST),
        ];
        let want = SelectionError::DuplicateChannel { name: "shm".into() };
        assert_eq!(select_channels(&dup, &host_offers(HOST)), Err(want.clone()));
        assert_eq!(select_channels(&host_offers(HOST), &dup), Err(want.clone()));
        assert!(want.to_string().contains("\"shm\""));

        let dup_dev = [offer("shm", 1, &[(Device::Cpu, "a"), (Device::Cpu, "b")])];
        let err = select_channels(&dup_dev, &[]).expect_err("duplicate device");
        assert_eq!(
            err,
            SelectionError::DuplicateDevice {
                channel: "shm".into(),
                device: Device::Cpu
            }
        );
    }

    #[test]
    fn verify_accepts_equal_lists() {
        let sel = select_channels(&host_offers(HOST), &host_offers(HOST)).expect("valid");
        assert_eq!(verify(&sel, &sel), Ok(()));
        assert_eq!(verify(&[], &[]), Ok(()));
        let two = vec![
            choice(Device::Cpu, Device::Cpu, "shm"),
            choice(Device::Cuda(0), Device::Cuda(0), "cuda_ipc"),
        ];
        let reversed: Vec<_> = two.iter().rev().cloned().collect();
        assert_eq!(verify(&two, &reversed), Ok(()));
        assert_eq!(Selection::new(reversed).verify(&two), Ok(()));
    }

    #[test]
    fn verify_names_the_first_difference() {
        let local = vec![
            choice(Device::Cpu, Device::Cpu, "shm"),
            choice(Device::Cpu, Device::Cuda(0), "staged"),
            choice(Device::Cuda(0), Device::Cuda(0), "cuda_ipc"),
        ];
        let mut remote = local.clone();
        remote[1].channel = "inline".into();
        remote[2].channel = "inline".into();
        let err = verify(&local, &remote).expect_err("mismatch");
        assert_eq!(
            err,
            SelectionError::Mismatch {
                source: Device::Cpu,
                target: Device::Cuda(0),
                local: Some("staged".into()),
                remote: Some("inline".into()),
            }
        );
        let msg = err.to_string();
        assert!(msg.contains("cpu -> cuda:0"), "{msg}");
        assert!(
            msg.contains("\"staged\"") && msg.contains("\"inline\""),
            "{msg}"
        );

        // A pair only one side has.
        let err = verify(&local, &local[..2]).expect_err("mismatch");
        assert_eq!(
            err,
            SelectionError::Mismatch {
                source: Device::Cuda(0),
                target: Device::Cuda(0),
                local: Some("cuda_ipc".into()),
                remote: None,
            }
        );
        assert!(err.to_string().contains("the peer chose no channel"));
        let err = verify(&local[1..], &local).expect_err("mismatch");
        assert_eq!(
            err,
            SelectionError::Mismatch {
                source: Device::Cpu,
                target: Device::Cpu,
                local: None,
                remote: Some("shm".into()),
            }
        );

        // A pair named twice.
        let dup = vec![local[0].clone(), local[0].clone()];
        assert_eq!(
            verify(&local, &dup),
            Err(SelectionError::DuplicatePair {
                source: Device::Cpu,
                target: Device::Cpu
            })
        );
    }

    #[test]
    fn errors_are_leaf_errors_with_clear_messages() {
        use std::error::Error as _;
        let errors = [
            SelectionError::DuplicateChannel { name: "shm".into() },
            SelectionError::DuplicateDevice {
                channel: "shm".into(),
                device: Device::Cuda(2),
            },
            SelectionError::NoChannel {
                source: Device::Cuda(1),
                target: Device::Cpu,
            },
            SelectionError::Mismatch {
                source: Device::Cpu,
                target: Device::Cuda(0),
                local: None,
                remote: Some("cuda_ipc".into()),
            },
            SelectionError::DuplicatePair {
                source: Device::Cuda(1),
                target: Device::Cuda(0),
            },
        ];
        let messages: Vec<String> = errors.iter().map(ToString::to_string).collect();
        for e in &errors {
            // A device field is not the error's cause.
            assert!(e.source().is_none(), "{e}");
        }
        assert!(messages[1].contains("\"shm\"") && messages[1].contains("cuda:2"));
        assert!(messages[2].contains("from cuda:1 on the sender to cpu on the receiver"));
        assert!(messages[3].contains("cpu -> cuda:0"), "{}", messages[3]);
        assert!(messages[3].contains("this worker chose no channel"));
        assert!(messages[3].contains("the peer chose channel \"cuda_ipc\""));
        assert!(messages[4].contains("cuda:1 -> cuda:0"));
    }

    #[test]
    fn new_sorts_and_keeps_first_duplicate() {
        let sel = Selection::new(vec![
            choice(Device::Cuda(1), Device::Cpu, "b"),
            choice(Device::Cpu, Device::Cpu, "a"),
            choice(Device::Cuda(1), Device::Cpu, "c"),
        ]);
        assert_eq!(
            sel.into_choices(),
            vec![
                choice(Device::Cpu, Device::Cpu, "a"),
                choice(Device::Cuda(1), Device::Cpu, "b"),
            ]
        );
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        const NAMES: [&str; 5] = ["cma", "cuda_ipc", "inline", "mpt", "shm"];
        const DEVICES: [Device; 3] = [Device::Cpu, Device::Cuda(0), Device::Cuda(1)];

        fn device_offers() -> impl Strategy<Value = Vec<DeviceOffer>> {
            prop::sample::subsequence(DEVICES.to_vec(), 0..=DEVICES.len()).prop_flat_map(
                |devices| {
                    let n = devices.len();
                    (
                        Just(devices),
                        prop::collection::vec(prop::sample::select(vec!["x", "y"]), n),
                    )
                        .prop_map(|(devices, descriptors)| {
                            devices
                                .into_iter()
                                .zip(descriptors)
                                .map(|(device, d)| DeviceOffer {
                                    device,
                                    descriptor: d.to_owned(),
                                })
                                .collect()
                        })
                },
            )
        }

        /// Offers with distinct names, small priorities (many ties) and
        /// few descriptors (many matches), in random order.
        fn offers() -> impl Strategy<Value = Vec<ChannelOffer>> {
            prop::sample::subsequence(NAMES.to_vec(), 0..=NAMES.len())
                .prop_flat_map(|names| {
                    let n = names.len();
                    (
                        Just(names),
                        prop::collection::vec((-2i32..=2, device_offers()), n),
                    )
                })
                .prop_map(|(names, rest)| {
                    names
                        .into_iter()
                        .zip(rest)
                        .map(|(name, (priority, devices))| ChannelOffer {
                            name: name.to_owned(),
                            priority,
                            devices,
                        })
                        .collect::<Vec<_>>()
                })
                .prop_shuffle()
        }

        /// The rank of `name` for (`source`, `target`) if it qualifies.
        fn qualifies(
            sender: &[ChannelOffer],
            receiver: &[ChannelOffer],
            name: &str,
            source: Device,
            target: Device,
        ) -> Option<i64> {
            let s = sender.iter().find(|o| o.name == name)?;
            let r = receiver.iter().find(|o| o.name == name)?;
            let sd = s.devices.iter().find(|d| d.device == source)?;
            let rd = r.devices.iter().find(|d| d.device == target)?;
            (sd.descriptor == rd.descriptor).then(|| i64::from(s.priority) + i64::from(r.priority))
        }

        fn transpose(choices: &[ChannelChoice]) -> Vec<ChannelChoice> {
            let mut t: Vec<_> = choices
                .iter()
                .map(|c| choice(c.target, c.source, &c.channel))
                .collect();
            t.sort_by_key(|c| (c.source, c.target));
            t
        }

        proptest! {
            #[test]
            fn selection_follows_the_rule(sender in offers(), receiver in offers()) {
                let got = select_channels(&sender, &receiver).expect("valid offers");

                // Deterministic, and independent of the order of the lists.
                prop_assert_eq!(&got, &select_channels(&sender, &receiver).expect("valid"));
                let (mut s_rev, mut r_rev) = (sender.clone(), receiver.clone());
                s_rev.reverse();
                r_rev.reverse();
                prop_assert_eq!(&got, &select_channels(&s_rev, &r_rev).expect("valid"));

                // Swapping the roles transposes the pairs.
                let swapped = select_channels(&receiver, &sender).expect("valid");
                prop_assert_eq!(transpose(&got), swapped);

                // Sorted, one entry per pair.
                for w in got.windows(2) {
                    prop_assert!((w[0].source, w[0].target) < (w[1].source, w[1].target));
                }
                prop_assert_eq!(verify(&got, &got), Ok(()));

                let sel = Selection::new(got.clone());
                for source in DEVICES {
                    for target in DEVICES {
                        let best = NAMES
                            .iter()
                            .filter_map(|&n| {
                                qualifies(&sender, &receiver, n, source, target).map(|r| (r, n))
                            })
                            // Highest sum, then smallest name; written out
                            // here independently of `outranks`.
                            .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(a.1)));
                        match (best, sel.channel_for(source, target)) {
                            (None, Err(e)) => prop_assert_eq!(
                                e,
                                SelectionError::NoChannel { source, target }
                            ),
                            (Some((rank, name)), Ok(chosen)) => {
                                // Offered by both sides, right devices, equal descriptors.
                                let chosen_rank =
                                    qualifies(&sender, &receiver, chosen, source, target);
                                prop_assert_eq!(chosen_rank, Some(rank));
                                // No better-ranked qualifying channel exists.
                                for &other in &NAMES {
                                    if let Some(r) =
                                        qualifies(&sender, &receiver, other, source, target)
                                    {
                                        prop_assert!(
                                            r < rank || (r == rank && other >= chosen),
                                            "{} ranks above {}", other, chosen
                                        );
                                    }
                                }
                                prop_assert_eq!(chosen, name);
                            }
                            (want, got) => prop_assert!(
                                false,
                                "pair {} -> {}: want {:?}, got {:?}",
                                source,
                                target,
                                want,
                                got
                            ),
                        }
                    }
                }
            }

            #[test]
            fn disclosure_hides_foreign_descriptors_and_keeps_the_selection(
                local in offers(),
                peer in offers(),
            ) {
                let shown = disclosed_channels(&local, &peer);
                // Every descriptor shown is one the peer gave for that channel.
                for o in &shown {
                    for d in &o.devices {
                        prop_assert!(peer.iter().any(|p| p.name == o.name
                            && p.devices.iter().any(|pd| pd.descriptor == d.descriptor)));
                    }
                }
                // Both ends still compute the same selection, both ways.
                prop_assert_eq!(
                    select_channels(&shown, &peer).expect("valid"),
                    select_channels(&local, &peer).expect("valid")
                );
                prop_assert_eq!(
                    select_channels(&peer, &shown).expect("valid"),
                    select_channels(&peer, &local).expect("valid")
                );
            }

            #[test]
            fn verify_detects_any_single_change(
                sender in offers(),
                receiver in offers(),
                pick in any::<prop::sample::Index>(),
            ) {
                let local = select_channels(&sender, &receiver).expect("valid");
                if local.is_empty() {
                    // Nothing chosen here: a peer that chose anything differs.
                    let remote = [choice(Device::Cuda(1), Device::Cpu, "inline")];
                    prop_assert_eq!(
                        verify(&local, &remote),
                        Err(SelectionError::Mismatch {
                            source: Device::Cuda(1),
                            target: Device::Cpu,
                            local: None,
                            remote: Some("inline".into()),
                        })
                    );
                    return Ok(());
                }
                let i = pick.index(local.len());
                let mut remote = local.clone();
                remote[i].channel.push('!');
                prop_assert_eq!(
                    verify(&local, &remote),
                    Err(SelectionError::Mismatch {
                        source: local[i].source,
                        target: local[i].target,
                        local: Some(local[i].channel.clone()),
                        remote: Some(remote[i].channel.clone()),
                    })
                );
                // A pair the peer left out.
                remote.remove(i);
                prop_assert_eq!(
                    verify(&local, &remote),
                    Err(SelectionError::Mismatch {
                        source: local[i].source,
                        target: local[i].target,
                        local: Some(local[i].channel.clone()),
                        remote: None,
                    })
                );
            }
        }
    }
}
