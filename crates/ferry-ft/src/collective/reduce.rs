//! The arithmetic of the allreduce, sans-IO: how a buffer is cut into one
//! segment per replica rank, and the reduction of a segment's
//! contributions in replica-rank order.

use std::ops::Range;

/// How contributions are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReduceOp {
    /// The element-wise sum.
    Sum,
    /// The element-wise sum divided by the number of contributions
    /// (gradient averaging).
    #[default]
    Mean,
}

/// The elements of segment `k` of a buffer of `len` elements cut into `n`
/// segments: contiguous, in order, sizes differing by at most one (the
/// first `len % n` segments are one longer). `n > 0`, `k < n`.
///
/// ```
/// use ferry_ft::collective::segment;
///
/// assert_eq!(segment(10, 3, 0), 0..4);
/// assert_eq!(segment(10, 3, 1), 4..7);
/// assert_eq!(segment(10, 3, 2), 7..10);
/// assert_eq!(segment(2, 3, 2), 2..2);
/// ```
pub fn segment(len: usize, n: usize, k: usize) -> Range<usize> {
    let n = n.max(1);
    let base = len / n;
    let extra = len % n;
    let start = k * base + k.min(extra);
    let size = base + usize::from(k < extra);
    start.min(len)..(start + size).min(len)
}

/// Reduces `contributions` (one slice per replica rank, in rank order, all
/// the same length) into `out`: the sum is accumulated in rank order,
/// `((c0 + c1) + c2) + ...`, then divided by the count for
/// [`ReduceOp::Mean`]. The order is fixed, so every replica that computes
/// (or receives) this result gets the same bits.
///
/// ```
/// use ferry_ft::collective::{reduce_in_rank_order, ReduceOp};
///
/// let mut out = [0.0f32; 2];
/// reduce_in_rank_order(&[&[1.0, 2.0], &[3.0, 4.0]], ReduceOp::Mean, &mut out);
/// assert_eq!(out, [2.0, 3.0]);
/// ```
///
/// # Panics
///
/// If a contribution's length differs from `out`'s.
pub fn reduce_in_rank_order(contributions: &[&[f32]], op: ReduceOp, out: &mut [f32]) {
    let Some((first, rest)) = contributions.split_first() else {
        out.fill(0.0);
        return;
    };
    assert!(
        contributions.iter().all(|c| c.len() == out.len()),
        "every contribution must have the output's length"
    );
    out.copy_from_slice(first);
    for contribution in rest {
        for (acc, &x) in out.iter_mut().zip(contribution.iter()) {
            *acc += x;
        }
    }
    if op == ReduceOp::Mean {
        let n = contributions.len() as f32;
        for acc in out.iter_mut() {
            *acc /= n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_tile_the_buffer() {
        for len in 0..40 {
            for n in 1..7 {
                let mut next = 0;
                for k in 0..n {
                    let range = segment(len, n, k);
                    assert_eq!(range.start, next, "len {len} n {n} k {k}");
                    assert!(range.len() == len / n || range.len() == len / n + 1);
                    next = range.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn rank_order_is_the_summation_order() {
        // Floating-point addition is not associative: the order shows.
        let a = [1.0e8f32];
        let b = [1.0f32];
        let c = [-1.0e8f32];
        let mut out = [0.0f32];
        reduce_in_rank_order(&[&a, &b, &c], ReduceOp::Sum, &mut out);
        assert_eq!(out[0], (1.0e8f32 + 1.0) - 1.0e8);
        reduce_in_rank_order(&[&a, &c, &b], ReduceOp::Sum, &mut out);
        assert_eq!(out[0], (1.0e8f32 - 1.0e8) + 1.0);
        assert_ne!((1.0e8f32 + 1.0) - 1.0e8, (1.0e8f32 - 1.0e8) + 1.0);
        reduce_in_rank_order(&[&[3.0], &[6.0]], ReduceOp::Mean, &mut out);
        assert_eq!(out[0], 4.5);
    }
}
