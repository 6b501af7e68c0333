//! `engine="auto"`: the engine is chosen by measuring both on the tier's own device, not by
//! whether io_uring is available. Which one is faster depends on the device, the filesystem,
//! the block size and the queue depth, so the open-time probe writes and reads back blocks of
//! the tier's size at its queue depth with each engine, on a scratch file in the tier's
//! directory, and keeps the faster. The figures are kept in the directory (`PROBE_NAME`), so a
//! reopen with the same block size, queue depth and kernel reuses them instead of probing
//! again, and `kvtier status` shows them.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::{Chain, EngineChoice, FdOwner, IoBuf, IoEngine, IoOp, OpKind};
use crate::disk::layout::{round_up_page, PAGE};
use crate::disk::slab::AlignedBuf;
use crate::disk::tierdir::TierDir;

/// Where the probe's result is kept in a tier directory.
pub const PROBE_NAME: &str = "kvtier-disk.engine";
/// The probe's scratch file; removed after the probe, and by the next open after a crash.
pub const SCRATCH_NAME: &str = ".kvtier-probe.tmp";
/// At most this many bytes per engine and direction: enough for several rounds of the queue
/// at 2 MiB blocks, short enough that an open stays well under a second on a disk.
const PROBE_BYTES: u64 = 64 << 20;
/// A probe that takes longer than this (a stalled device) is abandoned.
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// One engine's measured bandwidth, bytes per second.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Figures {
    pub write_bps: f64,
    pub read_bps: f64,
}

impl Figures {
    /// Seconds to write a byte and read it back: what a tier that stores and loads each block
    /// once spends per byte.
    fn round_trip(&self) -> f64 {
        1.0 / self.write_bps + 1.0 / self.read_bps
    }

    /// To the 0.1 MiB/s the record keeps, so a kept record reads back equal to the measured one.
    fn kept_precision(self) -> Figures {
        let round = |bps: f64| (bps / MIB * 10.0).round() / 10.0 * MIB;
        Figures { write_bps: round(self.write_bps), read_bps: round(self.read_bps) }
    }
}

/// What the probe measured, for which geometry, and what it chose.
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeRecord {
    pub block_bytes: usize,
    pub queue_depth: usize,
    /// The kernel release it was measured on: a new kernel changes io_uring, so it re-probes.
    pub kernel: String,
    pub io_uring: Figures,
    pub pool: Figures,
    pub chosen: EngineChoice,
    pub measured_unix: u64,
}

/// The faster engine for these figures: the lower write-plus-read time per byte; io_uring on a
/// tie (it needs fewer threads).
pub fn pick(io_uring: &Figures, pool: &Figures) -> EngineChoice {
    if pool.round_trip() < io_uring.round_trip() {
        EngineChoice::Pool
    } else {
        EngineChoice::IoUring
    }
}

pub fn engine_name(choice: EngineChoice) -> &'static str {
    match choice {
        EngineChoice::Pool => "pool",
        EngineChoice::IoUring => "io_uring",
        EngineChoice::Auto => "auto",
    }
}

const MIB: f64 = (1u64 << 20) as f64;

impl ProbeRecord {
    /// The plain-text form kept in `PROBE_NAME` (bandwidths in MiB/s).
    pub fn encode(&self) -> String {
        format!(
            "kvtier-engine-probe 1\nblock_bytes {}\nqueue_depth {}\nkernel {}\nchosen {}\n\
             io_uring_write_mib_s {:.1}\nio_uring_read_mib_s {:.1}\npool_write_mib_s {:.1}\n\
             pool_read_mib_s {:.1}\nmeasured_unix {}\n",
            self.block_bytes,
            self.queue_depth,
            self.kernel,
            engine_name(self.chosen),
            self.io_uring.write_bps / MIB,
            self.io_uring.read_bps / MIB,
            self.pool.write_bps / MIB,
            self.pool.read_bps / MIB,
            self.measured_unix
        )
    }

