//! Fault-tolerant data-parallel training, torchft style, with Ferry's
//! lighthouse, managers, live recovery and replica-group allreduce.
//!
//! `cargo run -p ferry-ft --example ft_train` runs the whole scenario:
//!
//! 1. a [`Lighthouse`] (min_replicas 2) starts in this process;
//! 2. three replica groups start, each a separate OS process running this
//!    example in replica mode (`ft_train replica --index I ...`) with its
//!    own [`Manager`] (world size 1), [`ManagerClient`],
//!    [`CheckpointServer`], rendezvous store ([`TcpStoreServer`]) and
//!    [`ProcessGroup`];
//!    they train a linear regression (parameters and SGD momentum in
//!    `Vec<f32>`, synthetic data drawn from the step and the replica rank)
//!    with torchft's loop: quorum → heal if told (fetch the state from the
//!    checkpoint server named in the source's checkpoint metadata) →
//!    forward/backward → allreduce of the gradients → should_commit → apply
//!    only when committed;
//! 3. replica group 2 is killed with SIGKILL mid-training; the other two
//!    keep training (they are not restarted) and commit steps on their own;
//! 4. replica group 2 is started again: it heals from a live peer and joins;
//! 5. everyone trains to the last step and prints its parameters.
//!
//! `ft_train --baby` runs the same scenario with each replica group's
//! allreduce in a [`BabyProcessGroup`]: a child process (this example
//! re-executed, see [`run_child_if_requested`] in `main`) that is killed
//! and restarted on failures instead of sharing the trainer's fate.
//!
//! Each replica prints one line per event on stdout, which the scenario
//! (and `tests/ft_e2e.rs`) parses: `READY`, `HEAL step=.. from=..`,
//! `COMMIT step=.. participants=..`, `SKIP step=.. reason=..` and
//! `FINAL step=.. hash=.. params=..`. The scenario checks that no step was
//! committed by fewer than `min_replicas` replica groups and that every
//! replica ends with bit-identical parameters.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use ferry_ft::baby::{run_child_if_requested, BabyOptions, BabyProcessGroup, ChildProgram};
use ferry_ft::collective::{ProcessGroup, ProcessGroupOptions};
use ferry_ft::lighthouse::{Lighthouse, LighthouseOptions};
use ferry_ft::manager::{Manager, ManagerClient, ManagerOptions, QuorumRequest, QuorumResult};
use ferry_ft::recovery::{
    fetch_checkpoint, CheckpointServer, CheckpointServerOptions, CheckpointState, FetchOptions,
};
use ferry_store::TcpStoreServer;
use ferry_transport::RawTensor;
use tracing::{info, info_span, warn, Instrument};

// ------------------------------------------------------------------------
// The model: linear regression with SGD and momentum.

/// Input features.
const DIM: usize = 8;
/// Samples per replica per step.
const BATCH: usize = 32;
const LEARNING_RATE: f32 = 0.05;
const MOMENTUM: f32 = 0.9;

