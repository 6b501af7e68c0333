//! The tier's directory, held open by a file descriptor.
//!
//! Every file of the tier is reached relative to that descriptor (`openat`, `renameat`,
//! `unlinkat`) and never through a symbolic link (`O_NOFOLLOW`): a tier often runs as root, and
//! a link planted in its directory would otherwise make it truncate, extend, chmod or overwrite
//! whatever the link names. Working on the descriptor also pins the directory itself: if it is
//! deleted (or renamed) and another one made at its path, the tier keeps to the inode it locked
//! and creates nothing in the new one (creating a file in a deleted directory fails, ENOENT).
//!
//! Only the configured path is resolved like any path (it may be a link an operator made, e.g.
//! to a mount); the directory it names must belong to the effective user and not be writable by
//! group or others, or the names inside it could be replaced by someone else.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::error::{KvError, KvResult};

pub struct TierDir {
    fd: File,
    path: PathBuf,
}

fn cname(name: &str) -> io::Result<CString> {
    // Names are the tier's own fixed ones; a separator or NUL would be a bug.
    if name.is_empty() || name.contains('/') {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// fstat on an open descriptor.
pub fn fstat(f: &File) -> io::Result<libc::stat> {
    // SAFETY: stat is plain old data, filled by fstat on an fd we own.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    check(unsafe { libc::fstat(f.as_raw_fd(), &mut st) })?;
    Ok(st)
}

impl TierDir {
    /// Open `path` as a directory, read-only and without checking whose it is (`kvtier status`).
    pub fn open(path: &Path) -> KvResult<TierDir> {
        let c =
            CString::new(path.as_os_str().as_bytes()).map_err(|_| KvError::invalid("path", "contains a NUL byte"))?;
        // SAFETY: plain syscall; the fd is owned by the File from here on.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) };
        let fd = check(fd).map_err(|e| match e.raw_os_error() {
            Some(libc::ENOTDIR) => {
                KvError::Io { op: "open", path: path.display().to_string(), detail: "not a directory".into() }
            }
            _ => KvError::io("open", path, &e),
        })?;
        // SAFETY: fd was just opened and is owned by nobody else.
        Ok(TierDir { fd: unsafe { File::from_raw_fd(fd) }, path: path.to_path_buf() })
    }

    /// Create `path` (0700, with its parents) if it is missing, open it, and refuse it unless
    /// the effective user owns it and neither group nor others may write it. Changes nothing in
    /// an existing directory: its mode is tightened by `tighten`, once the lock is held.
    pub fn prepare(path: &Path) -> KvResult<TierDir> {
        if let Err(e) = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(path) {
            // recursive(true) succeeds on an existing directory; this is a real failure, or a
            // file in the way (reported as "not a directory" by open below).
            if e.kind() != io::ErrorKind::AlreadyExists {
                return Err(KvError::io("create directory", path, &e));
            }
        }
        let dir = TierDir::open(path)?;
        let st = fstat(&dir.fd).map_err(|e| KvError::io("stat", path, &e))?;
        // SAFETY: no arguments, cannot fail.
        let euid = unsafe { libc::geteuid() };
        let refuse = |detail: String| KvError::Io {
            op: "refusing disk tier directory",
            path: path.display().to_string(),
            detail,
        };
        if st.st_uid != euid {
            return Err(refuse(format!(
                "owned by uid {}, not the effective user {euid}: chown it to uid {euid} or choose another directory",
                st.st_uid
            )));
        }
        if st.st_mode & 0o022 != 0 {
            return Err(refuse(format!(
                "writable by group or others (mode {:o}), who could replace its files: chmod 700 it or choose \
                 another directory",
                st.st_mode & 0o7777
            )));
        }
        Ok(dir)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path of `name` in the directory, for messages.
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// Make the directory 0700 (the tier's files are nobody else's business); only the lock
    /// holder calls it, so a refused opener changes nothing.
    pub fn tighten(&self) {
        if let Ok(st) = fstat(&self.fd) {
            if st.st_mode & 0o777 != 0o700 {
                // SAFETY: plain syscall on our fd.
                unsafe { libc::fchmod(self.fd.as_raw_fd(), 0o700) };
            }
        }
    }

    /// True once the directory was deleted (its fd then names an inode with no links).
    pub fn is_removed(&self) -> bool {
        fstat(&self.fd).is_ok_and(|st| st.st_nlink == 0)
    }

    /// A second, independent descriptor of the same directory (for its flock, released when
    /// the lock is dropped whatever else still holds this one).
    pub fn reopen(&self) -> io::Result<File> {
        let dot = cname(".")?;
        // SAFETY: plain syscall; the fd is owned by the File from here on.
        let fd = check(unsafe {
            libc::openat(self.fd.as_raw_fd(), dot.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC)
        })?;
        // SAFETY: fd was just opened and is owned by nobody else.
        Ok(unsafe { File::from_raw_fd(fd) })
    }

    /// Open the regular file `name` in the directory with `flags` (O_RDONLY, O_RDWR, O_CREAT,
    /// O_EXCL, O_DIRECT...), never following a link (O_NOFOLLOW: a link is ELOOP, reported as
    /// such) and refusing anything but a regular file before using it (O_NONBLOCK for the open
    /// alone, so a FIFO put in its place does not block it). Created files are 0600.
    pub fn open_file(&self, name: &str, flags: libc::c_int) -> io::Result<File> {
        let c = cname(name)?;
        let all = flags | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK;
        // SAFETY: plain syscall; the fd is owned by the File from here on.
        let fd = unsafe { libc::openat(self.fd.as_raw_fd(), c.as_ptr(), all, 0o600 as libc::c_uint) };
        let fd = check(fd).map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => {
                io::Error::other("is a symbolic link, which the tier never follows: remove it (and check who made it)")
            }
            _ => e,
        })?;
        // SAFETY: fd was just opened and is owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        let st = fstat(&file)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(io::Error::other("not a regular file; refusing to use it: remove it"));
        }
        // Back to blocking I/O (io_uring would otherwise answer EAGAIN instead of waiting).
        // SAFETY: plain fcntl on our fd.
        let fl = check(unsafe { libc::fcntl(fd, libc::F_GETFL) })?;
        check(unsafe { libc::fcntl(fd, libc::F_SETFL, fl & !libc::O_NONBLOCK) })?;
        Ok(file)
    }

    pub fn unlink(&self, name: &str) -> io::Result<()> {
        let c = cname(name)?;
        // SAFETY: plain syscall relative to our fd.
        check(unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), 0) }).map(drop)
    }

    /// Rename `from` over `to`; a link at `to` is replaced, not followed.
    pub fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let (f, t) = (cname(from)?, cname(to)?);
        let fd = self.fd.as_raw_fd();
        // SAFETY: plain syscall relative to our fd.
        check(unsafe { libc::renameat(fd, f.as_ptr(), fd, t.as_ptr()) }).map(drop)
    }

    pub fn sync(&self) -> io::Result<()> {
        self.fd.sync_all()
    }

    /// The names in the directory (not "." and ".."), read through the descriptor.
    pub fn names(&self) -> io::Result<Vec<String>> {
        let dup = self.reopen()?;
        // SAFETY: fdopendir takes ownership of the fd on success (closedir closes it).
        let dirp = unsafe { libc::fdopendir(dup.as_raw_fd()) };
        if dirp.is_null() {
            return Err(io::Error::last_os_error());
        }
        std::mem::forget(dup);
        let mut out = Vec::new();
        loop {
            // SAFETY: dirp is a valid DIR* until closedir; each entry is valid until the next call.
            let ent = unsafe { libc::readdir(dirp) };
            if ent.is_null() {
                break;
            }
            let name = unsafe { std::ffi::CStr::from_ptr((*ent).d_name.as_ptr()) }.to_string_lossy().into_owned();
            if name != "." && name != ".." {
                out.push(name);
            }
        }
        // SAFETY: dirp came from fdopendir and is closed once.
        unsafe { libc::closedir(dirp) };
        Ok(out)
    }
}

/// (device, inode) of an open file: the identity of what a name pointed at when it was opened.
pub fn identity(f: &File) -> io::Result<(u64, u64)> {
    let m = f.metadata()?;
    Ok((m.dev(), m.ino()))
}
