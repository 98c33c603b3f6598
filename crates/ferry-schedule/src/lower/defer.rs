//! Deferred receives: each RECV moved as late as it safely can.
//!
//! [`add_send_recv`](super::add_send_recv) posts every receive as early as
//! possible, which keeps buffers (and, on some fabrics, the communication
//! stream) busy long before the data is needed. [`defer_recvs`] moves each
//! receive down its rank's list towards the compute that consumes it.
//!
//! # The rule
//!
//! Think of the lowered schedule as a graph: one node per action, an edge
//! from each action to the next on its rank, and the two ends of each
//! send/receive pair joined: under [`CommModel::Rendezvous`] the pair is
//! one node (both ranks must be there together); under
//! [`CommModel::Buffered`] an edge runs from the send to the receive. The
//! schedule finishes exactly when this graph has no cycle (each rank runs
//! in order; the earliest node not yet run in a topological order always
//! has everything it needs).
//!
//! Moving a receive `R` one place down, past the next action `X` on its
//! rank, replaces the edge `R → X` by `X → R`. That closes a cycle exactly
//! when `R` still reaches `X` some other way, and the only other way out of
//! `R` is through its partner: under a rendezvous, from the send `S` that
//! `R` pairs with, along the sender's rank and any pairs after it. So:
//!
//! **A receive may pass the next action unless that action consumes it,
//! or that action (or its partner) can only run after the receive's peer
//! has gone on past the matching send.** Compute, UNSHARD, RESHARD,
//! REDUCE_GRAD never depend on the peer; a send or receive does when the
//! graph, walked from the action after `S` on the peer's rank, reaches it
//! or its partner. Under buffered sends no walk ever reaches it (a
//! receive has no edge out but to its rank's next action), so every
//! receive goes straight to its consumer; under a rendezvous the walk stops
//! it before the first send or receive that would wait on the peer.
//! Each move keeps the graph acyclic, so the deferred schedule finishes
//! whenever the input does, under the same model (checked in
//! `tests/defer.rs` for every generated schedule).
//!
//! PyTorch's `_defer_recv_ops` uses a rank-parity rule instead (a rank
//! flushes its deferred receives before sending to a higher rank only);
//! that rule can still deadlock under a strict rendezvous (the case in
//! `tests/defer.rs`), which this one cannot.

use std::collections::{HashMap, VecDeque};

use super::Schedule;
use crate::action::{Action, ActionKind};
use crate::deadlock::{check_deadlock_with, leaves, partner, CommModel, DeadlockError};

/// How [`defer_recvs`] moves receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeferOptions {
    /// When sends complete: the deferred schedule finishes under this
    /// model whenever the input does.
    pub model: CommModel,
    /// How many actions may stay between a receive and its consumer: 0
    /// moves it right before the consumer; more keeps it that many
    /// actions ahead (a prefetch window for the transfer).
    pub lead: usize,
}

impl Default for DeferOptions {
    /// Rendezvous sends (safe under either model), receives right before
    /// their consumer.
    fn default() -> DeferOptions {
        DeferOptions {
            model: CommModel::Rendezvous,
            lead: 0,
        }
    }
}

/// Moves every RECV of a lowered schedule as late as it safely can: down
/// towards the compute that consumes it (a forward for RECV_F, a backward
/// for RECV_B, or an OVERLAP_F_B holding one), keeping `options.lead`
/// actions between them, and never past an action that needs the
/// receive's peer to go on first (see the [module docs](self) for the rule
/// and why it cannot deadlock).
///
/// Every other action keeps its place and order; a receive no compute on
/// its rank consumes stays where it is. Idle steps are dropped. The input
/// must itself finish under `options.model`, else its [`DeadlockError`].
///
/// ```
/// use ferry_schedule::{add_send_recv, defer_recvs, DeferOptions, ScheduleKind};
///
/// let kind = ScheduleKind::OneFOneB;
/// let placement = kind.placement().stage_to_rank(2, 2)?;
/// let lowered = add_send_recv(&kind.generate(2, 1, 2)?, &placement)?;
/// assert!(lowered.to_csv().ends_with("1RECV_F0,1F0,1RECV_F1,1B0,1SEND_B0,1F1,1B1,1SEND_B1,1REDUCE_GRAD\r\n"));
/// // 1RECV_F1 passes 1B0 but not 1SEND_B0: rank 0 receives B0 only after
/// // it has sent F1, and a rendezvous send waits for its receive.
/// let deferred = defer_recvs(&lowered, &placement, DeferOptions::default())?;
/// assert!(deferred.to_csv().ends_with("1RECV_F0,1F0,1B0,1RECV_F1,1SEND_B0,1F1,1B1,1SEND_B1,1REDUCE_GRAD\r\n"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn defer_recvs(
    lowered: &Schedule,
    stage_to_rank: &[usize],
    options: DeferOptions,
) -> Result<Schedule, DeadlockError> {
    check_deadlock_with(lowered, stage_to_rank, options.model)?;
    let mut graph = Graph::new(lowered, stage_to_rank);
    if options.model == CommModel::Rendezvous && !graph.number() {
        // The pairs as matched here (in order, per kind) cannot all meet:
        // only possible with duplicated sends or receives, which the
        // deadlock check tolerates. Moving nothing is safe.
        return Ok(Schedule::new(
            lowered
                .ranks
                .iter()
                .map(|row| row.iter().flatten().cloned().map(Some).collect())
                .collect(),
        ));
    }
    for rank in 0..graph.order.len() {
        let recvs: Vec<usize> = graph.order[rank]
            .iter()
            .copied()
            .filter(|&id| is_recv(&graph.actions[id]))
            .collect();
        for id in recvs.into_iter().rev() {
            graph.defer(id, options);
        }
    }
    Ok(graph.into_schedule())
}

