//! The simulated group: one `RRefProtocol` per worker, the network between
//! them, the handles user code holds, and the invariant checks.
//!
//! Every protocol call goes through a `World` method, which then drains the
//! worker's transmits into the network and its events into the log, checking
//! each event the moment it comes out. Violations come back as `Err(text)`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use ferry_rref::protocol::{
    Control, Envelope, Event, ForkData, ForkError, ForkId, Holder, RRefId, RRefProtocol, WorkerId,
};

/// The result of a step: `Err` describes an invariant violation.
pub(crate) type Check<T = ()> = Result<T, String>;

/// How many delivered control messages and acks are kept for late replays.
const HISTORY: usize = 32;

/// One message in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Msg {
    /// A control transmit, a retry of one, or a duplicate.
    Control {
        from: WorkerId,
        to: WorkerId,
        envelope: Envelope,
    },
    /// The receiver `from` acknowledges `seq` to the sender `to`.
    Ack {
        from: WorkerId,
        to: WorkerId,
        seq: u64,
    },
    /// A user message (an rpc argument or result) that carries an RRef.
    User {
        from: WorkerId,
        to: WorkerId,
        data: ForkData,
    },
    /// A `remote` call: `to` makes the value of `rref_id`, created by `from`
    /// whose user is `fork_id`.
    RemoteCall {
        from: WorkerId,
        to: WorkerId,
        rref_id: RRefId,
        fork_id: ForkId,
    },
    /// The owner's reply to a `remote` call.
    RemoteReturn {
        from: WorkerId,
        to: WorkerId,
        fork_id: ForkId,
    },
}

impl Msg {
    /// A control message or an ack: the only kinds the network may drop or
    /// duplicate.
    pub(crate) fn is_control(&self) -> bool {
        matches!(self, Msg::Control { .. } | Msg::Ack { .. })
    }

    /// The control message inside, if any.
    pub(crate) fn control(&self) -> Option<Control> {
        match self {
            Msg::Control { envelope, .. } => Some(envelope.control),
            _ => None,
        }
    }

    /// Whether the message can still hand out a reference to `r`.
    fn carries(&self, r: RRefId) -> bool {
        match self {
            Msg::User { data, .. } => data.rref_id == r,
            Msg::RemoteCall { rref_id, .. } => *rref_id == r,
            _ => false,
        }
    }
}

pub(crate) struct ShowHolder(pub(crate) Holder);

impl fmt::Display for ShowHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Holder::Owner(r) => write!(f, "Owner[{r}]"),
            Holder::User(k) => write!(f, "User[{k}]"),
        }
    }
}

struct ShowControl(Control);

impl fmt::Display for ShowControl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Control::ForkRequest { rref_id, fork_id } => {
                write!(f, "ForkRequest({rref_id}, {fork_id})")
            }
            Control::ChildAccept { fork_id } => write!(f, "ChildAccept({fork_id})"),
            Control::UserDelete { rref_id, fork_id } => {
                write!(f, "UserDelete({rref_id}, {fork_id})")
            }
        }
    }
}

struct ShowData(ForkData);

impl fmt::Display for ShowData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        write!(
            f,
            "fork {} of {} (owner w{}, parent w{})",
            d.fork_id, d.rref_id, d.owner, d.parent
        )
    }
}

struct ShowEvent(Event);

impl fmt::Display for ShowEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Event::OwnerDeleted(r) => write!(f, "OwnerDeleted({r})"),
            Event::UserConfirmed(k) => write!(f, "UserConfirmed({k})"),
        }
    }
}

