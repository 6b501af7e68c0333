//! The directory: lock file, metadata file, and the slab files of fixed-size slots.
//!
//! File names are fixed (`kvtier-disk.lock`, `kvtier-disk.meta`, `slab-NNN.kvt`): keys never
//! become path components. Every file is opened relative to the directory's fd and never
//! through a link (`tierdir`). Files are created 0600 and the directory 0700. The metadata file is
//! plain `name=value` text written to a temporary name, synced and renamed over, so it is either
//! the old or the new version; stale temporaries from a crash are removed by the next opener once
//! it holds the directory lock.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::io::FdOwner;
use super::layout::{round_up_page, HEADER_BYTES, PAGE};
use super::tierdir::{fstat, identity, TierDir};
use crate::error::{KvError, KvResult};

pub const LOCK_NAME: &str = "kvtier-disk.lock";
pub const META_NAME: &str = "kvtier-disk.meta";
const META_TMP_PREFIX: &str = ".kvtier-disk.meta.tmp";
const META_FORMAT: u32 = 1;

pub fn slab_name(i: usize) -> String {
    format!("slab-{i:03}.kvt")
}

/// Whether `name` is one that `slab_name` gives.
pub fn is_slab_name(name: &str) -> bool {
    name.strip_prefix("slab-")
        .and_then(|rest| rest.strip_suffix(".kvt"))
        .is_some_and(|n| n.len() == 3 && n.bytes().all(|b| b.is_ascii_digit()))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub block_bytes: usize,
    /// Payload area of a slot: block_bytes rounded up to 4 KiB.
    pub data_bytes: usize,
    /// data_bytes + one header page.
    pub slot_stride: usize,
    pub slots_per_file: usize,
    pub num_files: usize,
}

/// Limits of a tier's geometry: checked for a new tier (`Geometry::new`) and for the metadata
/// of an existing one (`Meta::load`).
const MAX_BLOCK_BYTES: usize = 1 << 30;
const MAX_FILES: usize = 999;
const MAX_SLOTS: usize = u32::MAX as usize / 2;

impl Geometry {
    pub fn new(capacity_bytes: u64, block_bytes: usize, num_files: usize) -> KvResult<Self> {
        if block_bytes == 0 {
            return Err(KvError::invalid("block_bytes", "must be positive"));
        }
        if block_bytes > MAX_BLOCK_BYTES {
            return Err(KvError::invalid("block_bytes", format!("{block_bytes} is over the 1 GiB limit")));
        }
        if num_files == 0 || num_files > MAX_FILES {
            return Err(KvError::invalid("num_files", format!("must be in 1..={MAX_FILES}, got {num_files}")));
        }
        let data_bytes = round_up_page(block_bytes);
        let slot_stride = data_bytes + HEADER_BYTES;
        let total = (capacity_bytes / slot_stride as u64) as usize;
        if total < num_files {
            return Err(KvError::invalid(
                "capacity_bytes",
                format!(
                    "{capacity_bytes} bytes hold {total} slot(s) of {slot_stride} bytes (block plus 4 KiB header), \
                     fewer than num_files={num_files}"
                ),
            ));
        }
        if total > MAX_SLOTS {
            return Err(KvError::invalid("capacity_bytes", "more than 2^31 slots"));
        }
        Ok(Geometry { block_bytes, data_bytes, slot_stride, slots_per_file: total / num_files, num_files })
    }

    pub fn total_slots(&self) -> usize {
        self.slots_per_file * self.num_files
    }
    pub fn file_bytes(&self) -> u64 {
        (self.slots_per_file * self.slot_stride) as u64
    }
    /// (file index, byte offset of the slot's payload).
    pub fn locate(&self, slot: u32) -> (usize, u64) {
        let s = slot as usize;
        (s / self.slots_per_file, ((s % self.slots_per_file) * self.slot_stride) as u64)
    }
    pub fn header_offset(&self, slot: u32) -> (usize, u64) {
        let (f, off) = self.locate(slot);
        (f, off + self.data_bytes as u64)
    }
}

