//! Hand-written scenarios, each with an exact message order: the four
//! scenarios of PyTorch's Remote Reference Protocol note and the corner
//! cases around them. Every step still goes through the world's
//! invariant checks.

use ferry_rref::protocol::{Control, Event, ForkId, GloballyUniqueId, Holder, RRefId, WorkerId};

use super::world::{Msg, World};

/// Unwraps a step, panicking with the violation and the trace so far.
macro_rules! ok {
    ($w:ident, $e:expr) => {
        match $e {
            Ok(v) => v,
            Err(e) => panic!("{e}\ntrace:\n{}", $w.trace_text()),
        }
    };
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    ForkRequest,
    ChildAccept,
    UserDelete,
}

fn is_kind(c: Control, kind: Kind) -> bool {
    matches!(
        (c, kind),
        (Control::ForkRequest { .. }, Kind::ForkRequest)
            | (Control::ChildAccept { .. }, Kind::ChildAccept)
            | (Control::UserDelete { .. }, Kind::UserDelete)
    )
}

/// A control message of `kind` sent by `from`.
fn control(from: WorkerId, kind: Kind) -> impl Fn(&Msg) -> bool {
    move |m| match m {
        Msg::Control {
            from: f, envelope, ..
        } => *f == from && is_kind(envelope.control, kind),
        _ => false,
    }
}

fn user_msg(to: WorkerId) -> impl Fn(&Msg) -> bool {
    move |m| matches!(m, Msg::User { to: t, .. } if *t == to)
}

fn remote_call(m: &Msg) -> bool {
    matches!(m, Msg::RemoteCall { .. })
}

fn remote_return(m: &Msg) -> bool {
    matches!(m, Msg::RemoteReturn { .. })
}

fn any_control(m: &Msg) -> bool {
    m.control().is_some()
}

/// Delivers the control message matching `pred`, then its ack.
fn exchange(w: &mut World, pred: impl Fn(&Msg) -> bool) {
    let Some(m @ Msg::Control { from, to, envelope }) = w.find(pred) else {
        panic!(
            "no such control message in flight\ntrace:\n{}",
            w.trace_text()
        );
    };
    ok!(w, w.deliver_where(|x| *x == m));
    let ack = Msg::Ack {
        from: to,
        to: from,
        seq: envelope.seq,
    };
    ok!(w, w.deliver_where(|x| *x == ack));
}

/// Delivers the user message to `to` and returns the handle it became.
fn receive(w: &mut World, to: WorkerId) -> Holder {
    ok!(w, w.deliver_where(user_msg(to)));
    w.held[to as usize].last().unwrap().0
}

fn fork_of(h: Holder) -> ForkId {
    match h {
        Holder::User(f) => f,
        Holder::Owner(r) => panic!("expected a user handle, got the owner of {r}"),
    }
}

fn owner_deletes(w: &World, r: RRefId) -> usize {
    w.events
        .iter()
        .filter(|(_, e)| *e == Event::OwnerDeleted(r))
        .count()
}

/// Drops everything, drains the network, and checks the end state: every
/// table empty and `r` deleted exactly once, on `owner`.
fn finish(w: &mut World, r: RRefId, owner: WorkerId) {
    // A user message delivered while draining hands out a handle, which
    // is dropped in turn.
    while {
        ok!(w, w.drop_everything());
        ok!(w, w.deliver_all());
        w.held.iter().any(|h| !h.is_empty())
    } {}
    ok!(w, w.check_quiescent());
    assert_eq!(owner_deletes(w, r), 1, "trace:\n{}", w.trace_text());
    assert_eq!(w.deleted_on(r), Some(owner));
}

/// Seed scenario "User Share RRef with Owner as Return Value": A (0) calls
/// `remote` on B (1); A's delete waits for B's acknowledgement (G2).
#[test]
fn user_shares_with_owner_as_return_value() {
    let mut w = World::new(2, true);
    let a = ok!(w, w.remote(0, 1));
    let r = w.rref_of(0, a);
    ok!(w, w.drop_handle(0, a));
    assert!(
        w.find(any_control).is_none(),
        "A must not send its delete before B acknowledges the remote call"
    );
    ok!(w, w.deliver_where(remote_call));
    assert!(w.workers[1].owns(r));
    assert_eq!(owner_deletes(&w, r), 0);
    ok!(w, w.deliver_where(remote_return));
    assert!(w.find(control(0, Kind::UserDelete)).is_some());
    assert_eq!(owner_deletes(&w, r), 0);
    exchange(&mut w, control(0, Kind::UserDelete));
    assert_eq!(w.deleted_on(r), Some(1));
    finish(&mut w, r, 1);
}

