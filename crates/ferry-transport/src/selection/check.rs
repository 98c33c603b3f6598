//! Checking that both ends computed the same selection.

use std::cmp::Ordering;

use ferry_wire::ChannelChoice;

use super::error::SelectionError;

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
