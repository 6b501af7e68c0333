//! Rebuilding the index from slot headers when a directory is reopened.
//!
//! Every slot's header page is read (in parallel, on as many threads as the OS grants: the scan
//! is bound by read latency, not CPU) and checked: magic, version, header checksum, its own slot
//! number, the directory id, and a decodable key. Blank slots are free; anything else that
//! fails is discarded (counted) and freed. With `verify_payload` the payload is read and checked
//! too, so torn slots are dropped at open instead of at their first read; without it, the
//! per-read check still guarantees a torn slot is never served. When a key appears in more
//! than one slot (an evicted copy whose slot was not reused yet), the highest generation wins.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::layout::{HeaderError, SlotHeader, HEADER_BYTES};
use super::slab::{AlignedBuf, Geometry, SlabFile};
use super::spawn;
use crate::keys::BlockKey;

#[derive(Default, Debug)]
pub struct Recovered {
    /// Winning copies, oldest generation first (the order they re-enter the policy).
    pub entries: Vec<SlotHeader>,
    pub free: Vec<u32>,
    /// Slots past the end of a slab file shorter than the geometry says, one range per such
    /// file: free too, but not read and not listed one by one. Only a status scan meets them (a
    /// tier sizes its slabs before it scans them); damaged metadata can claim billions.
    pub past_eof: Vec<std::ops::Range<u32>>,
    /// Slots with a header that did not verify (torn, corrupt, foreign).
    pub discarded: u64,
    /// Older copies of a key that also lives in a newer slot.
    pub duplicates: u64,
    /// The highest generation of any header of this directory, held or dropped for its payload
    /// (the next open continues after it).
    pub max_generation: u64,
}

/// Fill `buf` from `off`; false on an I/O error. Bytes past the end of the file read as zeros,
/// as they do once a tier opens the slab (it sizes a short slab back up before this scan), so
/// `kvtier status` on a truncated slab counts what a reopening tier would serve.
fn pread_full(fd: i32, buf: &mut [u8], off: u64) -> bool {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: reads into our own buffer.
        let n = unsafe {
            libc::pread(fd, buf[done..].as_mut_ptr().cast(), buf.len() - done, (off + done as u64) as libc::off_t)
        };
        if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        if n == 0 {
            buf[done..].fill(0);
            return true;
        }
        if n < 0 {
            return false;
        }
        done += n as usize;
    }
    true
}

enum SlotScan {
    Free,
    /// With the generation its header gave, when the header was this directory's and only the
    /// payload failed: that generation was handed out, and the next open must go past it.
    Discarded(Option<u64>),
    Valid(SlotHeader),
}

fn scan_slot(
    geo: &Geometry,
    slabs: &[Arc<SlabFile>],
    dir_id: u64,
    slot: u32,
    verify: bool,
    buf: &mut AlignedBuf,
) -> SlotScan {
    let (file, payload_off) = geo.locate(slot);
    let fd = slabs[file].file.as_raw_fd();
    let header = if verify {
        let whole = &mut buf.as_mut_slice()[..geo.slot_stride];
        if !pread_full(fd, whole, payload_off) {
            return SlotScan::Discarded(None);
        }
        &whole[geo.data_bytes..]
    } else {
        let page = &mut buf.as_mut_slice()[..HEADER_BYTES];
        if !pread_full(fd, page, payload_off + geo.data_bytes as u64) {
            return SlotScan::Discarded(None);
        }
        &*page
    };
    match SlotHeader::decode(header, slot, dir_id) {
        Err(HeaderError::Blank) => SlotScan::Free,
        Err(_) => SlotScan::Discarded(None),
        Ok(h) if h.payload_len != geo.block_bytes as u64 => SlotScan::Discarded(Some(h.generation)),
        Ok(h) => {
            if verify && !h.payload_matches(&buf.as_slice()[..geo.block_bytes]) {
                return SlotScan::Discarded(Some(h.generation));
            }
            SlotScan::Valid(h)
        }
    }
}

