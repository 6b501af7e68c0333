//! The disk (NVMe) tier: the cold tier behind the host pool.
//!
//! Blocks move between host-pool slots and slots of a few preallocated slab files with no
//! intermediate copy: a write sends the host slot's bytes to the file, a read lands in the host
//! slot. The tier's own `TierIndex` maps keys to disk slots and carries its eviction policy and
//! admission rule (default: every block written through; `uses:2` spares the SSD where reuse is rare).
//!
//! Guarantees:
//! - Never a wrong byte: every read checks the header (key in full, length, location,
//!   checksum) and the payload checksum. A mismatch, short read or I/O error makes the block a
//!   miss: the job reports it failed, the host slot's payload is zeroed, the disk slot freed.
//! - Asynchronous: `submit_write`/`submit_read` queue I/O on the engine and return a job id;
//!   `poll`/`wait` collect results. Only `wait` and `close` block.
//! - Bounded: capacity is fixed at open (preallocated slabs); eviction frees slots for new
//!   writes. A full device (ENOSPC where preallocation was impossible) stops admission for
//!   `full_retry` while reads continue.
//! - Restart-safe: reopening rebuilds the index from the slot headers (see `recovery`).
//!
//! Memory safety contract with the caller (the host tier): a host slot given to `submit_write`
//! must not be modified, and one given to `submit_read` must not be read or written, until its
//! job completed. The host tier's index enforces that with its Writing state and pins; the disk
//! tier itself refuses a submission that would share a host slot with a read in flight, or read
//! into a slot a job in flight uses (`Shared::host_use`). What the caller does to the memory
//! outside these calls it cannot see.

pub mod io;
pub mod layout;
pub mod recovery;
pub mod slab;
pub mod spawn;
pub mod status;
pub mod tierdir;

#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use self::io::{build_engine, Chain, DoneFn, EngineChoice, IoBuf, IoEngine, IoFailure, IoOp, OpKind, PrepFn};
use self::layout::{unix_now_ms, Retention, SlotHeader, HEADER_BYTES, PAGE};
use self::slab::{AlignedBuf, DirLock, DirectMode, Geometry, Meta, SlabFile};
use self::tierdir::TierDir;
use crate::admission::AdmissionRule;
use crate::error::{KvError, KvResult};
use crate::fault::FaultPoint;
use crate::host_pool::HostRegion;
use crate::index::{IndexConfig, TierIndex};
use crate::keys::BlockKey;
use crate::policy::{InsertHint, PolicyKind};
use crate::slots::SlotAllocator;

/// Host memory that reads land in and writes come from: a page-aligned region of fixed slots.
/// Jobs hold an `Arc` of it until they are collected, so it outlives the I/O.
pub trait HostMemory: Send + Sync {
    fn base_ptr(&self) -> *mut u8;
    fn slot_bytes(&self) -> usize;
    fn num_slots(&self) -> usize;
}

impl HostMemory for HostRegion {
    fn base_ptr(&self) -> *mut u8 {
        self.as_ptr()
    }
    fn slot_bytes(&self) -> usize {
        HostRegion::slot_bytes(self)
    }
    fn num_slots(&self) -> usize {
        HostRegion::num_slots(self)
    }
}

#[derive(Clone, Debug)]
pub struct DiskConfig {
    pub dir: PathBuf,
    pub capacity_bytes: u64,
    pub block_bytes: usize,
    /// Number of slab files; 0 = automatic (4, fewer for tiny tiers, or what the directory has).
    pub num_files: usize,
    pub policy: PolicyKind,
    pub admission: AdmissionRule,
    pub engine: EngineChoice,
    pub queue_depth: usize,
    pub direct: DirectMode,
    /// Read and check every payload at open (slower; drops torn slots up front).
    pub verify_on_open: bool,
    /// After ENOSPC, how long to refuse writes before trying again.
    pub full_retry: Duration,
}