/// Seed scenario "User Share RRef with Owner as Argument": A (0) creates the
/// RRef on B (1), then passes it to B in an rpc that overtakes the remote
/// call itself.
#[test]
fn user_shares_with_owner_as_argument() {
    let mut w = World::new(2, true);
    let a = ok!(w, w.remote(0, 1));
    let r = w.rref_of(0, a);
    ok!(w, w.fork(0, a, 1)).unwrap();
    ok!(w, w.drop_handle(0, a));
    // The rpc arrives first: B gets its owner handle and accepts the child.
    let b = receive(&mut w, 1);
    assert_eq!(b, Holder::Owner(r));
    assert!(w.find(control(1, Kind::ChildAccept)).is_some());
    exchange(&mut w, control(1, Kind::ChildAccept));
    // A's own creation is still unconfirmed: no delete yet.
    assert!(w.find(control(0, Kind::UserDelete)).is_none());
    // The rpc's function finishes before the value is even created.
    ok!(w, w.drop_handle(1, b));
    assert_eq!(owner_deletes(&w, r), 0);
    ok!(w, w.deliver_where(remote_call));
    assert!(w.workers[1].owns(r));
    ok!(w, w.deliver_where(remote_return));
    exchange(&mut w, control(0, Kind::UserDelete));
    assert_eq!(w.deleted_on(r), Some(1));
    finish(&mut w, r, 1);
}

/// Seed scenario "Owner Share RRef with User": B (0) passes its local RRef
/// to C (1) and drops it at once; the fork keeps the value alive.
#[test]
fn owner_shares_with_user() {
    // An owner parent: w0 owns the RRef and forks it to w1.
    let mut w = World::new(2, true);
    let r = ok!(w, w.create_owner(0));
    ok!(w, w.fork(0, Holder::Owner(r), 1)).unwrap();
    ok!(w, w.drop_handle(0, Holder::Owner(r)));
    assert_eq!(owner_deletes(&w, r), 0);
    assert!(w.workers[0].owns(r));
    let c = receive(&mut w, 1);
    assert!(
        w.workers[1].is_confirmed(c),
        "a fork from the owner is confirmed at once"
    );
    assert!(
        w.find(any_control).is_none(),
        "owner to user needs no control message"
    );
    ok!(w, w.drop_handle(1, c));
    exchange(&mut w, control(1, Kind::UserDelete));
    assert_eq!(w.deleted_on(r), Some(0));
    finish(&mut w, r, 0);
}

/// Seed scenario "User Share RRef with User": A (0) creates the RRef on B
/// (1) and passes it to C (2); A is held until B confirms C and C accepts.
#[test]
fn user_shares_with_user() {
    let mut w = World::new(3, true);
    let a = ok!(w, w.remote(0, 1));
    let r = w.rref_of(0, a);
    ok!(w, w.fork(0, a, 2)).unwrap();
    ok!(w, w.drop_handle(0, a));
    ok!(w, w.deliver_where(remote_call));
    ok!(w, w.deliver_where(remote_return));
    assert!(
        w.find(control(0, Kind::UserDelete)).is_none(),
        "G2: A waits for its child"
    );
    let c = receive(&mut w, 2);
    assert!(!w.workers[2].is_confirmed(c));
    exchange(&mut w, control(2, Kind::ForkRequest));
    assert!(w.workers[2].is_confirmed(c));
    assert!(w.find(control(0, Kind::UserDelete)).is_none());
    exchange(&mut w, control(2, Kind::ChildAccept));
    exchange(&mut w, control(0, Kind::UserDelete));
    assert_eq!(owner_deletes(&w, r), 0, "C still holds the RRef");
    ok!(w, w.drop_handle(2, c));
    exchange(&mut w, control(2, Kind::UserDelete));
    assert_eq!(w.deleted_on(r), Some(1));
    finish(&mut w, r, 1);
}

