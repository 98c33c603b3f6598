//! Ferry's side of Table 2 of the PyTorch RPC paper: the overhead of
//! distributed autograd. Same model, protocol and JSON schema as
//! `benches/peers/pt_dist_autograd_overhead.py`, so `cargo xtask bench`
//! can put both in one table.
//!
//! Model: two `nn.Linear(H, H)` layers (`x.linear(w, Some(b))`, no
//! activation; H = 1024), input `B x H` (B = 32), `loss = out.sum()`, CPU,
//! float32. Two processes on 127.0.0.1, launched by this program itself:
//! rank 0 = `worker0` (the trainer, holds layer 1), rank 1 = `worker1`
//! (holds layer 2 for the RPC variants, created with `remote(make_layer)`).
//! Columns (each timed per iteration, ms):
//!
//! - `norpc-fwd`: `layer2(layer1(x)).sum()`, both layers local, autograd on;
//! - `nograd-fwd`: under `tch::no_grad`, layer 1 locally, then
//!   `by_name(remote_fwd_nograd).rpc_sync(worker1, (layer2_rref, h))` (the callee
//!   also runs under `no_grad`), no distributed autograd context;
//! - `grad-fwd`: inside `ferry_autograd::context()`, layer 1 locally, then
//!   `by_name(remote_fwd).rpc_sync(worker1, (layer2_rref, h))` (send/recv recorded);
//! - `norpc-bwd`: `loss.backward()` of the local model, its gradients
//!   cleared first (untimed);
//! - `grad-bwd`: `ctx.backward(&[loss], false)` of the RPC model, in the
//!   same iteration as `grad-fwd`;
//! - `dist-optim-step`: `DistributedOptimizer(SGD, lr 1e-3).step(ctx)`
//!   after a grad forward and backward (a separate loop);
//! - `norpc-step` (Ferry only; the peer has no such column): the same SGD
//!   update of the same four parameters, done locally in this process by a
//!   [`LocalOptimizer`](ferry_autograd::optim::LocalOptimizer) right after
//!   a local forward and backward (a separate loop): the step's local
//!   reference, as `norpc-bwd` is the backward's.
//!
//! Inferred overheads (as the peer reports them; `overheads` in the JSON):
//! RPC forward = nograd-fwd − norpc-fwd, distributed autograd forward =
//! grad-fwd − nograd-fwd, distributed autograd backward = grad-bwd −
//! norpc-bwd (`cargo xtask bench` infers these, the paper's backward
//! overhead and the step's over `norpc-step` itself, run by run, from the
//! columns of either side). After `--warmup` iterations of each, the three
//! forward variants are interleaved in blocks of `--block` iterations until
//! each has `--reps` timings.
//!
//! Usage: `autograd_overhead [--quick] [--hidden H] [--batch B] [--reps N]
//! [--optim-reps N] [--warmup N] [--block N] [--threads N]
//! [--rpc-timeout S] [--out PATH]`. As in the peer, `--quick` sets reps 40,
//! optim-reps 20, warm-up 5, block 10 (over explicit values); `--threads`
//! defaults to libtorch's own default (the peer's `torch.get_num_threads()`).
//!
//! `cargo xtask bench --only autograd` runs it; by hand:
//! `cargo run --release -p ferry-autograd --example autograd_overhead -- --quick`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Parser;
use ferry_autograd::optim::LocalOptimizer;
use ferry_autograd::{DistributedOptimizer, OptimizerKind};
use ferry_rpc::{BoxError, Function, Functions, RpcOptions, Schema};
use ferry_rref::{RRef, RemoteExt};
use ferry_tch::Tensor;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tch::{Device, Kind};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

const OPTS: (Kind, Device) = (Kind::Float, Device::Cpu);
const CALLEE: &str = "worker1";
/// Set by the launcher for its workers: where rank 0 writes its result.
const PART_ENV: &str = "FERRY_AUTOGRAD_OVERHEAD_PART";

