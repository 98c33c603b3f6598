//! Where plain (blocking) function bodies run: a thread of this pool that
//! is waiting for work and still polling for it, else the runtime's own
//! blocking pool.
//!
//! Handing a body to tokio's blocking pool wakes a parked thread: on a
//! small VM that wake-up (a futex, an inter-processor interrupt, the
//! scheduler) costs about 7 µs, a third of an empty call's round trip. A
//! caller that calls again right after its reply (the common loop) sends
//! its next request within microseconds, so the thread that ran the last
//! body keeps polling for the next one for [`ChannelConfig::spin`]
//! (the same budget the rings' readers and waiting callers use) before it
//! parks, and a body that arrives meanwhile starts without a wake-up.
//!
//! A body goes to one of these threads only when one is waiting for work
//! (a job per waiting thread, never queued behind a running body), so a
//! body that blocks (a nested `rpc_sync`) never delays another: the others
//! go to tokio's pool as before. At most [`MAX_POLLING`] threads poll at
//! a time (on a small host more would take the cores from the bodies);
//! the others park at once. The pool's threads (at most [`MAX_THREADS`],
//! PyTorch's default RPC thread count) live until the agent stops, parked
//! while there is no work: state a body keeps per thread (a Python thread
//! state, say: see [`on_body_thread`]) lives as long.
//!
//! [`ChannelConfig::spin`]: ferry_transport::ChannelConfig::spin

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use tokio::runtime::Handle;

/// A body to run.
pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

/// What runs on every thread of the agent before its first job (the
/// options' thread-start hooks).
pub(crate) type ThreadStart = Arc<crate::service::ThreadStart>;

/// The most threads the pool keeps; bodies beyond them go to tokio's pool.
pub(crate) const MAX_THREADS: usize = 16;

/// The most threads of the pool polling for work at a time.
pub(crate) const MAX_POLLING: usize = 2;

thread_local! {
    static BODY_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is one of an agent's body threads: it runs plain
/// function bodies and lives until its agent stops, so what a body keeps
/// per thread (a Python thread state, a scratch buffer) is there for the
/// next body it runs. Bodies also run on the runtime's blocking pool,
/// whose threads come and go.
pub fn on_body_thread() -> bool {
    BODY_THREAD.get()
}

/// The pool of one agent.
pub(crate) struct BlockingPool {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when a job is queued for a parked thread, or on close.
    work: Condvar,
    /// `state.queue.len()`, readable without the lock: what polling
    /// threads check.
    queued: AtomicUsize,
    spin: Duration,
    runtime: Handle,
    thread_starts: Vec<ThreadStart>,
    name: String,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    /// Threads of the pool alive.
    threads: usize,
    /// Threads waiting for work (polling or parked).
    waiting: usize,
    /// Of those, parked on `work`.
    parked: usize,
    /// Of those, polling `queued` (at most [`MAX_POLLING`]).
    polling: usize,
    closed: bool,
}

impl BlockingPool {
    /// A pool whose threads poll for `spin` after each job, run
    /// `thread_starts` when they start, enter `runtime`'s context and are
    /// named after `worker`. A zero `spin` makes no threads: every body
    /// goes to tokio's pool.
    pub(crate) fn new(
        runtime: Handle,
        spin: Duration,
        thread_starts: Vec<ThreadStart>,
        worker: &str,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                work: Condvar::new(),
                queued: AtomicUsize::new(0),
                spin,
                runtime,
                thread_starts,
                name: format!("ferry-{worker}-body"),
            }),
        }
    }

    /// Runs `job` on a waiting thread of the pool, or else on tokio's
    /// blocking pool (starting a thread of this pool for later jobs while
    /// it has fewer than [`MAX_THREADS`]).
    pub(crate) fn spawn(&self, job: Job) {
        let shared = &self.shared;
        let mut state = shared.state.lock();
        if !state.closed && state.queue.len() < state.waiting {
            state.queue.push_back(job);
            shared.queued.store(state.queue.len(), Ordering::Release);
            // Polling threads see `queued`; a parked one needs the signal
            // unless enough are polling to take every queued job.
            if state.queue.len() > state.polling {
                shared.work.notify_one();
            }
            return;
        }
        let start = !state.closed && !shared.spin.is_zero() && state.threads < MAX_THREADS;
        if start {
            state.threads += 1;
        }
        drop(state);
        if start && !self.start_thread() {
            shared.state.lock().threads -= 1;
        }
        shared.runtime.spawn_blocking(job);
    }

    /// Starts one thread of the pool; whether it started.
    fn start_thread(&self) -> bool {
        let shared = self.shared.clone();
        std::thread::Builder::new()
            .name(shared.name.clone())
            .spawn(move || shared.run())
            .map_err(|e| tracing::warn!("cannot start a thread for function bodies: {e}"))
            .is_ok()
    }

    /// Lets every thread of the pool leave once its job (if any) is done;
    /// later bodies go to tokio's pool.
    pub(crate) fn close(&self) {
        let mut state = self.shared.state.lock();
        state.closed = true;
        // Jobs queued and not taken yet (none, normally: a waiting thread
        // takes each at once) still run, on tokio's pool.
        let left: Vec<Job> = state.queue.drain(..).collect();
        self.shared.queued.store(0, Ordering::Release);
        drop(state);
        self.shared.work.notify_all();
        for job in left {
            self.shared.runtime.spawn_blocking(job);
        }
    }
}

impl Drop for BlockingPool {
    fn drop(&mut self) {
        self.close();
    }
}