/// Remove metadata and engine-probe temporaries a crash may have left (only our own fixed
/// prefixes). Only the
/// holder of the directory lock may call this: any other caller could delete the temporary the
/// holder is writing right now (`Meta::store`), whose rename would then fail.
pub fn remove_stale_temporaries(dir: &TierDir) {
    for name in dir.names().unwrap_or_default() {
        if name.starts_with(META_TMP_PREFIX) || name.starts_with(super::io::choose::SCRATCH_NAME) {
            let _ = dir.unlink(&name);
        }
    }
}

/// Exclusive advisory lock on the directory for the life of the tier (flock: released by the
/// kernel if the process dies, so a crash never leaves the directory locked).
///
/// Two flocks: one on the directory itself, which cannot be deleted while it holds the tier's
/// files, so deleting the lock file cannot let a second tier in; and one on the lock file, which
/// records the holder's pid for the error message and `kvtier status`. Where a filesystem
/// refuses flock on a directory, the lock file's flock alone guards it, as before.
pub struct DirLock {
    _dir: Option<File>,
    _file: File,
}

/// `flock(LOCK_EX | LOCK_NB)`: Ok(true) when taken, Ok(false) when another holder has it.
fn try_flock(file: &File) -> std::io::Result<bool> {
    // SAFETY: plain syscall on an fd we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(err)
    }
}