/// Builds owner -> A -> Y -> Z, each parent dropping its handle right after
/// forking, and processes all of Z's messages (fork request, accept,
/// delete) before any of Y's. `remote_creator`: the RRef is made by a
/// `remote` call from A whose call is delivered only at the end.
fn z_before_y(remote_creator: bool) {
    let (owner, a_w, y_w, z_w) = (0, 1, 2, 3);
    let mut w = World::new(4, true);
    let (r, a) = if remote_creator {
        let a = ok!(w, w.remote(a_w, owner));
        (w.rref_of(a_w, a), a)
    } else {
        let r = ok!(w, w.create_owner(owner));
        ok!(w, w.fork(owner, Holder::Owner(r), a_w)).unwrap();
        ok!(w, w.drop_handle(owner, Holder::Owner(r)));
        (r, receive(&mut w, a_w))
    };
    ok!(w, w.fork(a_w, a, y_w)).unwrap();
    ok!(w, w.drop_handle(a_w, a));
    let y = receive(&mut w, y_w);
    ok!(w, w.fork(y_w, y, z_w)).unwrap();
    ok!(w, w.drop_handle(y_w, y));
    let z = receive(&mut w, z_w);

    // Everything of Z's first.
    exchange(&mut w, control(z_w, Kind::ForkRequest));
    assert!(w.workers[z_w as usize].is_confirmed(z));
    exchange(&mut w, control(z_w, Kind::ChildAccept));
    ok!(w, w.drop_handle(z_w, z));
    exchange(&mut w, control(z_w, Kind::UserDelete));
    assert_eq!(owner_deletes(&w, r), 0, "A is still held by Y (G2)");
    assert!(
        w.find(control(a_w, Kind::UserDelete)).is_none(),
        "A must wait for Y"
    );

    // Now Y's fork request: Y is confirmed, accepts to A, and both delete.
    exchange(&mut w, control(y_w, Kind::ForkRequest));
    assert!(w.find(control(y_w, Kind::UserDelete)).is_some());
    exchange(&mut w, control(y_w, Kind::ChildAccept));
    if remote_creator {
        assert!(
            w.find(control(a_w, Kind::UserDelete)).is_none(),
            "the creator also waits for its own confirmation"
        );
        assert_eq!(owner_deletes(&w, r), 0);
        ok!(w, w.deliver_where(remote_call));
        ok!(w, w.deliver_where(remote_return));
    }
    assert!(w.find(control(a_w, Kind::UserDelete)).is_some());
    finish(&mut w, r, owner);
}

/// The protocol note's "Z before Y" case: owner -> A -> Y -> Z, with Z's fork
/// request and delete processed before anything of Y's.
#[test]
fn z_before_y_out_of_order() {
    z_before_y(false);
}

/// The same with an RRef created by A's `remote` call, whose call reaches
/// the owner last (the owner learns of Z before the value exists).
#[test]
fn z_before_y_on_a_remote_created_rref() {
    z_before_y(true);
}

/// Eight forwards in a row, each parent dropping its handle right after
/// forking; then every message is delivered newest first.
fn chain_of_forwards(remote_creator: bool) {
    let mut w = World::new(5, true);
    let owner = 0;
    let (r, mut holder, mut at) = if remote_creator {
        let h = ok!(w, w.remote(1, owner));
        (w.rref_of(1, h), h, 1)
    } else {
        let r = ok!(w, w.create_owner(owner));
        (r, Holder::Owner(r), owner)
    };
    let hops: [WorkerId; 8] = [1, 2, 3, 4, 1, 2, 3, 4];
    for (i, &to) in hops.iter().enumerate() {
        let to = if remote_creator && i == 0 { 2 } else { to };
        ok!(w, w.fork(at, holder, to)).unwrap();
        ok!(w, w.drop_handle(at, holder));
        holder = receive(&mut w, to);
        at = to;
    }
    assert_eq!(owner_deletes(&w, r), 0);
    ok!(w, w.drop_handle(at, holder));
    // Newest first: the end of the chain is heard of before its start.
    for _ in 0..10_000 {
        let Some(last) = w.net.len().checked_sub(1) else {
            break;
        };
        ok!(w, w.deliver(last, false));
        ok!(w, w.check_handles());
    }
    finish(&mut w, r, owner);
}