impl Shared {
    /// A thread's life: wait for a job (polling, then parked), run it,
    /// again; leave when closed.
    fn run(self: Arc<Self>) {
        let _runtime = self.runtime.enter();
        BODY_THREAD.set(true);
        for start in &self.thread_starts {
            start();
        }
        while let Some(job) = self.next_job() {
            // As on tokio's pool, a panic ends the job, not the thread.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                tracing::warn!(thread = %self.name, "a function body panicked outside its call");
            }
        }
    }

    /// The next job, or `None` when the thread should leave.
    fn next_job(&self) -> Option<Job> {
        let mut state = self.state.lock();
        state.waiting += 1;
        if state.polling < MAX_POLLING && state.queue.is_empty() {
            state.polling += 1;
            drop(state);
            ferry_transport::spin::spin_until(self.spin, || {
                self.queued.load(Ordering::Acquire) > 0
            });
            state = self.state.lock();
            state.polling -= 1;
        }
        loop {
            if let Some(job) = state.queue.pop_front() {
                self.queued.store(state.queue.len(), Ordering::Release);
                state.waiting -= 1;
                return Some(job);
            }
            if state.closed {
                break;
            }
            state.parked += 1;
            self.work.wait(&mut state);
            state.parked -= 1;
        }
        state.waiting -= 1;
        state.threads -= 1;
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    }

    /// Every job runs exactly once, whichever thread takes it.
    #[test]
    fn every_job_runs_once() {
        let rt = runtime();
        let pool = BlockingPool::new(rt.handle().clone(), Duration::from_micros(50), vec![], "t");
        let (tx, rx) = mpsc::channel();
        for i in 0..200 {
            let tx = tx.clone();
            pool.spawn(Box::new(move || tx.send(i).unwrap()));
        }
        drop(tx);
        let mut seen: Vec<i32> = rx.iter().collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..200).collect::<Vec<_>>());
    }

    /// A job that blocks until a later job has run does not hold that
    /// later job back.
    #[test]
    fn a_blocked_job_does_not_delay_the_next() {
        let rt = runtime();
        let pool = BlockingPool::new(rt.handle().clone(), Duration::from_millis(5), vec![], "t");
        // Warm a pool thread so that it is waiting when the jobs arrive.
        let (warm_tx, warm_rx) = mpsc::channel();
        pool.spawn(Box::new(move || warm_tx.send(()).unwrap()));
        warm_rx.recv().unwrap();
        for _ in 0..20 {
            let (gate_tx, gate_rx) = mpsc::channel::<()>();
            let (done_tx, done_rx) = mpsc::channel();
            pool.spawn(Box::new(move || {
                gate_rx.recv().unwrap();
                done_tx.send(()).unwrap();
            }));
            pool.spawn(Box::new(move || gate_tx.send(()).unwrap()));
            done_rx.recv().unwrap();
        }
    }

    /// Thread-start hooks run on the pool's threads, which see the
    /// runtime's context.
    #[test]
    fn threads_run_the_start_hooks_inside_the_runtime() {
        let rt = runtime();
        let started = Arc::new(AtomicUsize::new(0));
        let hook = {
            let started = started.clone();
            Arc::new(move || {
                started.fetch_add(1, Ordering::SeqCst);
            }) as ThreadStart
        };
        let pool = BlockingPool::new(
            rt.handle().clone(),
            Duration::from_millis(50),
            vec![hook],
            "t",
        );
        let mut on_pool = 0;
        for _ in 0..10 {
            let (tx, rx) = mpsc::channel();
            pool.spawn(Box::new(move || {
                tx.send((Handle::try_current().is_ok(), on_body_thread()))
                    .unwrap();
            }));
            let (in_runtime, on_body) = rx.recv().unwrap();
            assert!(in_runtime, "a body runs inside the agent's runtime");
            on_pool += usize::from(on_body);
        }
        // The first body started the pool's thread (it ran on tokio's).
        assert!(on_pool <= 9, "{on_pool}");
        assert!(!on_body_thread());
        let pool_threads = started.load(Ordering::SeqCst);
        assert!((1..=MAX_THREADS).contains(&pool_threads), "{pool_threads}");
    }

    /// After `close`, threads leave and jobs still run (on tokio's pool).
    #[test]
    fn close_lets_threads_leave_and_later_jobs_still_run() {
        let rt = runtime();
        let pool = BlockingPool::new(rt.handle().clone(), Duration::from_millis(50), vec![], "t");
        let (tx, rx) = mpsc::channel();
        let t = tx.clone();
        pool.spawn(Box::new(move || t.send(1).unwrap()));
        assert_eq!(rx.recv().unwrap(), 1);
        pool.close();
        pool.spawn(Box::new(move || tx.send(2).unwrap()));
        assert_eq!(rx.recv().unwrap(), 2);
        let shared = pool.shared.clone();
        drop(pool);
        // Each thread leaves once it sees `closed` (the guard only bounds
        // a hang).
        let guard = std::time::Instant::now() + Duration::from_secs(60);
        while shared.state.lock().threads > 0 {
            assert!(
                std::time::Instant::now() < guard,
                "the pool's threads did not leave"
            );
            std::thread::yield_now();
        }
    }

    /// With no spin there are no threads of the pool.
    #[test]
    fn zero_spin_uses_tokio_only() {
        let rt = runtime();
        let pool = BlockingPool::new(rt.handle().clone(), Duration::ZERO, vec![], "t");
        let (tx, rx) = mpsc::channel();
        pool.spawn(Box::new(move || tx.send(()).unwrap()));
        rx.recv().unwrap();
        assert_eq!(pool.shared.state.lock().threads, 0);
    }
}
