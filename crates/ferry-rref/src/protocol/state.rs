//! The per-worker bookkeeping of the RRef protocol, without any I/O.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use super::dedup::Dedup;
use super::ids::{ForkId, GloballyUniqueId, RRefId, WorkerId};
use super::message::{Control, Envelope, ForkData, Transmit};

/// What a local handle refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Holder {
    /// This worker owns the RRef: the handle is a local reference to the
    /// [`OwnerRRef`](RRefProtocol) entry.
    Owner(RRefId),
    /// This worker is a user of the RRef: the handle is the `UserRRef` with
    /// this fork id.
    User(ForkId),
}

/// Something the driver must act on, besides transmits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// No user can reach this owned RRef any more: drop its value.
    OwnerDeleted(RRefId),
    /// The owner confirmed this user.
    UserConfirmed(ForkId),
}

/// Why a fork was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ForkError {
    /// The RRef's creation failed or timed out, so there is nothing to share.
    #[error("the creation of {rref_id} failed or timed out")]
    CreationFailed {
        /// The RRef.
        rref_id: RRefId,
    },
    /// The handle is not known here (already deleted, or from elsewhere).
    #[error("{0:?} is not known on this worker")]
    Unknown(Holder),
}

/// How the creation of a user's RRef stands (only the creator of a
/// `remote` call has one that is not `Confirmed` from the start or after
/// its fork request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Confirmation {
    Pending,
    Confirmed,
    /// The remote call that creates the value timed out or failed to send;
    /// the owner may or may not have received it.
    CreationFailed,
}

#[derive(Debug)]
struct Owner {
    /// Users the owner knows about.
    forks: HashSet<ForkId>,
    /// Handles held by code on this worker.
    local_handles: u32,
    /// Whether the value exists or is being computed (the creating message
    /// arrived, or the RRef was made here). False for an entry that a fork
    /// request or a handle made before the creating message arrived.
    created: bool,
    /// Users deleted before the owner learnt of them (a creator whose
    /// `remote` timed out deletes without knowing if the owner got it).
    early_deletes: HashSet<ForkId>,
}

#[derive(Debug)]
struct User {
    rref_id: RRefId,
    owner: WorkerId,
    confirmation: Confirmation,
    /// Whether local code still holds the handle.
    alive: bool,
    /// Forks of this user not yet confirmed by the owner (G2).
    children: u32,
    /// The parent to notify once the owner confirms this user.
    accept_to: Option<WorkerId>,
    /// The creating `remote` call never left: the owner does not know
    /// this user, so it is forgotten without a deletion.
    never_sent: bool,
}

impl User {
    fn deletable(&self) -> bool {
        !self.alive && self.children == 0 && self.confirmation != Confirmation::Pending
    }
}

/// The state of the RRef protocol on one worker, as a sans-IO state machine.
///
/// The driver calls the methods below as its handles are created, forked,
/// received and dropped and as control messages arrive, then drains
/// [`poll_transmit`](Self::poll_transmit) and [`poll_event`](Self::poll_event).
/// Nothing here blocks, sleeps or does I/O, so a simulator can drive many
/// workers under any message schedule (see the crate's tests).
///
/// ```
/// use ferry_rref::protocol::{Event, Holder, RRefProtocol};
///
/// let mut owner = RRefProtocol::new(0);
/// let mut user = RRefProtocol::new(1);
/// let rref = owner.create_owner();
/// let data = owner.fork(Holder::Owner(rref)).unwrap();
/// let handle = user.receive(data);
/// assert!(user.is_confirmed(handle));
/// owner.drop_handle(Holder::Owner(rref));
/// user.drop_handle(handle);
/// let delete = user.poll_transmit().unwrap();
/// assert!(owner.handle_control(1, delete.envelope));
/// user.handle_ack(delete.to, delete.envelope.seq);
/// assert_eq!(owner.poll_event(), Some(Event::OwnerDeleted(rref)));
/// assert!(owner.is_empty() && user.is_empty());
/// ```
#[derive(Debug)]
pub struct RRefProtocol {
    me: WorkerId,
    next_local_id: u64,
    owners: HashMap<RRefId, Owner>,
    users: HashMap<ForkId, User>,
    /// Child fork -> the user on this worker that forked it.
    pending_children: HashMap<ForkId, ForkId>,
    next_seq: HashMap<WorkerId, u64>,
    unacked: BTreeMap<(WorkerId, u64), Control>,
    dedup: HashMap<WorkerId, Dedup>,
    transmits: VecDeque<Transmit>,
    events: VecDeque<Event>,
}