/// A 64-bit mix (splitmix64's finaliser).
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A value in [-1, 1) drawn from `seed`.
fn uniform(seed: u64) -> f32 {
    (mix(seed) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// The weights the data is generated from (the last one is the bias).
fn true_params() -> Vec<f32> {
    (0..=DIM).map(|i| uniform(1000 + i as u64) * 2.0).collect()
}

/// The model: parameters (weights then bias) and the optimizer's momentum.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Model {
    params: Vec<f32>,
    momentum: Vec<f32>,
}

impl Model {
    fn new() -> Self {
        Self {
            params: (0..=DIM).map(|i| 0.01 * i as f32).collect(),
            momentum: vec![0.0; DIM + 1],
        }
    }

    /// The batch of replica rank `rank` at `step`: features and targets.
    fn batch(step: i64, rank: u64) -> Vec<([f32; DIM], f32)> {
        let truth = true_params();
        (0..BATCH as u64)
            .map(|sample| {
                let seed = (step as u64) << 32 ^ rank << 16 ^ sample;
                let mut x = [0.0f32; DIM];
                for (d, value) in x.iter_mut().enumerate() {
                    *value = uniform(seed.wrapping_mul(31).wrapping_add(d as u64));
                }
                let noise = 0.01 * uniform(seed ^ 0xABCD_EF01);
                let y = x.iter().zip(&truth).map(|(a, b)| a * b).sum::<f32>() + truth[DIM] + noise;
                (x, y)
            })
            .collect()
    }

    /// Forward and backward on the batch: (loss, gradient).
    fn gradient(&self, step: i64, rank: u64) -> (f32, Vec<f32>) {
        let mut grad = vec![0.0f32; DIM + 1];
        let mut loss = 0.0f32;
        let batch = Self::batch(step, rank);
        for (x, y) in &batch {
            let prediction =
                x.iter().zip(&self.params).map(|(a, w)| a * w).sum::<f32>() + self.params[DIM];
            let error = prediction - y;
            loss += 0.5 * error * error;
            for (g, a) in grad.iter_mut().zip(x.iter()) {
                *g += error * a;
            }
            grad[DIM] += error;
        }
        let n = batch.len() as f32;
        for g in &mut grad {
            *g /= n;
        }
        (loss / n, grad)
    }

    /// One optimizer step with the (averaged) gradient.
    fn apply(&mut self, grad: &[f32]) {
        for ((p, m), g) in self.params.iter_mut().zip(&mut self.momentum).zip(grad) {
            *m = MOMENTUM * *m + g;
            *p -= LEARNING_RATE * *m;
        }
    }

    /// The state a healing replica fetches.
    fn state(&self, step: i64) -> Result<CheckpointState> {
        let shape = [(DIM + 1) as i64];
        Ok(CheckpointState::new(step)
            .with_tensor("model.linear", RawTensor::from_slice(&self.params, &shape)?)
            .with_tensor(
                "optim.momentum",
                RawTensor::from_slice(&self.momentum, &shape)?,
            ))
    }

    fn load(&mut self, state: &CheckpointState) -> Result<()> {
        let read = |name: &str| -> Result<Vec<f32>> {
            let values = state
                .get(name)
                .and_then(|t| t.as_slice::<f32>())
                .ok_or_else(|| anyhow!("the checkpoint has no f32 tensor {name}"))?;
            if values.len() != DIM + 1 {
                bail!("{name} has {} values, expected {}", values.len(), DIM + 1);
            }
            Ok(values.to_vec())
        };
        self.params = read("model.linear")?;
        self.momentum = read("optim.momentum")?;
        Ok(())
    }

    /// The parameters' bits, as hex (what replicas compare at the end).
    fn params_hex(&self) -> String {
        self.params
            .iter()
            .map(|p| format!("{:08x}", p.to_bits()))
            .collect()
    }

    fn params_hash(&self) -> u64 {
        self.params.iter().fold(0xcbf2_9ce4_8422_2325, |h, p| {
            p.to_bits()
                .to_le_bytes()
                .iter()
                .fold(h, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
        })
    }
}

// ------------------------------------------------------------------------
// Replica mode: one replica group.

/// Back-off before asking for a quorum again after a failed request.
const QUORUM_RETRY_PAUSE: Duration = Duration::from_millis(100);

/// A replica group's settings (`ft_train replica ...`).
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "ft_train replica")]
pub(crate) struct ReplicaArgs {
    /// Which replica group (0, 1, 2); its replica id is `ft_train_{index}:{pid}`.
    #[arg(long, default_value_t = 0)]
    pub(crate) index: usize,
    /// The lighthouse's address.
    #[arg(long)]
    pub(crate) lighthouse: String,
    /// Train until this many steps are committed.
    #[arg(long, default_value_t = 100)]
    pub(crate) steps: i64,
    /// Then go on until a step is committed by this many replica groups
    /// (0: stop at `steps`): every group ends at the same step, whoever was
    /// down on the way.
    #[arg(long, default_value_t = 0)]
    pub(crate) until_groups: u64,
    /// Fewest replica groups a step may be committed with.
    #[arg(long, default_value_t = 2)]
    pub(crate) min_replicas: u64,
    /// Timeout of the process group (rendezvous, allreduce) and of healing.
    #[arg(long, default_value_t = 3000)]
    pub(crate) timeout_ms: u64,
    /// Fault injection: stop dead in the first step at or after this one,
    /// after the quorum and before the allreduce (a replica about to be
    /// killed mid-step).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) hang_at_step: Option<i64>,
    /// Run the allreduce in a Baby process group (a child process) rather
    /// than in this process.
    #[arg(long)]
    pub(crate) baby: bool,
}

