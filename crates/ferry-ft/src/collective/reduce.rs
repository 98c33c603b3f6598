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

/// Values reduced per pass of [`reduce_in_place`]: a block of every
/// contribution stays in the L1 cache while it is summed.
const BLOCK: usize = 1024;

/// Reduces in place: `own` holds this member's contribution, the one of
/// replica rank `me`, and `others` the other ranks' (in rank order, all
/// of `own`'s length); afterwards `own` holds exactly the bits
/// [`reduce_in_rank_order`] gives for all of them, the sum accumulated in
/// rank order with `own` at its place (then divided by the count for
/// [`ReduceOp::Mean`]). No copy of `own` is made: the buffer is reduced
/// block by block through a small accumulator.
///
/// ```
/// use ferry_ft::collective::{reduce_in_place, ReduceOp};
///
/// let mut own = [3.0f32, 4.0];
/// reduce_in_place(&mut own, 1, &[&[1.0, 2.0]], ReduceOp::Mean);
/// assert_eq!(own, [2.0, 3.0]);
/// ```
///
/// # Panics
///
/// If a contribution's length differs from `own`'s, or `me` is past the
/// last rank (`others.len()`).
pub fn reduce_in_place(own: &mut [f32], me: usize, others: &[&[f32]], op: ReduceOp) {
    assert!(
        others.iter().all(|c| c.len() == own.len()),
        "every contribution must have the output's length"
    );
    assert!(me <= others.len(), "rank {me} of {}", others.len() + 1);
    let count = (others.len() + 1) as f32;
    let (before, after) = others.split_at(me);
    let mut acc = [0.0f32; BLOCK];
    for start in (0..own.len()).step_by(BLOCK) {
        let end = (start + BLOCK).min(own.len());
        let acc = &mut acc[..end - start];
        let out = &mut own[start..end];
        match before.split_first() {
            None => acc.copy_from_slice(out),
            Some((first, rest)) => {
                acc.copy_from_slice(&first[start..end]);
                for contribution in rest {
                    add(acc, &contribution[start..end]);
                }
                add(acc, out);
            }
        }
        for contribution in after {
            add(acc, &contribution[start..end]);
        }
        if op == ReduceOp::Mean {
            for value in acc.iter_mut() {
                *value /= count;
            }
        }
        out.copy_from_slice(acc);
    }
}

/// `acc[i] += x[i]`, the accumulator on the left (the order
/// [`reduce_in_rank_order`] adds in).
fn add(acc: &mut [f32], x: &[f32]) {
    for (acc, &x) in acc.iter_mut().zip(x) {
        *acc += x;
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

    #[test]
    fn in_place_matches_rank_order_at_every_rank() {
        // Values of very different magnitudes, so that the order shows.
        let len = 2 * BLOCK + 37;
        let inputs: Vec<Vec<f32>> = (0..4u32)
            .map(|r| {
                (0..len as u32)
                    .map(|i| {
                        let x = (i.wrapping_mul(2_654_435_761) ^ r.wrapping_mul(40_503)) % 1000;
                        (x as f32 - 500.0) * 10f32.powi((r as i32 * 3 + i as i32) % 9 - 4)
                    })
                    .collect()
            })
            .collect();
        for n in 1..=4 {
            for op in [ReduceOp::Sum, ReduceOp::Mean] {
                let all: Vec<&[f32]> = inputs[..n].iter().map(Vec::as_slice).collect();
                let mut want = vec![0.0f32; len];
                reduce_in_rank_order(&all, op, &mut want);
                for me in 0..n {
                    let others: Vec<&[f32]> = (0..n)
                        .filter(|&k| k != me)
                        .map(|k| inputs[k].as_slice())
                        .collect();
                    let mut own = inputs[me].clone();
                    reduce_in_place(&mut own, me, &others, op);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&own), bits(&want), "n {n} me {me} {op:?}");
                }
            }
        }
    }
}