impl fmt::Display for Msg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Msg::Control { from, to, envelope } => write!(
                f,
                "control w{from}->w{to} #{} {}",
                envelope.seq,
                ShowControl(envelope.control)
            ),
            Msg::Ack { from, to, seq } => write!(f, "ack w{from}->w{to} #{seq}"),
            Msg::User { from, to, data } => {
                write!(f, "user msg w{from}->w{to} with {}", ShowData(data))
            }
            Msg::RemoteCall {
                from,
                to,
                rref_id,
                fork_id,
            } => write!(
                f,
                "remote call w{from}->w{to} creating {rref_id} ({fork_id})"
            ),
            Msg::RemoteReturn { from, to, fork_id } => {
                write!(f, "remote return w{from}->w{to} for {fork_id}")
            }
        }
    }
}

/// Counters over one or many schedules, to see what the schedules reached.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Stats {
    pub(crate) schedules: u64,
    pub(crate) steps: u64,
    pub(crate) delivered: u64,
    /// Control messages `handle_control` reported as already seen.
    pub(crate) duplicates_seen: u64,
    pub(crate) lost: u64,
    pub(crate) retransmits: u64,
    pub(crate) replays: u64,
    pub(crate) remotes: u64,
    pub(crate) owner_deletes: u64,
    pub(crate) timeouts: u64,
    pub(crate) late_returns_applied: u64,
    pub(crate) late_returns_discarded: u64,
    /// A creator's `UserDelete` reached the owner before its remote call.
    pub(crate) early_deletes: u64,
    /// A fork request, or a fork sent to the owner, arrived before the
    /// remote call that creates the value.
    pub(crate) before_creation: u64,
    /// Forks refused because the creation timed out.
    pub(crate) forks_refused: u64,
    pub(crate) self_forks: u64,
    /// User messages their receiver refused (or that never left) before
    /// decoding them: the sender undid the fork.
    pub(crate) refused: u64,
    /// Of those, forks made by the owner itself.
    pub(crate) refused_owner_forks: u64,
    pub(crate) max_in_flight: u64,
}

impl Stats {
    pub(crate) fn add(&mut self, o: &Stats) {
        self.schedules += o.schedules;
        self.steps += o.steps;
        self.delivered += o.delivered;
        self.duplicates_seen += o.duplicates_seen;
        self.lost += o.lost;
        self.retransmits += o.retransmits;
        self.replays += o.replays;
        self.remotes += o.remotes;
        self.owner_deletes += o.owner_deletes;
        self.timeouts += o.timeouts;
        self.late_returns_applied += o.late_returns_applied;
        self.late_returns_discarded += o.late_returns_discarded;
        self.early_deletes += o.early_deletes;
        self.before_creation += o.before_creation;
        self.forks_refused += o.forks_refused;
        self.self_forks += o.self_forks;
        self.refused += o.refused;
        self.refused_owner_forks += o.refused_owner_forks;
        self.max_in_flight = self.max_in_flight.max(o.max_in_flight);
    }
}

/// The simulated group.
pub(crate) struct World {
    pub(crate) workers: Vec<RRefProtocol>,
    /// Per worker, the handles user code holds, with their RRef.
    pub(crate) held: Vec<Vec<(Holder, RRefId)>>,
    /// Messages in flight, in no particular order.
    pub(crate) net: Vec<Msg>,
    /// Per worker, the transmits it sent and has not seen acknowledged: what
    /// its retransmit timer resends.
    unacked: Vec<BTreeMap<(WorkerId, u64), Envelope>>,
    owner_of: BTreeMap<RRefId, WorkerId>,
    /// Creator users whose remote call has neither returned nor timed out.
    pending_remotes: BTreeMap<ForkId, (WorkerId, RRefId)>,
    timed_out: BTreeSet<ForkId>,
    /// RRefs whose remote call is in flight, with the creator's fork.
    calls_in_flight: BTreeMap<RRefId, ForkId>,
    /// Users the owner has learnt of (a fork request or remote call it
    /// processed): only those may be confirmed.
    owner_knows: BTreeSet<ForkId>,
    /// Per user, the children it forked (G2: it may not be deleted before
    /// the owner knows each of them).
    children: BTreeMap<ForkId, Vec<ForkId>>,
    /// RRefs whose value was made (`create_owner` or `remote_received`).
    created: BTreeMap<RRefId, WorkerId>,
    /// RRefs with an `OwnerDeleted` event, and where.
    deleted: BTreeMap<RRefId, WorkerId>,
    confirmed: BTreeSet<ForkId>,
    history: VecDeque<Msg>,
    pub(crate) events: Vec<(WorkerId, Event)>,
    trace: Option<Vec<String>>,
    pub(crate) stats: Stats,
}