impl ReplicaArgs {
    fn to_args(&self) -> Vec<String> {
        vec![
            "--index".into(),
            self.index.to_string(),
            "--lighthouse".into(),
            self.lighthouse.clone(),
            "--steps".into(),
            self.steps.to_string(),
            "--until-groups".into(),
            self.until_groups.to_string(),
            "--min-replicas".into(),
            self.min_replicas.to_string(),
            "--timeout-ms".into(),
            self.timeout_ms.to_string(),
        ]
        .into_iter()
        .chain(
            self.hang_at_step
                .map(|step| ["--hang-at-step".to_owned(), step.to_string()])
                .into_iter()
                .flatten(),
        )
        .chain(self.baby.then(|| "--baby".to_owned()))
        .collect()
    }

    fn parse(args: &[String]) -> Result<Self> {
        use clap::Parser;
        Ok(Self::try_parse_from(
            std::iter::once("replica").chain(args.iter().map(String::as_str)),
        )?)
    }
}

/// Runs one replica group to the last step (replica mode); `args` are the
/// flags after `replica`.
pub(crate) fn replica_main(args: &[String]) -> Result<()> {
    let args = ReplicaArgs::parse(args)?;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(run_replica(args))
}

async fn run_replica(args: ReplicaArgs) -> Result<()> {
    let index = args.index;
    // torchft's replica ids are `{name}:{uuid}`: a restarted group is a new
    // member of the quorum.
    let replica_id = format!("ft_train_{index}:{}", std::process::id());
    let span = info_span!("replica", replica_id = %replica_id, index);
    train(args, replica_id).instrument(span).await
}