/// Counts of the protocol's tables on one worker, for debugging and leak
/// reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Owned RRefs (including entries waiting for their creating message).
    pub owners: usize,
    /// Users the owner has confirmed.
    pub confirmed_users: usize,
    /// Users waiting for the owner's confirmation.
    pub pending_users: usize,
    /// Forks of local users waiting for the child's acceptance.
    pub pending_children: usize,
    /// Control messages sent and not yet acknowledged.
    pub unacked: usize,
}

impl RRefProtocol {
    /// The state of worker `me`.
    pub fn new(me: WorkerId) -> Self {
        Self {
            me,
            next_local_id: 0,
            owners: HashMap::new(),
            users: HashMap::new(),
            pending_children: HashMap::new(),
            next_seq: HashMap::new(),
            unacked: BTreeMap::new(),
            dedup: HashMap::new(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
        }
    }

    /// This worker.
    pub fn me(&self) -> WorkerId {
        self.me
    }

    fn next_id(&mut self) -> GloballyUniqueId {
        self.next_local_id += 1;
        GloballyUniqueId {
            created_on: self.me,
            local_id: self.next_local_id,
        }
    }

    /// A new RRef owned here, held by one local handle (`RRef::new`, or a
    /// `remote` call to this worker itself).
    pub fn create_owner(&mut self) -> RRefId {
        let rref_id = RRefId(self.next_id());
        self.owners.insert(
            rref_id,
            Owner {
                forks: HashSet::new(),
                local_handles: 1,
                created: true,
                early_deletes: HashSet::new(),
            },
        );
        rref_id
    }

    /// A new RRef owned by `owner` (another worker), created by a `remote`
    /// call this worker is about to send. The returned user is pending
    /// until [`remote_confirmed`](Self::remote_confirmed).
    pub fn create_user(&mut self, owner: WorkerId) -> (RRefId, ForkId) {
        debug_assert_ne!(owner, self.me, "a remote call to self creates an owner");
        let rref_id = RRefId(self.next_id());
        let fork_id = ForkId(self.next_id());
        self.users.insert(
            fork_id,
            User {
                rref_id,
                owner,
                confirmation: Confirmation::Pending,
                alive: true,
                children: 0,
                accept_to: None,
                never_sent: false,
            },
        );
        (rref_id, fork_id)
    }

    /// The owner side of a `remote` call from `creator`: the value is being
    /// made, and the creator's user `fork_id` exists.
    pub fn remote_received(&mut self, rref_id: RRefId, fork_id: ForkId) {
        let owner = self.owner_entry(rref_id);
        owner.created = true;
        if !owner.early_deletes.remove(&fork_id) {
            owner.forks.insert(fork_id);
        }
        self.maybe_delete_owner(rref_id);
    }

    /// The creator's `remote` call was acknowledged by the owner.
    pub fn remote_confirmed(&mut self, fork_id: ForkId) {
        if let Some(u) = self.users.get_mut(&fork_id) {
            if u.confirmation == Confirmation::Pending {
                u.confirmation = Confirmation::Confirmed;
                self.events.push_back(Event::UserConfirmed(fork_id));
            }
            self.maybe_delete_user(fork_id);
        }
    }

    /// The creator's `remote` call timed out or could not be sent: the
    /// handle can no longer be forked, and its deletion is sent without
    /// waiting for a confirmation (the owner holds it back if the call is
    /// still on its way).
    pub fn remote_failed(&mut self, fork_id: ForkId) {
        if let Some(u) = self.users.get_mut(&fork_id) {
            if u.confirmation == Confirmation::Pending {
                u.confirmation = Confirmation::CreationFailed;
            }
            self.maybe_delete_user(fork_id);
        }
    }

    /// The creator's `remote` call never left this worker (it could not be
    /// encoded or queued): the owner will never hear of `fork_id`, so the
    /// user fails like [`remote_failed`](Self::remote_failed) but is
    /// forgotten without a deletion message.
    pub fn remote_not_sent(&mut self, fork_id: ForkId) {
        if let Some(u) = self.users.get_mut(&fork_id) {
            if u.confirmation == Confirmation::Pending {
                u.confirmation = Confirmation::CreationFailed;
                u.never_sent = true;
            }
            self.maybe_delete_user(fork_id);
        }
    }

    /// Shares a handle inside a message: returns what the message carries.
    /// The sender's handle stays alive until the new child is confirmed.
    pub fn fork(&mut self, holder: Holder) -> Result<ForkData, ForkError> {
        match holder {
            Holder::Owner(rref_id) => {
                if !self.owners.contains_key(&rref_id) {
                    return Err(ForkError::Unknown(holder));
                }
                let fork_id = ForkId(self.next_id());
                self.owner_entry(rref_id).forks.insert(fork_id);
                Ok(ForkData {
                    owner: self.me,
                    rref_id,
                    fork_id,
                    parent: self.me,
                })
            }
            Holder::User(parent_fork) => {
                let (rref_id, owner) = match self.users.get(&parent_fork) {
                    None => return Err(ForkError::Unknown(holder)),
                    Some(u) if u.confirmation == Confirmation::CreationFailed => {
                        return Err(ForkError::CreationFailed { rref_id: u.rref_id })
                    }
                    Some(u) => (u.rref_id, u.owner),
                };
                let fork_id = ForkId(self.next_id());
                if let Some(u) = self.users.get_mut(&parent_fork) {
                    u.children += 1;
                }
                self.pending_children.insert(fork_id, parent_fork);
                Ok(ForkData {
                    owner,
                    rref_id,
                    fork_id,
                    parent: self.me,
                })
            }
        }
    }

    /// The message that carried `data` (forked here) never reached its
    /// receiver's code: it failed to encode, was not sent, or the receiver
    /// refused it before decoding it. The fork is undone: a user forgets
    /// the pending child (which may let the user go), an owner forgets the
    /// fork it counted. Nobody else ever heard of the fork, so nothing is
    /// sent for it. A second call, or a call for a fork that was
    /// received after all, changes nothing.
    ///
    /// Only call it when the receiver certainly did not decode the message:
    /// a fork the receiver holds must stay counted.
    pub fn fork_not_delivered(&mut self, data: ForkData) {
        if data.parent != self.me {
            return;
        }
        if data.owner == self.me {
            if let Some(o) = self.owners.get_mut(&data.rref_id) {
                if o.forks.remove(&data.fork_id) {
                    self.maybe_delete_owner(data.rref_id);
                }
            }
        } else if let Some(parent) = self.pending_children.remove(&data.fork_id) {
            if let Some(u) = self.users.get_mut(&parent) {
                u.children = u.children.saturating_sub(1);
            }
            self.maybe_delete_user(parent);
        }
    }

    /// Takes in an RRef that arrived inside a message and returns the local
    /// handle it becomes.
    pub fn receive(&mut self, data: ForkData) -> Holder {
        let ForkData {
            owner,
            rref_id,
            fork_id,
            parent,
        } = data;
        if owner == self.me {
            let me = self.me;
            let entry = self.owner_entry(rref_id);
            entry.local_handles += 1;
            if parent == me {
                // Sent to itself: the fork added when it was sent never
                // becomes a user.
                entry.forks.remove(&fork_id);
            } else {
                // From a user: the owner is the child and is confirmed at
                // once (no fork is recorded for it).
                self.send(parent, Control::ChildAccept { fork_id });
            }
            return Holder::Owner(rref_id);
        }
        let from_owner = parent == owner;
        self.users.insert(
            fork_id,
            User {
                rref_id,
                owner,
                confirmation: if from_owner {
                    Confirmation::Confirmed
                } else {
                    Confirmation::Pending
                },
                alive: true,
                children: 0,
                accept_to: (!from_owner).then_some(parent),
                never_sent: false,
            },
        );
        if !from_owner {
            self.send(owner, Control::ForkRequest { rref_id, fork_id });
        }
        Holder::User(fork_id)
    }

    /// The last local handle was dropped.
    pub fn drop_handle(&mut self, holder: Holder) {
        match holder {
            Holder::Owner(rref_id) => {
                if let Some(o) = self.owners.get_mut(&rref_id) {
                    o.local_handles = o.local_handles.saturating_sub(1);
                    self.maybe_delete_owner(rref_id);
                }
            }
            Holder::User(fork_id) => {
                if let Some(u) = self.users.get_mut(&fork_id) {
                    u.alive = false;
                    self.maybe_delete_user(fork_id);
                }
            }
        }
    }

    /// A control message from `from`. Returns whether it was new (a
    /// duplicate changes nothing); either way the driver acknowledges it.
    pub fn handle_control(&mut self, from: WorkerId, envelope: Envelope) -> bool {
        if !self.dedup.entry(from).or_default().first_time(envelope.seq) {
            return false;
        }
        self.apply(envelope.control);
        true
    }

    fn apply(&mut self, control: Control) {
        match control {
            Control::ForkRequest { rref_id, fork_id } => {
                let owner = self.owner_entry(rref_id);
                if !owner.early_deletes.remove(&fork_id) {
                    owner.forks.insert(fork_id);
                }
                self.maybe_delete_owner(rref_id);
            }
            Control::ChildAccept { fork_id } => {
                if let Some(parent) = self.pending_children.remove(&fork_id) {
                    if let Some(u) = self.users.get_mut(&parent) {
                        u.children = u.children.saturating_sub(1);
                    }
                    self.maybe_delete_user(parent);
                }
            }
            Control::UserDelete { rref_id, fork_id } => {
                let owner = self.owner_entry(rref_id);
                if !owner.forks.remove(&fork_id) {
                    owner.early_deletes.insert(fork_id);
                }
                self.maybe_delete_owner(rref_id);
            }
        }
    }

    /// The receiver acknowledged message `seq` to `to`.
    pub fn handle_ack(&mut self, to: WorkerId, seq: u64) {
        let Some(control) = self.unacked.remove(&(to, seq)) else {
            return;
        };
        if let Control::ForkRequest { fork_id, .. } = control {
            let Some(u) = self.users.get_mut(&fork_id) else {
                return;
            };
            if u.confirmation != Confirmation::Pending {
                return;
            }
            u.confirmation = Confirmation::Confirmed;
            let accept_to = u.accept_to.take();
            self.events.push_back(Event::UserConfirmed(fork_id));
            if let Some(parent) = accept_to {
                self.send(parent, Control::ChildAccept { fork_id });
            }
            self.maybe_delete_user(fork_id);
        }
    }

    /// Shutdown: every user handle still alive is treated as dropped, so
    /// its deletion goes out once nothing holds it back.
    pub fn release_all_users(&mut self) {
        let forks: Vec<ForkId> = self.users.keys().copied().collect();
        for f in forks {
            if let Some(u) = self.users.get_mut(&f) {
                u.alive = false;
            }
            self.maybe_delete_user(f);
        }
    }

    /// Shutdown, after the group has drained: forgets owners that no user
    /// references any more and returns the ones still referenced (leaks).
    pub fn release_owners(&mut self) -> Vec<RRefId> {
        let ids: Vec<RRefId> = self.owners.keys().copied().collect();
        let mut leaked = Vec::new();
        for id in ids {
            let forks = self.owners.get(&id).map_or(0, |o| o.forks.len());
            if forks > 0 {
                leaked.push(id);
            } else if let Some(o) = self.owners.remove(&id) {
                if o.created {
                    self.events.push_back(Event::OwnerDeleted(id));
                }
            }
        }
        leaked.sort();
        leaked
    }

    /// The next control message to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Whether `holder` is confirmed by its owner (always true on the owner).
    pub fn is_confirmed(&self, holder: Holder) -> bool {
        match holder {
            Holder::Owner(_) => true,
            Holder::User(f) => self
                .users
                .get(&f)
                .is_some_and(|u| u.confirmation == Confirmation::Confirmed),
        }
    }

    /// Whether `holder`'s creation failed or timed out.
    pub fn creation_failed(&self, holder: Holder) -> bool {
        match holder {
            Holder::Owner(_) => false,
            Holder::User(f) => self
                .users
                .get(&f)
                .is_some_and(|u| u.confirmation == Confirmation::CreationFailed),
        }
    }

    /// Whether an owner entry for `rref_id` exists here.
    pub fn owns(&self, rref_id: RRefId) -> bool {
        self.owners.contains_key(&rref_id)
    }

    /// The users of `rref_id` this worker has (alive or held back).
    pub fn users_of(&self, rref_id: RRefId) -> impl Iterator<Item = ForkId> + '_ {
        self.users
            .iter()
            .filter(move |(_, u)| u.rref_id == rref_id)
            .map(|(f, _)| *f)
    }

