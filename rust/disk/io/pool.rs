//! Positioned-I/O thread pool: `queue_depth` threads each take a chain, run its ops with
//! preadv/pwritev, and call its `done`. Works on every kernel and sandbox; the queue depth is
//! the number of chains in flight at once.

use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use super::{run_op_blocking, Chain, IoEngine};
use crate::disk::spawn;

struct Queue {
    chains: VecDeque<Chain>,
    stopping: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
}

pub struct PoolEngine {
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    depth: usize,
}

impl PoolEngine {
    /// Start `depth` threads. If the OS refuses one, the threads already started are stopped
    /// and joined (by dropping the half-built engine) and the OS's error is returned.
    pub fn new(depth: usize) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue { chains: VecDeque::new(), stopping: false }),
            ready: Condvar::new(),
        });
        let engine = PoolEngine { shared, threads: Mutex::new(Vec::with_capacity(depth)), depth };
        for i in 0..depth {
            let shared = engine.shared.clone();
            let thread = spawn::spawn(format!("kvtier-io-{i}"), move || worker(&shared))?;
            engine.threads.lock().push(thread);
        }
        Ok(engine)
    }
}

fn worker(shared: &Shared) {
    loop {
        let chain = {
            let mut q = shared.queue.lock();
            loop {
                if let Some(c) = q.chains.pop_front() {
                    break c;
                }
                if q.stopping {
                    return;
                }
                shared.ready.wait(&mut q);
            }
        };
        let Some((ops, done)) = chain.run_prep() else { continue };
        let result = ops.iter().enumerate().try_for_each(|(i, op)| run_op_blocking(op, i));
        drop(ops);
        done(result);
    }
}

impl IoEngine for PoolEngine {
    fn name(&self) -> &'static str {
        "pool"
    }
    fn queue_depth(&self) -> usize {
        self.depth
    }
    fn submit(&self, chains: Vec<Chain>) {
        let n = chains.len();
        if n == 0 {
            return;
        }
        self.shared.queue.lock().chains.extend(chains);
        if n == 1 {
            self.shared.ready.notify_one();
        } else {
            self.shared.ready.notify_all();
        }
    }
    fn shutdown(&self) {
        self.shared.queue.lock().stopping = true;
        self.shared.ready.notify_all();
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for PoolEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}
