//! A read-only look at a disk-tier directory: what it holds and what is damaged, without
//! opening it as a tier.
//!
//! `DiskTier::open` takes the directory's exclusive flock, removes stale temporaries, tightens
//! permissions, creates and sizes slabs and writes the metadata file. None of that may happen
//! here: an operator runs `kvtier status` against a directory a serving process holds open, and
//! against a damaged directory they want to inspect before deciding anything. So this opens
//! the metadata and slab files read-only, takes no lock (a shared flock would make a tier that
//! starts at the same moment fail with "directory locked"), and reuses the recovery scan, the
//! one place that parses slot headers.
//!
//! While a tier is writing, a header page can be read mid-write: such a slot shows up as
//! damaged in this snapshot although the live tier will complete it. The numbers are a
//! snapshot of the files, not of the live tier's index.

use std::path::Path;
use std::sync::Arc;

use super::recovery;
use super::slab::{slab_name, Meta, SlabFile, META_NAME};
use super::tierdir::TierDir;
use crate::error::{KvError, KvResult};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskStatus {
    pub block_bytes: u64,
    pub slot_stride: u64,
    pub num_files: u64,
    pub slots_per_file: u64,
    pub capacity_blocks: u64,
    pub dir_id: u64,
    /// Blocks a tier reopening this directory would serve (newest copy of each key).
    pub blocks: u64,
    /// Payload bytes of those blocks.
    pub bytes: u64,
    /// Never-written or freed slots.
    pub free_slots: u64,
    /// Slots whose header (or payload, with `verify_payload`) does not verify: torn, corrupt,
    /// foreign, or in the middle of a write when scanned.
    pub damaged_slots: u64,
    /// Older copies of keys that also live in a newer slot (reused on the next open).
    pub stale_copies: u64,
    /// Slots past the end of slab files shorter than the metadata says (truncated slabs, or
    /// damaged metadata): whatever they held is gone; a reopening tier starts them empty.
    pub missing_slots: u64,
    /// Lowest and highest generation among the blocks held (0 and 0 when empty), and the
    /// highest generation of any header of this directory, also one whose payload failed (the
    /// next open continues after it).
    pub min_generation: u64,
    pub max_generation: u64,
    pub last_generation: u64,
    pub verified_payloads: bool,
}

impl DiskStatus {
    /// (name, value) pairs in a fixed order, for the Python dict.
    pub fn fields(&self) -> [(&'static str, u64); 16] {
        [
            ("block_bytes", self.block_bytes),
            ("slot_stride", self.slot_stride),
            ("num_files", self.num_files),
            ("slots_per_file", self.slots_per_file),
            ("capacity_blocks", self.capacity_blocks),
            ("dir_id", self.dir_id),
            ("blocks", self.blocks),
            ("bytes", self.bytes),
            ("free_slots", self.free_slots),
            ("damaged_slots", self.damaged_slots),
            ("stale_copies", self.stale_copies),
            ("missing_slots", self.missing_slots),
            ("min_generation", self.min_generation),
            ("max_generation", self.max_generation),
            ("last_generation", self.last_generation),
            ("verified_payloads", u64::from(self.verified_payloads)),
        ]
    }
}

/// Scan `dir` without modifying it. Fails with an `Io` error naming the path when the
/// directory is not a kvtier disk tier or a slab file is missing.
pub fn disk_status(dir: &Path, verify_payload: bool) -> KvResult<DiskStatus> {
    if !dir.is_dir() {
        return Err(KvError::Io { op: "status", path: dir.display().to_string(), detail: "not a directory".into() });
    }
    // Read-only, like every open here: no O_CREAT, no O_DIRECT (buffered reads see the same
    // bytes and need no alignment probe), no link followed, nothing but regular files read.
    let tier_dir = TierDir::open(dir)?;
    let meta = Meta::load(&tier_dir)?.ok_or_else(|| KvError::Io {
        op: "status",
        path: dir.join(META_NAME).display().to_string(),
        detail: "missing: not a kvtier disk-tier directory".into(),
    })?;
    let geo = meta.geometry();
    let mut slabs = Vec::with_capacity(geo.num_files);
    for i in 0..geo.num_files {
        let path = dir.join(slab_name(i));
        let file =
            tier_dir.open_file(&slab_name(i), libc::O_RDONLY).map_err(|e| KvError::io("open read-only", &path, &e))?;
        // A short (truncated) slab is fine: its missing slots read short and count as damaged.
        slabs.push(Arc::new(SlabFile { file, path, direct: false, preallocated: false }));
    }
    let rec = recovery::scan(&geo, &slabs, meta.dir_id, verify_payload);
    let gens = rec.entries.iter().map(|h| h.generation);
    Ok(DiskStatus {
        block_bytes: geo.block_bytes as u64,
        slot_stride: geo.slot_stride as u64,
        num_files: geo.num_files as u64,
        slots_per_file: geo.slots_per_file as u64,
        capacity_blocks: geo.total_slots() as u64,
        dir_id: meta.dir_id,
        blocks: rec.entries.len() as u64,
        bytes: rec.entries.iter().map(|h| h.payload_len).sum(),
        // `free` also lists damaged slots and stale copies (recovery frees them); count only
        // the slots that hold nothing.
        free_slots: rec.free.len() as u64 - rec.discarded - rec.duplicates,
        damaged_slots: rec.discarded,
        stale_copies: rec.duplicates,
        missing_slots: rec.past_eof.iter().map(|r| u64::from(r.end - r.start)).sum(),
        min_generation: gens.clone().min().unwrap_or(0),
        max_generation: gens.max().unwrap_or(0),
        last_generation: rec.max_generation,
        verified_payloads: verify_payload,
    })
}
