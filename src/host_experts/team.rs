//! A team of host threads that stay awake between a decode step's layers.
//!
//! A layer's host work is a few hundred microseconds, and the layers come one after another
//! with the GPU's share of each in between. A pool whose idle threads sleep pays one wake-up per
//! thread per parallel pass (tens of microseconds each on a virtual machine, where waking a
//! thread is an interrupt between processors), and a layer has two passes. The team's threads
//! spin between jobs instead, and sleep only after [`SPIN_BEFORE_SLEEP`] without work, so a
//! decode step keeps them hot and an idle server does not burn its cores.
//!
//! A job is a list of phases of tasks: every task of a phase finishes before any task of the
//! next one starts (the gate/up pass writes what the down pass reads), and the workers move from
//! one phase to the next without the calling thread. The calling thread first runs its own
//! `side` work (the GPU's share of the layer), then takes tasks too. A job waits only for the
//! workers that joined it: one that another program keeps off its core, or that sleeps, does
//! not hold up a layer whose tasks the others have done.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// How long an idle worker spins before it sleeps: longer than the gaps between a decode
/// step's layers and between its steps (under a millisecond), short enough that a server
/// between requests gives its cores back.
pub const SPIN_BEFORE_SLEEP: Duration = Duration::from_millis(3);

/// A task of a job: `(phase, index within the phase)`.
type Task<'a> = dyn Fn(usize, usize) + Sync + 'a;

/// What the workers read of the current job.
struct Job {
    task: *const Task<'static>,
    /// `starts[p]` is the first ticket of phase `p`; the last entry is the job's ticket count.
    starts: Vec<usize>,
}

struct Shared {
    /// Moves by one for every job (and once more to stop the workers).
    epoch: AtomicU64,
    /// Written only by the thread running a job, while no worker is inside a job.
    job: UnsafeCell<Option<Job>>,
    /// Whether workers may still join the current job.
    open: AtomicBool,
    /// The next ticket to hand out.
    next: AtomicUsize,
    /// Tickets finished.
    done: AtomicUsize,
    /// Workers inside the current job (joined and not yet left).
    inside: AtomicUsize,
    panicked: AtomicBool,
    stop: AtomicBool,
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the thread that owns the team's run lock, at times when no
// worker reads it (before the epoch that publishes it moves, after the job closed with no worker
// inside: a worker reads it only after joining an open job of the current epoch);
// the task it points at is `Sync`. Every other field is a synchronisation primitive.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw task pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// The team: `workers` threads and the protocol above.
pub struct Team {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// One job at a time.
    running: Mutex<()>,
}

impl Team {
    /// Starts `workers` threads named `{name}-{i}`.
    pub fn new(workers: usize, name: &str) -> Result<Self> {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            open: AtomicBool::new(false),
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            inside: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut team = Team {
            shared: shared.clone(),
            workers: Vec::with_capacity(workers),
            running: Mutex::new(()),
        };
        for i in 0..workers {
            let shared = shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || work(&shared))
                .map_err(|e| Error::Backend(format!("cannot start host thread {name}-{i}: {e}")))?;
            // Pushed one by one so that Drop stops the ones already started if a later one fails.
            team.workers.push(handle);
        }
        Ok(team)
    }

