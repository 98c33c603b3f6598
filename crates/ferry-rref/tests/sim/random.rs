//! Random schedules: program actions and an adversarial network, chosen by
//! a seeded PRNG, then a drain phase and the liveness checks.

use std::panic::{catch_unwind, AssertUnwindSafe};

use ferry_rref::protocol::WorkerId;

use super::rng::Rng;
use super::world::{Check, Msg, Stats, World};

/// Drain iterations during which the network may still misbehave.
const DRAIN_CHAOS: usize = 300;
/// Drain iterations after which the schedule counts as stuck.
const DRAIN_LIMIT: usize = 200_000;

#[derive(Debug, Clone, Copy)]
enum Action {
    Create,
    Fork,
    Drop,
    Deliver,
    Duplicate,
    Lose,
    Retransmit,
    Replay,
    Timeout,
    Refuse,
}

/// Per-schedule weights, so schedules differ in flavour (a lazy network
/// piles messages up, an eager one delivers them almost at once).
struct Weights {
    create: usize,
    fork: usize,
    drop: usize,
    deliver: usize,
    chaos: usize,
    timeout: usize,
    refuse: usize,
}

/// Runs schedule `seed`. Returns the statistics, or the violation (a panic
/// inside the protocol counts as one) and the trace (when `trace`).
pub(crate) fn run_seed(seed: u64, trace: bool) -> (Result<Stats, String>, String) {
    let mut rng = Rng::new(seed);
    let n = rng.range(3, 5);
    let mut world = World::new(n, trace);
    world.log(|| format!("seed {seed}: {n} workers"));
    let outcome = catch_unwind(AssertUnwindSafe(|| drive(&mut world, &mut rng)));
    let result = match outcome {
        Ok(r) => r,
        Err(payload) => Err(format!(
            "panicked: {}",
            payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied())
                .unwrap_or("(non-string payload)")
        )),
    };
    let mut stats = world.stats;
    stats.schedules = 1;
    (result.map(|()| stats), world.trace_text())
}

fn drive(world: &mut World, rng: &mut Rng) -> Check {
    let steps = rng.range(30, 200);
    let w = Weights {
        create: rng.range(3, 10),
        fork: rng.range(8, 25),
        drop: rng.range(10, 25),
        deliver: rng.range(15, 80),
        chaos: rng.range(0, 12),
        timeout: rng.range(0, 6),
        refuse: rng.range(0, 6),
    };
    for step in 0..steps {
        world.log(|| format!("-- step {step}"));
        random_step(world, rng, &w)?;
        world.check_handles()?;
        world.stats.steps += 1;
    }

    world.log(|| "-- end: every handle is dropped".to_string());
    loop {
        let holders: Vec<usize> = (0..world.n())
            .filter(|&x| !world.held[x].is_empty())
            .collect();
        if holders.is_empty() {
            break;
        }
        let x = holders[rng.below(holders.len())];
        let (h, _) = world.held[x][rng.below(world.held[x].len())];
        world.drop_handle(x as WorkerId, h)?;
        world.check_handles()?;
    }

    world.log(|| "-- end: the network drains".to_string());
    for i in 0..DRAIN_LIMIT {
        if world.net.is_empty() {
            if (0..world.n()).all(|x| world.unacked_count(x as WorkerId) == 0) {
                return world.check_quiescent();
            }
            world.log(|| "retransmit timers fire".to_string());
            world.retransmit_all();
            continue;
        }
        if i < DRAIN_CHAOS && rng.chance(8) {
            match rng.below(5) {
                4 => {
                    if let Some(k) = pick_user(world, rng) {
                        world.refuse(k)?;
                    }
                }
                0 => {
                    if let Some(k) = pick_control(world, rng) {
                        world.duplicate(k)?;
                    }
                }
                1 => {
                    if let Some(k) = pick_control(world, rng) {
                        world.lose(k)?;
                    }
                }
                2 => {
                    if world.history_len() > 0 {
                        let k = rng.below(world.history_len());
                        world.replay(k);
                    }
                }
                _ => {
                    let pending: Vec<_> = world.pending_remotes().collect();
                    if !pending.is_empty() {
                        world.timeout(pending[rng.below(pending.len())])?;
                    }
                }
            }
        } else {
            let k = rng.below(world.net.len());
            let discard = rng.chance(50);
            world.deliver(k, discard)?;
            // A user message delivered now hands its receiver a handle,
            // which the (finished) user code drops at once.
            world.drop_everything()?;
        }
        world.check_handles()?;
    }
    Err(format!(
        "the network did not drain after {DRAIN_LIMIT} iterations ({} in flight)",
        world.net.len()
    ))
}