async fn train(args: ReplicaArgs, replica_id: String) -> Result<()> {
    let index = args.index;
    let timeout = Duration::from_millis(args.timeout_ms);
    let quorum_timeout = Duration::from_secs(10);

    let store = TcpStoreServer::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).await?;
    let checkpoints =
        CheckpointServer::bind("127.0.0.1:0", CheckpointServerOptions::new(&replica_id)).await?;
    let mut pg = if args.baby {
        // The child is this example re-executed (`main` starts with
        // `run_child_if_requested`), or the `ferry-ft-baby` program named
        // by FERRY_FT_BABY_BIN.
        let child = if std::env::var_os(ferry_ft::baby::CHILD_BIN_ENV).is_some() {
            ChildProgram::Auto
        } else {
            ChildProgram::CurrentExe
        };
        Group::Baby(BabyProcessGroup::new(
            BabyOptions::new(&replica_id)
                .with_timeout(timeout)
                .with_child(child),
        ))
    } else {
        Group::InProcess(
            ProcessGroup::bind(
                "127.0.0.1:0",
                ProcessGroupOptions::new(&replica_id).with_timeout(timeout),
            )
            .await?,
        )
    };
    let store_address = store.local_addr().to_string();
    let manager = Manager::bind(
        "127.0.0.1:0",
        ManagerOptions::new(&replica_id, &args.lighthouse, store_address, 1)
            .with_heartbeat_interval(Duration::from_millis(50))
            .with_connect_timeout(Duration::from_secs(5))
            .with_quorum_retries(3),
    )
    .await?;
    let client =
        ManagerClient::connect_with_timeout(manager.address(), Duration::from_secs(5)).await?;
    let fetch_options = FetchOptions::new(&replica_id)
        .with_wait(timeout)
        .with_io_timeout(timeout)
        .with_connect_timeout(timeout);
    println!(
        "READY replica={index} id={replica_id} pid={}",
        std::process::id()
    );

    let mut model = Model::new();
    let mut step: i64 = 0;
    let mut commit_failures: u64 = 0;
    // Replica groups that committed the last step.
    let mut last_groups: u64 = 0;
    while step < args.steps || last_groups < args.until_groups {
        let quorum = match client
            .quorum(
                QuorumRequest {
                    checkpoint_metadata: checkpoints.address(),
                    commit_failures,
                    ..QuorumRequest::new(0, step)
                },
                quorum_timeout,
            )
            .await
        {
            Ok(quorum) => quorum,
            Err(error) => {
                warn!("quorum failed, asking again: {error}");
                tokio::time::sleep(QUORUM_RETRY_PAUSE).await;
                continue;
            }
        };
        let participants = quorum.replica_world_size;
        let mut failure: Option<String> = None;

        // A recovery source serves its state of this step until it commits.
        let serving = !quorum.recover_dst_replica_ranks.is_empty();
        if serving {
            checkpoints.allow(model.state(step)?)?;
        }

        if quorum.heal {
            match heal(&quorum, &fetch_options, timeout).await {
                Ok(state) => {
                    model.load(&state)?;
                    step = state.step;
                    println!(
                        "HEAL replica={index} step={step} from={} quorum_id={}",
                        quorum.recover_src_replica_rank.unwrap_or_default(),
                        quorum.quorum_id
                    );
                }
                Err(error) => failure = Some(format!("heal: {error:#}")),
            }
        }
        if failure.is_none() {
            if let Err(error) = pg.configure(&quorum).await {
                failure = Some(format!("configure: {error}"));
            }
        }

        // Forward and backward.
        println!(
            "STEP replica={index} step={step} participants={participants} quorum_id={}",
            quorum.quorum_id
        );
        if args.hang_at_step.is_some_and(|hang| step >= hang) {
            warn!(step, "hanging here, as asked (--hang-at-step)");
            std::future::pending::<()>().await;
        }
        let (loss, mut grad) = model.gradient(step, quorum.replica_rank);

        if failure.is_none() {
            if let Err(error) = pg.allreduce_mean(&mut grad).await {
                failure = Some(format!("allreduce: {error}"));
            }
        }
        if failure.is_none() && participants < args.min_replicas {
            failure = Some(format!(
                "{participants} participants, fewer than min_replicas {}",
                args.min_replicas
            ));
        }
        let vote = failure.is_none();
        let committed = match client.should_commit(0, step, vote, quorum_timeout).await {
            Ok(decision) => decision,
            Err(error) => {
                failure.get_or_insert(format!("should_commit: {error}"));
                false
            }
        };
        if serving {
            checkpoints.disallow().await;
        }
        if committed {
            model.apply(&grad);
            println!(
                "COMMIT replica={index} step={step} participants={participants} quorum_id={} loss={loss:.6}",
                quorum.quorum_id
            );
            step += 1;
            commit_failures = 0;
            last_groups = participants as u64;
        } else {
            commit_failures += 1;
            let reason = failure.unwrap_or_else(|| "the group voted no".into());
            println!(
                "SKIP replica={index} step={step} participants={participants} quorum_id={} reason={}",
                quorum.quorum_id,
                reason.replace(char::is_whitespace, "_")
            );
        }
    }
    println!(
        "FINAL replica={index} step={step} hash={:016x} params={}",
        model.params_hash(),
        model.params_hex()
    );
    info!(step, "training done");
    if let Group::Baby(pg) = pg {
        pg.shutdown().await;
    }
    drop(client);
    manager.shutdown().await?;
    Ok(())
}

/// The replica groups' process group: in this process, or in a Baby child.
enum Group {
    InProcess(ProcessGroup),
    Baby(BabyProcessGroup),
}