/// A chain of 8 forwards from the owner, delivered newest first.
#[test]
fn chain_of_eight_forwards() {
    chain_of_forwards(false);
}

/// A chain of 8 forwards from a `remote` creator, delivered newest first
/// (the remote call itself arrives last).
#[test]
fn chain_of_eight_forwards_from_a_remote_creator() {
    chain_of_forwards(true);
}

/// A copy of a fork request shows up after the user's delete and the
/// owner's deletion: it must be ignored, not recreate an entry.
#[test]
fn duplicated_fork_request_after_user_delete_does_not_leak() {
    let (owner, a_w, c_w) = (0, 1, 2);
    let mut w = World::new(3, true);
    let r = ok!(w, w.create_owner(owner));
    ok!(w, w.fork(owner, Holder::Owner(r), a_w)).unwrap();
    ok!(w, w.drop_handle(owner, Holder::Owner(r)));
    let a = receive(&mut w, a_w);
    ok!(w, w.fork(a_w, a, c_w)).unwrap();
    ok!(w, w.drop_handle(a_w, a));
    let c = receive(&mut w, c_w);
    let request = w.find(control(c_w, Kind::ForkRequest)).unwrap();
    let i = w.net.iter().position(|m| *m == request).unwrap();
    ok!(w, w.duplicate(i));
    exchange(&mut w, control(c_w, Kind::ForkRequest));
    exchange(&mut w, control(c_w, Kind::ChildAccept));
    exchange(&mut w, control(a_w, Kind::UserDelete));
    ok!(w, w.drop_handle(c_w, c));
    exchange(&mut w, control(c_w, Kind::UserDelete));
    assert_eq!(w.deleted_on(r), Some(owner));
    // The stale copy arrives now.
    assert_eq!(w.net, vec![request]);
    ok!(w, w.deliver(0, false));
    assert!(
        !w.workers[owner as usize].owns(r),
        "the duplicate recreated an entry"
    );
    finish(&mut w, r, owner);
}

/// The creator's remote call times out before it reaches the owner: the
/// handle can no longer be forked, its delete goes out at once, and the
/// owner deletes the value as soon as the call arrives. `discard_late`: the
/// driver drops the late reply instead of applying it.
fn timed_out_before_call_arrived(discard_late: bool) {
    let mut w = World::new(2, true);
    let a = ok!(w, w.remote(0, 1));
    let r = w.rref_of(0, a);
    ok!(w, w.timeout(fork_of(a)));
    assert!(w.workers[0].creation_failed(a));
    assert_eq!(
        ok!(w, w.fork(0, a, 1)),
        None,
        "fork after a timeout is refused"
    );
    ok!(w, w.drop_handle(0, a));
    exchange(&mut w, control(0, Kind::UserDelete));
    assert!(w.workers[1].owns(r), "the owner keeps the early delete");
    assert_eq!(owner_deletes(&w, r), 0);
    ok!(w, w.deliver_where(remote_call));
    assert_eq!(w.deleted_on(r), Some(1), "nothing references the value");
    let i = w.net.iter().position(remote_return).unwrap();
    ok!(w, w.deliver(i, discard_late));
    finish(&mut w, r, 1);
}

#[test]
fn remote_timed_out_before_call_arrived() {
    timed_out_before_call_arrived(false);
}

#[test]
fn remote_timed_out_before_call_arrived_reply_discarded() {
    timed_out_before_call_arrived(true);
}