fn is_recv(action: &Action) -> bool {
    matches!(action.kind(), ActionKind::RecvF | ActionKind::RecvB)
}

/// Whether `action` (or one of its sub-actions) consumes `recv`.
fn consumes(action: &Action, recv: &Action) -> bool {
    leaves(action).iter().any(|leaf| {
        let kind_fits = match recv.kind() {
            ActionKind::RecvF => leaf.kind() == ActionKind::Forward,
            ActionKind::RecvB => matches!(
                leaf.kind(),
                ActionKind::FullBackward | ActionKind::BackwardInput
            ),
            _ => false,
        };
        kind_fits && leaf.stage() == recv.stage() && leaf.microbatch() == recv.microbatch()
    })
}

/// The schedule as a graph whose rank lists change as receives move.
///
/// Under a rendezvous it keeps a topological numbering of the pair graph
/// (`label`, equal for the two ends of a pair), updated on every move as in
/// Pearce and Kelly's dynamic topological order: the searches that find
/// whether a move closes a cycle stay within the labels between the two
/// actions, so a move costs about the work the ranks do meanwhile, not
/// the whole schedule.
struct Graph {
    actions: Vec<Action>,
    rank_of: Vec<usize>,
    /// Each rank's list of action ids, in order.
    order: Vec<Vec<usize>>,
    /// Each action's index in its rank's list.
    pos: Vec<usize>,
    /// The other end of each cross-rank send/receive pair.
    partner: Vec<Option<usize>>,
    /// A topological number per action (rendezvous only).
    label: Vec<u64>,
    /// Walk marks: `seen[n] == epoch` when visited in the current walk.
    seen: Vec<u32>,
    epoch: u32,
}

impl Graph {
    fn new(lowered: &Schedule, stage_to_rank: &[usize]) -> Graph {
        let mut actions = Vec::new();
        let mut rank_of = Vec::new();
        let mut pos = Vec::new();
        let mut order = Vec::with_capacity(lowered.ranks.len());
        for (rank, row) in lowered.ranks.iter().enumerate() {
            let mut ids = Vec::with_capacity(row.len());
            for action in row.iter().flatten() {
                ids.push(actions.len());
                pos.push(ids.len() - 1);
                rank_of.push(rank);
                actions.push(action.clone());
            }
            order.push(ids);
        }
        // Pair the k-th send of each kind with the k-th matching receive
        // on the receiving stage's rank, as the ranks would meet them.
        let mut pending: HashMap<(usize, Action), VecDeque<usize>> = HashMap::new();
        for (id, action) in actions.iter().enumerate() {
            if matches!(action.kind(), ActionKind::SendF | ActionKind::SendB) {
                let recv = partner(action);
                if let Some(&to) = stage_to_rank.get(recv.stage()) {
                    if to != rank_of[id] && recv != *action {
                        pending.entry((to, recv)).or_default().push_back(id);
                    }
                }
            }
        }
        let mut partner_of = vec![None; actions.len()];
        for ids in &order {
            for &id in ids {
                if !is_recv(&actions[id]) {
                    continue;
                }
                let key = (rank_of[id], actions[id].clone());
                if let Some(send) = pending.get_mut(&key).and_then(|q| q.pop_front()) {
                    partner_of[id] = Some(send);
                    partner_of[send] = Some(id);
                }
            }
        }
        let n = actions.len();
        Graph {
            actions,
            rank_of,
            order,
            pos,
            partner: partner_of,
            label: vec![0; n],
            seen: vec![0; n],
            epoch: 0,
        }
    }

