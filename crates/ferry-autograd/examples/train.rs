//! The paper's Listing 1, trained: a model split across three local
//! processes. Worker 0 (the coordinator) drives; workers 1 and 2 each own
//! one `Layer` (Linear + ReLU). The input goes to worker 1 as an RRef, the
//! activation travels from worker 1 to worker 2 directly, and the output
//! comes back to the coordinator; distributed autograd and the
//! `DistributedOptimizer` train both layers on a synthetic regression task
//! (targets from a fixed random "teacher" network).
//!
//! At the end the same training runs locally in one process, from the same
//! initial weights and the same batches, for comparison.
//!
//! `cargo xtask demo` runs it; by hand:
//! `cargo run --release -p ferry-autograd --example train -- [--steps N]`.

use std::time::{Duration, Instant};

use clap::Parser;
use ferry_autograd::optim::LocalOptimizer;
use ferry_autograd::{DistributedOptimizer, OptimizerKind};
use ferry_rpc::{BoxError, Function, Functions, RpcOptions, Schema};
use ferry_rref::{Method, MethodsExt, RRef, RemoteExt};
use ferry_tch::Tensor;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind};

const OPTS: (Kind, Device) = (Kind::Float, Device::Cpu);
const INPUTS: i64 = 32;
const HIDDEN: i64 = 64;
const OUTPUTS: i64 = 8;
const BATCH: i64 = 64;

/// Listing 1's `Layer`: `Sequential(Linear(i, o), ReLU())`, kept on its owner.
#[derive(Serialize, Deserialize, Schema)]
struct Layer {
    weight: Tensor,
    bias: Tensor,
}

impl Layer {
    /// Builds a layer on the worker it is called on: (inputs, outputs, seed).
    const NEW: Function<(i64, i64, i64), Layer> = Function::new("Layer.new");
    /// Listing 1's `Layer.forward(self, x_rref)`: fetch the input, run the layer.
    const FORWARD: Method<Layer, RRef<Tensor>, Tensor> = Method::new("Layer.forward");
    /// RRefs of the layer's parameters, for the DistributedOptimizer.
    const PARAMS: Method<Layer, (), Vec<RRef<Tensor>>> = Method::new("Layer.params");

    /// PyTorch's `nn.Linear` initialisation (uniform ±1/sqrt(inputs)), seeded.
    fn new(inputs: i64, outputs: i64, seed: i64) -> Layer {
        tch::manual_seed(seed);
        let bound = 1.0 / (inputs as f64).sqrt();
        let weight = (tch::Tensor::rand([outputs, inputs], OPTS) * (2.0 * bound) - bound)
            .set_requires_grad(true);
        let bias =
            (tch::Tensor::rand([outputs], OPTS) * (2.0 * bound) - bound).set_requires_grad(true);
        Layer {
            weight: weight.into(),
            bias: bias.into(),
        }
    }

    fn forward(&self, x: &tch::Tensor) -> tch::Tensor {
        x.linear(&self.weight, Some(&*self.bias)).relu()
    }

    fn params(&self) -> Vec<tch::Tensor> {
        vec![self.weight.shallow_clone(), self.bias.shallow_clone()]
    }
}

/// The functions the layer owners serve.
fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(Layer::NEW, |(i, o, seed)| Layer::new(i, o, seed));
    f.add_method(Layer::FORWARD, |layer: &Layer, x: RRef<Tensor>| {
        let x = x.to_here()?;
        Ok::<_, BoxError>(Tensor::from(layer.forward(&x)))
    });
    f.add_method(Layer::PARAMS, |layer: &Layer, ()| {
        let w = RRef::new(layer.weight.clone())?;
        let b = RRef::new(layer.bias.clone())?;
        Ok::<_, BoxError>(vec![w, b])
    });
    f
}

/// One batch of the synthetic task: inputs and the teacher's outputs.
fn batch(step: usize, teacher: &(Layer, Layer)) -> (tch::Tensor, tch::Tensor) {
    tch::manual_seed(10_000 + step as i64);
    let x = tch::Tensor::randn([BATCH, INPUTS], OPTS);
    let y = tch::no_grad(|| teacher.1.forward(&teacher.0.forward(&x)));
    (x, y)
}

fn mse(y: &tch::Tensor, target: &tch::Tensor) -> tch::Tensor {
    (y - target).square().mean(Kind::Float)
}

fn optimizer() -> OptimizerKind {
    OptimizerKind::sgd(0.05).momentum(0.9)
}

/// The coordinator's progress: an `indicatif` bar redrawn in place on a
/// terminal, plus a line every tenth of the run (the only output when
/// stderr is not a terminal, e.g. in CI logs).
struct Progress {
    bar: ProgressBar,
    steps: usize,
}

impl Progress {
    fn new(steps: usize) -> Self {
        let bar = ProgressBar::new(steps as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "  [{bar:30}] {pos:>4}/{len}  loss {msg:>10}  {per_sec:>14}  eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("#>."),
        );
        Self { bar, steps }
    }