/// The benchmark's settings (the peer's arguments, same spellings).
#[derive(Debug, Clone, Parser)]
#[command(name = "autograd_overhead")]
struct Config {
    /// Hidden width of the two linear layers.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(i64).range(1..))]
    hidden: i64,
    /// Rows per batch.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(i64).range(1..))]
    batch: i64,
    /// Timed forward/backward repetitions per side.
    #[arg(long, default_value_t = 300, value_parser = positive)]
    reps: usize,
    /// Timed optimizer-step repetitions per side.
    #[arg(long, default_value_t = 100, value_parser = positive)]
    optim_reps: usize,
    /// Untimed repetitions before measuring.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Repetitions per alternation block between the sides.
    #[arg(long, default_value_t = 20, value_parser = positive)]
    block: usize,
    /// libtorch intra-op threads (libtorch's default when absent).
    #[arg(long)]
    threads: Option<i32>,
    /// RPC timeout in seconds.
    #[arg(long, default_value_t = 120.0, value_parser = seconds)]
    rpc_timeout: f64,
    /// The peer's quick run: 40 reps, 20 optimizer reps, warm-up 5, blocks of
    /// 10 (overriding those options, as the peer's `--quick` does).
    #[arg(long)]
    quick: bool,
    /// Where to write the JSON result (stdout when absent).
    #[arg(long, value_name = "PATH")]
    out: Option<String>,
}

/// clap's parser for a count of at least 1.
fn positive(text: &str) -> std::result::Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{text:?} is not a count of at least 1")),
    }
}

/// clap's parser for a duration in seconds (finite, not negative).
fn seconds(text: &str) -> std::result::Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if s.is_finite() && s >= 0.0 => Ok(s),
        _ => Err(format!("{text:?} is not a number of seconds")),
    }
}

fn config() -> Config {
    let mut c = Config::parse();
    if c.quick {
        // The peer's `--quick` overrides these, explicit or not.
        (c.reps, c.optim_reps, c.warmup, c.block) = (40, 20, 5, 10);
    }
    c
}

// ------------------------------------------------------------------ the model

/// `nn.Linear(inputs, outputs)`: weight `[outputs, inputs]` and bias
/// `[outputs]`, both requiring grad.
#[derive(Serialize, Deserialize, Schema)]
struct Linear {
    weight: Tensor,
    bias: Tensor,
}

impl Linear {
    /// PyTorch's `nn.Linear` initialisation (uniform ±1/sqrt(inputs)),
    /// seeded like the peer's `make_layer` (`torch.manual_seed(seed)`).
    fn new(h: i64, seed: i64) -> Linear {
        tch::manual_seed(seed);
        let bound = 1.0 / (h as f64).sqrt();
        let uniform = |shape: &[i64]| {
            (tch::Tensor::rand(shape, OPTS) * (2.0 * bound) - bound).set_requires_grad(true)
        };
        Linear {
            weight: uniform(&[h, h]).into(),
            bias: uniform(&[h]).into(),
        }
    }

    fn forward(&self, x: &tch::Tensor) -> tch::Tensor {
        x.linear(&self.weight, Some(&*self.bias))
    }

    /// The peer's `p.grad = None` for both parameters: each becomes a fresh
    /// leaf over the same storage (no copy), without a gradient, so that
    /// the next `backward` allocates its gradients instead of adding into
    /// old ones (tch cannot reset `.grad` to undefined).
    fn clear_grads(&mut self) {
        for p in [&mut self.weight, &mut self.bias] {
            *p = Tensor::from(p.detach().set_requires_grad(true));
        }
    }

    fn params(&self) -> [&Tensor; 2] {
        [&self.weight, &self.bias]
    }
}

/// The peer's `make_layer(h, seed)`: layer 2, built on `worker1`.
const MAKE_LAYER: Function<(i64, i64), Linear> = Function::new("make_layer");
/// The peer's `remote_fwd(layer_rref, h)`: layer 2's forward on its owner.
const REMOTE_FWD: Function<(RRef<Linear>, Tensor), Tensor> = Function::new("remote_fwd");
/// `remote_fwd` under `no_grad` on the callee too.
const REMOTE_FWD_NOGRAD: Function<(RRef<Linear>, Tensor), Tensor> =
    Function::new("remote_fwd_nograd");
/// RRefs of layer 2's parameters, for the `DistributedOptimizer`.
const PARAM_RREFS: Function<RRef<Linear>, Vec<RRef<Tensor>>> = Function::new("param_rrefs");