impl Group {
    async fn configure(&mut self, quorum: &QuorumResult) -> Result<(), String> {
        match self {
            Group::InProcess(pg) => pg.configure(quorum).await.map_err(|e| e.to_string()),
            Group::Baby(pg) => pg.configure(quorum).await.map_err(|e| e.to_string()),
        }
    }

    /// An error here means the step must not be committed.
    async fn allreduce_mean(&mut self, grad: &mut [f32]) -> Result<(), String> {
        match self {
            Group::InProcess(pg) => pg.allreduce_mean(grad).await.map_err(|e| e.to_string()),
            Group::Baby(pg) => pg.allreduce_mean(grad).await.map_err(|e| e.to_string()),
        }
    }
}

/// Fetches the state to heal to: the source's checkpoint address from its
/// manager (its checkpoint metadata), then the checkpoint at `max_step`.
async fn heal(
    quorum: &ferry_ft::manager::QuorumResult,
    options: &FetchOptions,
    timeout: Duration,
) -> Result<CheckpointState> {
    let source = quorum
        .recover_src_manager_address
        .as_deref()
        .context("told to heal without a source")?;
    let source_manager = ManagerClient::connect_with_timeout(source, timeout).await?;
    let metadata = source_manager.checkpoint_metadata(0, timeout).await?;
    let state = fetch_checkpoint(&metadata, quorum.max_step, options).await?;
    Ok(state)
}

// ------------------------------------------------------------------------
// Scenario mode: the lighthouse and the replica groups, a SIGKILL and a
// restart.

/// The scenario's knobs.
#[derive(Debug, Clone)]
pub(crate) struct ScenarioOptions {
    /// Steps to train (at least: then until all groups commit a step).
    pub(crate) steps: i64,
    /// Replica groups in the scenario.
    pub(crate) groups: u64,
    /// Replica group 2 stops dead in this step (after its quorum, before its
    /// allreduce) and is killed there.
    pub(crate) kill_after_step: i64,
    pub(crate) min_replicas: u64,
    pub(crate) timeout_ms: u64,
    /// The whole scenario must end within this.
    pub(crate) deadline: Duration,
    /// Replica groups allreduce through Baby process groups.
    pub(crate) baby: bool,
}

impl Default for ScenarioOptions {
    fn default() -> Self {
        Self {
            steps: 150,
            groups: 3,
            kill_after_step: 15,
            min_replicas: 2,
            timeout_ms: 2000,
            deadline: Duration::from_secs(60),
            baby: false,
        }
    }
}

/// A step started, committed or skipped, as a replica reported it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Record {
    /// Which process (0, 1, 2; 3 is replica group 2 restarted).
    pub(crate) process: usize,
    pub(crate) step: i64,
    /// Replica groups in the step's quorum.
    pub(crate) participants: u64,
    pub(crate) quorum_id: i64,
}

/// What the scenario saw.
#[derive(Debug, Clone, Default)]
pub(crate) struct ScenarioReport {
    /// Steps committed.
    pub(crate) commits: Vec<Record>,
    /// Steps started (quorum and process group ready).
    pub(crate) steps: Vec<Record>,
    /// Steps not committed.
    pub(crate) skips: Vec<Record>,
    /// (process, step healed to).
    pub(crate) heals: Vec<(usize, i64)>,
    /// Process -> (final step, params hex).
    pub(crate) finals: BTreeMap<usize, (i64, String)>,
    /// The last step process 2 committed before it was killed.
    pub(crate) killed_after: i64,
    /// Commits made by the survivors with two participants while the
    /// killed group was down.
    pub(crate) commits_while_down: usize,
    /// The step replica group 2 was killed in (after its quorum, before its
    /// allreduce), and that step's quorum.
    pub(crate) killed_in: Record,
    pub(crate) elapsed: Duration,
}

/// One parsed stdout line of a replica.
#[derive(Debug, Clone)]
enum Event {
    Ready,
    Heal { step: i64 },
    Step(Record),
    Commit(Record),
    Skip(Record),
    Final { step: i64, params: String },
    Exited,
    Other,
}