    /// Step `step` (1-based) ended with `loss`.
    fn step(&self, step: usize, loss: f64) {
        self.bar.set_message(format!("{loss:.6}"));
        self.bar.set_position(step as u64);
        if step == 1 || step % (self.steps / 10).max(1) == 0 || step == self.steps {
            let rate = step as f64 / self.bar.elapsed().as_secs_f64().max(1e-9);
            let line = format!(
                "  step {step:>4}/{}  loss {loss:>10.6}  {rate:>6.1} steps/s",
                self.steps
            );
            if self.bar.is_hidden() {
                eprintln!("{line}");
            } else {
                self.bar.println(line);
            }
        }
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// The coordinator: Listing 1's training loop over RPC.
fn coordinate(steps: usize) -> Result<(Vec<f64>, Duration), Box<dyn std::error::Error>> {
    let teacher = (
        Layer::new(INPUTS, HIDDEN, 101),
        Layer::new(HIDDEN, OUTPUTS, 102),
    );
    // Listing 1's Model: two layers placed on workers 1 and 2.
    let l1 = Layer::NEW.remote("worker1", (INPUTS, HIDDEN, 1))?;
    let l2 = Layer::NEW.remote("worker2", (HIDDEN, OUTPUTS, 2))?;
    let mut params = l1.rpc_sync().call(Layer::PARAMS, ())?;
    params.extend(l2.rpc_sync().call(Layer::PARAMS, ())?);
    let opt = DistributedOptimizer::new(optimizer(), params)?;
    let mut losses = Vec::with_capacity(steps);
    let started = Instant::now();
    let progress = Progress::new(steps);
    for step in 0..steps {
        let (x, target) = batch(step, &teacher);
        let ctx = ferry_autograd::context()?;
        // Model.forward(x_rref): r11 on worker 1, r12 on worker 2.
        let ri = RRef::new(Tensor::from(x))?;
        let rx = l1.remote().call(Layer::FORWARD, ri)?;
        let ry = l2.remote().call(Layer::FORWARD, rx)?;
        let y = ry.to_here()?;
        let loss = mse(&y, &target);
        ctx.backward(&[loss.shallow_clone()], false)?;
        opt.step(ctx.id())?;
        let l = loss.double_value(&[]);
        losses.push(l);
        progress.step(step + 1, l);
    }
    progress.finish();
    Ok((losses, started.elapsed()))
}

/// The same training in one process: same initial weights, same batches.
fn train_locally(steps: usize) -> Result<(Vec<f64>, Duration), Box<dyn std::error::Error>> {
    let teacher = (
        Layer::new(INPUTS, HIDDEN, 101),
        Layer::new(HIDDEN, OUTPUTS, 102),
    );
    let (m1, m2) = (
        Layer::new(INPUTS, HIDDEN, 1),
        Layer::new(HIDDEN, OUTPUTS, 2),
    );
    let params: Vec<tch::Tensor> = m1.params().into_iter().chain(m2.params()).collect();
    let mut opt = LocalOptimizer::new(
        optimizer(),
        params.iter().map(|p| p.shallow_clone()).collect(),
    )?;
    let mut losses = Vec::with_capacity(steps);
    let started = Instant::now();
    for step in 0..steps {
        let (x, target) = batch(step, &teacher);
        let loss = mse(&m2.forward(&m1.forward(&x)), &target);
        let grads = tch::Tensor::run_backward(&[&loss], &params, false, false);
        opt.step(&grads.into_iter().map(Some).collect::<Vec<_>>())?;
        losses.push(loss.double_value(&[]));
    }
    Ok((losses, started.elapsed()))
}

/// Listing 1 trained across 3 local processes, then locally.
#[derive(Debug, Parser)]
#[command(name = "train")]
struct Args {
    /// Training steps (one batch each).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    steps: u64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let steps = usize::try_from(Args::parse().steps)?;
    let rank = match ferry::launch::local(3)? {
        ferry::launch::Role::Launcher => return Ok(()),
        ferry::launch::Role::Worker { rank, .. } => rank,
    };
    // The coordinator computes nothing heavy; keep the three processes off
    // each other's cores.
    tch::set_num_threads(1);
    let mut options = RpcOptions::from_env(format!("worker{rank}"))?.functions(functions());
    ferry_autograd::install(&mut options);
    ferry::init_rpc(options)?;
    if rank == 0 {
        eprintln!(
            "Listing 1 across 3 processes: coordinator worker0, Layer({INPUTS}, {HIDDEN}) on worker1, \
             Layer({HIDDEN}, {OUTPUTS}) on worker2; batch {BATCH}, SGD(lr 0.05, momentum 0.9), {steps} steps"
        );
        let (losses, took) = coordinate(steps)?;
        let (local, local_took) = train_locally(steps)?;
        let first = losses.first().copied().unwrap_or(f64::NAN);
        let last = losses.last().copied().unwrap_or(f64::NAN);
        let local_last = local.last().copied().unwrap_or(f64::NAN);
        let worst = losses
            .iter()
            .zip(&local)
            .map(|(a, b)| ((a - b) / b.abs().max(1e-12)).abs())
            .fold(0.0, f64::max);
        println!();
        println!("distributed (3 processes): loss {first:.6} -> {last:.6} in {steps} steps, {:.1} steps/s", steps as f64 / took.as_secs_f64());
        println!("local (1 process):         loss {:.6} -> {local_last:.6} in {steps} steps, {:.1} steps/s", local.first().copied().unwrap_or(f64::NAN), steps as f64 / local_took.as_secs_f64());
        println!("largest relative difference between the two loss curves: {worst:.2e}");
        println!("FINAL_LOSS={last}");
        println!("LOCAL_FINAL_LOSS={local_last}");
    }
    ferry::shutdown()?;
    Ok(())
}