    /// Runs `task(p, i)` for every phase `p` and `i < phases[p]`, each phase's tasks after all of
    /// the previous phase's, on the workers and the calling thread, which first runs `side`.
    /// Returns `side`'s value once every task has run and every worker that joined has left. A
    /// panicking task becomes an error (its phase still counts it done, so nothing waits forever);
    /// a panic in `side` resumes once the workers are out of the job.
    pub fn run<R>(&self, phases: &[usize], task: &Task<'_>, side: impl FnOnce() -> R) -> Result<R> {
        let _one = self
            .running
            .lock()
            .map_err(|_| Error::Backend("host thread team: a previous job panicked".into()))?;
        let s = &*self.shared;
        let mut starts = Vec::with_capacity(phases.len() + 1);
        let mut total = 0usize;
        for &n in phases {
            starts.push(total);
            total += n;
        }
        starts.push(total);
        // SAFETY: only the lifetime is erased. The pointer is dereferenced by workers inside the
        // job, and this function does not return (nor unwind) before the job is closed with no
        // worker inside, so `task` outlives every use.
        let task: *const Task<'static> = unsafe { std::mem::transmute(task as *const Task<'_>) };
        // SAFETY: the previous job closed with no worker inside before its `run` returned (and
        // the run lock is held), so no worker reads `job` until it joins the next epoch's job.
        unsafe { *s.job.get() = Some(Job { task, starts }) };
        s.next.store(0, Ordering::Relaxed);
        s.done.store(0, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        s.open.store(true, Ordering::SeqCst);
        // Publishes the job (the stores above happen before any worker's acquire of the epoch).
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = s.sleep.lock();
            s.wake.notify_all();
        }
        let side = catch_unwind(AssertUnwindSafe(side));
        // SAFETY: the job was written above and stays until this function clears it.
        if let Some(job) = unsafe { (*s.job.get()).as_ref() } {
            take_tickets(s, job);
        }
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) < total {
            relax(&mut spins);
        }
        // Closes the job, then waits for the workers inside it: a worker that joins after the
        // close sees it closed (both sides' accesses are sequentially consistent) and leaves
        // without reading the job.
        s.open.store(false, Ordering::SeqCst);
        while s.inside.load(Ordering::SeqCst) > 0 {
            relax(&mut spins);
        }
        // SAFETY: the job is closed and no worker is inside it; none reads `job` again before
        // it joins the next epoch's job.
        unsafe { *s.job.get() = None };
        let side = match side {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        if s.panicked.load(Ordering::Relaxed) {
            return Err(Error::Backend("a host expert task panicked".into()));
        }
        Ok(side)
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.stop.store(true, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        {
            let _guard = s.sleep.lock();
            s.wake.notify_all();
        }
        for handle in self.workers.drain(..) {
            let _ = handle.join();
        }
    }
}