    /// Counts of every table, for debug info and leak reports.
    pub fn counts(&self) -> Counts {
        let confirmed = self
            .users
            .values()
            .filter(|u| u.confirmation == Confirmation::Confirmed)
            .count();
        Counts {
            owners: self.owners.len(),
            confirmed_users: confirmed,
            pending_users: self.users.len() - confirmed,
            pending_children: self.pending_children.len(),
            unacked: self.unacked.len(),
        }
    }

    /// Whether every table is empty: no owners, users, pending children,
    /// unacknowledged messages, undelivered transmits or events, and no
    /// early sequence numbers waiting for a gap to fill.
    pub fn is_empty(&self) -> bool {
        self.owners.is_empty()
            && self.users.is_empty()
            && self.pending_children.is_empty()
            && self.unacked.is_empty()
            && self.transmits.is_empty()
            && self.events.is_empty()
            && self.dedup.values().all(Dedup::is_settled)
    }

    fn owner_entry(&mut self, rref_id: RRefId) -> &mut Owner {
        self.owners.entry(rref_id).or_insert_with(|| Owner {
            forks: HashSet::new(),
            local_handles: 0,
            created: false,
            early_deletes: HashSet::new(),
        })
    }

    fn maybe_delete_owner(&mut self, rref_id: RRefId) {
        let Some(o) = self.owners.get(&rref_id) else {
            return;
        };
        if o.forks.is_empty() && o.local_handles == 0 && o.early_deletes.is_empty() {
            let created = o.created;
            self.owners.remove(&rref_id);
            if created {
                self.events.push_back(Event::OwnerDeleted(rref_id));
            }
        }
    }

    fn maybe_delete_user(&mut self, fork_id: ForkId) {
        let Some(u) = self.users.get(&fork_id) else {
            return;
        };
        if !u.deletable() {
            return;
        }
        let (owner, rref_id, never_sent) = (u.owner, u.rref_id, u.never_sent);
        self.users.remove(&fork_id);
        if !never_sent {
            self.send(owner, Control::UserDelete { rref_id, fork_id });
        }
    }

    fn send(&mut self, to: WorkerId, control: Control) {
        if to == self.me {
            // Only a child accept can go to this worker itself (a user
            // forked to itself); apply it at once.
            self.apply(control);
            return;
        }
        let seq = self.next_seq.entry(to).or_insert(0);
        *seq += 1;
        let envelope = Envelope { seq: *seq, control };
        self.unacked.insert((to, envelope.seq), control);
        self.transmits.push_back(Transmit { to, envelope });
    }
}