/// The creator forked to C before its call timed out: C keeps the value
/// alive after the creator's early delete.
#[test]
fn remote_timed_out_after_forking_a_child() {
    let (a_w, owner, c_w) = (0, 1, 2);
    let mut w = World::new(3, true);
    let a = ok!(w, w.remote(a_w, owner));
    let r = w.rref_of(a_w, a);
    ok!(w, w.fork(a_w, a, c_w)).unwrap();
    ok!(w, w.timeout(fork_of(a)));
    assert_eq!(ok!(w, w.fork(a_w, a, owner)), None);
    ok!(w, w.drop_handle(a_w, a));
    assert!(
        w.find(control(a_w, Kind::UserDelete)).is_none(),
        "G2: the child is not confirmed yet"
    );
    let c = receive(&mut w, c_w);
    exchange(&mut w, control(c_w, Kind::ForkRequest));
    exchange(&mut w, control(c_w, Kind::ChildAccept));
    exchange(&mut w, control(a_w, Kind::UserDelete));
    ok!(w, w.deliver_where(remote_call));
    assert_eq!(owner_deletes(&w, r), 0, "C still holds the RRef");
    ok!(w, w.drop_handle(c_w, c));
    exchange(&mut w, control(c_w, Kind::UserDelete));
    assert_eq!(w.deleted_on(r), Some(owner));
    finish(&mut w, r, owner);
}

/// A user passes its RRef to itself: the new user needs the owner's
/// confirmation, and the old one waits for it (the accept is local).
#[test]
fn user_forks_to_itself() {
    let mut w = World::new(2, true);
    let a = ok!(w, w.remote(0, 1));
    let r = w.rref_of(0, a);
    ok!(w, w.deliver_where(remote_call));
    ok!(w, w.deliver_where(remote_return));
    assert!(w.workers[0].is_confirmed(a));
    ok!(w, w.fork(0, a, 0)).unwrap();
    let a2 = receive(&mut w, 0);
    assert_ne!(a, a2);
    assert!(!w.workers[0].is_confirmed(a2));
    ok!(w, w.drop_handle(0, a));
    assert!(
        w.find(control(0, Kind::UserDelete)).is_none(),
        "G2: the old user waits for its child"
    );
    exchange(&mut w, control(0, Kind::ForkRequest));
    assert!(w.workers[0].is_confirmed(a2));
    let deletes_old = |m: &Msg| {
        m.control()
            == Some(Control::UserDelete {
                rref_id: r,
                fork_id: fork_of(a),
            })
    };
    assert!(w.find(deletes_old).is_some());
    exchange(&mut w, deletes_old);
    assert_eq!(owner_deletes(&w, r), 0);
    finish(&mut w, r, 1);
}

/// The owner passes its RRef to itself: no control message at all.
#[test]
fn owner_forks_to_itself() {
    let mut w = World::new(1, true);
    let r = ok!(w, w.create_owner(0));
    ok!(w, w.fork(0, Holder::Owner(r), 0)).unwrap();
    ok!(w, w.drop_handle(0, Holder::Owner(r)));
    assert!(w.workers[0].owns(r));
    assert_eq!(owner_deletes(&w, r), 0);
    let again = receive(&mut w, 0);
    assert_eq!(again, Holder::Owner(r));
    assert!(w.net.is_empty());
    ok!(w, w.drop_handle(0, again));
    assert_eq!(w.deleted_on(r), Some(0));
    finish(&mut w, r, 0);
}

/// Checks the checker: dropping the owner's handle while a user message
/// carries a fork must not delete (fork() recorded it), and the checker
/// would flag a delete at that moment.
#[test]
fn owner_drop_with_fork_in_flight_does_not_delete() {
    // An owner parent: w0 owns the RRef and forks it to w1.
    let mut w = World::new(2, true);
    let r = ok!(w, w.create_owner(0));
    ok!(w, w.fork(0, Holder::Owner(r), 1)).unwrap();
    ok!(w, w.drop_handle(0, Holder::Owner(r)));
    assert_eq!(owner_deletes(&w, r), 0);
    assert!(w.workers[0].owns(r));
    let err = w.check_event(0, Event::OwnerDeleted(r)).unwrap_err();
    assert!(err.contains("in flight"), "{err}");
    finish(&mut w, r, 0);
}

