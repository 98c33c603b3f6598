//! The thread waiting in `backward` runs the passes that arrive for its
//! context meanwhile.
//!
//! libtorch's intra-op parallelism is libgomp's OpenMP: every thread that
//! enters a parallel region gets a team of helper threads of its own. Once
//! a process holds more team threads than it has CPUs, libgomp stops
//! letting idle helpers spin and puts them to sleep at once, so that every
//! parallel region (each matrix product of a pass) then pays for waking
//! them. A process that runs libtorch on one thread keeps one team, and its
//! helpers stay warm from one region to the next.
//!
//! So a pass that a gradient from another worker starts here runs on the
//! thread that called `backward` in that context, if one is waiting here
//! (the thread of the forward pass, whose team exists already; libtorch's
//! own engine likewise runs a backward on the calling thread), and on the
//! runtime's blocking pool otherwise, where the forward's function bodies
//! ran (never on a runtime worker, whose reading of other messages it
//! would hold up).

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::{self, Thread};

use parking_lot::Mutex;

/// A pass to run, as a closure that reports its outcome itself.
pub(crate) type Job = Box<dyn FnOnce() + Send>;

/// The jobs queued for one thread blocked in `backward`.
pub(crate) struct WaitingRoot {
    jobs: Mutex<VecDeque<Job>>,
    thread: Thread,
}

/// Wakes the waiting thread when a reply it polls for arrives.
struct Unpark(Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

impl WaitingRoot {
    /// A queue for the current thread.
    pub(crate) fn for_current_thread() -> Arc<WaitingRoot> {
        Arc::new(WaitingRoot {
            jobs: Mutex::new(VecDeque::new()),
            thread: thread::current(),
        })
    }

    /// Queues `job` and wakes the waiting thread to run it.
    pub(crate) fn push(&self, job: Job) {
        self.jobs.lock().push_back(job);
        self.thread.unpark();
    }

    /// Runs every queued job on the current thread.
    pub(crate) fn run_queued(&self) {
        loop {
            let Some(job) = self.jobs.lock().pop_front() else {
                return;
            };
            job();
        }
    }

    /// Blocks the thread this queue was made for until `future` completes,
    /// running the jobs queued meanwhile. A push or a wake-up between a
    /// check and `park` is not lost: `unpark` before `park` makes `park`
    /// return at once.
    pub(crate) fn block_on<F: Future>(&self, future: F) -> F::Output {
        debug_assert_eq!(thread::current().id(), self.thread.id());
        let mut future = std::pin::pin!(future);
        let waker = Waker::from(Arc::new(Unpark(self.thread.clone())));
        let mut cx = Context::from_waker(&waker);
        loop {
            self.run_queued();
            if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
                return out;
            }
            if self.jobs.lock().is_empty() {
                thread::park();
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn jobs_pushed_from_other_threads_run_on_the_waiting_thread_before_it_returns() {
        let root = WaitingRoot::for_current_thread();
        let me = thread::current().id();
        let ran = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = tokio::sync::oneshot::channel::<usize>();
        let pusher = {
            let root = root.clone();
            let ran = ran.clone();
            thread::spawn(move || {
                let (done_tx, done_rx) = std::sync::mpsc::channel();
                for _ in 0..3 {
                    let ran = ran.clone();
                    let done_tx = done_tx.clone();
                    root.push(Box::new(move || {
                        assert_eq!(thread::current().id(), me);
                        ran.fetch_add(1, Ordering::SeqCst);
                        done_tx.send(()).unwrap();
                    }));
                }
                // The future completes only after the three jobs ran.
                for _ in 0..3 {
                    done_rx.recv().unwrap();
                }
                tx.send(ran.load(Ordering::SeqCst)).unwrap();
            })
        };
        assert_eq!(root.block_on(rx).unwrap(), 3);
        pusher.join().unwrap();
        assert_eq!(ran.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn a_job_left_after_the_wait_runs_with_run_queued() {
        let root = WaitingRoot::for_current_thread();
        assert_eq!(root.block_on(async { 7 }), 7);
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        root.push(Box::new(move || {
            r.fetch_add(1, Ordering::SeqCst);
        }));
        root.run_queued();
        assert_eq!(ran.load(Ordering::SeqCst), 1);
    }
}