/// The functions `worker1` serves (both workers register them).
fn functions() -> Functions {
    let mut f = Functions::new();
    f.add(MAKE_LAYER, |(h, seed)| Linear::new(h, seed));
    f.add(REMOTE_FWD, |(layer, h): (RRef<Linear>, Tensor)| {
        let layer = layer.local_value()?;
        Ok::<_, BoxError>(Tensor::from(layer.forward(&h)))
    });
    f.add(REMOTE_FWD_NOGRAD, |(layer, h): (RRef<Linear>, Tensor)| {
        let layer = layer.local_value()?;
        Ok::<_, BoxError>(Tensor::from(tch::no_grad(|| layer.forward(&h))))
    });
    f.add(PARAM_RREFS, |layer: RRef<Linear>| {
        let layer = layer.local_value()?;
        layer
            .params()
            .into_iter()
            .map(|p| RRef::new(p.clone()))
            .collect::<std::result::Result<Vec<RRef<Tensor>>, _>>()
    });
    f
}

// ------------------------------------------------------------------ statistics

/// The `p`-quantile of the ascending, non-empty `sorted` (the peer's `pct`).
fn pct(sorted: &[f64], p: f64) -> f64 {
    let idx = p * (sorted.len() - 1) as f64;
    let lo = idx.floor() as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    sorted[lo] * (1.0 - (idx - lo as f64)) + sorted[hi] * (idx - lo as f64)
}

