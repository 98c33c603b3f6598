//! The driver of the RRef protocol on one worker: it feeds the sans-IO
//! [`RRefProtocol`] with what happens to handles and messages, sends its
//! control messages over the agent (retried with back-off), keeps owned
//! values, and serves `remote` and `to_here`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ferry_rpc::watch::{Delivery, MessageWatch, Watches};
use ferry_rpc::{Agent, BoxFuture, RpcError, Service, Value, WeakAgent, WorkerInfo};
use ferry_transport::IncomingMessage;
use ferry_wire::payload::{self, Encoded};
use parking_lot::{Condvar, Mutex};
use tokio::sync::Notify;
use tracing::{debug, warn};

use crate::error::RRefError;
use crate::message::{RRefMessage, RemoteReply, ToHereReply, RREF_SERVICE};
use crate::protocol::{
    Counts, Envelope, Event, ForkData, ForkId, Holder, RRefId, RRefProtocol, Transmit, WorkerId,
};
use crate::slot::{FailureText, OwnerSlot, SlotState};
use crate::wait;

/// How often a control message is tried before it is given up (and the
/// RRef reported as leaked at shutdown).
const SEND_ATTEMPTS: u32 = 8;
/// First back-off between tries; doubles each time.
const FIRST_BACKOFF: Duration = Duration::from_millis(20);
/// Timeout of one try of a control message.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(30);

/// The RRef layer of one worker: PyTorch's `RRefContext`.
///
/// Installed into the agent's options with [`install`](crate::install);
/// found again with [`RRefContext::of`].
pub struct RRefContext {
    agent: OnceLock<WeakAgent>,
    protocol: Mutex<RRefProtocol>,
    values: Mutex<HashMap<RRefId, Arc<OwnerSlot>>>,
    /// Woken whenever an owned value is created here.
    created: Notify,
    /// Why creations failed, for the errors of later uses.
    creation_errors: Mutex<HashMap<ForkId, String>>,
    /// `remote` calls this worker sent that have not been answered.
    pending_remotes: AtomicUsize,
    /// Woken whenever a control message is acknowledged or given up, or a
    /// remote call answered.
    progress: Notify,
    shut_down: AtomicBool,
    leaked: Mutex<Vec<RRefId>>,
    /// Bumped whenever the tables may have changed, for threads waiting on them.
    generation: Mutex<u64>,
    changed: Condvar,
}

impl std::fmt::Debug for RRefContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RRefContext")
            .field("counts", &self.debug_info())
            .finish()
    }
}

/// Debug counts of the RRef layer on one worker (PyTorch's
/// `_get_debug_info` RRef part).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DebugInfo {
    /// RRefs owned here.
    pub num_owner_rrefs: usize,
    /// Users here confirmed by their owners.
    pub num_confirmed_users: usize,
    /// Users here waiting for their owner's confirmation.
    pub num_pending_users: usize,
    /// Forks of users here waiting for the child to be confirmed.
    pub num_pending_children: usize,
    /// Control messages sent and not yet acknowledged.
    pub num_pending_control: usize,
    /// `remote` calls sent and not yet answered.
    pub num_pending_remotes: usize,
}

impl RRefContext {
    pub(crate) fn new() -> Self {
        Self {
            agent: OnceLock::new(),
            protocol: Mutex::new(RRefProtocol::new(0)),
            values: Mutex::new(HashMap::new()),
            created: Notify::new(),
            creation_errors: Mutex::new(HashMap::new()),
            pending_remotes: AtomicUsize::new(0),
            progress: Notify::new(),
            shut_down: AtomicBool::new(false),
            leaked: Mutex::new(Vec::new()),
            generation: Mutex::new(0),
            changed: Condvar::new(),
        }
    }

    /// The RRef layer of `agent`.
    pub fn of(agent: &Agent) -> Result<Arc<RRefContext>, RRefError> {
        agent.layer::<RRefContext>().ok_or(RRefError::NotInstalled)
    }

    /// The RRef layer of the agent this thread works for: the current one
    /// inside remote functions and reply decoding, else the process's.
    pub fn current() -> Result<Arc<RRefContext>, RRefError> {
        let agent = match Agent::current() {
            Some(a) => a,
            None => ferry_rpc::agent()?,
        };
        Self::of(&agent)
    }