/// A worker: waits for each new epoch, joins its job if it is still open, takes tickets until
/// none is left, leaves.
fn work(s: &Shared) {
    let mut seen = 0u64;
    loop {
        seen = wait_for_epoch(s, seen);
        if s.stop.load(Ordering::SeqCst) {
            return;
        }
        s.inside.fetch_add(1, Ordering::SeqCst);
        if s.open.load(Ordering::SeqCst) && s.epoch.load(Ordering::SeqCst) == seen {
            // SAFETY: this worker joined the open job of epoch `seen` (published before the
            // epoch moved), and the running thread neither clears nor replaces it while a
            // joined worker is inside.
            if let Some(job) = unsafe { (*s.job.get()).as_ref() } {
                take_tickets(s, job);
            }
        }
        s.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Spins until the epoch moves past `seen`, then sleeps until it does; returns the new epoch.
/// The spin yields the processor on every turn after the first few, so that a thread with work
/// (the driver's, the decode thread) runs at once where it shares a core with an idle worker.
fn wait_for_epoch(s: &Shared, seen: u64) -> u64 {
    let spinning = Instant::now();
    let mut spins = 0u32;
    loop {
        let epoch = s.epoch.load(Ordering::Acquire);
        if epoch != seen {
            return epoch;
        }
        spins = spins.wrapping_add(1);
        if spins < 64 {
            std::hint::spin_loop();
            continue;
        }
        std::thread::yield_now();
        if spins.is_multiple_of(64) && spinning.elapsed() > SPIN_BEFORE_SLEEP {
            break;
        }
    }
    let mut guard = s.sleep.lock().unwrap_or_else(|p| p.into_inner());
    s.sleepers.fetch_add(1, Ordering::SeqCst);
    let epoch = loop {
        let epoch = s.epoch.load(Ordering::SeqCst);
        if epoch != seen {
            break epoch;
        }
        guard = s.wake.wait(guard).unwrap_or_else(|p| p.into_inner());
    };
    s.sleepers.fetch_sub(1, Ordering::SeqCst);
    epoch
}

/// Takes tickets until the job has none left; a ticket of a later phase waits until every
/// ticket of the earlier phases is done (they were all handed out before it).
fn take_tickets(s: &Shared, job: &Job) {
    let total = *job.starts.last().unwrap_or(&0);
    loop {
        let ticket = s.next.fetch_add(1, Ordering::Relaxed);
        if ticket >= total {
            return;
        }
        let phase = job.starts.partition_point(|&start| start <= ticket) - 1;
        let start = job.starts[phase];
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) < start {
            relax(&mut spins);
        }
        // SAFETY: the running thread keeps the task alive while a joined worker is inside.
        let task = unsafe { &*job.task };
        if catch_unwind(AssertUnwindSafe(|| task(phase, ticket - start))).is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

/// One step of a busy wait that yields the processor now and then, so a thread that holds work
/// can run where the team has more threads than cores.
fn relax(spins: &mut u32) {
    *spins = spins.wrapping_add(1);
    if spins.is_multiple_of(16) {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_run_in_order_and_every_task_once() {
        let team = Team::new(3, "test-team").expect("team");
        for round in 0..200 {
            let phases = [round % 7 + 1, 0, round % 5 + 2];
            let first: Vec<AtomicUsize> = (0..phases[0]).map(|_| AtomicUsize::new(0)).collect();
            let second: Vec<AtomicUsize> = (0..phases[2]).map(|_| AtomicUsize::new(0)).collect();
            let task = |p: usize, i: usize| match p {
                0 => {
                    first[i].fetch_add(1, Ordering::Relaxed);
                }
                2 => {
                    // Every first-phase task is done before any of this phase starts.
                    assert!(first.iter().all(|c| c.load(Ordering::Relaxed) == 1));
                    second[i].fetch_add(1, Ordering::Relaxed);
                }
                _ => panic!("phase {p} has no tasks"),
            };
            let side = team.run(&phases, &task, || round * 2).expect("run");
            assert_eq!(side, round * 2);
            assert!(first
                .iter()
                .chain(&second)
                .all(|c| c.load(Ordering::Relaxed) == 1));
        }
    }

    /// Runs a one-phase job of `n` tasks that count themselves; the count.
    fn count_tasks(team: &Team, n: usize) -> usize {
        let ran = AtomicUsize::new(0);
        let task = |_: usize, _: usize| {
            ran.fetch_add(1, Ordering::Relaxed);
        };
        team.run(&[n], &task, || ()).expect("run");
        ran.load(Ordering::Relaxed)
    }

    #[test]
    fn a_panicking_task_is_an_error_and_the_team_goes_on() {
        let team = Team::new(2, "test-team").expect("team");
        let task = |_: usize, i: usize| assert!(i != 3, "task 3 fails");
        let err = team.run(&[8], &task, || ()).expect_err("a task panicked");
        assert!(err.to_string().contains("panicked"), "{err}");
        assert_eq!(count_tasks(&team, 5), 5, "the next job runs");
    }

    #[test]
    fn more_workers_than_cores_finish_every_job() {
        // Workers that join late or never (no core free) must neither be waited for nor read a
        // finished job.
        let team = Team::new(12, "test-team").expect("team");
        for round in 0..2000 {
            let n = round % 9;
            let ran: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            let task = |_: usize, i: usize| {
                ran[i].fetch_add(1, Ordering::Relaxed);
            };
            team.run(&[n], &task, || ()).expect("run");
            assert!(ran.iter().all(|c| c.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn sleeping_workers_wake_for_the_next_job() {
        let team = Team::new(2, "test-team").expect("team");
        std::thread::sleep(SPIN_BEFORE_SLEEP * 3);
        assert_eq!(count_tasks(&team, 64), 64);
    }
}