fn parse(process: usize, line: &str) -> Event {
    let mut words = line.split_whitespace();
    let kind = words.next().unwrap_or_default();
    let fields: BTreeMap<&str, &str> = words.filter_map(|w| w.split_once('=')).collect();
    let int = |key: &str| fields.get(key).and_then(|v| v.parse::<i64>().ok());
    match kind {
        "READY" => Event::Ready,
        "HEAL" => int("step").map_or(Event::Other, |step| Event::Heal { step }),
        "STEP" | "COMMIT" | "SKIP" => match (int("step"), int("participants"), int("quorum_id")) {
            (Some(step), Some(participants), Some(quorum_id)) => {
                let record = Record {
                    process,
                    step,
                    participants: participants as u64,
                    quorum_id,
                };
                match kind {
                    "STEP" => Event::Step(record),
                    "COMMIT" => Event::Commit(record),
                    _ => Event::Skip(record),
                }
            }
            _ => Event::Other,
        },
        "FINAL" => match (int("step"), fields.get("params")) {
            (Some(step), Some(params)) => Event::Final {
                step,
                params: (*params).to_owned(),
            },
            _ => Event::Other,
        },
        _ => Event::Other,
    }
}

/// The replica processes; every one still running is killed on drop.
struct Processes {
    children: Vec<Option<Child>>,
    events: mpsc::Sender<(usize, Event, String)>,
}

impl Processes {
    fn spawn(&mut self, mut command: Command) -> Result<usize> {
        let process = self.children.len();
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("spawn a replica group")?;
        let stdout = child.stdout.take().context("replica stdout")?;
        let events = self.events.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let event = parse(process, &line);
                if events.send((process, event, line)).is_err() {
                    return;
                }
            }
            let _ = events.send((process, Event::Exited, String::new()));
        });
        self.children.push(Some(child));
        Ok(process)
    }

    /// SIGKILL, and reap.
    fn kill(&mut self, process: usize) -> Result<()> {
        if let Some(mut child) = self.children.get_mut(process).and_then(Option::take) {
            child.kill().context("kill")?;
            child.wait().context("reap")?;
        }
        Ok(())
    }

    fn wait_all(&mut self) {
        for child in self.children.iter_mut().filter_map(Option::take) {
            let mut child = child;
            let _ = child.wait();
        }
    }
}