    /// The agent, while it runs.
    pub(crate) fn agent(&self) -> Option<Agent> {
        self.agent
            .get()
            .and_then(WeakAgent::upgrade)
            .filter(|a| a.is_running() && !self.shut_down.load(Ordering::SeqCst))
    }

    pub(crate) fn is_shut_down(&self) -> bool {
        self.shut_down.load(Ordering::SeqCst)
    }

    pub(crate) fn me(&self) -> WorkerId {
        self.protocol.lock().me()
    }

    /// The name of worker `id` (its rank as text if unknown).
    pub(crate) fn worker_name(&self, id: WorkerId) -> String {
        self.agent
            .get()
            .and_then(WeakAgent::upgrade)
            .and_then(|a| a.workers().get(id as usize).map(|w| w.name.clone()))
            .unwrap_or_else(|| format!("rank {id}"))
    }

    /// Counts of this worker's RRef tables.
    pub fn debug_info(&self) -> DebugInfo {
        let Counts {
            owners,
            confirmed_users,
            pending_users,
            pending_children,
            unacked,
        } = self.protocol.lock().counts();
        DebugInfo {
            num_owner_rrefs: owners,
            num_confirmed_users: confirmed_users,
            num_pending_users: pending_users,
            num_pending_children: pending_children,
            num_pending_control: unacked,
            num_pending_remotes: self.pending_remotes.load(Ordering::SeqCst),
        }
    }

    /// Blocks until this worker's RRef tables are empty (no owned values,
    /// no users, nothing pending) or `timeout` passes; on timeout returns
    /// what is left. Useful before a checkpoint, and in tests to see that
    /// every value was deleted once its last user went away.
    pub fn wait_until_empty(&self, timeout: Duration) -> Result<(), DebugInfo> {
        let deadline = std::time::Instant::now() + timeout;
        let mut generation = self.generation.lock();
        loop {
            let info = self.debug_info();
            if info == DebugInfo::default() {
                return Ok(());
            }
            if self
                .changed
                .wait_until(&mut generation, deadline)
                .timed_out()
            {
                let info = self.debug_info();
                return if info == DebugInfo::default() {
                    Ok(())
                } else {
                    Err(info)
                };
            }
        }
    }

    fn bump(&self) {
        *self.generation.lock() += 1;
        self.changed.notify_all();
    }

    /// The owned RRefs that were still referenced when RPC shut down.
    pub fn leaked(&self) -> Vec<RRefId> {
        self.leaked.lock().clone()
    }

    /// Runs `f` on the protocol, then carries out what it asked for.
    pub(crate) fn with_protocol<R>(self: &Arc<Self>, f: impl FnOnce(&mut RRefProtocol) -> R) -> R {
        let r = f(&mut self.protocol.lock());
        self.flush();
        r
    }

    /// Sends the protocol's transmits and applies its events. Values
    /// deleted here are dropped after every lock is released (a value may
    /// hold RRefs whose drop comes back here).
    fn flush(self: &Arc<Self>) {
        let (transmits, events) = {
            let mut p = self.protocol.lock();
            let mut t = Vec::new();
            while let Some(x) = p.poll_transmit() {
                t.push(x);
            }
            let mut e = Vec::new();
            while let Some(x) = p.poll_event() {
                e.push(x);
            }
            (t, e)
        };
        let mut dropped = Vec::new();
        for event in events {
            match event {
                Event::OwnerDeleted(id) => {
                    debug!(rref = %id, "owner deleted");
                    dropped.push(self.values.lock().remove(&id));
                }
                Event::UserConfirmed(fork) => debug!(fork = %fork, "user confirmed"),
            }
        }
        for t in transmits {
            self.send_control(t);
        }
        drop(dropped);
        self.bump();
    }