impl DirLock {
    pub fn acquire(dir: &TierDir) -> KvResult<Self> {
        let path = dir.join(LOCK_NAME);
        let locked = |pid_file: Option<&mut File>| {
            let mut holder = String::new();
            if let Some(f) = pid_file {
                let _ = f.read_to_string(&mut holder);
            }
            let holder = holder.trim();
            KvError::Locked(format!(
                "{} is already open by another disk tier{}",
                dir.path().display(),
                if holder.is_empty() { String::new() } else { format!(" (pid {holder})") }
            ))
        };
        let dir_file = dir.reopen().map_err(|e| KvError::io("open", dir.path(), &e))?;
        let dir_lock = match try_flock(&dir_file) {
            Ok(true) => Some(dir_file),
            Ok(false) => return Err(locked(dir.open_file(LOCK_NAME, libc::O_RDONLY).ok().as_mut())),
            Err(_) => None,
        };
        let mut file = dir
            .open_file(LOCK_NAME, libc::O_RDWR | libc::O_CREAT)
            .map_err(|e| KvError::io("open lock file", &path, &e))?;
        match try_flock(&file) {
            Ok(true) => {}
            Ok(false) => return Err(locked(Some(&mut file))),
            Err(e) => return Err(KvError::io("lock", &path, &e)),
        }
        let _ = file.set_len(0);
        let _ = write!(file, "{}", std::process::id());
        Ok(DirLock { _dir: dir_lock, _file: file })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Meta {
    pub block_bytes: usize,
    pub slots_per_file: usize,
    pub num_files: usize,
    pub dir_id: u64,
}

impl Meta {
    fn render(&self) -> String {
        format!(
            "format={META_FORMAT}\nblock_bytes={}\nslots_per_file={}\nnum_files={}\ndir_id={}\n",
            self.block_bytes, self.slots_per_file, self.num_files, self.dir_id
        )
    }

    /// The slot geometry the metadata describes.
    pub fn geometry(&self) -> Geometry {
        let data_bytes = round_up_page(self.block_bytes);
        Geometry {
            block_bytes: self.block_bytes,
            data_bytes,
            slot_stride: data_bytes + HEADER_BYTES,
            slots_per_file: self.slots_per_file,
            num_files: self.num_files,
        }
    }

    /// Why these values are not ones a tier could have written (the limits `Geometry::new`
    /// puts on a new tier), if they are not.
    fn implausible(&self) -> Option<String> {
        if self.block_bytes == 0 || self.block_bytes > MAX_BLOCK_BYTES {
            return Some(format!("block_bytes={} is outside 1..={MAX_BLOCK_BYTES}", self.block_bytes));
        }
        if self.num_files == 0 || self.num_files > MAX_FILES {
            return Some(format!("num_files={} is outside 1..={MAX_FILES}", self.num_files));
        }
        let slots = self.slots_per_file.saturating_mul(self.num_files);
        if self.slots_per_file == 0 || slots > MAX_SLOTS {
            return Some(format!(
                "{} file(s) of slots_per_file={} is outside 1..={MAX_SLOTS} slots",
                self.num_files, self.slots_per_file
            ));
        }
        None
    }

    /// The first key written on more than one line, if any. `render` writes each key once, so
    /// a repeat (a line appended or duplicated) is damage, and which value was meant cannot be
    /// told: `parse` alone would silently take the first.
    fn repeated_key(text: &str) -> Option<&'static str> {
        const KEYS: [&str; 5] = ["format", "block_bytes", "slots_per_file", "num_files", "dir_id"];
        KEYS.into_iter().find(|name| {
            text.lines().filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with('='))).count() > 1
        })
    }

    /// Parse the metadata text; never evaluates anything, only integers by name.
    fn parse(text: &str) -> Option<Meta> {
        let get = |name: &str| -> Option<u64> {
            text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix('=')?.trim().parse().ok())
        };
        if get("format")? != u64::from(META_FORMAT) {
            return None;
        }
        Some(Meta {
            block_bytes: get("block_bytes")? as usize,
            slots_per_file: get("slots_per_file")? as usize,
            num_files: get("num_files")? as usize,
            dir_id: get("dir_id")?,
        })
    }

    /// The directory's metadata, None when it has none. Refuses (naming the file) one that is
    /// not a regular file, not in kvtier's format, or describes a geometry no tier writes: a
    /// tier opening the directory or a status scan would otherwise act on nonsense sizes.
    pub fn load(dir: &TierDir) -> KvResult<Option<Meta>> {
        let path = dir.join(META_NAME);
        let refuse = |detail: String| KvError::Io {
            op: "read",
            path: path.display().to_string(),
            detail: format!("{detail}; refusing to touch this directory"),
        };
        let mut file = match dir.open_file(META_NAME, libc::O_RDONLY) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) if e.raw_os_error().is_none() => return Err(refuse(e.to_string())),
            Err(e) => return Err(KvError::io("read", &path, &e)),
        };
        let mut text = String::new();
        file.read_to_string(&mut text).map_err(|e| KvError::io("read", &path, &e))?;
        let meta =
            Meta::parse(&text).ok_or_else(|| refuse("not a kvtier disk-tier metadata file (unknown format)".into()))?;
        if let Some(key) = Meta::repeated_key(&text) {
            return Err(refuse(format!("damaged metadata ({key}= is given more than once)")));
        }
        match meta.implausible() {
            Some(why) => Err(refuse(format!("damaged metadata ({why})"))),
            None => Ok(Some(meta)),
        }
    }

    /// Replace the metadata atomically: written to a temporary created afresh (O_EXCL, so a
    /// name planted there is never written through), synced, renamed over the old file (a link
    /// there is replaced, not followed), and the directory synced.
    pub fn store(&self, dir: &TierDir) -> KvResult<()> {
        let tmp = format!("{META_TMP_PREFIX}.{}", std::process::id());
        let dst = dir.join(META_NAME);
        let res = (|| -> std::io::Result<()> {
            // Ours alone to remove: only the lock holder writes metadata, and the pid is its own.
            match dir.unlink(&tmp) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            let mut f = dir.open_file(&tmp, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL)?;
            f.write_all(self.render().as_bytes())?;
            f.sync_all()?;
            dir.rename(&tmp, META_NAME)?;
            dir.sync()
        })();
        if let Err(e) = res {
            let _ = dir.unlink(&tmp);
            return Err(KvError::io("write", &dst, &e));
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirectMode {
    Auto,
    On,
    Off,
}

impl DirectMode {
    pub fn parse(s: &str) -> KvResult<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(DirectMode::Auto),
            "on" | "true" | "yes" => Ok(DirectMode::On),
            "off" | "false" | "no" => Ok(DirectMode::Off),
            other => Err(KvError::invalid("direct", format!("{other:?}: expected \"auto\", \"on\" or \"off\""))),
        }
    }
}