fn ix(w: WorkerId) -> usize {
    w as usize
}

impl World {
    /// `n` workers with ids `0..n`; `trace` records every action as text.
    pub(crate) fn new(n: usize, trace: bool) -> Self {
        Self {
            workers: (0..n as WorkerId).map(RRefProtocol::new).collect(),
            held: vec![Vec::new(); n],
            net: Vec::new(),
            unacked: vec![BTreeMap::new(); n],
            owner_of: BTreeMap::new(),
            pending_remotes: BTreeMap::new(),
            timed_out: BTreeSet::new(),
            calls_in_flight: BTreeMap::new(),
            owner_knows: BTreeSet::new(),
            children: BTreeMap::new(),
            created: BTreeMap::new(),
            deleted: BTreeMap::new(),
            confirmed: BTreeSet::new(),
            history: VecDeque::new(),
            events: Vec::new(),
            trace: trace.then(Vec::new),
            stats: Stats::default(),
        }
    }

    pub(crate) fn n(&self) -> usize {
        self.workers.len()
    }

    /// Records a trace line; the text is only built when tracing.
    pub(crate) fn log(&mut self, line: impl FnOnce() -> String) {
        if let Some(t) = &mut self.trace {
            t.push(line());
        }
    }

    pub(crate) fn trace_text(&self) -> String {
        self.trace.as_ref().map_or_else(
            || "(not traced)".to_string(),
            |t| {
                let mut s = String::new();
                for line in t {
                    s.push_str(line);
                    s.push('\n');
                }
                s
            },
        )
    }