    fn send_control(self: &Arc<Self>, t: Transmit) {
        // After shutdown nothing is sent (the group has stopped serving).
        let Some(agent) = self.agent() else {
            return;
        };
        let message = match payload::encode(&RRefMessage::Control(t.envelope)) {
            Ok(m) => m,
            Err(e) => return warn!(error = %e, "cannot encode a control message"),
        };
        // The first try is queued now, so graceful shutdown counts it.
        let first = agent.call_service(t.to, RREF_SERVICE, message, CONTROL_TIMEOUT);
        let ctx = self.clone();
        let agent2 = agent.clone();
        agent.spawn(async move {
            let mut result = first.await;
            let mut backoff = FIRST_BACKOFF;
            for attempt in 1..SEND_ATTEMPTS {
                match &result {
                    Ok(_) => break,
                    Err(e) if retryable(e) && agent2.is_running() => {
                        debug!(to = t.to, attempt, error = %e, "retrying an RRef control message");
                        tokio::time::sleep(backoff).await;
                        backoff *= 2;
                        let Ok(m) = payload::encode(&RRefMessage::Control(t.envelope)) else {
                            break;
                        };
                        result = agent2
                            .call_service(t.to, RREF_SERVICE, m, CONTROL_TIMEOUT)
                            .await;
                    }
                    Err(_) => break,
                }
            }
            match result {
                Ok(_) => ctx.with_protocol(|p| p.handle_ack(t.to, t.envelope.seq)),
                Err(e) => {
                    if agent2.is_running() {
                        warn!(to = t.to, error = %e, control = ?t.envelope.control, "giving up an RRef control message");
                    }
                }
            }
            ctx.progress.notify_waiters();
        });
    }

    /// Takes in an RRef that arrived in a message.
    pub(crate) fn receive(self: &Arc<Self>, data: ForkData) -> Holder {
        self.with_protocol(|p| p.receive(data))
    }

    /// Forks a handle into a message being encoded.
    pub(crate) fn fork(
        self: &Arc<Self>,
        holder: Holder,
        rref_id: RRefId,
        owner: WorkerId,
    ) -> Result<ForkData, RRefError> {
        if self.is_shut_down() {
            return Err(RRefError::ShutDown { rref_id });
        }
        let r = self.with_protocol(|p| p.fork(holder));
        r.map_err(|_| self.creation_failed(holder, rref_id, owner))
    }

    /// The last handle to `holder` here was dropped.
    pub(crate) fn drop_handle(self: &Arc<Self>, holder: Holder) {
        self.with_protocol(|p| p.drop_handle(holder));
        if let Holder::User(f) = holder {
            self.creation_errors.lock().remove(&f);
        }
    }

    pub(crate) fn is_confirmed(&self, holder: Holder) -> bool {
        self.protocol.lock().is_confirmed(holder)
    }

    /// Resolves once the owner has confirmed `holder`, or fails after the
    /// agent's default timeout.
    pub(crate) async fn confirmed(
        &self,
        holder: Holder,
        rref_id: RRefId,
        owner: WorkerId,
    ) -> Result<(), RRefError> {
        let after = self
            .agent()
            .ok_or(RRefError::ShutDown { rref_id })?
            .rpc_timeout();
        let confirmed = || self.is_confirmed(holder).then_some(());
        wait::until_timeout(&self.progress, after, confirmed)
            .await
            .ok_or_else(|| RRefError::NotConfirmed {
                rref_id,
                owner: self.worker_name(owner),
                after,
            })
    }

    /// Attaches the fork `data` to the message being encoded: if the
    /// message never reaches its receiver's code, the fork is undone.
    pub(crate) fn watch_fork(self: &Arc<Self>, data: ForkData) {
        let watch = Box::new(ForkWatch {
            ctx: self.clone(),
            data,
        });
        if ferry_rpc::watch::watch_message(watch).is_err() {
            // Checked by the caller; never here.
            warn!(fork = %data.fork_id, "an RRef fork outside any message");
        }
    }

    /// The error of a handle whose creation failed.
    pub(crate) fn creation_failed(
        &self,
        holder: Holder,
        rref_id: RRefId,
        owner: WorkerId,
    ) -> RRefError {
        let reason = match holder {
            Holder::User(f) => self.creation_errors.lock().get(&f).cloned(),
            Holder::Owner(_) => None,
        };
        RRefError::CreationFailed {
            rref_id,
            owner: self.worker_name(owner),
            reason: reason.unwrap_or_else(|| "the owner never confirmed it".into()),
        }
    }