impl DiskConfig {
    pub fn new(dir: impl Into<PathBuf>, capacity_bytes: u64, block_bytes: usize) -> Self {
        DiskConfig {
            dir: dir.into(),
            capacity_bytes,
            block_bytes,
            num_files: 0,
            policy: PolicyKind::Lru,
            admission: AdmissionRule::Always,
            engine: EngineChoice::Auto,
            queue_depth: 16,
            direct: DirectMode::Auto,
            verify_on_open: false,
            full_retry: Duration::from_secs(10),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobKind {
    Read,
    Write,
}

/// Outcome of one job. `keepalive` holds the host memory until the result is dropped.
pub struct JobResult {
    pub id: u64,
    pub kind: JobKind,
    pub ok_keys: Vec<BlockKey>,
    pub failed_keys: Vec<BlockKey>,
    pub bytes: u64,
    pub seconds: f64,
    pub keepalive: Option<Arc<dyn HostMemory>>,
}

impl JobResult {
    pub fn success(&self) -> bool {
        self.failed_keys.is_empty()
    }
}

/// What `submit_write` did with each key.
#[derive(Debug, Default)]
pub struct WriteTicket {
    pub job_id: u64,
    /// Keys being written by the job.
    pub keys: Vec<BlockKey>,
    /// Already on disk (or being written): nothing to do.
    pub skipped: Vec<BlockKey>,
    /// Turned away: by the admission rule, or because the device is full.
    pub refused: Vec<BlockKey>,
    /// Evicted to make room.
    pub evicted: Vec<BlockKey>,
}

#[derive(Default)]
struct Counters {
    jobs: AtomicU64,
    blocks_written: AtomicU64,
    bytes_written: AtomicU64,
    blocks_read: AtomicU64,
    bytes_read: AtomicU64,
    write_failures: AtomicU64,
    read_misses: AtomicU64,
    checksum_failures: AtomicU64,
    short_reads: AtomicU64,
    read_errors: AtomicU64,
    enospc: AtomicU64,
    refused_full: AtomicU64,
    refused_dir_removed: AtomicU64,
    slabs_lost: AtomicU64,
    blocks_lost: AtomicU64,
    recovered_blocks: AtomicU64,
    recovery_discarded: AtomicU64,
    recovery_duplicates: AtomicU64,
    recovery_us: AtomicU64,
}

enum JobSlot {
    Running,
    Done(JobResult),
}

struct Job {
    id: u64,
    kind: JobKind,
    keys: Vec<BlockKey>,
    ok: Vec<AtomicBool>,
    remaining: AtomicUsize,
    bytes: AtomicU64,
    started: Instant,
    host: Mutex<Option<Arc<dyn HostMemory>>>,
    /// The host pool (its address) and the slots of it the job uses, released when it ends.
    pool: usize,
    claims: Vec<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(any(test, feature = "fault-injection")), allow(dead_code))]
pub enum Fault {
    /// The next `count` block writes fail with this errno before touching the disk.
    WriteErrno(i32),
    /// The next `count` block reads fail with this errno.
    ReadErrno(i32),
    /// The next `count` block writes land, then their completion panics inside its index
    /// update (a bug there): the index must fail closed and the job still finish.
    CompletionPanic,
    /// The io_uring engine's next `count` `io_uring_enter` calls fail with this errno: the
    /// transient ones are retried, any other stops the engine (see `io::uring`).
    EnterErrno(i32),
    /// The next `count` block reads start this many milliseconds late (a slow device), on the
    /// engine's thread, then run as usual.
    ReadDelayMs(u32),
}

struct Shared {
    index: TierIndex,
    geo: Geometry,
    /// Written into every slot header and checked on every read and at recovery; `clear`
    /// replaces it, which voids every header written before.
    dir_id: AtomicU64,
    /// One per slab file; None once the tier is closed (`close` releases the files then, so a
    /// closed tier holds no fd even while the object lives on).
    slabs: Vec<RwLock<Option<Arc<SlabFile>>>>,
    counters: Counters,
    jobs: Mutex<HashMap<u64, JobSlot>>,
    job_done: Condvar,
    next_job: AtomicU64,
    next_gen: AtomicU64,
    origin: Instant,
    full_until_ns: AtomicU64,
    full_retry: Duration,
    fault: FaultPoint<Fault>,
    /// Slots known to hold disk blocks: written at least once, or recovered. After ENOSPC on a
    /// sparse slab, only these (and slots of preallocated slabs) can take a write for sure.
    backed: SlotBits,
    /// Set once the directory was found deleted: nothing can be re-created in it, so writes
    /// are refused; reads go on from the files held open.
    dir_removed: AtomicBool,
    /// Host slots (by pool address and slot) used by jobs in flight: see `claim_host_slots`.
    host_use: Mutex<HashMap<(usize, u32), HostUse>>,
}

/// How the jobs in flight use one host slot: one read lands in it, or writes (any number, they
/// only read it) take their bytes from it.
#[derive(Clone, Copy)]
enum HostUse {
    Read { job: u64 },
    Write { job: u64, jobs: usize },
}

/// One bit per slot, set and read without a lock.
struct SlotBits(Vec<AtomicU64>);

impl SlotBits {
    fn new(n: usize) -> Self {
        SlotBits((0..n.div_ceil(64)).map(|_| AtomicU64::new(0)).collect())
    }
    fn get(&self, i: u32) -> bool {
        self.0[i as usize / 64].load(Ordering::Relaxed) & (1 << (i % 64)) != 0
    }
    fn set(&self, i: u32, on: bool) {
        let (w, bit) = (&self.0[i as usize / 64], 1u64 << (i % 64));
        if on {
            w.fetch_or(bit, Ordering::Relaxed);
        } else {
            w.fetch_and(!bit, Ordering::Relaxed);
        }
    }
}

pub struct DiskTier {
    shared: Arc<Shared>,
    engine: Arc<dyn IoEngine>,
    /// true once closed; submitters hold the read side so close() waits for them.
    closed: RwLock<bool>,
    lock: Mutex<Option<DirLock>>,
    /// The directory, held open (every file is opened relative to it); None once closed.
    tier_dir: RwLock<Option<TierDir>>,
    dir: PathBuf,
    direct: bool,
    preallocated: bool,
    notes: Vec<String>,
    engine_probe: Option<(io::choose::ProbeRecord, bool)>,
}

/// A host pool's identity for `Shared::host_use`: its address (a pool in use by a job is kept
/// alive by it, so no other pool can take that address meanwhile).
fn pool_id(host: &dyn HostMemory) -> usize {
    host.base_ptr() as usize
}

fn random_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    h.write_u32(std::process::id());
    h.finish() | 1
}

impl DiskTier {
    pub fn open(cfg: DiskConfig) -> KvResult<DiskTier> {
        if cfg.capacity_bytes == 0 {
            return Err(KvError::invalid("capacity_bytes", "must be positive"));
        }
        if cfg.dir.as_os_str().is_empty() {
            return Err(KvError::invalid("path", "must not be empty"));
        }
        // Whatever can be refused without the directory is, before it is touched: a mistyped
        // argument must not leave a directory, metadata and preallocated slabs behind. The
        // geometry is checked as if for one file (the real number may come from the metadata;
        // it only refuses more), and the engine is started (it checks queue_depth and probes
        // io_uring; dropped again if the open fails later).
        Geometry::new(cfg.capacity_bytes, cfg.block_bytes, cfg.num_files.max(1))?;
        let (engine, uring_refusal) = build_engine(cfg.engine, cfg.queue_depth, &cfg.dir)?;
        let dir = TierDir::prepare(&cfg.dir)?;
        let lock = DirLock::acquire(&dir)?;
        // Only the lock holder changes anything in the directory.
        dir.tighten();
        slab::remove_stale_temporaries(&dir);
        let meta = Meta::load(&dir)?;
        let stride = layout::round_up_page(cfg.block_bytes.max(1)) + HEADER_BYTES;
        let num_files = match (cfg.num_files, &meta) {
            (0, Some(m)) => m.num_files,
            (0, None) => ((cfg.capacity_bytes / stride as u64) as usize).clamp(1, 4),
            (n, _) => n,
        };
        let geo = Geometry::new(cfg.capacity_bytes, cfg.block_bytes, num_files)?;
        if let Some(m) = &meta {
            if m.block_bytes != geo.block_bytes {
                return Err(KvError::invalid(
                    "block_bytes",
                    format!(
                        "{} was created with block_bytes={}, not {}",
                        cfg.dir.display(),
                        m.block_bytes,
                        geo.block_bytes
                    ),
                ));
            }
            if m.num_files != geo.num_files || m.slots_per_file != geo.slots_per_file {
                return Err(KvError::invalid(
                    "capacity_bytes",
                    format!(
                        "{} was created with {} file(s) of {} slots ({} bytes); open it with that capacity and \
                         num_files, or use a new directory",
                        cfg.dir.display(),
                        m.num_files,
                        m.slots_per_file,
                        m.num_files as u64 * m.slots_per_file as u64 * geo.slot_stride as u64
                    ),
                ));
            }
        }
        let dir_id = meta.as_ref().map_or_else(random_id, |m| m.dir_id);

        let mut notes = Vec::new();
        if meta.is_none() {
            // The directory's id lives only in its metadata, so slabs left by an earlier tier
            // cannot be told from another directory's: they are started afresh (their blocks are
            // counted in recovery_discarded). Said here, since it loses every block they held.
            let orphans = dir.names().unwrap_or_default().iter().filter(|n| slab::is_slab_name(n)).count();
            if orphans > 0 {
                notes.push(format!(
                    "{} was missing: {orphans} slab file(s) of an earlier tier were started afresh and \
                     their blocks discarded",
                    slab::META_NAME
                ));
            }
        }
        // Slabs this open created are removed again if it fails, and a new directory's metadata
        // is written only once every slab is sized: an open refused on the way (a slab larger
        // than the filesystem allows, say) leaves nothing that refuses the corrected open.
        let mut created = Vec::new();
        let undo = |created: &[usize], e: KvError| {
            for &i in created {
                let _ = dir.unlink(&slab::slab_name(i));
            }
            e
        };
        let mut slabs = Vec::with_capacity(geo.num_files);
        for i in 0..geo.num_files {
            let opened = SlabFile::open(&dir, &slab::slab_name(i), geo.file_bytes(), cfg.direct)
                .map_err(|e| undo(&created, e))?;
            if opened.created {
                created.push(i);
            }
            if let Some(why) = opened.direct_refusal {
                notes.push(format!("{}: buffered I/O (O_DIRECT refused: {why})", slab::slab_name(i)));
            }
            if let Some(why) = opened.prealloc_refusal {
                notes.push(format!("{}: sparse, not preallocated ({why})", slab::slab_name(i)));
            }
            slabs.push(Arc::new(opened.slab));
        }
        // `auto` where io_uring works: measure both engines on this directory's device (or
        // reuse the figures kept from an earlier open) and keep the faster.
        let (engine, engine_probe) = if cfg.engine == EngineChoice::Auto && uring_refusal.is_none() {
            let make_pool = || build_engine(EngineChoice::Pool, cfg.queue_depth, &cfg.dir).map(|(e, _)| e);
            let auto = io::choose::choose_auto(
                &dir,
                engine,
                make_pool,
                geo.block_bytes,
                cfg.capacity_bytes,
                slabs.iter().all(|s| s.direct),
            )
            .map_err(|e| undo(&created, e))?;
            notes.push(auto.note);
            (auto.engine, auto.record)
        } else {
            (engine, None)
        };
        if meta.is_none() {
            let m = Meta {
                block_bytes: geo.block_bytes,
                slots_per_file: geo.slots_per_file,
                num_files: geo.num_files,
                dir_id,
            };
            m.store(&dir).map_err(|e| undo(&created, e))?;
        }
        let direct = slabs.iter().all(|s| s.direct);
        let preallocated = slabs.iter().all(|s| s.preallocated);

        let t0 = Instant::now();
        let rec = recovery::scan(&geo, &slabs, dir_id, cfg.verify_on_open);
        let total = geo.total_slots();
        let allocator = Arc::new(SlotAllocator::empty(total));
        for s in rec.free.iter().copied().chain(rec.past_eof.iter().cloned().flatten()) {
            allocator.release(s);
        }
        let index = TierIndex::with_slots(
            IndexConfig {
                capacity: total,
                policy: cfg.policy,
                admission: cfg.admission,
                tier: 2,
                manual_clock: false,
                block_bytes: geo.block_bytes as u64,
            },
            allocator,
        )?;
        let now_ms = unix_now_ms();
        let backed = SlotBits::new(total);
        for h in &rec.entries {
            index.insert_recovered(h.key, h.slot, h.payload_len, h.payload_crc, h.retention.to_hint(now_ms))?;
            backed.set(h.slot, true);
        }
        let counters = Counters::default();
        counters.recovered_blocks.store(rec.entries.len() as u64, Ordering::Relaxed);
        counters.recovery_discarded.store(rec.discarded, Ordering::Relaxed);
        counters.recovery_duplicates.store(rec.duplicates, Ordering::Relaxed);
        counters.recovery_us.store(t0.elapsed().as_micros() as u64, Ordering::Relaxed);

        if let Some(why) = uring_refusal {
            notes.push(format!("engine: thread pool (io_uring unavailable: {why})"));
        }
        let shared = Arc::new(Shared {
            index,
            geo,
            dir_id: AtomicU64::new(dir_id),
            slabs: slabs.into_iter().map(|s| RwLock::new(Some(s))).collect(),
            counters,
            jobs: Mutex::new(HashMap::new()),
            job_done: Condvar::new(),
            next_job: AtomicU64::new(1),
            next_gen: AtomicU64::new(rec.max_generation + 1),
            origin: Instant::now(),
            full_until_ns: AtomicU64::new(0),
            full_retry: cfg.full_retry,
            fault: FaultPoint::default(),
            backed,
            dir_removed: AtomicBool::new(false),
            host_use: Mutex::new(HashMap::new()),
        });
        Ok(DiskTier {
            shared,
            engine,
            closed: RwLock::new(false),
            lock: Mutex::new(Some(lock)),
            tier_dir: RwLock::new(Some(dir)),
            dir: cfg.dir,
            direct,
            preallocated,
            notes,
            engine_probe,
        })
    }