pub struct SlabFile {
    pub file: File,
    pub path: PathBuf,
    pub direct: bool,
    pub preallocated: bool,
}

impl FdOwner for SlabFile {
    fn raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

/// Why O_DIRECT was not used, if it was not (for stats).
pub struct SlabOpen {
    pub slab: SlabFile,
    /// This open created the file (it did not exist).
    pub created: bool,
    pub direct_refusal: Option<String>,
    pub prealloc_refusal: Option<String>,
}

/// What the filesystem says of a slab's space and does when asked for more: the real calls,
/// or (in tests) a filesystem that behaves like some FUSE ones, which report no blocks for any
/// file and refuse fallocate.
pub(super) struct SpaceOps {
    /// Bytes of disk blocks the file holds (`st_blocks` * 512).
    pub allocated: fn(&File) -> std::io::Result<u64>,
    /// fallocate(0, len).
    pub allocate: fn(&File, u64) -> std::io::Result<()>,
    /// Bytes an unprivileged writer may still allocate on the file's filesystem.
    pub free: fn(&File) -> std::io::Result<u64>,
}

const REAL_SPACE: SpaceOps = SpaceOps {
    allocated: |f| f.metadata().map(|m| m.blocks().saturating_mul(512)),
    allocate: |f, bytes| {
        // SAFETY: plain syscall on an fd the caller owns.
        let rc = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, bytes as libc::off_t) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    },
    free: free_bytes,
};

/// Give `file` its full `bytes` of disk blocks (None), or make it that long but sparse and say
/// why (Some). A full device then shows up as ENOSPC on writes, which the tier degrades on.
///
/// fallocate is only tried when the filesystem has room for the blocks the file still lacks:
/// on ext4 a fallocate that runs out of space keeps the blocks it allocated before failing, so
/// a tier larger than the free space took all of it at open and left other programs none. If
/// it fails anyway (another writer took the room meanwhile), a slab this open created (empty
/// by length) is cut back to nothing before it is made sparse, which frees those blocks. A
/// slab that existed keeps whatever it holds, whatever its block count says: some filesystems
/// (FUSE ones) report no blocks for any file, and cutting such a slab back lost the whole
/// tier's data at every reopen.
pub(super) fn preallocate(fs: &SpaceOps, file: &File, path: &Path, bytes: u64) -> KvResult<Option<String>> {
    let len = |file: &File| file.metadata().map(|m| m.len()).map_err(|e| KvError::io("stat slab", path, &e));
    let created = len(file)? == 0;
    let allocated = (fs.allocated)(file).map_err(|e| KvError::io("stat slab", path, &e))?;
    let missing = bytes.saturating_sub(allocated);
    let free = (fs.free)(file).map_err(|e| KvError::io("statvfs slab", path, &e))?;
    let refusal = if missing > free {
        Some(format!("{missing} bytes to allocate, {free} free on its filesystem"))
    } else {
        match (fs.allocate)(file, bytes) {
            Ok(()) => return Ok(None),
            Err(err) => {
                if created {
                    file.set_len(0).map_err(|e| KvError::io("size slab", path, &e))?;
                }
                Some(format!("fallocate: {err}"))
            }
        }
    };
    if len(file)? < bytes {
        file.set_len(bytes).map_err(|e| KvError::io("size slab", path, &e))?;
    }
    Ok(refusal)
}