    pub(crate) fn has_failed(&self, holder: Holder) -> bool {
        self.protocol.lock().creation_failed(holder)
    }

    /// Resolves when `holder`'s creation has failed (never, if it does not).
    pub(crate) async fn creation_failure(&self, holder: Holder) {
        wait::until(&self.progress, || self.has_failed(holder).then_some(())).await;
    }

    /// Keeps `value` as a new RRef owned here.
    pub(crate) fn create_local(self: &Arc<Self>, value: Value) -> RRefId {
        let id = self.with_protocol(RRefProtocol::create_owner);
        self.values
            .lock()
            .insert(id, Arc::new(OwnerSlot::ready(value)));
        self.created.notify_waiters();
        id
    }

    /// Starts a `remote` call of `function` on `owner` with the encoded
    /// arguments and the watches of the RRefs forked into them; returns the
    /// new handle at once.
    pub(crate) fn remote(
        self: &Arc<Self>,
        agent: &Agent,
        owner: WorkerId,
        function: &str,
        caller: &crate::Caller,
        (args, watches): (Encoded, Watches),
        timeout: Duration,
    ) -> (RRefId, Holder) {
        // A call to this worker itself still goes through its own
        // connection, so arguments decode exactly as elsewhere.
        let (rref_id, holder, fork_id) = if owner == self.me() {
            let id = self.with_protocol(RRefProtocol::create_owner);
            self.values
                .lock()
                .insert(id, Arc::new(OwnerSlot::pending()));
            self.created.notify_waiters();
            (id, Holder::Owner(id), None)
        } else {
            let (rref_id, fork_id) = self.with_protocol(|p| p.create_user(owner));
            (rref_id, Holder::User(fork_id), Some(fork_id))
        };
        let header = RRefMessage::Remote {
            rref_id,
            fork_id,
            function: function.to_string(),
            signature: caller.signature,
            caller: caller.shown.clone(),
            caller_names: caller.names.clone(),
        };
        let message = match payload::encode(&header) {
            Ok(mut m) => {
                m.payload.extend_from_slice(&args.payload);
                m.tensors = args.tensors;
                m
            }
            Err(e) => {
                watches.settle(Delivery::NotDecoded);
                let reason = format!("cannot encode the call: {e}");
                match fork_id {
                    Some(f) => {
                        self.creation_errors.lock().insert(f, reason);
                        self.with_protocol(|p| p.remote_not_sent(f));
                    }
                    None => self.fail_creation(rref_id, None, reason),
                }
                return (rref_id, holder);
            }
        };
        self.pending_remotes.fetch_add(1, Ordering::SeqCst);
        let reply = agent.call_service(owner, RREF_SERVICE, message, timeout);
        let ctx = self.clone();
        let function = function.to_string();
        agent.spawn(async move {
            let reply = reply.await;
            // The forks in the arguments: undone if the owner refused the
            // call before decoding them.
            watches.settle(match &reply {
                Ok(m) => match postcard::from_bytes::<RemoteReply>(&m.payload) {
                    Ok(RemoteReply::Ran) => Delivery::Decoded,
                    Ok(RemoteReply::Refused) => Delivery::NotDecoded,
                    Err(_) => Delivery::Unknown,
                },
                Err(_) => Delivery::Unknown,
            });
            match (reply, fork_id) {
                (Ok(_), Some(f)) => ctx.with_protocol(|p| p.remote_confirmed(f)),
                (Ok(_), None) => {}
                (Err(e), _) => {
                    let e = named_call(e, &function);
                    ctx.fail_creation(rref_id, fork_id, e.to_string())
                }
            }
            ctx.pending_remotes.fetch_sub(1, Ordering::SeqCst);
            ctx.progress.notify_waiters();
            ctx.bump();
        });
        (rref_id, holder)
    }

    fn fail_creation(self: &Arc<Self>, rref_id: RRefId, fork_id: Option<ForkId>, reason: String) {
        debug!(rref = %rref_id, %reason, "RRef creation failed");
        match fork_id {
            Some(f) => {
                self.creation_errors.lock().insert(f, reason);
                self.with_protocol(|p| p.remote_failed(f));
            }
            // Owned here: the value itself records the failure.
            None => {
                if let Some(slot) = self.slot(rref_id) {
                    slot.set(Err(FailureText::new(format!(
                        "RRef creation failed: {reason}"
                    ))));
                }
            }
        }
    }