    /// Parse `encode`'s form; None for anything else (the probe then runs again).
    pub fn parse(text: &str) -> Option<ProbeRecord> {
        let mut lines = text.lines();
        if lines.next()? != "kvtier-engine-probe 1" {
            return None;
        }
        let mut kv = std::collections::HashMap::new();
        for line in lines {
            let (k, v) = line.split_once(' ')?;
            kv.insert(k, v);
        }
        let num = |k: &str| kv.get(k)?.parse::<f64>().ok().filter(|x| x.is_finite() && *x > 0.0);
        let figures = |engine: &str| {
            Some(Figures {
                write_bps: num(&format!("{engine}_write_mib_s"))? * MIB,
                read_bps: num(&format!("{engine}_read_mib_s"))? * MIB,
            })
        };
        let chosen = match *kv.get("chosen")? {
            "pool" => EngineChoice::Pool,
            "io_uring" => EngineChoice::IoUring,
            _ => return None,
        };
        Some(ProbeRecord {
            block_bytes: kv.get("block_bytes")?.parse().ok()?,
            queue_depth: kv.get("queue_depth")?.parse().ok()?,
            kernel: kv.get("kernel")?.to_string(),
            io_uring: figures("io_uring")?,
            pool: figures("pool")?,
            chosen,
            measured_unix: kv.get("measured_unix")?.parse().ok()?,
        })
    }

    /// One line for the tier's notes and logs.
    pub fn describe(&self, cached: bool) -> String {
        format!(
            "engine: auto chose {} for {} KiB blocks at queue depth {} (write/read MiB/s: io_uring {:.0}/{:.0}, \
             pool {:.0}/{:.0}; {})",
            engine_name(self.chosen),
            self.block_bytes >> 10,
            self.queue_depth,
            self.io_uring.write_bps / MIB,
            self.io_uring.read_bps / MIB,
            self.pool.write_bps / MIB,
            self.pool.read_bps / MIB,
            if cached { "measured earlier, kept in kvtier-disk.engine" } else { "measured at open" }
        )
    }

    /// Whether this record answers for a tier of this geometry on this kernel.
    pub fn fits(&self, block_bytes: usize, queue_depth: usize, kernel: &str) -> bool {
        self.block_bytes == block_bytes && self.queue_depth == queue_depth && self.kernel == kernel
    }
}

/// The running kernel's release ("6.8.0-..."), or "" where uname fails.
pub fn kernel_release() -> String {
    // SAFETY: utsname is plain old data that uname fills.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    if unsafe { libc::uname(&mut u) } != 0 {
        return String::new();
    }
    // SAFETY: uname NUL-terminates release.
    unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) }.to_string_lossy().replace(' ', "_")
}

/// The record kept in `dir`, if any and readable.
pub fn load(dir: &TierDir) -> Option<ProbeRecord> {
    let mut f = dir.open_file(PROBE_NAME, libc::O_RDONLY).ok()?;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::Read::take(&mut f, 4096), &mut text).ok()?;
    ProbeRecord::parse(&text)
}

/// Keep `rec` in `dir` (a temporary renamed into place). Failure only costs a probe next time.
pub fn store(dir: &TierDir, rec: &ProbeRecord) {
    let tmp = format!("{SCRATCH_NAME}.record");
    let _ = dir.unlink(&tmp);
    let written = dir
        .open_file(&tmp, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL)
        .and_then(|mut f| std::io::Write::write_all(&mut f, rec.encode().as_bytes()));
    if written.is_err() || dir.rename(&tmp, PROBE_NAME).is_err() {
        let _ = dir.unlink(&tmp);
    }
}

