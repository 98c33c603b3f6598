//! Per-device-pair channel selection, computed alike by both ends.
//!
//! Each worker's [`Handshake`](ferry_wire::Handshake) lists the tensor
//! channels it offers ([`ChannelOffer`](ferry_wire::ChannelOffer)): a
//! name, a priority, and for every local device the channel serves, a
//! *domain descriptor*. For one direction of a connection (sender →
//! receiver), [`select_channels`] picks, for every (source device, target
//! device) pair, the channel that carries tensors from the sender's
//! `source` device into the receiver's `target` device.
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

mod check;
mod disclose;
mod error;
mod rule;
mod table;

pub use check::verify;
pub use disclose::{disclosed_channels, disclosed_transports};
pub use error::SelectionError;
pub use rule::{select_channels, select_transport};
pub use table::Selection;

#[cfg(test)]
mod tests;
