//! [`Selection`]: one direction's choices, looked up per device pair.

use ferry_wire::{ChannelChoice, ChannelOffer, Device};

use super::check::verify;
use super::error::SelectionError;
use super::rule::select_channels;

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