/// Checks the checker: a delete while a handle is held, a second delete,
/// a delete of something never created, and a leak are all reported.
#[test]
fn checker_reports_unsafe_deletes_resurrections_and_leaks() {
    // An owner parent: w0 owns the RRef and forks it to w1.
    let mut w = World::new(2, true);
    let r = ok!(w, w.create_owner(0));
    let err = w.check_event(0, Event::OwnerDeleted(r)).unwrap_err();
    assert!(err.contains("holds"), "{err}");
    ok!(w, w.drop_handle(0, Holder::Owner(r)));
    assert_eq!(w.deleted_on(r), Some(0));
    let err = w.check_event(0, Event::OwnerDeleted(r)).unwrap_err();
    assert!(err.contains("resurrection"), "{err}");

    // A user holding a confirmed user handle.
    let r2 = ok!(w, w.create_owner(0));
    ok!(w, w.fork(0, Holder::Owner(r2), 1)).unwrap();
    let c = receive(&mut w, 1);
    ok!(w, w.drop_handle(0, Holder::Owner(r2)));
    // Pretend the handle is gone without telling the protocol.
    let saved = std::mem::take(&mut w.held[1]);
    let err = w.check_event(0, Event::OwnerDeleted(r2)).unwrap_err();
    assert!(err.contains("still has user"), "{err}");
    w.held[1] = saved;
    ok!(w, w.drop_handle(1, c));

    let never = RRefId(GloballyUniqueId {
        created_on: 1,
        local_id: 99,
    });
    let err = w.check_event(1, Event::OwnerDeleted(never)).unwrap_err();
    assert!(err.contains("never created"), "{err}");

    // A user message lost by a broken driver leaks the owner's entry.
    let r3 = ok!(w, w.create_owner(0));
    ok!(w, w.fork(0, Holder::Owner(r3), 1)).unwrap();
    w.net.clear();
    ok!(w, w.drop_handle(0, Holder::Owner(r3)));
    ok!(w, w.deliver_all());
    let err = w.check_quiescent().unwrap_err();
    assert!(err.contains("leak"), "{err}");
}

/// Outside PyTorch's model (where a timed-out `remote` call still arrives
/// eventually): a call that never left its creator. The creator must not
/// send a deletion the owner would keep forever as an early delete.
#[test]
fn remote_call_that_never_leaves_leaves_nothing_anywhere() {
    let mut w = World::new(2, true);
    let a = ok!(w, w.remote(0, 1));
    let i = w.net.iter().position(remote_call).unwrap();
    w.net.remove(i);
    ok!(w, w.not_sent(fork_of(a)));
    assert!(w.workers[0].creation_failed(a));
    assert!(w.workers[0].fork(a).is_err());
    ok!(w, w.drop_handle(0, a));
    assert!(w.net.is_empty(), "no message may go out for it");
    ok!(w, w.deliver_all());
    ok!(w, w.check_quiescent());
}

/// A user message refused before its receiver decoded it (no such
/// function, a wrong signature, or it never left): the sender undoes the
/// fork. From a user, the parent is released (G2 no longer waits); from
/// the owner, the fork it counted goes; nothing is sent for the fork.
#[test]
fn refused_user_messages_undo_their_forks() {
    let mut w = World::new(3, true);
    // A user parent: w0 created the RRef on w1 and forks it to w2.
    let a = ok!(w, w.remote(0, 1));
    let r = w.rref_of(0, a);
    ok!(w, w.deliver_where(remote_call));
    ok!(w, w.deliver_where(remote_return));
    ok!(w, w.fork(0, a, 2));
    assert_eq!(w.workers[0].counts().pending_children, 1);
    let i = w.net.iter().position(user_msg(2)).unwrap();
    ok!(w, w.refuse(i));
    assert_eq!(w.workers[0].counts().pending_children, 0);
    assert!(w.net.is_empty(), "nothing goes out for a refused fork");
    ok!(w, w.drop_handle(0, a));
    finish(&mut w, r, 1);

    // An owner parent: w0 owns the RRef and forks it to w1.
    let mut w = World::new(2, true);
    let r = ok!(w, w.create_owner(0));
    ok!(w, w.fork(0, Holder::Owner(r), 1));
    let i = w.net.iter().position(user_msg(1)).unwrap();
    ok!(w, w.refuse(i));
    ok!(w, w.drop_handle(0, Holder::Owner(r)));
    // Deleted at once: the refused fork no longer holds the value.
    assert_eq!(owner_deletes(&w, r), 1, "trace:\n{}", w.trace_text());
    finish(&mut w, r, 0);
}