    // ---- facts ---------------------------------------------------------------------------

    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }
    pub fn geometry(&self) -> Geometry {
        self.shared.geo
    }
    pub fn engine_name(&self) -> &'static str {
        self.engine.name()
    }
    pub fn queue_depth(&self) -> usize {
        self.engine.queue_depth()
    }
    /// What `engine="auto"` measured and chose at open, and whether the figures were kept
    /// from an earlier open; None for an engine named outright, or where io_uring is refused.
    pub fn engine_probe(&self) -> Option<&(io::choose::ProbeRecord, bool)> {
        self.engine_probe.as_ref()
    }
    /// "direct" when every slab uses O_DIRECT, "buffered" otherwise.
    pub fn io_mode(&self) -> &'static str {
        if self.direct {
            "direct"
        } else {
            "buffered"
        }
    }
    pub fn preallocated(&self) -> bool {
        self.preallocated
    }
    /// Human-readable notes on fallbacks taken at open (buffered I/O, sparse files, engine).
    pub fn notes(&self) -> &[String] {
        &self.notes
    }
    pub fn index(&self) -> &TierIndex {
        &self.shared.index
    }
    pub fn len(&self) -> usize {
        self.shared.index.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn capacity_blocks(&self) -> usize {
        self.shared.index.capacity()
    }
    pub fn is_full(&self) -> bool {
        self.shared.is_full()
    }
    pub fn is_closed(&self) -> bool {
        *self.closed.read()
    }

    fn check_open(&self) -> KvResult<()> {
        if *self.closed.read() {
            return Err(KvError::Closed(format!("disk tier at {}", self.dir.display())));
        }
        Ok(())
    }

    // ---- index passthroughs --------------------------------------------------------------

    pub fn lookup_prefix(&self, keys: &[BlockKey]) -> KvResult<usize> {
        self.check_open()?;
        Ok(self.shared.index.lookup_prefix(keys))
    }
    pub fn contains(&self, keys: &[BlockKey]) -> KvResult<Vec<bool>> {
        self.check_open()?;
        Ok(self.shared.index.contains_ready(keys))
    }
    pub fn touch(&self, keys: &[BlockKey]) -> KvResult<()> {
        self.check_open()?;
        self.shared.index.touch(keys);
        Ok(())
    }
    /// `TierIndex::renew` on the tier's index. Unlike a write's own hint, which its header
    /// records, the renewed retention is not written to disk (that would be a header write per
    /// renewed block): a reopened tier ranks the block by the hint it was written with.
    pub fn renew(&self, keys: &[BlockKey], hint: InsertHint) -> KvResult<usize> {
        self.check_open()?;
        self.shared.index.renew(keys, hint)
    }
    /// Forget every block, now and after a restart: a cache reset (the engine's weights
    /// changed, say), after which nothing written before may be served. The directory takes a
    /// new id, its metadata rewritten first (atomically, `Meta::store`): slot headers written
    /// under the old id no longer verify, so a reopened tier discards them, and no slab byte is
    /// rewritten. Where no new metadata file can be written (a full filesystem, say), the old
    /// one is unlinked instead, which needs no space: a tier reopening a directory without
    /// metadata starts its slabs afresh (`open`'s note says so), so nothing from before the
    /// reset comes back, at the price of what is written after it until then. Refused while
    /// jobs run, since their blocks are pinned or being written and would outlive the reset
    /// (`wait_idle` first); no job starts while it runs. If neither works, nothing changes and
    /// the error says why. Returns how many blocks were dropped.
    pub fn clear(&self) -> KvResult<usize> {
        let closed = self.closed.write();
        if *closed {
            return Err(KvError::Closed(format!("disk tier at {}", self.dir.display())));
        }
        let running = self.running_jobs();
        if running > 0 {
            return Err(KvError::invalid(
                "clear",
                format!("{running} disk job(s) still running; wait_idle() first, so no block outlives the reset"),
            ));
        }
        let old = self.shared.dir_id.load(Ordering::Acquire);
        let new = std::iter::repeat_with(random_id).find(|&id| id != old).expect("an endless iterator");
        let geo = &self.shared.geo;
        let meta = Meta {
            block_bytes: geo.block_bytes,
            slots_per_file: geo.slots_per_file,
            num_files: geo.num_files,
            dir_id: new,
        };
        let dir = self.tier_dir.read();
        let dir = dir.as_ref().expect("the directory is held until close()");
        match meta.store(dir) {
            Ok(()) => self.shared.dir_id.store(new, Ordering::Release),
            // The new file may be in place with only the directory's sync failing: then the new
            // id is what a reopening tier will trust, so it must be the one written from now on.
            Err(_) if matches!(Meta::load(dir), Ok(Some(m)) if m.dir_id == new) => {
                self.shared.dir_id.store(new, Ordering::Release)
            }
            Err(stored) => match dir.unlink(slab::META_NAME) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(_) => return Err(stored),
            },
        }
        let dropped = self.shared.index.clear();
        drop(closed);
        Ok(dropped)
    }

    pub fn record_use(&self, keys: &[BlockKey]) -> KvResult<()> {
        self.check_open()?;
        self.shared.index.record_use(keys);
        Ok(())
    }
    /// Drop ready, unpinned blocks from the tier. Their slots are reused by later writes; a
    /// removed block whose slot was not reused yet can come back after a restart, with its own
    /// (correct) bytes, since the header on disk is not erased.
    pub fn remove(&self, keys: &[BlockKey]) -> KvResult<Vec<BlockKey>> {
        self.check_open()?;
        Ok(self.shared.index.remove(keys).into_iter().map(|(k, _)| k).collect())
    }

    /// Test hook: make the next `count` block writes or reads fail with an errno, at the I/O
    /// layer (after the index reserved the slot, before any byte moves), or the engine's next
    /// `count` submissions to the kernel (`EnterErrno`, io_uring only).
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn inject_fault(&self, fault: Option<Fault>, count: u32) -> KvResult<()> {
        if let Some(Fault::EnterErrno(errno)) = fault {
            if !self.engine.inject_enter_failure(errno, count) {
                return Err(KvError::invalid("fault", "an io_uring_enter failure needs engine=io_uring"));
            }
            return Ok(());
        }
        self.shared.fault.arm(fault, count);
        Ok(())
    }

    fn check_host(&self, host: &dyn HostMemory, slots: &[u32], keys: usize) -> KvResult<()> {
        if slots.len() != keys {
            return Err(KvError::invalid("slots", format!("{} slots for {keys} keys", slots.len())));
        }
        let geo = &self.shared.geo;
        if host.slot_bytes() < geo.data_bytes {
            return Err(KvError::invalid(
                "pool",
                format!("host slots are {} bytes, the disk tier needs {} per block", host.slot_bytes(), geo.data_bytes),
            ));
        }
        if host.base_ptr() as usize % PAGE != 0 || host.slot_bytes() % PAGE != 0 {
            return Err(KvError::invalid("pool", "host memory must be 4 KiB aligned with 4 KiB-multiple slots"));
        }
        if let Some(bad) = slots.iter().find(|&&s| s as usize >= host.num_slots()) {
            return Err(KvError::invalid("slots", format!("slot {bad} out of range 0..{}", host.num_slots())));
        }
        Ok(())
    }

    fn new_job(&self, kind: JobKind, keys: Vec<BlockKey>, host: Arc<dyn HostMemory>, claims: Vec<u32>) -> Arc<Job> {
        let id = self.shared.next_job.fetch_add(1, Ordering::Relaxed);
        let n = keys.len();
        let job = Arc::new(Job {
            id,
            kind,
            ok: (0..n).map(|_| AtomicBool::new(false)).collect(),
            keys,
            remaining: AtomicUsize::new(n),
            bytes: AtomicU64::new(0),
            started: Instant::now(),
            pool: pool_id(&*host),
            host: Mutex::new(Some(host)),
            claims,
        });
        self.shared.counters.jobs.fetch_add(1, Ordering::Relaxed);
        self.shared.jobs.lock().insert(id, JobSlot::Running);
        job
    }

    /// Checks at the start of a submission that touches the slabs: a slab deleted behind the
    /// tier's back is replaced before any I/O is queued to it (a write to the deleted file would
    /// be acknowledged and then lost), and a deleted directory is noticed.
    fn check_files(&self) {
        if let Some(dir) = self.tier_dir.read().as_ref() {
            self.shared.check_slabs(dir);
        }
    }

    /// Write the blocks of `keys` from host slots `slots` of `host`. Keys already on disk are
    /// skipped, keys the admission rule (or a full device) turns away are refused; the rest
    /// get disk slots, evicting if needed (all-or-nothing: `NoSpace` changes nothing), and are
    /// written asynchronously. Returns at once with the job id. A host slot that a read in
    /// flight lands in is refused (`slots`): its bytes are not the block's until that read ends.
    pub fn submit_write(
        &self,
        keys: &[BlockKey],
        slots: &[u32],
        host: Arc<dyn HostMemory>,
        hint: InsertHint,
    ) -> KvResult<WriteTicket> {
        self.check_host(&*host, slots, keys.len())?;
        let gate = self.closed.read();
        if *gate {
            return Err(KvError::Closed(format!("disk tier at {}", self.dir.display())));
        }
        let sh = &self.shared;
        self.check_files();
        let refuse_all = |counter: &AtomicU64| {
            counter.fetch_add(keys.len() as u64, Ordering::Relaxed);
            let job = self.new_job(JobKind::Write, Vec::new(), host.clone(), Vec::new());
            sh.finalize(&job);
            WriteTicket { job_id: job.id, refused: keys.to_vec(), ..Default::default() }
        };
        if sh.dir_removed.load(Ordering::Acquire) {
            return Ok(refuse_all(&sh.counters.refused_dir_removed));
        }
        if sh.is_full() {
            return Ok(refuse_all(&sh.counters.refused_full));
        }
        // The retry after a full device: slots withheld then may be tried again, after the ones
        // freed meanwhile.
        sh.index.return_withheld();
        let pool = pool_id(&*host);
        let mut host_use = sh.host_use.lock();
        sh.check_host_slots(&host_use, pool, slots, JobKind::Write)?;
        let out = match sh.index.prepare_store(keys, hint) {
            // A write that failed meanwhile withheld the free slots: as full as a moment later.
            Err(KvError::NoSpace { .. }) if sh.is_full() => return Ok(refuse_all(&sh.counters.refused_full)),
            out => out?,
        };
        let mut host_slot: HashMap<BlockKey, u32> = HashMap::with_capacity(keys.len());
        for (k, s) in keys.iter().zip(slots) {
            host_slot.entry(*k).or_insert(*s);
        }
        let write_keys: Vec<BlockKey> = out.to_write.iter().map(|(k, _)| *k).collect();
        let mut claims: Vec<u32> = write_keys.iter().map(|k| host_slot[k]).collect();
        claims.sort_unstable();
        claims.dedup();
        let job = self.new_job(JobKind::Write, write_keys.clone(), host.clone(), claims);
        sh.claim_host_slots(&mut host_use, &job);
        drop(host_use); // before anything can finish the job (which releases its claims)
        let mut chains = Vec::with_capacity(out.to_write.len());
        let retention = Retention::from_hint(hint, unix_now_ms());
        for (i, (key, disk_slot)) in out.to_write.iter().enumerate() {
            chains.push(sh.write_chain(&job, i, (*key, retention), *disk_slot, host_slot[key], &host));
        }
        if chains.is_empty() {
            sh.finalize(&job);
        }
        self.engine.submit(chains);
        drop(gate);
        Ok(WriteTicket {
            job_id: job.id,
            keys: write_keys,
            skipped: out.already_present(keys),
            refused: out.refused,
            evicted: out.evicted.into_iter().map(|(k, _)| k).collect(),
        })
    }

    /// Read the blocks of `keys` into host slots `slots` of `host`. Keys not on disk fail at
    /// once (misses); the others are pinned (safe from eviction) and read asynchronously, each
    /// verified before it is reported ok. Returns the job id. A host slot used by any job in
    /// flight is refused (`slots`): two jobs may not both write it.
    pub fn submit_read(&self, keys: &[BlockKey], slots: &[u32], host: Arc<dyn HostMemory>) -> KvResult<u64> {
        self.check_host(&*host, slots, keys.len())?;
        let mut seen = HashSet::with_capacity(slots.len());
        if let Some(dup) = slots.iter().find(|s| !seen.insert(**s)) {
            return Err(KvError::invalid("slots", format!("host slot {dup} appears twice in one read")));
        }
        let gate = self.closed.read();
        if *gate {
            return Err(KvError::Closed(format!("disk tier at {}", self.dir.display())));
        }
        let sh = &self.shared;
        self.check_files();
        let mut host_use = sh.host_use.lock();
        sh.check_host_slots(&host_use, pool_id(&*host), slots, JobKind::Read)?;
        let job = self.new_job(JobKind::Read, keys.to_vec(), host.clone(), slots.to_vec());
        sh.claim_host_slots(&mut host_use, &job);
        drop(host_use); // before anything can finish the job (which releases its claims)
        if keys.is_empty() {
            sh.finalize(&job); // nothing will ever complete it otherwise
        }
        let mut chains = Vec::with_capacity(keys.len());
        for (i, (key, hs)) in keys.iter().zip(slots).enumerate() {
            let pinned = sh.index.pin_for_load(std::slice::from_ref(key)).ok().and_then(|s| {
                let crc = sh.index.with_entry(key, |e| e.checksum.load(Ordering::Acquire));
                crc.map(|c| (s[0], c))
            });
            match pinned {
                Some((disk_slot, crc)) => chains.push(sh.read_chain(&job, i, *key, disk_slot, crc, *hs, &host)),
                None => {
                    sh.counters.read_misses.fetch_add(1, Ordering::Relaxed);
                    sh.finish_one(&job, i, false, 0);
                }
            }
        }
        self.engine.submit(chains);
        drop(gate);
        Ok(job.id)
    }

    /// Collect every finished job (each is returned once).
    pub fn poll(&self) -> Vec<JobResult> {
        let mut jobs = self.shared.jobs.lock();
        let done: Vec<u64> = jobs.iter().filter(|(_, s)| matches!(s, JobSlot::Done(_))).map(|(id, _)| *id).collect();
        let mut out: Vec<JobResult> = done
            .into_iter()
            .filter_map(|id| match jobs.remove(&id) {
                Some(JobSlot::Done(r)) => Some(r),
                _ => None,
            })
            .collect();
        out.sort_by_key(|r| r.id);
        out
    }

    /// Take job `id`'s result if it finished; None if it is still running.
    pub fn try_take(&self, id: u64) -> KvResult<Option<JobResult>> {
        let mut jobs = self.shared.jobs.lock();
        match jobs.get(&id) {
            None => Err(unknown_job(id)),
            Some(JobSlot::Running) => Ok(None),
            Some(JobSlot::Done(_)) => match jobs.remove(&id) {
                Some(JobSlot::Done(r)) => Ok(Some(r)),
                _ => unreachable!("checked above"),
            },
        }
    }

    /// Block until job `id` finished (or `timeout` passed: None) and take its result.
    pub fn wait(&self, id: u64, timeout: Option<Duration>) -> KvResult<Option<JobResult>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut jobs = self.shared.jobs.lock();
        loop {
            match jobs.get(&id) {
                None => return Err(unknown_job(id)),
                Some(JobSlot::Done(_)) => {
                    return match jobs.remove(&id) {
                        Some(JobSlot::Done(r)) => Ok(Some(r)),
                        _ => unreachable!("checked above"),
                    }
                }
                Some(JobSlot::Running) => match deadline {
                    None => self.shared.job_done.wait(&mut jobs),
                    Some(d) => {
                        if self.shared.job_done.wait_until(&mut jobs, d).timed_out() {
                            return Ok(None);
                        }
                    }
                },
            }
        }
    }

    /// Block until no job is running (or `timeout` passed: false).
    pub fn wait_idle(&self, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut jobs = self.shared.jobs.lock();
        while jobs.values().any(|s| matches!(s, JobSlot::Running)) {
            match deadline {
                None => self.shared.job_done.wait(&mut jobs),
                Some(d) => {
                    if self.shared.job_done.wait_until(&mut jobs, d).timed_out() {
                        return false;
                    }
                }
            }
        }
        true
    }

    pub fn running_jobs(&self) -> usize {
        self.shared.jobs.lock().values().filter(|s| matches!(s, JobSlot::Running)).count()
    }

    /// Finish all queued I/O, sync and close the slabs, release the directory lock and the
    /// engine's fds. Finished results stay collectable. Idempotent.
    pub fn close(&self) -> KvResult<()> {
        {
            let mut closed = self.closed.write();
            if *closed {
                return Ok(());
            }
            *closed = true;
        }
        self.engine.shutdown();
        let mut first_err = None;
        // The engine has finished every chain, so these are the files' last references: taking
        // them closes the fds.
        for s in self.shared.slabs.iter().filter_map(|cell| cell.write().take()) {
            if let Err(e) = s.file.sync_data() {
                first_err.get_or_insert(KvError::io("sync", &s.path, &e));
            }
        }
        self.lock.lock().take();
        self.tier_dir.write().take();
        first_err.map_or(Ok(()), Err)
    }

    /// Counters as (name, value) pairs: the disk tier's own, then its index's.
    pub fn stats(&self) -> Vec<(&'static str, u64)> {
        let c = &self.shared.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut v = vec![
            ("jobs", l(&c.jobs)),
            ("blocks_written", l(&c.blocks_written)),
            ("bytes_written", l(&c.bytes_written)),
            ("blocks_read", l(&c.blocks_read)),
            ("bytes_read", l(&c.bytes_read)),
            ("write_failures", l(&c.write_failures)),
            ("read_misses", l(&c.read_misses)),
            ("checksum_failures", l(&c.checksum_failures)),
            ("short_reads", l(&c.short_reads)),
            ("read_errors", l(&c.read_errors)),
            ("enospc", l(&c.enospc)),
            ("refused_disk_full", l(&c.refused_full)),
            ("disk_full", u64::from(self.shared.is_full())),
            // The directory was deleted under the tier: writes refused, reads from open files.
            ("dir_removed", u64::from(self.shared.dir_removed.load(Ordering::Relaxed))),
            ("refused_dir_removed", l(&c.refused_dir_removed)),
            // The errno that stopped the I/O engine for good (every I/O then fails), else 0.
            ("engine_errno", self.engine.failure().map_or(0, |e| e as u64)),
            ("slabs_lost", l(&c.slabs_lost)),
            ("blocks_lost", l(&c.blocks_lost)),
            ("recovered_blocks", l(&c.recovered_blocks)),
            ("recovery_discarded", l(&c.recovery_discarded)),
            ("recovery_duplicates", l(&c.recovery_duplicates)),
            ("recovery_us", l(&c.recovery_us)),
            ("direct_io", u64::from(self.direct)),
            ("preallocated", u64::from(self.preallocated)),
            ("block_bytes", self.shared.geo.block_bytes as u64),
            ("slot_stride", self.shared.geo.slot_stride as u64),
            ("capacity_bytes", (self.shared.geo.total_slots() * self.shared.geo.slot_stride) as u64),
        ];
        v.extend(self.shared.index.stats().fields());
        v
    }
}