/// Bytes an unprivileged writer may still allocate on `file`'s filesystem.
fn free_bytes(file: &File) -> std::io::Result<u64> {
    // SAFETY: statvfs is plain old data; fstatvfs fills it for an fd we own.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstatvfs(file.as_raw_fd(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

impl SlabFile {
    /// Open or create the slab `name` of `dir`, size it (fallocate, or a sparse file where the
    /// filesystem cannot preallocate or has too little free space) and pick direct or buffered
    /// I/O. Every step works on the descriptor: the name is resolved once, without following a
    /// link, and a file is only changed (mode, size) once it is known to be a regular file.
    pub fn open(dir: &TierDir, name: &str, bytes: u64, mode: DirectMode) -> KvResult<SlabOpen> {
        let path = dir.join(name);
        let (file, created) = match dir.open_file(name, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL) {
            Ok(f) => (f, true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                (dir.open_file(name, libc::O_RDWR).map_err(|e| KvError::io("open slab", &path, &e))?, false)
            }
            Err(e) => return Err(KvError::io("open slab", &path, &e)),
        };
        let fail = |e: KvError| {
            // A slab this open made is removed again: a refused open leaves nothing behind.
            if created {
                let _ = dir.unlink(name);
            }
            e
        };
        let st = fstat(&file).map_err(|e| fail(KvError::io("stat slab", &path, &e)))?;
        if st.st_mode & 0o777 != 0o600 {
            // SAFETY: plain syscall on our fd.
            if unsafe { libc::fchmod(file.as_raw_fd(), 0o600) } != 0 {
                return Err(fail(KvError::io("chmod slab", &path, &std::io::Error::last_os_error())));
            }
        }
        let prealloc_refusal = preallocate(&REAL_SPACE, &file, &path, bytes).map_err(fail)?;
        let mut direct_refusal = None;
        let mut slab = SlabFile { file, path, direct: false, preallocated: prealloc_refusal.is_none() };
        if mode != DirectMode::Off {
            match Self::reopen_direct(dir, name, &slab.file) {
                Ok(f) => {
                    slab.file = f;
                    slab.direct = true;
                }
                Err(why) if mode == DirectMode::Auto => direct_refusal = Some(why),
                Err(why) => {
                    let path = slab.path.display().to_string();
                    return Err(fail(KvError::Io { op: "open O_DIRECT", path, detail: why }));
                }
            }
        }
        Ok(SlabOpen { slab, created, direct_refusal, prealloc_refusal })
    }

    /// Open `name` again with O_DIRECT, check it is still the file `buffered` is, and prove
    /// O_DIRECT works with one aligned read (some filesystems accept the flag at open and
    /// refuse the I/O).
    fn reopen_direct(dir: &TierDir, name: &str, buffered: &File) -> Result<File, String> {
        let f = dir.open_file(name, libc::O_RDWR | libc::O_DIRECT).map_err(|e| format!("open: {e}"))?;
        if identity(&f).ok() != identity(buffered).ok() {
            return Err("the file was replaced while it was opened".into());
        }
        let buf = AlignedBuf::new(PAGE);
        // SAFETY: buf is PAGE bytes, PAGE aligned.
        let n = unsafe { libc::pread(f.as_raw_fd(), buf.ptr().cast(), PAGE, 0) };
        if n < 0 {
            return Err(format!("aligned read: {}", std::io::Error::last_os_error()));
        }
        Ok(f)
    }
}

/// A zeroed, page-aligned heap buffer (header pages, recovery scratch).
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}
// SAFETY: plain owned memory.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len.max(PAGE), PAGE).expect("valid layout");
        // SAFETY: non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, layout }
    }
    pub fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    pub fn len(&self) -> usize {
        self.layout.size()
    }
    pub fn is_empty(&self) -> bool {
        false
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: owned, initialised (zeroed) memory.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: owned, initialised memory, exclusive borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}