    /// The slot of a value owned here, if it exists.
    pub(crate) fn slot(&self, id: RRefId) -> Option<Arc<OwnerSlot>> {
        self.values.lock().get(&id).cloned()
    }

    /// Waits (async) until the slot of `id` exists, up to `timeout`.
    pub(crate) async fn slot_async(&self, id: RRefId, timeout: Duration) -> Option<Arc<OwnerSlot>> {
        wait::until_timeout(&self.created, timeout, || self.slot(id)).await
    }

    async fn serve(
        self: Arc<Self>,
        from: WorkerInfo,
        msg: IncomingMessage,
    ) -> Result<Encoded, String> {
        let (header, rest) = postcard::take_from_bytes::<RRefMessage>(&msg.payload)
            .map(|(h, rest)| (h, msg.payload.len() - rest.len()))
            .map_err(|e| format!("malformed RRef message: {e}"))?;
        match header {
            RRefMessage::Control(envelope) => {
                self.on_control(from.id, envelope);
                Ok(Encoded::default())
            }
            RRefMessage::Remote {
                rref_id,
                fork_id,
                function,
                signature,
                caller,
                caller_names,
            } => {
                let agent = self.agent().ok_or("the worker is shutting down")?;
                let slot = {
                    let mut values = self.values.lock();
                    match fork_id {
                        Some(_) => values
                            .entry(rref_id)
                            .or_insert_with(|| Arc::new(OwnerSlot::pending()))
                            .clone(),
                        // A call to itself: the slot was made with the RRef.
                        // If every handle is already gone the function still
                        // runs (it may have effects) and its result is dropped.
                        None => values
                            .get(&rref_id)
                            .cloned()
                            .unwrap_or_else(|| Arc::new(OwnerSlot::pending())),
                    }
                };
                if let Some(fork_id) = fork_id {
                    self.with_protocol(|p| p.remote_received(rref_id, fork_id));
                }
                self.created.notify_waiters();
                let IncomingMessage {
                    payload, tensors, ..
                } = msg;
                let args = payload[rest..].to_vec();
                let outcome = agent
                    .run_function(&function, signature, args, tensors)
                    .await
                    .map_err(|e| match e {
                        // Name the creator's signature, which only it
                        // knows, written as the registration's is.
                        RpcError::WrongType {
                            worker,
                            function,
                            expected,
                            by_schema,
                            ..
                        } => RpcError::WrongType {
                            worker,
                            function,
                            expected,
                            got: bounded(if by_schema { caller } else { caller_names }),
                            by_schema,
                        },
                        other => other,
                    });
                let reply = match &outcome {
                    Err(RpcError::UnknownFunction { .. } | RpcError::WrongType { .. }) => {
                        RemoteReply::Refused
                    }
                    _ => RemoteReply::Ran,
                };
                // Kept as raised; escaped where it is shown.
                slot.set(outcome.map_err(FailureText::of));
                payload::encode(&reply).map_err(|e| e.to_string())
            }
            RRefMessage::ToHere {
                rref_id,
                type_name,
                timeout_ms,
            } => {
                let timeout = Duration::from_millis(timeout_ms);
                let reply = |r: ToHereReply| payload::encode(&r).map_err(|e| e.to_string());
                let Some(slot) = self.slot_async(rref_id, timeout).await else {
                    return reply(ToHereReply::Unknown);
                };
                match slot.wait_async(timeout).await {
                    SlotState::Pending => reply(ToHereReply::NotYet),
                    SlotState::Failed(e) => reply(ToHereReply::Failed(e)),
                    SlotState::Ready(v) if v.type_name() != type_name => {
                        reply(ToHereReply::WrongType(v.type_name().to_string()))
                    }
                    SlotState::Ready(v) => {
                        let agent = self.agent().ok_or("the worker is shutting down")?;
                        // RRefs inside the value are forked into the reply.
                        let (value, watches) =
                            agent.enter(|| ferry_rpc::watch::encoding_message(|| v.encode()));
                        watches.settle(match value {
                            Ok(_) => Delivery::Decoded,
                            Err(_) => Delivery::NotDecoded,
                        });
                        match value {
                            Ok(value) => {
                                let mut out = reply(ToHereReply::Value)?;
                                out.payload.extend_from_slice(&value.payload);
                                out.tensors = value.tensors;
                                Ok(out)
                            }
                            Err(e) => reply(ToHereReply::Failed(FailureText::new(format!(
                                "cannot encode the value: {e}"
                            )))),
                        }
                    }
                }
            }
        }
    }