pub fn scan(geo: &Geometry, slabs: &[Arc<SlabFile>], dir_id: u64, verify_payload: bool) -> Recovered {
    let total = geo.total_slots();
    // Per file, how many of its slots start before its end (a slot cut by the end reads as
    // zeros from there, see `pread_full`). A file that cannot be stat'ed is read in full.
    let present: Vec<usize> = slabs
        .iter()
        .map(|s| match s.file.metadata() {
            Ok(m) => (m.len().div_ceil(geo.slot_stride as u64) as usize).min(geo.slots_per_file),
            Err(_) => geo.slots_per_file,
        })
        .collect();
    let present = &present;
    let threads = if verify_payload { 4 } else { 16 }.min(total.max(1));
    // Chunks of slots handed out in turn, so that however many threads the OS grants (down to
    // none but the calling thread) share the whole scan.
    let chunk = total.div_ceil(threads * 4).max(1);
    let next_chunk = AtomicUsize::new(0);
    let work = || {
        let mut buf = AlignedBuf::new(if verify_payload { geo.slot_stride } else { HEADER_BYTES });
        let (mut valid, mut free, mut bad, mut bad_generation) = (Vec::new(), Vec::new(), 0u64, 0u64);
        loop {
            let start = next_chunk.fetch_add(1, Ordering::Relaxed) * chunk;
            if start >= total {
                break;
            }
            for slot in start..(start + chunk).min(total) {
                if slot % geo.slots_per_file >= present[slot / geo.slots_per_file] {
                    continue;
                }
                match scan_slot(geo, slabs, dir_id, slot as u32, verify_payload, &mut buf) {
                    SlotScan::Free => free.push(slot as u32),
                    SlotScan::Discarded(generation) => {
                        bad += 1;
                        bad_generation = bad_generation.max(generation.unwrap_or(0));
                        free.push(slot as u32);
                    }
                    SlotScan::Valid(h) => valid.push(h),
                }
            }
        }
        (valid, free, bad, bad_generation)
    };
    let parts: Vec<(Vec<SlotHeader>, Vec<u32>, u64, u64)> = std::thread::scope(|s| {
        let mut helpers = Vec::with_capacity(threads - 1);
        for t in 1..threads {
            match spawn::spawn_scoped(s, format!("kvtier-scan-{t}"), work) {
                Ok(h) => helpers.push(h),
                // The OS refused a thread (a pids limit): scan with the ones it granted.
                Err(_) => break,
            }
        }
        let mut parts = vec![work()];
        parts.extend(helpers.into_iter().map(|h| h.join().expect("scan thread")));
        parts
    });

    let mut out = Recovered::default();
    for (f, &n) in present.iter().enumerate() {
        if n < geo.slots_per_file {
            let first = (f * geo.slots_per_file) as u32;
            out.past_eof.push(first + n as u32..first + geo.slots_per_file as u32);
        }
    }
    let mut best: HashMap<BlockKey, SlotHeader> = HashMap::new();
    for (valid, free, bad, bad_generation) in parts {
        out.free.extend(free);
        out.discarded += bad;
        // A torn slot dropped here keeps its header on disk until the slot is reused; an open
        // that does not read payloads will take it as valid. Generations after this open must
        // outrank it, or a block rewritten now loses to its own torn copy there.
        out.max_generation = out.max_generation.max(bad_generation);
        for h in valid {
            out.max_generation = out.max_generation.max(h.generation);
            match best.get_mut(&h.key) {
                Some(cur) if cur.generation >= h.generation => {
                    out.duplicates += 1;
                    out.free.push(h.slot);
                }
                Some(cur) => {
                    out.duplicates += 1;
                    out.free.push(cur.slot);
                    *cur = h;
                }
                None => {
                    best.insert(h.key, h);
                }
            }
        }
    }
    out.entries = best.into_values().collect();
    out.entries.sort_by_key(|h| h.generation);
    out.free.sort_unstable();
    out
}