    /// Numbers the pair graph in an order the ranks can run it (each rank
    /// in order, the two ends of a pair together); `false` if it has a
    /// cycle (only for malformed pairings the deadlock check lets by,
    /// such as duplicated sends).
    fn number(&mut self) -> bool {
        let mut at = vec![0; self.order.len()];
        let mut next_label = 0;
        let total = self.actions.len();
        let mut numbered = 0;
        while numbered < total {
            let mut progress = false;
            for rank in 0..self.order.len() {
                while let Some(&id) = self.order[rank].get(at[rank]) {
                    if let Some(other) = self.partner[id] {
                        let peer = self.rank_of[other];
                        if self.order[peer].get(at[peer]) != Some(&other) {
                            break;
                        }
                        self.label[other] = next_label;
                        at[peer] += 1;
                        numbered += 1;
                    }
                    self.label[id] = next_label;
                    next_label += 1;
                    at[rank] += 1;
                    numbered += 1;
                    progress = true;
                }
            }
            if !progress {
                return false;
            }
        }
        true
    }

    /// The action after `id` on its rank.
    fn next(&self, id: usize) -> Option<usize> {
        self.order[self.rank_of[id]].get(self.pos[id] + 1).copied()
    }

    /// The action before `id` on its rank.
    fn prev(&self, id: usize) -> Option<usize> {
        let at = self.pos[id].checked_sub(1)?;
        self.order[self.rank_of[id]].get(at).copied()
    }

    fn defer(&mut self, recv: usize, options: DeferOptions) {
        let rank = self.rank_of[recv];
        let start = self.pos[recv];
        let Some(consumer) = self.order[rank][start + 1..]
            .iter()
            .position(|&id| consumes(&self.actions[id], &self.actions[recv]))
            .map(|k| start + 1 + k)
        else {
            return;
        };
        let mut at = start;
        while consumer - at - 1 > options.lead {
            let next = self.order[rank][at + 1];
            if options.model == CommModel::Rendezvous && !self.relabel_for_swap(recv, next) {
                break;
            }
            self.order[rank].swap(at, at + 1);
            self.pos[next] = at;
            self.pos[recv] = at + 1;
            at += 1;
        }
    }

    /// Whether `recv` may pass `next` (the action after it on its rank)
    /// without closing a cycle in the rendezvous pair graph; if so,
    /// renumbers the graph for the swapped order.
    ///
    /// The swap turns the edge `recv -> next` into `next -> recv`. It
    /// closes a cycle exactly when `recv` reaches `next` another way, and
    /// the only other way out of `recv` is through the action after its
    /// partner send on the peer's rank.
    fn relabel_for_swap(&mut self, recv: usize, next: usize) -> bool {
        let (low, high) = (self.label[recv], self.label[next]);
        // Forward from `recv` (not by its edge to `next`): what it reaches
        // numbered below `next`. Reaching `next` means a cycle.
        self.epoch += 1;
        let mut forward = vec![recv];
        self.mark(recv);
        let mut stack: Vec<usize> = self.partner[recv]
            .and_then(|s| self.next(s))
            .into_iter()
            .collect();
        while let Some(node) = stack.pop() {
            if self.label[node] == high {
                return false;
            }
            if self.label[node] > high || self.is_marked(node) {
                continue;
            }
            self.mark(node);
            forward.push(node);
            stack.extend(self.next(node));
            stack.extend(self.partner[node].and_then(|p| self.next(p)));
        }
        // Backward from `next` (not by its edge from `recv`): what reaches
        // it numbered above `recv`.
        let mut backward = vec![next];
        self.mark(next);
        let mut stack: Vec<usize> = self.partner[next]
            .and_then(|p| self.prev(p))
            .into_iter()
            .collect();
        while let Some(node) = stack.pop() {
            if self.label[node] < low || self.is_marked(node) {
                continue;
            }
            self.mark(node);
            backward.push(node);
            stack.extend(self.prev(node));
            stack.extend(self.partner[node].and_then(|p| self.prev(p)));
        }
        // The same numbers, those reaching `next` first.
        let by_label = |g: &Graph, nodes: &mut Vec<usize>| nodes.sort_by_key(|&n| g.label[n]);
        by_label(self, &mut backward);
        by_label(self, &mut forward);
        let mut labels: Vec<u64> = backward
            .iter()
            .chain(&forward)
            .map(|&n| self.label[n])
            .collect();
        labels.sort_unstable();
        for (&node, label) in backward.iter().chain(&forward).zip(labels) {
            self.label[node] = label;
            if let Some(other) = self.partner[node] {
                self.label[other] = label;
            }
        }
        true
    }

    /// Marks a node (both ends of a pair) as seen in this walk.
    fn mark(&mut self, node: usize) {
        self.seen[node] = self.epoch;
        if let Some(other) = self.partner[node] {
            self.seen[other] = self.epoch;
        }
    }

    fn is_marked(&self, node: usize) -> bool {
        self.seen[node] == self.epoch
    }

    fn into_schedule(self) -> Schedule {
        let Graph {
            mut actions, order, ..
        } = self;
        let mut taken: Vec<Option<Action>> = actions.drain(..).map(Some).collect();
        Schedule::new(
            order
                .into_iter()
                .map(|ids| ids.into_iter().map(|id| taken[id].take()).collect())
                .collect(),
        )
    }
}