    fn on_control(self: &Arc<Self>, from: WorkerId, envelope: Envelope) {
        self.with_protocol(|p| {
            p.handle_control(from, envelope);
        });
    }

    /// Shutdown, once the group is idle (no function runs anywhere): every
    /// user still held is released, and this waits until this worker's
    /// control messages and `remote` calls are answered.
    async fn release_users(self: Arc<Self>) {
        self.with_protocol(RRefProtocol::release_all_users);
        wait::until(&self.progress, || {
            let info = self.debug_info();
            (info.num_pending_control == 0 && info.num_pending_remotes == 0).then_some(())
        })
        .await;
    }

    /// Shutdown, once the deletions above have drained everywhere: owned
    /// values no user references are deleted; the others are reported as
    /// leaked.
    fn release_owners(self: &Arc<Self>) {
        let leaked = self.with_protocol(RRefProtocol::release_owners);
        if !leaked.is_empty() {
            warn!(count = leaked.len(), rrefs = ?leaked, "RRefs still referenced by users at shutdown (leaked)");
        }
        *self.leaked.lock() = leaked;
        self.shut_down.store(true, Ordering::SeqCst);
        let values: Vec<_> = self.values.lock().drain().collect();
        drop(values);
    }
}

fn retryable(e: &RpcError) -> bool {
    matches!(
        e,
        RpcError::PeerUnreachable { .. } | RpcError::Timeout { .. }
    )
}

/// Undoes a fork whose message its receiver never decoded.
struct ForkWatch {
    ctx: Arc<RRefContext>,
    data: ForkData,
}

impl MessageWatch for ForkWatch {
    fn settled(self: Box<Self>, delivery: Delivery) {
        if delivery == Delivery::NotDecoded {
            debug!(fork = %self.data.fork_id, rref = %self.data.rref_id, "fork not delivered: undone");
            self.ctx.with_protocol(|p| p.fork_not_delivered(self.data));
        }
    }
}

/// The agent-facing side of the context.
pub(crate) struct RRefService(pub(crate) Arc<RRefContext>);

impl Service for RRefService {
    fn name(&self) -> &str {
        "rref"
    }

    fn handle(
        &self,
        from: WorkerInfo,
        message: IncomingMessage,
    ) -> BoxFuture<Result<Encoded, String>> {
        Box::pin(self.0.clone().serve(from, message))
    }

    fn started(&self, agent: &Agent) {
        *self.0.protocol.lock() = RRefProtocol::new(agent.worker_info().id);
        let _ = self.0.agent.set(agent.downgrade());
    }

    fn after_join(&self) -> BoxFuture<()> {
        Box::pin(self.0.clone().release_users())
    }

    fn before_stop(&self) -> BoxFuture<()> {
        self.0.release_owners();
        Box::pin(async {})
    }
}

/// The error of the service call that carries a `remote` call of
/// `function`, named after `function` rather than the RRef service: a
/// timeout reads `call of "Counter.add" on worker "worker1" timed out ...`.
fn named_call(e: RpcError, function: &str) -> RpcError {
    let function = function.to_string();
    match e {
        RpcError::Timeout { worker, after, .. } => RpcError::Timeout {
            worker,
            function,
            after,
        },
        RpcError::ShutDown { worker, .. } => RpcError::ShutDown { worker, function },
        RpcError::TooLarge {
            worker,
            what,
            len,
            max,
            ..
        } => RpcError::TooLarge {
            worker,
            function,
            what,
            len,
            max,
        },
        other => other,
    }
}

/// A peer's text cut to [`ferry_rpc::MAX_ERROR_TEXT_BYTES`] on a character
/// boundary (errors show it escaped).
fn bounded(text: String) -> String {
    FailureText::new(text).message
}