struct Scratch(std::fs::File);
impl FdOwner for Scratch {
    fn raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// How many blocks each probe direction moves for a tier of `capacity_bytes`: `PROBE_BYTES`,
/// no more than an eighth of the tier (a small tier gets a small probe), at least two.
pub fn probe_blocks(block_bytes: usize, capacity_bytes: u64) -> usize {
    let budget = PROBE_BYTES.min(capacity_bytes / 8);
    ((budget / block_bytes.max(1) as u64) as usize).max(2)
}

/// Measure `engines` (io_uring, pool) on a scratch file in `dir`: each writes `blocks` blocks
/// of `block_bytes` and reads them back, with as many in flight as the engine's queue depth.
/// The engines take turns twice and the better figure of each counts, so one slow moment of
/// the device does not decide. O_DIRECT as the slabs use it, when `direct`.
pub fn measure(
    dir: &TierDir,
    engines: [&dyn IoEngine; 2],
    block_bytes: usize,
    blocks: usize,
    direct: bool,
) -> Result<[Figures; 2], String> {
    let _ = dir.unlink(SCRATCH_NAME);
    let flags = libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | if direct { libc::O_DIRECT } else { 0 };
    let file = dir.open_file(SCRATCH_NAME, flags).map_err(|e| format!("create {SCRATCH_NAME}: {e}"))?;
    let stride = round_up_page(block_bytes);
    let size = (stride * blocks) as libc::off_t;
    // SAFETY: plain syscalls on our fd. A file sized up front, as the slabs are: no write extends it.
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, size) } != 0
        && unsafe { libc::ftruncate(file.as_raw_fd(), size) } != 0
    {
        let e = std::io::Error::last_os_error();
        let _ = dir.unlink(SCRATCH_NAME);
        return Err(format!("size {SCRATCH_NAME}: {e}"));
    }
    let file: Arc<dyn FdOwner> = Arc::new(Scratch(file));
    let buf = AlignedBuf::new(stride.max(PAGE));
    let mut best = [Figures { write_bps: 0.0, read_bps: 0.0 }; 2];
    let result = (|| {
        for _round in 0..2 {
            for (engine, best) in engines.iter().zip(best.iter_mut()) {
                let write = pass(*engine, &file, &buf, OpKind::Write, stride, blocks)?;
                let read = pass(*engine, &file, &buf, OpKind::Read, stride, blocks)?;
                best.write_bps = best.write_bps.max(write);
                best.read_bps = best.read_bps.max(read);
            }
        }
        Ok(best)
    })();
    let _ = dir.unlink(SCRATCH_NAME);
    if result.is_err() {
        // A failed or stalled pass may leave ops with the kernel: never free memory it may
        // still write.
        std::mem::forget(buf);
    }
    result
}

/// One timed pass: `blocks` one-op chains at consecutive slots; bytes per second.
fn pass(
    engine: &dyn IoEngine,
    file: &Arc<dyn FdOwner>,
    buf: &AlignedBuf,
    kind: OpKind,
    stride: usize,
    blocks: usize,
) -> Result<f64, String> {
    let (tx, rx) = mpsc::channel();
    // Every op uses the same buffer: writes only read it, and what reads leave in it is never
    // looked at. It outlives the pass, which waits for every chain (or leaks it on a timeout).
    let chains = (0..blocks)
        .map(|i| {
            let tx = tx.clone();
            Chain {
                prep: None,
                ops: vec![IoOp {
                    kind,
                    file: file.clone(),
                    offset: (i * stride) as u64,
                    bufs: vec![IoBuf { ptr: buf.ptr(), len: stride }],
                }],
                done: Box::new(move |res| {
                    let _ = tx.send(res);
                }),
            }
        })
        .collect();
    drop(tx);
    let t0 = Instant::now();
    engine.submit(chains);
    for _ in 0..blocks {
        match rx.recv_timeout(PROBE_TIMEOUT) {
            Ok(Ok(())) => {}
            Ok(Err(f)) => return Err(format!("probe {kind:?} failed: {f:?}")),
            Err(_) => return Err("probe timed out".into()),
        }
    }
    let secs = t0.elapsed().as_secs_f64().max(1e-9);
    Ok((blocks * stride) as f64 / secs)
}

/// What `auto` settled on at open.
pub struct AutoChoice {
    pub engine: Arc<dyn IoEngine>,
    /// The figures it went by (None when the probe failed), and whether they were kept from
    /// an earlier open.
    pub record: Option<(ProbeRecord, bool)>,
    /// One line for the tier's notes.
    pub note: String,
}

