//! A parameter server in Rust for trainers in Python, in one group: the
//! server holds a linear model's parameters and applies the gradients the
//! trainers push (asynchronous SGD, after PyTorch's RPC parameter-server
//! tutorial); the trainers (`examples/python/param_server_trainer.py`)
//! pull the parameters, compute gradients on their own data with torch's
//! autograd, and push them, calling the server's functions by name. Once
//! every trainer is done, the server calls each trainer's `evaluate` (a
//! Python function registered for Rust callers) with the final parameters
//! and checks the model it trained against the one the data came from.
//!
//! ```sh
//! # rank 0, the server; ranks 1.. run the trainer script.
//! RANK=0 WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
//!     cargo run -p ferry --features torch --example param_server
//! ```
//!
//! It exits with 0 when the trained weights are within 0.05 of the true
//! ones and every trainer's loss is under 0.01, with 1 otherwise.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{bail, Context};
use ferry::tensor::tch::{self, Kind};
use ferry::tensor::Tensor;
use ferry::{Function, Functions, RpcOptions, Schema};
use serde::{Deserialize, Serialize};

/// The weights the trainers' data is made from (`y = x·w + b`).
const TRUE_W: [f32; 4] = [2.0, -3.0, 0.5, 1.0];
/// The bias the trainers' data is made from.
const TRUE_B: f32 = 0.7;
/// SGD's learning rate.
const LR: f64 = 0.1;
/// How long the server waits for its trainers to finish.
const TRAINING_BOUND: Duration = Duration::from_secs(120);

/// The model's parameters, as the trainers pull them.
#[derive(Serialize, Deserialize, Schema)]
struct Params {
    w: Tensor,
    b: f32,
    version: u64,
}

/// A trainer's gradients of its loss.
#[derive(Serialize, Deserialize, Schema)]
struct Grads {
    w: Tensor,
    b: f32,
}

const PULL: Function<(), Params> = Function::new("pull");
const PUSH: Function<Grads, u64> = Function::new("push");
const DONE: Function<String, ()> = Function::new("done");
/// Registered by each trainer in Python: its loss on its data under the
/// given parameters.
const EVALUATE: Function<Params, f64> = Function::new("evaluate");

/// The server's state.
struct Server {
    model: Mutex<Model>,
    done: Mutex<Vec<String>>,
    all_done: Condvar,
}

struct Model {
    w: tch::Tensor,
    b: f32,
    version: u64,
}

/// The lock's value, also after a panic elsewhere held it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Server {
    fn params(&self) -> Params {
        let m = lock(&self.model);
        Params {
            w: Tensor::from(m.w.copy()),
            b: m.b,
            version: m.version,
        }
    }

    /// One SGD step with a trainer's gradients.
    fn apply(&self, g: Grads) -> Result<u64, String> {
        let mut m = lock(&self.model);
        if g.w.0.size() != m.w.size() || g.w.0.kind() != Kind::Float {
            return Err(format!(
                "gradients of shape {:?} ({:?}) for weights of shape {:?}",
                g.w.0.size(),
                g.w.0.kind(),
                m.w.size()
            ));
        }
        let step = &g.w.0 * LR;
        let _ = m.w.f_sub_(&step).map_err(|e| e.to_string())?;
        m.b -= (LR as f32) * g.b;
        m.version += 1;
        Ok(m.version)
    }
}

fn main() -> anyhow::Result<()> {
    let server = Arc::new(Server {
        model: Mutex::new(Model {
            w: tch::Tensor::zeros([TRUE_W.len() as i64], (Kind::Float, tch::Device::Cpu)),
            b: 0.0,
            version: 0,
        }),
        done: Mutex::new(Vec::new()),
        all_done: Condvar::new(),
    });
    let mut functions = Functions::new();
    let (s1, s2, s3) = (server.clone(), server.clone(), server.clone());
    functions
        .add(PULL, move |()| s1.params())
        .add(PUSH, move |g: Grads| s2.apply(g))
        .add(DONE, move |trainer: String| {
            lock(&s3.done).push(trainer);
            s3.all_done.notify_all();
        });
    let options = RpcOptions::from_env("ps")
        .context("RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are needed")?
        .functions(functions);
    let worker = ferry::init_rpc(options)?;
    let trainers: Vec<String> = worker
        .agent()
        .workers()
        .iter()
        .map(|w| w.name.clone())
        .filter(|n| n != "ps")
        .collect();
    println!("parameter server: training with {trainers:?}");

    // Wait on state (every trainer said it is done), bounded.
    {
        let deadline = std::time::Instant::now() + TRAINING_BOUND;
        let mut done = lock(&server.done);
        while done.len() < trainers.len() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                bail!("trainers done after {TRAINING_BOUND:?}: {done:?} of {trainers:?}");
            }
            done = server
                .all_done
                .wait_timeout(done, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    let version = lock(&server.model).version;
    let mut ok = true;
    for t in &trainers {
        let loss = EVALUATE.rpc_sync(t.as_str(), server.params())?;
        println!("parameter server: {t}'s loss under the trained model: {loss:.6}");
        ok &= loss < 0.01;
    }
    let (w, b) = {
        let m = lock(&server.model);
        (Vec::<f32>::try_from(&m.w)?, m.b)
    };
    let err = w
        .iter()
        .zip(TRUE_W)
        .map(|(a, t)| (a - t).abs())
        .fold((b - TRUE_B).abs(), f32::max);
    println!("parameter server: {version} steps, w = {w:?}, b = {b:.4}, largest error {err:.4}");
    ok &= err < 0.05;
    ferry::shutdown()?;
    if !ok {
        bail!("the trained model is not the one the data came from");
    }
    println!("parameter server: trained");
    Ok(())
}