fn pick_user(world: &World, rng: &mut Rng) -> Option<usize> {
    let users: Vec<usize> = (0..world.net.len())
        .filter(|&k| matches!(world.net[k], Msg::User { .. }))
        .collect();
    (!users.is_empty()).then(|| users[rng.below(users.len())])
}

fn pick_control(world: &World, rng: &mut Rng) -> Option<usize> {
    let controls: Vec<usize> = (0..world.net.len())
        .filter(|&k| world.net[k].is_control())
        .collect();
    (!controls.is_empty()).then(|| controls[rng.below(controls.len())])
}

fn random_step(world: &mut World, rng: &mut Rng, w: &Weights) -> Check {
    let n = world.n();
    let handles: usize = world.held.iter().map(Vec::len).sum();
    let controls = world.net.iter().filter(|m| m.is_control()).count();
    let unacked: usize = (0..n).map(|x| world.unacked_count(x as WorkerId)).sum();
    let pending = world.pending_remotes().count();
    let user_msgs = world
        .net
        .iter()
        .filter(|m| matches!(m, Msg::User { .. }))
        .count();
    let if_any = |weight: usize, any: bool| if any { weight } else { 0 };
    let choices = [
        (w.create, Action::Create),
        (if_any(w.fork, handles > 0), Action::Fork),
        (if_any(w.drop, handles > 0), Action::Drop),
        (if_any(w.deliver, !world.net.is_empty()), Action::Deliver),
        (if_any(w.chaos, controls > 0), Action::Duplicate),
        (if_any(w.chaos, controls > 0), Action::Lose),
        (if_any(w.chaos / 2 + 1, unacked > 0), Action::Retransmit),
        (if_any(w.chaos / 3, world.history_len() > 0), Action::Replay),
        (if_any(w.timeout, pending > 0), Action::Timeout),
        (if_any(w.refuse, user_msgs > 0), Action::Refuse),
    ];
    let total: usize = choices.iter().map(|(weight, _)| weight).sum();
    let mut roll = rng.below(total);
    let mut action = Action::Create;
    for (weight, a) in choices {
        if roll < weight {
            action = a;
            break;
        }
        roll -= weight;
    }

    match action {
        Action::Create => {
            let from = rng.below(n) as WorkerId;
            let to = rng.below(n) as WorkerId;
            world.remote(from, to)?;
        }
        Action::Fork | Action::Drop => {
            let holders: Vec<usize> = (0..n).filter(|&x| !world.held[x].is_empty()).collect();
            let x = holders[rng.below(holders.len())];
            let (h, _) = world.held[x][rng.below(world.held[x].len())];
            if matches!(action, Action::Fork) {
                let to = rng.below(n) as WorkerId;
                world.fork(x as WorkerId, h, to)?;
            } else {
                world.drop_handle(x as WorkerId, h)?;
            }
        }
        Action::Deliver => {
            let k = rng.below(world.net.len());
            let discard = rng.chance(50);
            world.deliver(k, discard)?;
        }
        Action::Duplicate => {
            if let Some(k) = pick_control(world, rng) {
                world.duplicate(k)?;
            }
        }
        Action::Lose => {
            if let Some(k) = pick_control(world, rng) {
                world.lose(k)?;
            }
        }
        Action::Retransmit => {
            let senders: Vec<usize> = (0..n)
                .filter(|&x| world.unacked_count(x as WorkerId) > 0)
                .collect();
            let x = senders[rng.below(senders.len())] as WorkerId;
            let k = rng.below(world.unacked_count(x));
            world.retransmit(x, k);
        }
        Action::Replay => {
            let k = rng.below(world.history_len());
            world.replay(k);
        }
        Action::Refuse => {
            if let Some(k) = pick_user(world, rng) {
                world.refuse(k)?;
            }
        }
        Action::Timeout => {
            let pending: Vec<_> = world.pending_remotes().collect();
            let f = pending[rng.below(pending.len())];
            // Now and then the call never left at all (it could not be sent).
            if !(rng.chance(20) && world.unsend(f)?) {
                world.timeout(f)?;
            }
        }
    }
    Ok(())
}