    pub(crate) fn pending_remotes(&self) -> impl Iterator<Item = ForkId> + '_ {
        self.pending_remotes.keys().copied()
    }

    pub(crate) fn unacked_count(&self, w: WorkerId) -> usize {
        self.unacked[ix(w)].len()
    }

    pub(crate) fn history_len(&self) -> usize {
        self.history.len()
    }

    pub(crate) fn deleted_on(&self, r: RRefId) -> Option<WorkerId> {
        self.deleted.get(&r).copied()
    }

    /// Moves `w`'s transmits into the network and checks its events.
    fn pump(&mut self, w: WorkerId) -> Check {
        while let Some(t) = self.workers[ix(w)].poll_transmit() {
            if t.to == w {
                return Err(format!("w{w} sent a transmit to itself: {t:?}"));
            }
            if self.unacked[ix(w)]
                .insert((t.to, t.envelope.seq), t.envelope)
                .is_some()
            {
                return Err(format!(
                    "w{w} reused sequence number {} to w{}",
                    t.envelope.seq, t.to
                ));
            }
            let m = Msg::Control {
                from: w,
                to: t.to,
                envelope: t.envelope,
            };
            self.log(|| format!("    w{w} sends {m}"));
            if let Control::UserDelete { fork_id, .. } = t.envelope.control {
                self.check_user_delete(w, fork_id)?;
            }
            self.net.push(m);
        }
        self.stats.max_in_flight = self.stats.max_in_flight.max(self.net.len() as u64);
        while let Some(ev) = self.workers[ix(w)].poll_event() {
            self.log(|| format!("    w{w} event {}", ShowEvent(ev)));
            self.check_event(w, ev)?;
            self.events.push((w, ev));
        }
        Ok(())
    }

    /// G1/G2 at the moment `w` sends the deletion of its user `f`: nothing
    /// on `w` holds `f` any more, and the owner knows every child of `f`.
    fn check_user_delete(&mut self, w: WorkerId, f: ForkId) -> Check {
        if self.held[ix(w)].iter().any(|(h, _)| *h == Holder::User(f)) {
            return Err(format!("w{w} sent UserDelete({f}) while still holding it"));
        }
        for c in self.children.remove(&f).unwrap_or_default() {
            if !self.owner_knows.contains(&c) {
                return Err(format!(
                    "G2: w{w} sent UserDelete({f}) before the owner knew its child {c}"
                ));
            }
        }
        Ok(())
    }

    /// The checks made the moment `w` emits `ev`.
    pub(crate) fn check_event(&mut self, w: WorkerId, ev: Event) -> Check {
        match ev {
            Event::OwnerDeleted(r) => {
                match self.created.get(&r) {
                    None => {
                        return Err(format!(
                            "w{w} emitted OwnerDeleted({r}) for a value never created"
                        ))
                    }
                    Some(&o) if o != w => {
                        return Err(format!(
                            "w{w} emitted OwnerDeleted({r}) but the owner is w{o}"
                        ))
                    }
                    Some(_) => {}
                }
                if let Some(prev) = self.deleted.get(&r) {
                    return Err(format!(
                        "resurrection: {r} deleted again on w{w} (first OwnerDeleted on w{prev})"
                    ));
                }
                for (x, hs) in self.held.iter().enumerate() {
                    if let Some((h, _)) = hs.iter().find(|(_, hr)| *hr == r) {
                        return Err(format!(
                            "unsafe delete: w{w} deleted {r} while w{x} holds {}",
                            ShowHolder(*h)
                        ));
                    }
                }
                if let Some(m) = self.net.iter().find(|m| m.carries(r)) {
                    return Err(format!(
                        "unsafe delete: w{w} deleted {r} while in flight: {m}"
                    ));
                }
                for (x, p) in self.workers.iter().enumerate() {
                    if let Some(f) = p.users_of(r).next() {
                        return Err(format!(
                            "unsafe delete: w{w} deleted {r} while w{x} still has user {f}"
                        ));
                    }
                }
                if self.workers[ix(w)].owns(r) {
                    return Err(format!(
                        "w{w} emitted OwnerDeleted({r}) but still has an owner entry"
                    ));
                }
                self.deleted.insert(r, w);
                self.stats.owner_deletes += 1;
            }
            Event::UserConfirmed(f) => {
                if !self.owner_knows.contains(&f) {
                    return Err(format!(
                        "w{w} confirmed {f} before its owner processed its fork request or remote call"
                    ));
                }
                if !self.confirmed.insert(f) {
                    return Err(format!("w{w} confirmed {f} twice"));
                }
            }
        }
        Ok(())
    }

    /// Every held handle still has its protocol entry, and the retransmit
    /// mirror agrees with the protocol's unacked count.
    pub(crate) fn check_handles(&self) -> Check {
        for (x, hs) in self.held.iter().enumerate() {
            let p = &self.workers[x];
            for &(h, r) in hs {
                let ok = match h {
                    Holder::Owner(o) => o == r && p.owns(r),
                    Holder::User(f) => p.users_of(r).any(|g| g == f),
                };
                if !ok {
                    return Err(format!(
                        "w{x} holds {} of {r} but its protocol has no entry for it",
                        ShowHolder(h)
                    ));
                }
            }
            if p.counts().unacked != self.unacked[x].len() {
                return Err(format!(
                    "w{x}: protocol has {} unacked transmits, the driver saw {}",
                    p.counts().unacked,
                    self.unacked[x].len()
                ));
            }
        }
        Ok(())
    }

    fn note_created(&mut self, r: RRefId, w: WorkerId) -> Check {
        if let Some(prev) = self.created.insert(r, w) {
            return Err(format!("{r} created twice (on w{prev}, then on w{w})"));
        }
        Ok(())
    }

    fn held_rref(&self, w: WorkerId, h: Holder) -> Check<(usize, RRefId)> {
        self.held[ix(w)]
            .iter()
            .position(|(x, _)| *x == h)
            .map(|i| (i, self.held[ix(w)][i].1))
            .ok_or_else(|| format!("driver bug: w{w} does not hold {}", ShowHolder(h)))
    }

    /// The RRef of the handle `h` that `w` holds.
    pub(crate) fn rref_of(&self, w: WorkerId, h: Holder) -> RRefId {
        match self.held_rref(w, h) {
            Ok((_, r)) => r,
            Err(e) => panic!("{e}"),
        }
    }

    /// `RRef::new` on `w` (or a `remote` call to itself).
    pub(crate) fn create_owner(&mut self, w: WorkerId) -> Check<RRefId> {
        let r = self.workers[ix(w)].create_owner();
        self.log(|| format!("w{w} create_owner -> {r}"));
        self.note_created(r, w)?;
        self.owner_of.insert(r, w);
        self.held[ix(w)].push((Holder::Owner(r), r));
        self.pump(w)?;
        Ok(r)
    }

    /// `remote(to, ..)` called on `from`: returns the caller's handle.
    pub(crate) fn remote(&mut self, from: WorkerId, to: WorkerId) -> Check<Holder> {
        if from == to {
            return Ok(Holder::Owner(self.create_owner(from)?));
        }
        let (r, f) = self.workers[ix(from)].create_user(to);
        self.log(|| format!("w{from} remote on w{to} -> {r}, creator {f}"));
        self.owner_of.insert(r, to);
        self.held[ix(from)].push((Holder::User(f), r));
        let m = Msg::RemoteCall {
            from,
            to,
            rref_id: r,
            fork_id: f,
        };
        self.net.push(m);
        self.pending_remotes.insert(f, (from, r));
        self.calls_in_flight.insert(r, f);
        self.stats.remotes += 1;
        self.pump(from)?;
        Ok(Holder::User(f))
    }

    /// `w` puts its handle `h` into a user message to `to`. Returns the fork
    /// data, or `None` when the fork was (rightly) refused.
    pub(crate) fn fork(&mut self, w: WorkerId, h: Holder, to: WorkerId) -> Check<Option<ForkData>> {
        let (_, r) = self.held_rref(w, h)?;
        let res = self.workers[ix(w)].fork(h);
        self.log(|| {
            let got = match res {
                Ok(data) => ShowData(data).to_string(),
                Err(e) => format!("refused: {e}"),
            };
            format!("w{w} fork {} to w{to} -> {got}", ShowHolder(h))
        });
        let must_refuse = matches!(h, Holder::User(f) if self.timed_out.contains(&f));
        match res {
            Err(ForkError::CreationFailed { rref_id }) if must_refuse && rref_id == r => {
                self.stats.forks_refused += 1;
                self.pump(w)?;
                Ok(None)
            }
            other if must_refuse => Err(format!(
                "w{w} forked {} after its remote call timed out: want CreationFailed, got {other:?}",
                ShowHolder(h)
            )),
            Ok(data) => {
                let owner = self.owner_of.get(&r).copied();
                if data.rref_id != r || data.parent != w || Some(data.owner) != owner {
                    return Err(format!(
                        "w{w} fork of {} gave wrong data {data:?} (owner {owner:?})",
                        ShowHolder(h)
                    ));
                }
                if to == w {
                    self.stats.self_forks += 1;
                }
                if let Holder::User(parent) = h {
                    self.children.entry(parent).or_default().push(data.fork_id);
                }
                self.net.push(Msg::User { from: w, to, data });
                self.pump(w)?;
                Ok(Some(data))
            }
            Err(e) => Err(format!(
                "w{w} could not fork its held {}: {e}",
                ShowHolder(h)
            )),
        }
    }

    /// `w`'s code drops its handle `h` (the last local reference).
    pub(crate) fn drop_handle(&mut self, w: WorkerId, h: Holder) -> Check {
        let (i, _) = self.held_rref(w, h)?;
        self.held[ix(w)].swap_remove(i);
        self.log(|| format!("w{w} drop {}", ShowHolder(h)));
        self.workers[ix(w)].drop_handle(h);
        self.pump(w)
    }

    /// The creator's remote call for `f` times out.
    pub(crate) fn timeout(&mut self, f: ForkId) -> Check {
        let Some((w, r)) = self.pending_remotes.remove(&f) else {
            return Err(format!("driver bug: {f} has no pending remote call"));
        };
        self.timed_out.insert(f);
        self.stats.timeouts += 1;
        self.log(|| format!("w{w} remote call for {f} times out: remote_failed"));
        self.workers[ix(w)].remote_failed(f);
        let p = &self.workers[ix(w)];
        if p.users_of(r).any(|g| g == f) && !p.creation_failed(Holder::User(f)) {
            return Err(format!(
                "w{w}: after remote_failed({f}) the user is not marked failed"
            ));
        }
        self.pump(w)
    }

    /// If the remote call for `f` is still in the network, it never left:
    /// take it out and tell the creator. Returns whether it did.
    pub(crate) fn unsend(&mut self, f: ForkId) -> Result<bool, String> {
        let Some(i) = self
            .net
            .iter()
            .position(|m| matches!(m, Msg::RemoteCall { fork_id, .. } if *fork_id == f))
        else {
            return Ok(false);
        };
        self.net.remove(i);
        self.not_sent(f)?;
        Ok(true)
    }

    /// The remote call for `f` never leaves its creator (the caller has
    /// taken it out of the network): the creator is told with `remote_not_sent`.
    pub(crate) fn not_sent(&mut self, f: ForkId) -> Check {
        let Some((w, _)) = self.pending_remotes.remove(&f) else {
            return Err(format!("driver bug: {f} has no pending remote call"));
        };
        self.timed_out.insert(f);
        self.log(|| format!("w{w} remote call for {f} never sent: remote_not_sent"));
        self.workers[ix(w)].remote_not_sent(f);
        self.pump(w)
    }

    /// The user message at `i` is not decoded by its receiver: it failed to
    /// encode or send, or the receiver refused the call (no such function,
    /// a wrong signature). The sender is told with `fork_not_delivered`.
    pub(crate) fn refuse(&mut self, i: usize) -> Check {
        let m = self.net.remove(i);
        let Msg::User { from, data, .. } = m else {
            return Err(format!("driver bug: refusing {m}"));
        };
        self.log(|| format!("refused, never decoded: {m}"));
        self.stats.refused += 1;
        if data.owner == from {
            self.stats.refused_owner_forks += 1;
        }
        // The owner never learns of this child, so G2 no longer waits for it.
        for kids in self.children.values_mut() {
            kids.retain(|c| *c != data.fork_id);
        }
        self.workers[ix(from)].fork_not_delivered(data);
        // A second report (a duplicate of the failure) changes nothing.
        self.workers[ix(from)].fork_not_delivered(data);
        self.pump(from)
    }

    fn remember(&mut self, m: Msg) {
        if self.history.len() == HISTORY {
            self.history.pop_front();
        }
        self.history.push_back(m);
    }

    /// Delivers the message at `i` of the network. A remote return that
    /// arrives after its call timed out is dropped (as the real driver does)
    /// when `discard_late_return`, else applied.
    pub(crate) fn deliver(&mut self, i: usize, discard_late_return: bool) -> Check {
        let m = self.net.remove(i);
        self.stats.delivered += 1;
        match m {
            Msg::Control { from, to, envelope } => {
                let fresh = self.workers[ix(to)].handle_control(from, envelope);
                self.log(|| format!("deliver {m}{}", if fresh { "" } else { " (seen: ignored)" }));
                if fresh {
                    match envelope.control {
                        Control::ForkRequest { rref_id, fork_id } => {
                            self.owner_knows.insert(fork_id);
                            if self.calls_in_flight.contains_key(&rref_id) {
                                self.stats.before_creation += 1;
                            }
                        }
                        Control::UserDelete { rref_id, fork_id } => {
                            if self.calls_in_flight.get(&rref_id) == Some(&fork_id) {
                                self.stats.early_deletes += 1;
                            }
                        }
                        Control::ChildAccept { .. } => {}
                    }
                } else {
                    self.stats.duplicates_seen += 1;
                }
                self.net.push(Msg::Ack {
                    from: to,
                    to: from,
                    seq: envelope.seq,
                });
                self.remember(m);
                self.pump(to)
            }
            Msg::Ack { from, to, seq } => {
                self.log(|| format!("deliver {m}"));
                self.workers[ix(to)].handle_ack(from, seq);
                self.unacked[ix(to)].remove(&(from, seq));
                self.remember(m);
                self.pump(to)
            }
            Msg::User { to, data, .. } => {
                if data.owner == to {
                    // The owner is the child: it knows it from now on.
                    self.owner_knows.insert(data.fork_id);
                    if self.calls_in_flight.contains_key(&data.rref_id) {
                        self.stats.before_creation += 1;
                    }
                }
                let h = self.workers[ix(to)].receive(data);
                self.log(|| format!("deliver {m} -> w{to} holds {}", ShowHolder(h)));
                let want = if data.owner == to {
                    Holder::Owner(data.rref_id)
                } else {
                    Holder::User(data.fork_id)
                };
                if h != want {
                    return Err(format!(
                        "w{to} received {} as {}, expected {}",
                        ShowData(data),
                        ShowHolder(h),
                        ShowHolder(want)
                    ));
                }
                self.held[ix(to)].push((h, data.rref_id));
                self.pump(to)
            }
            Msg::RemoteCall {
                from,
                to,
                rref_id,
                fork_id,
            } => {
                self.log(|| format!("deliver {m}"));
                self.calls_in_flight.remove(&rref_id);
                self.note_created(rref_id, to)?;
                self.owner_knows.insert(fork_id);
                self.workers[ix(to)].remote_received(rref_id, fork_id);
                self.net.push(Msg::RemoteReturn {
                    from: to,
                    to: from,
                    fork_id,
                });
                self.pump(to)
            }
            Msg::RemoteReturn { to, fork_id, .. } => {
                let late = self.timed_out.contains(&fork_id);
                if late && discard_late_return {
                    self.log(|| format!("deliver {m}: late, discarded"));
                    self.stats.late_returns_discarded += 1;
                    return Ok(());
                }
                self.log(|| format!("deliver {m}{}", if late { " (late)" } else { "" }));
                let r = if late {
                    self.stats.late_returns_applied += 1;
                    None
                } else {
                    match self.pending_remotes.remove(&fork_id) {
                        Some((_, r)) => Some(r),
                        None => return Err(format!("driver bug: {fork_id} was not pending")),
                    }
                };
                self.workers[ix(to)].remote_confirmed(fork_id);
                let p = &self.workers[ix(to)];
                let h = Holder::User(fork_id);
                if late && p.is_confirmed(h) {
                    return Err(format!(
                        "w{to}: a late remote return confirmed {fork_id} after remote_failed"
                    ));
                }
                if let Some(r) = r {
                    if p.users_of(r).any(|g| g == fork_id) && !p.is_confirmed(h) {
                        return Err(format!(
                            "w{to}: remote_confirmed({fork_id}) left the user unconfirmed"
                        ));
                    }
                }
                self.pump(to)
            }
        }
    }

    /// Delivers the first message matching `pred`; an error if none does.
    pub(crate) fn deliver_where(&mut self, pred: impl Fn(&Msg) -> bool) -> Check {
        let i = self
            .net
            .iter()
            .position(pred)
            .ok_or_else(|| format!("no such message in flight: {:?}", self.net))?;
        self.deliver(i, false)
    }

    /// The first message matching `pred`, if any is in flight.
    pub(crate) fn find(&self, pred: impl Fn(&Msg) -> bool) -> Option<Msg> {
        self.net.iter().copied().find(pred)
    }

    /// The network makes a copy of the control message or ack at `i`.
    pub(crate) fn duplicate(&mut self, i: usize) -> Check {
        let m = self.net[i];
        if !m.is_control() {
            return Err(format!("driver bug: duplicating {m}"));
        }
        self.log(|| format!("network duplicates {m}"));
        self.net.push(m);
        Ok(())
    }

    /// The network loses the control message or ack at `i`.
    pub(crate) fn lose(&mut self, i: usize) -> Check {
        let m = self.net.remove(i);
        if !m.is_control() {
            return Err(format!("driver bug: losing {m}"));
        }
        self.log(|| format!("network loses {m}"));
        self.stats.lost += 1;
        Ok(())
    }

    /// `w`'s retransmit timer resends its `k`-th unacked transmit.
    pub(crate) fn retransmit(&mut self, w: WorkerId, k: usize) {
        let Some((&(to, _), &envelope)) = self.unacked[ix(w)].iter().nth(k) else {
            return;
        };
        let m = Msg::Control {
            from: w,
            to,
            envelope,
        };
        self.log(|| format!("w{w} retransmits {m}"));
        self.stats.retransmits += 1;
        self.net.push(m);
    }

    /// Every worker resends every unacked transmit.
    pub(crate) fn retransmit_all(&mut self) {
        for w in 0..self.n() {
            for k in 0..self.unacked[w].len() {
                self.retransmit(w as WorkerId, k);
            }
        }
    }

    /// An old control message or ack shows up again, arbitrarily late.
    pub(crate) fn replay(&mut self, k: usize) {
        if let Some(&m) = self.history.get(k) {
            self.log(|| format!("network replays old {m}"));
            self.stats.replays += 1;
            self.net.push(m);
        }
    }

    /// Every worker drops every handle it holds, last first.
    pub(crate) fn drop_everything(&mut self) -> Check {
        for w in 0..self.n() {
            while let Some(&(h, _)) = self.held[w].last() {
                self.drop_handle(w as WorkerId, h)?;
            }
        }
        Ok(())
    }

    /// Delivers everything in order (oldest first), retransmitting what is
    /// still unacked whenever the network runs dry, until nothing is left.
    pub(crate) fn deliver_all(&mut self) -> Check {
        for _ in 0..100_000 {
            if self.net.is_empty() {
                if self.unacked.iter().all(BTreeMap::is_empty) {
                    return Ok(());
                }
                self.retransmit_all();
            }
            self.deliver(0, false)?;
            self.check_handles()?;
        }
        Err("the network did not drain".to_string())
    }

    /// After everything is dropped and the network drained: every table is
    /// empty and every created value was deleted exactly once.
    pub(crate) fn check_quiescent(&self) -> Check {
        if let Some((w, hs)) = self.held.iter().enumerate().find(|(_, hs)| !hs.is_empty()) {
            return Err(format!("w{w} still holds {} handles", hs.len()));
        }
        if let Some(m) = self.net.first() {
            return Err(format!("still in flight: {m}"));
        }
        if let Some(f) = self.pending_remotes.keys().next() {
            return Err(format!("remote call for {f} never returned"));
        }
        for (w, p) in self.workers.iter().enumerate() {
            if !p.is_empty() {
                return Err(format!("leak: w{w} is not empty: {:?}", p.counts()));
            }
            if !self.unacked[w].is_empty() {
                return Err(format!("w{w}: the driver still sees unacked transmits"));
            }
        }
        for (r, o) in &self.created {
            match self.deleted.get(r) {
                None => return Err(format!("leak: {r} created on w{o} was never deleted")),
                Some(d) if d != o => {
                    return Err(format!("{r} created on w{o} but deleted on w{d}"))
                }
                Some(_) => {}
            }
        }
        Ok(())
    }
}