fn unknown_job(id: u64) -> KvError {
    KvError::invalid("job_id", format!("no job {id} (unknown, or its result was already taken)"))
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

/// The write chain's header page plus the checksum computed in prep (read by `done`).
struct WriteCtx {
    header: AlignedBuf,
    crc: AtomicU32,
}

impl Shared {
    fn now_ns(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }

    fn is_full(&self) -> bool {
        let until = self.full_until_ns.load(Ordering::Acquire);
        until != 0 && self.now_ns() < until
    }

    fn mark_full(&self) {
        // Saturating: full_retry may be as long as u64::MAX ns ("never retry"), and a wrapped
        // sum would mark the tier full for no time at all (or overflow a debug build).
        let retry = u64::try_from(self.full_retry.as_nanos()).unwrap_or(u64::MAX);
        let until = self.now_ns().saturating_add(retry);
        self.full_until_ns.store(until.max(1), Ordering::Release);
    }

    /// The errno of an injected read or write fault, using up one count of it.
    fn take_fault(&self, reading: bool) -> Option<i32> {
        self.take_fault_as(|f| match (f, reading) {
            (Fault::WriteErrno(e), false) | (Fault::ReadErrno(e), true) => Some(e),
            _ => None,
        })
    }

    /// `pick`'s view of the injected fault, using up one count of it if `pick` takes it.
    fn take_fault_as<R>(&self, pick: impl Fn(Fault) -> Option<R>) -> Option<R> {
        self.fault.take_as(pick)
    }

    fn slab(&self, i: usize) -> Arc<SlabFile> {
        self.slabs[i].read().clone().expect("slabs are open until close(), and no I/O is submitted after it")
    }

    /// Where one block moves between: its slab file, the payload offset of `disk_slot` in it,
    /// and the address of `host_slot` in the host memory.
    fn endpoints(&self, disk_slot: u32, host_slot: u32, host: &Arc<dyn HostMemory>) -> (Arc<SlabFile>, u64, *mut u8) {
        let (file_i, payload_off) = self.geo.locate(disk_slot);
        // SAFETY: host_slot was range-checked by the caller; the slot is data_bytes or larger.
        let ptr = unsafe { host.base_ptr().add(host_slot as usize * host.slot_bytes()) };
        (self.slab(file_i), payload_off, ptr)
    }

    /// A slab deleted behind our back: its blocks become misses, and a fresh file takes its
    /// place for new writes. In-flight I/O keeps the old file open through its `Arc`, so no fd
    /// number is ever reused under the kernel's feet. The fresh file is created relative to the
    /// directory's fd, so only in the directory the tier locked: if that was deleted (another
    /// may have been made at its path, perhaps opened by another tier), nothing is created,
    /// writes are refused from then on and reads go on from the files held open.
    fn check_slabs(&self, dir: &TierDir) {
        if self.dir_removed.load(Ordering::Acquire) {
            return;
        }
        for (i, cell) in self.slabs.iter().enumerate() {
            let Some(cur) = cell.read().clone() else { continue };
            if tierdir::fstat(&cur.file).map_or(true, |st| st.st_nlink > 0) {
                continue;
            }
            if dir.is_removed() {
                self.dir_removed.store(true, Ordering::Release);
                return;
            }
            let mut w = cell.write();
            if !w.as_ref().is_some_and(|s| Arc::ptr_eq(s, &cur)) {
                continue; // another thread replaced it already
            }
            let mode = if cur.direct { DirectMode::Auto } else { DirectMode::Off };
            match SlabFile::open(dir, &slab::slab_name(i), self.geo.file_bytes(), mode) {
                Ok(o) => *w = Some(Arc::new(o.slab)),
                // A link or another non-file in its place, or no room: keep serving from the
                // unlinked file (its blocks stay good); retried at the next submission.
                Err(_) => continue,
            }
            drop(w);
            self.counters.slabs_lost.fetch_add(1, Ordering::Relaxed);
            let lo = (i * self.geo.slots_per_file) as u32;
            let hi = lo + self.geo.slots_per_file as u32;
            for s in lo..hi {
                self.backed.set(s, false); // the fresh file holds no blocks yet
            }
            let keys: Vec<BlockKey> = self
                .index
                .snapshot()
                .into_iter()
                .filter(|(_, _, _, s)| (lo..hi).contains(s))
                .map(|(k, ..)| k)
                .collect();
            let n = self.index.remove(&keys).len();
            self.counters.blocks_lost.fetch_add(n as u64, Ordering::Relaxed);
        }
    }

    /// After ENOSPC: withhold the free slots of sparse slabs that never held a block, which the
    /// full filesystem cannot back, so that writes go to freed slots (which keep their disk
    /// blocks) and stores evict to make room, until the retry (`submit_write` returns them).
    /// Without it, freed slots waited behind every never-written one, each failing once more.
    fn withhold_unbacked_slots(&self) {
        let preallocated: Vec<bool> =
            self.slabs.iter().map(|c| c.read().as_ref().is_some_and(|s| s.preallocated)).collect();
        let spf = self.geo.slots_per_file;
        self.index.withhold_free_slots(|s| preallocated[s as usize / spf] || self.backed.get(s));
    }

    /// Refuse host slots a job in flight uses in a way that conflicts with `kind`: a read may
    /// share its slots with no other job (two reads would both write them; a write would take
    /// the read's bytes and store them, checksummed, as its own block); writes only read their
    /// slots and may share them with each other.
    fn check_host_slots(
        &self,
        used: &HashMap<(usize, u32), HostUse>,
        pool: usize,
        slots: &[u32],
        kind: JobKind,
    ) -> KvResult<()> {
        for &s in slots {
            let job = match (used.get(&(pool, s)), kind) {
                (None, _) | (Some(HostUse::Write { .. }), JobKind::Write) => continue,
                (Some(HostUse::Read { job }), _) | (Some(HostUse::Write { job, .. }), JobKind::Read) => *job,
            };
            return Err(KvError::invalid(
                "slots",
                format!(
                    "host slot {s} of this pool is in use by disk job {job}, still in flight: a read may not \
                     share a host slot with another job (wait for job {job} first)"
                ),
            ));
        }
        Ok(())
    }

    /// Record `job`'s host slots as in use (checked by `check_host_slots` under the same lock).
    fn claim_host_slots(&self, used: &mut HashMap<(usize, u32), HostUse>, job: &Job) {
        for &s in &job.claims {
            let e = used.entry((job.pool, s)).or_insert(HostUse::Write { job: job.id, jobs: 0 });
            *e = match (job.kind, *e) {
                (JobKind::Write, HostUse::Write { jobs, .. }) => HostUse::Write { job: job.id, jobs: jobs + 1 },
                _ => HostUse::Read { job: job.id },
            };
        }
    }

    fn release_host_slots(&self, job: &Job) {
        if job.claims.is_empty() {
            return;
        }
        let mut used = self.host_use.lock();
        for &s in &job.claims {
            let key = (job.pool, s);
            match used.get_mut(&key) {
                Some(HostUse::Write { jobs, .. }) if *jobs > 1 => *jobs -= 1,
                _ => {
                    used.remove(&key);
                }
            }
        }
    }

    fn finish_one(&self, job: &Job, i: usize, ok: bool, bytes: u64) {
        if ok {
            job.ok[i].store(true, Ordering::Release);
            job.bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        if job.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.finalize(job);
        }
    }

    fn finalize(&self, job: &Job) {
        // Before the result is visible: whoever waited for the job may reuse its slots at once.
        self.release_host_slots(job);
        let (mut ok_keys, mut failed_keys) = (Vec::new(), Vec::new());
        for (k, ok) in job.keys.iter().zip(&job.ok) {
            if ok.load(Ordering::Acquire) {
                ok_keys.push(*k)
            } else {
                failed_keys.push(*k)
            }
        }
        let result = JobResult {
            id: job.id,
            kind: job.kind,
            ok_keys,
            failed_keys,
            bytes: job.bytes.load(Ordering::Relaxed),
            seconds: job.started.elapsed().as_secs_f64(),
            keepalive: job.host.lock().take(),
        };
        self.jobs.lock().insert(job.id, JobSlot::Done(result));
        self.job_done.notify_all();
    }

    fn write_chain(
        self: &Arc<Self>,
        job: &Arc<Job>,
        i: usize,
        (key, retention): (BlockKey, Retention),
        disk_slot: u32,
        host_slot: u32,
        host: &Arc<dyn HostMemory>,
    ) -> Chain {
        let geo = self.geo;
        let (file, payload_off, src) = self.endpoints(disk_slot, host_slot, host);
        let ctx = Arc::new(WriteCtx { header: AlignedBuf::new(HEADER_BYTES), crc: AtomicU32::new(0) });
        let generation = self.next_gen.fetch_add(1, Ordering::Relaxed);
        let prep = {
            let (me, ctx) = (self.clone(), ctx.clone());
            let src = IoBuf { ptr: src, len: geo.block_bytes };
            Box::new(move || {
                let src = src; // capture the whole Send wrapper, not its raw field
                if let Some(e) = me.take_fault(false) {
                    return Err(e);
                }
                // SAFETY: the caller keeps the host slot unchanged until the job completes.
                let payload = unsafe { std::slice::from_raw_parts(src.ptr, src.len) };
                let crc = crc32c::crc32c(payload);
                let h = SlotHeader {
                    key,
                    generation,
                    payload_len: geo.block_bytes as u64,
                    payload_crc: crc,
                    slot: disk_slot,
                    dir_id: me.dir_id.load(Ordering::Acquire),
                    retention,
                };
                // SAFETY: the header page is only touched here before the ops start, and by
                // the kernel afterwards; nobody else has a reference that writes it.
                let page = unsafe { std::slice::from_raw_parts_mut(ctx.header.ptr(), HEADER_BYTES) };
                h.encode_into(page);
                ctx.crc.store(crc, Ordering::Release);
                Ok(())
            }) as PrepFn
        };
        // One vectored write of payload and header: the slot is one contiguous range, and one
        // op per block keeps as many blocks in the device's queue as the queue depth allows.
        let ops = vec![IoOp {
            kind: OpKind::Write,
            file,
            offset: payload_off,
            bufs: vec![IoBuf { ptr: src, len: geo.data_bytes }, IoBuf { ptr: ctx.header.ptr(), len: HEADER_BYTES }],
        }];
        let done = {
            let (me, job) = (self.clone(), job.clone());
            Box::new(move |res: Result<(), IoFailure>| {
                let c = &me.counters;
                // Index updates run contained (`TierIndex::contain`): a panic in one fails the
                // index, and the job still finishes.
                match res {
                    Ok(()) => {
                        let crc = ctx.crc.load(Ordering::Acquire);
                        let readable = me.index.contain(|| {
                            if me.take_fault_as(|f| matches!(f, Fault::CompletionPanic).then_some(())).is_some() {
                                panic!("injected fault: a write's completion panicked");
                            }
                            me.index.with_entry(&key, |e| e.checksum.store(crc, Ordering::Release));
                            me.index.complete_store(&[key], true) == 1
                        });
                        let bytes = geo.slot_stride as u64;
                        me.backed.set(disk_slot, true);
                        c.blocks_written.fetch_add(1, Ordering::Relaxed);
                        c.bytes_written.fetch_add(bytes, Ordering::Relaxed);
                        // Written but not readable (the index failed meanwhile): not an ok key.
                        let ok = readable == Some(true);
                        me.finish_one(&job, i, ok, if ok { geo.block_bytes as u64 } else { 0 });
                    }
                    Err(f) => {
                        me.index.contain(|| me.index.complete_store(&[key], false));
                        c.write_failures.fetch_add(1, Ordering::Relaxed);
                        // A short write on a sized file, ENOSPC or EDQUOT: the device is full.
                        if matches!(f.errno(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
                            || matches!(f, IoFailure::Short { .. })
                        {
                            c.enospc.fetch_add(1, Ordering::Relaxed);
                            me.mark_full();
                            me.withhold_unbacked_slots();
                        }
                        me.finish_one(&job, i, false, 0);
                    }
                }
                drop(ctx);
            }) as DoneFn
        };
        Chain { prep: Some(prep), ops, done }
    }

    #[allow(clippy::too_many_arguments)]
    fn read_chain(
        self: &Arc<Self>,
        job: &Arc<Job>,
        i: usize,
        key: BlockKey,
        disk_slot: u32,
        expected_crc: u32,
        host_slot: u32,
        host: &Arc<dyn HostMemory>,
    ) -> Chain {
        let geo = self.geo;
        let (file, payload_off, dst_ptr) = self.endpoints(disk_slot, host_slot, host);
        let dst = IoBuf { ptr: dst_ptr, len: geo.data_bytes };
        let header = Arc::new(AlignedBuf::new(HEADER_BYTES));
        let prep = {
            let me = self.clone();
            Box::new(move || {
                if let Some(ms) = me.take_fault_as(|f| if let Fault::ReadDelayMs(ms) = f { Some(ms) } else { None }) {
                    std::thread::sleep(std::time::Duration::from_millis(ms.into()));
                }
                me.take_fault(true).map_or(Ok(()), Err)
            }) as PrepFn
        };
        let ops = vec![IoOp {
            kind: OpKind::Read,
            file,
            offset: payload_off,
            bufs: vec![dst, IoBuf { ptr: header.ptr(), len: HEADER_BYTES }],
        }];
        let done = {
            let (me, job) = (self.clone(), job.clone());
            Box::new(move |res: Result<(), IoFailure>| {
                let dst = dst; // capture the whole Send wrapper, not its raw field
                let c = &me.counters;
                // SAFETY: the read completed (or failed); the slot is ours until the job ends.
                let payload = unsafe { std::slice::from_raw_parts_mut(dst.ptr, geo.block_bytes) };
                let verdict = match res {
                    Err(IoFailure::Short { .. }) => Err(&c.short_reads),
                    Err(_) => Err(&c.read_errors),
                    Ok(()) => match SlotHeader::decode(header.as_slice(), disk_slot, me.dir_id.load(Ordering::Acquire))
                    {
                        Ok(h)
                            if h.key == key
                                && h.payload_len == geo.block_bytes as u64
                                && h.payload_crc == expected_crc
                                && h.payload_matches(payload) =>
                        {
                            Ok(())
                        }
                        _ => Err(&c.checksum_failures),
                    },
                };
                me.index.contain(|| me.index.unpin(&[key]));
                match verdict {
                    Ok(()) => {
                        me.index.contain(|| me.index.touch(&[key]));
                        c.blocks_read.fetch_add(1, Ordering::Relaxed);
                        c.bytes_read.fetch_add(geo.block_bytes as u64, Ordering::Relaxed);
                        me.finish_one(&job, i, true, geo.block_bytes as u64);
                    }
                    Err(counter) => {
                        // Never leave unverified bytes where the caller might use them.
                        payload.fill(0);
                        counter.fetch_add(1, Ordering::Relaxed);
                        me.index.contain(|| me.index.remove(&[key]));
                        me.finish_one(&job, i, false, 0);
                    }
                }
            }) as DoneFn
        };
        Chain { prep: Some(prep), ops, done }
    }
}