/// `auto` where io_uring works: reuse the figures kept in `dir` when they fit this geometry and
/// kernel, else probe both engines (`uring` and one `make_pool` starts) and keep the result.
/// The engine not chosen is shut down. A probe that fails leaves io_uring, with the reason in
/// the note; it never fails the open.
pub fn choose_auto(
    dir: &TierDir,
    uring: Arc<dyn IoEngine>,
    make_pool: impl Fn() -> crate::error::KvResult<Arc<dyn IoEngine>>,
    block_bytes: usize,
    capacity_bytes: u64,
    direct: bool,
) -> crate::error::KvResult<AutoChoice> {
    let depth = uring.queue_depth();
    let kernel = kernel_release();
    let (record, cached, pool) = match load(dir).filter(|r| r.fits(block_bytes, depth, &kernel)) {
        Some(rec) => (rec, true, None),
        None => {
            let pool = make_pool()?;
            let blocks = probe_blocks(block_bytes, capacity_bytes);
            match measure(dir, [&*uring, &*pool], block_bytes, blocks, direct) {
                Ok([u, p]) => {
                    let (u, p) = (u.kept_precision(), p.kept_precision());
                    let rec = ProbeRecord {
                        block_bytes,
                        queue_depth: depth,
                        kernel,
                        io_uring: u,
                        pool: p,
                        chosen: pick(&u, &p),
                        measured_unix: std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map_or(0, |d| d.as_secs()),
                    };
                    store(dir, &rec);
                    (rec, false, Some(pool))
                }
                Err(why) => {
                    pool.shutdown();
                    let note = format!("engine: auto kept io_uring (the engine probe failed: {why})");
                    return Ok(AutoChoice { engine: uring, record: None, note });
                }
            }
        }
    };
    let note = record.describe(cached);
    let engine = match record.chosen {
        EngineChoice::Pool => {
            uring.shutdown();
            match pool {
                Some(p) => p,
                None => make_pool()?,
            }
        }
        _ => {
            if let Some(p) = pool {
                p.shutdown();
            }
            uring
        }
    };
    Ok(AutoChoice { engine, record: Some((record, cached)), note })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(write_mib: f64, read_mib: f64) -> Figures {
        Figures { write_bps: write_mib * MIB, read_bps: read_mib * MIB }
    }

    #[test]
    fn the_engine_with_the_shorter_write_and_read_back_wins() {
        assert_eq!(pick(&figures(2000.0, 1500.0), &figures(1800.0, 1400.0)), EngineChoice::IoUring);
        assert_eq!(pick(&figures(1200.0, 1100.0), &figures(1800.0, 1400.0)), EngineChoice::Pool);
        // Faster writes do not win when the reads lose more: 1/3000 + 1/500 > 1/1000 + 1/1000.
        assert_eq!(pick(&figures(3000.0, 500.0), &figures(1000.0, 1000.0)), EngineChoice::Pool);
        // A tie keeps io_uring.
        assert_eq!(pick(&figures(1000.0, 1000.0), &figures(1000.0, 1000.0)), EngineChoice::IoUring);
    }

    #[test]
    fn a_record_reads_back_as_written_and_anything_else_is_no_record() {
        let rec = ProbeRecord {
            block_bytes: 2 << 20,
            queue_depth: 16,
            kernel: "6.8.0-test".into(),
            io_uring: figures(1234.5, 987.6),
            pool: figures(1500.0, 1000.0),
            chosen: EngineChoice::Pool,
            measured_unix: 1_765_000_000,
        };
        assert_eq!(ProbeRecord::parse(&rec.encode()), Some(rec.clone()));
        assert!(rec.fits(2 << 20, 16, "6.8.0-test"));
        assert!(!rec.fits(1 << 20, 16, "6.8.0-test") && !rec.fits(2 << 20, 8, "6.8.0-test"));
        assert!(!rec.fits(2 << 20, 16, "6.9.0"));
        assert_eq!(ProbeRecord::parse(""), None);
        assert_eq!(ProbeRecord::parse(&rec.encode().replace("chosen pool", "chosen fast")), None);
        assert_eq!(ProbeRecord::parse(&rec.encode().replace("pool_read_mib_s 1000.0", "pool_read_mib_s 0")), None);
        assert_eq!(ProbeRecord::parse(&rec.encode().replace("kvtier-engine-probe 1", "kvtier-engine-probe 2")), None);
    }

    #[test]
    fn a_small_tier_gets_a_small_probe() {
        assert_eq!(probe_blocks(2 << 20, 1 << 40), 32);
        assert_eq!(probe_blocks(256 << 10, 1 << 40), 256);
        assert_eq!(probe_blocks(4096, 1 << 20), 32);
        assert_eq!(probe_blocks(8 << 20, 16 << 20), 2);
    }
}