/// The peer's `stats_ms` of durations in seconds (sample std, as
/// `statistics.stdev`).
fn stats_ms(secs: &[f64]) -> Value {
    let mut ms: Vec<f64> = secs.iter().map(|s| s * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let n = ms.len();
    let mean = ms.iter().sum::<f64>() / n as f64;
    let std = if n > 1 {
        (ms.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
    } else {
        0.0
    };
    json!({
        "n": n, "mean_ms": mean, "std_ms": std, "median_ms": pct(&ms, 0.5),
        "p10_ms": pct(&ms, 0.1), "p90_ms": pct(&ms, 0.9), "min_ms": ms[0], "max_ms": ms[n - 1],
    })
}

// ------------------------------------------------------------------ trainer (rank 0)

const COLUMNS: [&str; 5] = [
    "norpc-fwd",
    "nograd-fwd",
    "grad-fwd",
    "norpc-bwd",
    "grad-bwd",
];

/// The per-iteration timings of the five interleaved columns, in seconds.
#[derive(Default)]
struct Timings {
    norpc_fwd: Vec<f64>,
    nograd_fwd: Vec<f64>,
    grad_fwd: Vec<f64>,
    norpc_bwd: Vec<f64>,
    grad_bwd: Vec<f64>,
}

struct Trainer {
    x: tch::Tensor,
    layer1: Linear,
    layer2_local: Linear,
    layer2_rref: RRef<Linear>,
    t: Timings,
}

impl Trainer {
    fn it_norpc(&mut self, record: bool) -> Result<()> {
        self.layer1.clear_grads();
        self.layer2_local.clear_grads();
        let s = Instant::now();
        let loss = self
            .layer2_local
            .forward(&self.layer1.forward(&self.x))
            .sum(Kind::Float);
        let f = s.elapsed().as_secs_f64();
        let s = Instant::now();
        loss.f_backward()?;
        let b = s.elapsed().as_secs_f64();
        if record {
            self.t.norpc_fwd.push(f);
            self.t.norpc_bwd.push(b);
        }
        Ok(())
    }

    fn it_nograd(&mut self, record: bool) -> Result<()> {
        let s = Instant::now();
        let loss = tch::no_grad(|| -> Result<tch::Tensor> {
            let h = Tensor::from(self.layer1.forward(&self.x));
            let out = REMOTE_FWD_NOGRAD.rpc_sync(CALLEE, (self.layer2_rref.clone(), h))?;
            Ok(out.sum(Kind::Float))
        })?;
        let f = s.elapsed().as_secs_f64();
        drop(loss);
        if record {
            self.t.nograd_fwd.push(f);
        }
        Ok(())
    }

    fn it_grad(&mut self, record: bool) -> Result<()> {
        let ctx = ferry_autograd::context()?;
        let s = Instant::now();
        let h = Tensor::from(self.layer1.forward(&self.x));
        let out = REMOTE_FWD.rpc_sync(CALLEE, (self.layer2_rref.clone(), h))?;
        let loss = out.sum(Kind::Float);
        let f = s.elapsed().as_secs_f64();
        let s = Instant::now();
        ctx.backward(&[loss], false)?;
        let b = s.elapsed().as_secs_f64();
        drop(ctx);
        if record {
            self.t.grad_fwd.push(f);
            self.t.grad_bwd.push(b);
        }
        Ok(())
    }

    /// The peer's separate `DistributedOptimizer(SGD)` loop: a grad forward
    /// and backward (untimed), then the timed `step`.
    fn optim_steps(&self, c: &Config) -> Result<Vec<f64>> {
        let mut params: Vec<RRef<Tensor>> = Vec::new();
        for p in self.layer1.params() {
            params.push(RRef::new(p.clone())?);
        }
        let remote = PARAM_RREFS.rpc_sync(CALLEE, self.layer2_rref.clone())?;
        params.extend(remote);
        let opt = DistributedOptimizer::new(OptimizerKind::sgd(1e-3), params)?;
        let mut steps = Vec::with_capacity(c.optim_reps);
        for i in 0..c.warmup + c.optim_reps {
            let ctx = ferry_autograd::context()?;
            let h = Tensor::from(self.layer1.forward(&self.x));
            let out = REMOTE_FWD.rpc_sync(CALLEE, (self.layer2_rref.clone(), h))?;
            ctx.backward(&[out.sum(Kind::Float)], false)?;
            let s = Instant::now();
            opt.step(ctx.id())?;
            let e = s.elapsed().as_secs_f64();
            drop(ctx);
            if i >= c.warmup {
                steps.push(e);
            }
        }
        Ok(steps)
    }

    /// `norpc-step`: the local model's forward and backward (untimed), then
    /// the timed SGD update of its four parameters by a local optimizer.
    fn local_steps(&mut self, c: &Config) -> Result<Vec<f64>> {
        let params = [&self.layer1, &self.layer2_local]
            .into_iter()
            .flat_map(|l| l.params().map(|p| p.shallow_clone()))
            .collect();
        let mut opt = LocalOptimizer::new(OptimizerKind::sgd(1e-3), params)?;
        let mut steps = Vec::with_capacity(c.optim_reps);
        for i in 0..c.warmup + c.optim_reps {
            self.layer1.clear_grads();
            self.layer2_local.clear_grads();
            let loss = self
                .layer2_local
                .forward(&self.layer1.forward(&self.x))
                .sum(Kind::Float);
            loss.f_backward()?;
            // The cleared leaves share the optimizer's storage: their
            // gradients are the optimizer's parameters' gradients.
            let grads: Vec<Option<tch::Tensor>> = [&self.layer1, &self.layer2_local]
                .into_iter()
                .flat_map(|l| l.params().map(|p| Some(p.grad())))
                .collect();
            let s = Instant::now();
            opt.step(&grads)?;
            let e = s.elapsed().as_secs_f64();
            if i >= c.warmup {
                steps.push(e);
            }
        }
        Ok(steps)
    }
}

fn trainer(c: &Config) -> Result<Value> {
    let layer1 = Linear::new(c.hidden, 1);
    let layer2_local = Linear::new(c.hidden, 2);
    let layer2_rref = MAKE_LAYER.remote(CALLEE, (c.hidden, 2))?;
    let x = tch::Tensor::randn([c.batch, c.hidden], OPTS);
    let mut tr = Trainer {
        x,
        layer1,
        layer2_local,
        layer2_rref,
        t: Timings::default(),
    };
    eprintln!("[ferry autograd] warm-up ({} iterations)", c.warmup);
    for _ in 0..c.warmup {
        tr.it_norpc(false)?;
        tr.it_nograd(false)?;
        tr.it_grad(false)?;
    }
    let mut done = 0;
    let c0 = Instant::now();
    while done < c.reps {
        let k = c.block.min(c.reps - done);
        for _ in 0..k {
            tr.it_norpc(true)?;
        }
        for _ in 0..k {
            tr.it_nograd(true)?;
        }
        for _ in 0..k {
            tr.it_grad(true)?;
        }
        done += k;
    }
    let t = &tr.t;
    let mut columns = serde_json::Map::new();
    for (name, secs) in COLUMNS.iter().zip([
        &t.norpc_fwd,
        &t.nograd_fwd,
        &t.grad_fwd,
        &t.norpc_bwd,
        &t.grad_bwd,
    ]) {
        columns.insert(name.to_string(), stats_ms(secs));
    }
    eprintln!("[ferry autograd] DistributedOptimizer steps");
    columns.insert("dist-optim-step".into(), stats_ms(&tr.optim_steps(c)?));
    eprintln!("[ferry autograd] local optimizer steps");
    columns.insert("norpc-step".into(), stats_ms(&tr.local_steps(c)?));

    let get = |col: &str, stat: &str| columns[col][stat].as_f64().unwrap_or(f64::NAN);
    let diff = |a: &str, b: &str| {
        json!({
            "mean": get(a, "mean_ms") - get(b, "mean_ms"),
            "median": get(a, "median_ms") - get(b, "median_ms"),
        })
    };
    let overheads = json!({
        "rpc_fwd_overhead_ms (nograd-fwd - norpc-fwd)": diff("nograd-fwd", "norpc-fwd"),
        "dist_autograd_fwd_overhead_ms (grad-fwd - nograd-fwd)": diff("grad-fwd", "nograd-fwd"),
        "dist_autograd_bwd_overhead_ms (grad-bwd - norpc-bwd)": diff("grad-bwd", "norpc-bwd"),
    });
    Ok(json!({
        "columns": columns,
        "overheads": overheads,
        "measure_wall_s": c0.elapsed().as_secs_f64(),
        "threads": tch::get_num_threads(),
    }))
}

// ------------------------------------------------------------------ processes

/// One worker: starts RPC with distributed autograd, trains on rank 0
/// (writing the result to `part`), then shuts down with the other.
fn worker(rank: u32, c: &Config, part: &Path) -> Result<()> {
    if let Some(n) = c.threads {
        tch::set_num_threads(n);
    }
    let mut options = RpcOptions::from_env(format!("worker{rank}"))?
        .functions(functions())
        .rpc_timeout(Duration::from_secs_f64(c.rpc_timeout));
    ferry_autograd::install(&mut options);
    // The agent with the autograd layer alone, as the process's.
    let agent = ferry_rpc::Agent::start(options)?;
    ferry_rpc::set_process_agent(&agent)?;
    let result = if rank == 0 {
        trainer(c).and_then(|r| Ok(std::fs::write(part, serde_json::to_vec(&r)?)?))
    } else {
        Ok(())
    };
    ferry_rpc::shutdown()?;
    result
}

/// Where rank 0 writes its results for the launcher: next to `--out`, or
/// in the temporary directory.
fn part_path(c: &Config) -> Result<PathBuf> {
    Ok(match &c.out {
        Some(out) => {
            if let Some(dir) = Path::new(out).parent() {
                std::fs::create_dir_all(dir)?;
            }
            PathBuf::from(format!("{out}.part"))
        }
        None => std::env::temp_dir().join(format!(
            "ferry_autograd_overhead.{}.json.part",
            std::process::id()
        )),
    })
}

fn main() -> Result<()> {
    let c = config();
    let t0 = Instant::now();
    if std::env::var_os("RANK").is_none() {
        // The launcher: the workers inherit where rank 0 writes its part.
        let part = part_path(&c)?;
        let _ = std::fs::remove_file(&part);
        std::env::set_var(PART_ENV, &part);
    }
    let part = PathBuf::from(std::env::var_os(PART_ENV).ok_or(format!("{PART_ENV} is not set"))?);
    // Ranks 0 and 1 are copies of this executable (ferry's local launcher).
    if let ferry::launch::Role::Worker { rank, .. } = ferry::launch::local(2)? {
        return worker(rank, &c, &part);
    }
    let result: Value = serde_json::from_slice(&std::fs::read(&part)?)?;
    std::fs::remove_file(&part)?;
    let mut value = json!({
        "bench": "ferry_dist_autograd_overhead",
        "versions": {
            "ferry": env!("CARGO_PKG_VERSION"),
            "platform": format!("{}-{}", std::env::consts::OS, std::env::consts::ARCH),
        },
        "config": {
            "hidden": c.hidden, "batch": c.batch, "reps": c.reps, "optim_reps": c.optim_reps,
            "warmup": c.warmup, "block": c.block,
            "threads": result["threads"].clone(),
            "rpc_timeout": c.rpc_timeout, "quick": c.quick, "out": c.out,
        },
    });
    for key in ["columns", "overheads", "measure_wall_s"] {
        value[key] = result[key].clone();
    }
    value["elapsed_s"] = json!(t0.elapsed().as_secs_f64());
    let text = serde_json::to_string_pretty(&value)?;
    if let Some(out) = &c.out {
        std::fs::write(out, &text)?;
    }
    println!("{text}");
    Ok(())
}