impl Drop for Processes {
    fn drop(&mut self) {
        for child in self.children.iter_mut().filter_map(Option::take) {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Everything the replicas said, and the scenario's deadline.
struct Watch {
    events: mpsc::Receiver<(usize, Event, String)>,
    deadline: Instant,
    log: Vec<String>,
    report: ScenarioReport,
    killed: Option<usize>,
    exited: Vec<usize>,
}

impl Watch {
    /// Takes events until `done` says so; fails at the deadline.
    fn until(
        &mut self,
        what: &str,
        mut done: impl FnMut(&Self, usize, &Event) -> bool,
    ) -> Result<()> {
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            let (process, event, line) = match self.events.recv_timeout(left) {
                Ok(received) => received,
                Err(_) => bail!("timed out waiting for {what}; last lines:\n{}", self.tail()),
            };
            if !line.is_empty() {
                // Show the events, and every 25th commit.
                let shown = match &event {
                    Event::Commit(record) => record.step % 25 == 0,
                    Event::Step { .. } | Event::Other => false,
                    _ => true,
                };
                if shown {
                    println!("  [process {process}] {}", truncate(&line, 110));
                }
                self.log.push(format!("[{process}] {line}"));
            }
            match &event {
                Event::Commit(record) => self.report.commits.push(*record),
                Event::Step(record) => self.report.steps.push(*record),
                Event::Skip(record) => self.report.skips.push(*record),
                Event::Heal { step } => self.report.heals.push((process, *step)),
                Event::Final { step, params } => {
                    self.report.finals.insert(process, (*step, params.clone()));
                }
                Event::Exited => {
                    self.exited.push(process);
                    if self.killed != Some(process) && !self.report.finals.contains_key(&process) {
                        bail!(
                            "replica process {process} exited before the end; last lines:\n{}",
                            self.tail()
                        );
                    }
                }
                Event::Ready | Event::Other => {}
            }
            if done(self, process, &event) {
                return Ok(());
            }
        }
    }

    fn tail(&self) -> String {
        let start = self.log.len().saturating_sub(40);
        self.log[start..].join("\n")
    }
}

fn truncate(line: &str, max: usize) -> String {
    match line.char_indices().nth(max) {
        Some((at, _)) => format!("{}...", &line[..at]),
        None => line.to_owned(),
    }
}

/// Runs the scenario; `replica(args)` builds the command that runs this
/// example in replica mode with `args` (the flags after `replica`).
pub(crate) fn run_scenario(
    options: &ScenarioOptions,
    replica: &dyn Fn(&[String]) -> Command,
) -> Result<ScenarioReport> {
    let started = Instant::now();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let lighthouse = runtime.block_on(Lighthouse::bind(
        "127.0.0.1:0",
        LighthouseOptions::new(options.min_replicas)
            .with_join_timeout(Duration::from_millis(300))
            .with_quorum_tick(Duration::from_millis(10))
            .with_heartbeat_timeout(Duration::from_secs(1)),
    ))?;
    let args = |index: usize, hang_at_step: Option<i64>| ReplicaArgs {
        hang_at_step,
        index,
        lighthouse: lighthouse.url(),
        steps: options.steps,
        until_groups: options.groups,
        min_replicas: options.min_replicas,
        timeout_ms: options.timeout_ms,
        baby: options.baby,
    };

    let (sender, receiver) = mpsc::channel();
    let mut processes = Processes {
        children: Vec::new(),
        events: sender,
    };
    let mut watch = Watch {
        events: receiver,
        deadline: started + options.deadline,
        log: Vec::new(),
        report: ScenarioReport::default(),
        killed: None,
        exited: Vec::new(),
    };
    for index in 0..3 {
        let hang = (index == 2).then_some(options.kill_after_step + 1);
        processes.spawn(replica(&args(index, hang).to_args()))?;
    }

    // Let replica group 2 train a while, then SIGKILL it.
    let kill_after = options.kill_after_step;
    let mut killed_in = None;
    watch.until(
        "replica group 2 to train a few steps",
        |_, process, event| match (process, event) {
            (2, Event::Step(record)) if record.step > kill_after => {
                killed_in = Some(*record);
                true
            }
            _ => false,
        },
    )?;
    let killed_in = killed_in.context("the step replica group 2 stopped in")?;
    watch.killed = Some(2);
    processes.kill(2)?;
    watch.report.killed_in = killed_in;
    watch.report.killed_after = watch
        .report
        .commits
        .iter()
        .filter(|c| c.process == 2)
        .map(|c| c.step)
        .max()
        .unwrap_or_default();
    println!(
        "scenario: killed replica group 2 (SIGKILL) in step {} (quorum {}), its last commit was step {}",
        killed_in.step,
        killed_in.quorum_id,
        watch.report.killed_after
    );

    // The survivors keep training on their own.
    let mut alone = [false; 2];
    watch.until(
        "the survivors to commit without replica group 2",
        |_, process, event| {
            if let (0 | 1, Event::Commit(record)) = (process, event) {
                if record.participants == 2 {
                    alone[process] = true;
                }
            }
            alone == [true, true]
        },
    )?;
    println!(
        "scenario: replica groups 0 and 1 committed a step with two participants; restarting 2"
    );

    // Replica group 2 comes back, heals from a live peer and joins.
    let newcomer = processes.spawn(replica(&args(2, None).to_args()))?;
    watch.until(
        "the restarted replica group to heal",
        |_, process, event| process == newcomer && matches!(event, Event::Heal { .. }),
    )?;
    watch.until(
        "the restarted replica group to commit",
        |_, process, event| process == newcomer && matches!(event, Event::Commit(_)),
    )?;
    println!("scenario: the restarted replica group healed and trains again");
    watch.report.commits_while_down = {
        let restarted_first = watch
            .report
            .commits
            .iter()
            .find(|c| c.process == newcomer)
            .map(|c| c.step)
            .unwrap_or_default();
        watch
            .report
            .commits
            .iter()
            .filter(|c| {
                c.process < 2
                    && c.participants == 2
                    && c.step > watch.report.killed_after
                    && c.step < restarted_first
            })
            .count()
    };

    let survivors = [0, 1, newcomer];
    watch.until("every replica group to finish", |watch, _, _| {
        survivors
            .iter()
            .all(|p| watch.report.finals.contains_key(p) && watch.exited.contains(p))
    })?;
    processes.wait_all();
    runtime.block_on(lighthouse.shutdown())?;
    watch.report.elapsed = started.elapsed();

    check(&watch.report, options, &survivors)
        .map_err(|error| anyhow!("{error:#}; last lines:\n{}", watch.tail()))?;
    Ok(watch.report)
}

/// The scenario's invariants.
fn check(report: &ScenarioReport, options: &ScenarioOptions, survivors: &[usize]) -> Result<()> {
    if let Some(bad) = report
        .commits
        .iter()
        .find(|c| c.participants < options.min_replicas)
    {
        bail!(
            "step {} was committed by {} participants: {bad:?}",
            bad.step,
            bad.participants
        );
    }
    // The step replica group 2 died in was committed by no one in its
    // quorum: every other member's allreduce failed.
    let killed = report.killed_in;
    let in_that_step = |r: &&Record| r.step == killed.step && r.quorum_id == killed.quorum_id;
    if let Some(bad) = report.commits.iter().find(in_that_step) {
        bail!("the step replica group 2 died in was committed: {bad:?}");
    }
    for started in report
        .steps
        .iter()
        .filter(in_that_step)
        .filter(|r| r.process != 2)
    {
        if !report
            .skips
            .iter()
            .any(|s| s.process == started.process && in_that_step(&s))
        {
            bail!(
                "process {} did not skip the step replica group 2 died in",
                started.process
            );
        }
    }
    let finals: Vec<&(i64, String)> = survivors
        .iter()
        .map(|p| report.finals.get(p).context("a final line is missing"))
        .collect::<Result<_>>()?;
    for (p, (step, params)) in survivors.iter().zip(&finals) {
        if *step < options.steps || *step != finals[0].0 {
            bail!(
                "process {p} ended at step {step}, not with the others ({}) at or after {}",
                finals[0].0,
                options.steps
            );
        }
        if params != &finals[0].1 {
            bail!(
                "process {p} ended with other parameters:\n{params}\n{}",
                finals[0].1
            );
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    // A Baby process group's child (`--baby`) is this program re-executed.
    run_child_if_requested();
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("replica") {
        return replica_main(&args[1..]);
    }
    let baby = args.first().map(String::as_str) == Some("--baby");
    if args.len() > usize::from(baby) {
        bail!("usage: ft_train [--baby]   (the whole scenario; --baby: allreduce in child processes)\n       ft_train replica ...  (one replica group)");
    }
    let exe = std::env::current_exe()?;
    let replica = |flags: &[String]| {
        let mut command = Command::new(&exe);
        command.arg("replica").args(flags);
        command
    };
    let options = ScenarioOptions {
        baby,
        ..ScenarioOptions::default()
    };
    let report = run_scenario(&options, &replica)?;
    let truth = true_params();
    println!(
        "scenario done in {:.1} s: {} commits ({} by the two survivors while replica group 2 was down), skipped (process, step): {:?}, heals at steps {:?}",
        report.elapsed.as_secs_f64(),
        report.commits.len(),
        report.commits_while_down,
        report
            .skips
            .iter()
            .map(|r| (r.process, r.step))
            .collect::<Vec<_>>(),
        report.heals.iter().map(|(_, step)| step).collect::<Vec<_>>()
    );
    if let Some((step, params)) = report.finals.values().next() {
        println!("all replica groups hold bit-identical parameters at step {step}: {params}");
    }
    println!("(the data were generated from {truth:?})");
    Ok(())
}
