//! Files as memory (NIXL's FILE memory): a registered file is a range of offsets that
//! storage transfers read and write.
//!
//! A registration holds its own handle on the file (a duplicate of the descriptor it
//! was given, or the one it opened), so closing or reusing the caller's descriptor
//! afterwards never redirects a transfer to another file: the registration keeps
//! naming the file it was made for. Descriptors of a file carry its device id
//! ([`MemKind::File`](crate::MemKind::File)): by NIXL's convention, the number of the descriptor it was
//! registered with.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, OFlags};

use crate::error::{err, Error, ErrorKind, Result};

/// Alignment O_DIRECT I/O needs on a file: memory addresses, file offsets and lengths
/// must be multiples of these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirectAlignment {
    /// Memory address alignment in bytes.
    pub memory: u32,
    /// File offset (and length) alignment in bytes.
    pub offset: u32,
}

/// A registered file: the agent's own handle on it and what it found at registration.
#[derive(Debug)]
pub struct FileHandle {
    fd: OwnedFd,
    device: u32,
    len: u64,
    readable: bool,
    writable: bool,
    direct: Option<DirectAlignment>,
    path: Option<PathBuf>,
    /// Flushes of this file that failed, and the lock they run under
    /// ([`FileHandle::flush_with`]).
    flush_failures: std::sync::atomic::AtomicU64,
    flushing: std::sync::Mutex<()>,
}

/// How [`Memory::open_file`](crate::Memory::open_file) opens a file.
#[derive(Clone, Debug)]
pub struct FileOptions {
    /// Open for writing too (WRITE transfers store into it). Default: true.
    pub write: bool,
    /// Create the file when it does not exist (needs `write`). Default: false.
    pub create: bool,
    /// Open with `O_DIRECT` (bypass the page cache; every transfer must then be
    /// aligned, see [`DirectAlignment`]). Default: false.
    pub direct: bool,
    /// Bytes to register: the file grows to this length when shorter (never shrinks).
    /// `None` (the default): the file's current length.
    pub len: Option<u64>,
    /// The device id FILE descriptors name this file by (NIXL's `devId` of a
    /// path-mode registration). `None` (the default): the number of the descriptor
    /// opened for it.
    pub device: Option<u32>,
}

impl Default for FileOptions {
    fn default() -> Self {
        Self {
            write: true,
            create: false,
            direct: false,
            len: None,
            device: None,
        }
    }
}

const OP: &str = "register file";

fn io_err(context: String, e: impl Into<std::io::Error>) -> Error {
    let e = e.into();
    let kind = match e.kind() {
        std::io::ErrorKind::NotFound => ErrorKind::NotFound,
        std::io::ErrorKind::PermissionDenied => ErrorKind::NotAllowed,
        _ => ErrorKind::Io,
    };
    Error::new(kind, OP, format!("{context}: {e}")).with_source(e)
}

impl FileHandle {
    /// Open `path` as `options` say and take the file for registration; descriptors
    /// name it by `options.device`, else by the number of the descriptor opened here
    /// ([`FileHandle::device`]).
    pub(crate) fn open(path: &Path, options: &FileOptions) -> Result<Self> {
        let mut flags = if options.write {
            OFlags::RDWR
        } else {
            OFlags::RDONLY
        } | OFlags::CLOEXEC;
        if options.create {
            if !options.write {
                return err(
                    ErrorKind::InvalidArgument,
                    OP,
                    format!("{}: creating a file needs write access", path.display()),
                );
            }
            flags |= OFlags::CREATE;
        }
        if options.direct {
            flags |= OFlags::DIRECT;
        }
        let fd = rustix::fs::open(path, flags, rustix::fs::Mode::from_raw_mode(0o644))
            .map_err(|e| io_err(format!("cannot open {}", path.display()), e))?;
        let device = options.device.unwrap_or(fd.as_raw_fd() as u32);
        Self::take(fd, device, options.len, Some(path.to_owned()))
    }

    /// Take a duplicate of `fd` for registration; descriptors name it by `fd`'s
    /// number. `len` 0: the file's current length; otherwise the file grows to `len`
    /// when shorter (it must then be open for writing).
    pub(crate) fn from_fd(fd: BorrowedFd<'_>, len: u64) -> Result<Self> {
        let device = fd.as_raw_fd() as u32;
        let own = fd
            .try_clone_to_owned()
            .map_err(|e| io_err(format!("file descriptor {device} cannot be used"), e))?;
        Self::take(own, device, (len > 0).then_some(len), None)
    }

    fn take(fd: OwnedFd, device: u32, len: Option<u64>, path: Option<PathBuf>) -> Result<Self> {
        let name = describe(device, path.as_deref());
        let st = rustix::fs::fstat(&fd).map_err(|e| io_err(format!("{name}: fstat"), e))?;
        let file_type = FileType::from_raw_mode(st.st_mode);
        let size = match file_type {
            FileType::RegularFile => st.st_size as u64,
            FileType::BlockDevice => block_device_size(st.st_rdev)
                .map_err(|e| io_err(format!("{name}: size of the block device"), e))?,
            other => {
                return err(
                    ErrorKind::InvalidArgument,
                    OP,
                    format!("{name} is a {other:?}, not a regular file or block device"),
                )
            }
        };
        let fl = rustix::fs::fcntl_getfl(&fd).map_err(|e| io_err(format!("{name}: fcntl"), e))?;
        if fl.contains(OFlags::APPEND) {
            // Linux writes an O_APPEND file at its end whatever the offset asked.
            return err(
                ErrorKind::InvalidArgument,
                OP,
                format!("{name} is open with O_APPEND: positional writes would land at its end; open it without O_APPEND"),
            );
        }
        let access = fl & OFlags::RWMODE;
        let readable = access == OFlags::RDONLY || access == OFlags::RDWR;
        let writable = access == OFlags::WRONLY || access == OFlags::RDWR;
        let direct = fl
            .contains(OFlags::DIRECT)
            .then(|| direct_alignment(fd.as_fd()));
        let len = match len {
            None | Some(0) if size == 0 => {
                return err(
                    ErrorKind::ZeroLength,
                    OP,
                    format!("{name} is empty: give the length to register (the file grows to it)"),
                )
            }
            None | Some(0) => size,
            Some(len) if len <= size => len,
            Some(len) => {
                if file_type != FileType::RegularFile || !writable {
                    return err(
                        ErrorKind::InvalidArgument,
                        OP,
                        format!(
                            "{name} holds {size} bytes, fewer than the {len} to register, and cannot grow ({})",
                            if writable { "a block device" } else { "not open for writing" }
                        ),
                    );
                }
                // Set the size now, so every byte of the registration exists: a READ
                // of a block never written reads zeros, never a short read.
                rustix::fs::ftruncate(&fd, len)
                    .map_err(|e| io_err(format!("{name}: growing it to {len} bytes"), e))?;
                len
            }
        };
        Ok(Self {
            fd,
            device,
            len,
            readable,
            writable,
            direct,
            path,
            flush_failures: std::sync::atomic::AtomicU64::new(0),
            flushing: std::sync::Mutex::new(()),
        })
    }

    /// The agent's own descriptor of the file (open for as long as the registration
    /// or a transfer uses it).
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The device id descriptors of this file carry.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// Registered length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the registered length is zero (never for a registration).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Open for reading (READ transfers load from it).
    pub fn readable(&self) -> bool {
        self.readable
    }

    /// Open for writing (WRITE transfers store into it).
    pub fn writable(&self) -> bool {
        self.writable
    }

    /// Opened with `O_DIRECT`: the alignment every transfer must keep, else `None`.
    pub fn direct(&self) -> Option<DirectAlignment> {
        self.direct
    }

    /// The path it was opened from, when registered by path.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The file's length now (it may have been truncated or grown since).
    ///
    /// # Errors
    /// The `fstat` error.
    pub fn current_len(&self) -> std::io::Result<u64> {
        let st = rustix::fs::fstat(&self.fd)?;
        if FileType::from_raw_mode(st.st_mode) == FileType::BlockDevice {
            return block_device_size(st.st_rdev);
        }
        Ok(st.st_size as u64)
    }

    /// Refuse a positional WRITE into this file if its descriptor was switched to
    /// `O_APPEND` after registration (it shares the caller's open file when
    /// registered by descriptor): Linux would write every block at the file's end
    /// and report success.
    ///
    /// # Errors
    /// [`ErrorKind::NotAllowed`] naming the file; [`ErrorKind::Io`] if its flags
    /// cannot be read.
    pub fn check_positional_writes(&self, op: &'static str) -> Result<()> {
        let fl = rustix::fs::fcntl_getfl(&self.fd).map_err(|e| {
            Error::new(ErrorKind::Io, op, format!("{}: fcntl", self.describe()))
                .with_source(std::io::Error::from(e))
        })?;
        if fl.contains(OFlags::APPEND) {
            return err(
                ErrorKind::NotAllowed,
                op,
                format!(
                    "{} was switched to O_APPEND after it was registered: positional writes would land at its end",
                    self.describe()
                ),
            );
        }
        Ok(())
    }

    /// How many flushes of this file (`fsync`, `fdatasync`) failed so far, through
    /// [`FileHandle::flush_with`] or [`FileHandle::flush_failed`].
    ///
    /// Linux reports a failed writeback to one flush of the open file only (the
    /// first after the error), whichever transfer's pages failed; a later flush
    /// returns success although those pages are lost. So a transfer that must be
    /// durable notes this count before its data is written and, after its own flush
    /// succeeded, fails all the same if the count moved meanwhile.
    pub fn flush_failures(&self) -> u64 {
        self.flush_failures
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Count a failed flush of this file (one whose result arrived elsewhere, such
    /// as an io_uring completion, processed in completion order).
    pub fn flush_failed(&self) {
        self.flush_failures
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    /// Run a blocking flush of this file, one at a time, counting its failure
    /// before the next flush can return: a flush that follows a failed one sees the
    /// count moved ([`FileHandle::flush_failures`]).
    ///
    /// # Errors
    /// What `flush` returned.
    pub fn flush_with(
        &self,
        flush: impl FnOnce(BorrowedFd<'_>) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let _one = self.flushing.lock().unwrap_or_else(|p| p.into_inner());
        let r = flush(self.fd.as_fd());
        if r.is_err() {
            self.flush_failed();
        }
        r
    }

    /// How errors name this file: its path, or its descriptor number.
    pub fn describe(&self) -> String {
        describe(self.device, self.path.as_deref())
    }
}

fn describe(device: u32, path: Option<&Path>) -> String {
    match path {
        Some(p) => format!("file {} (fd {device})", p.display()),
        None => format!("file fd {device}"),
    }
}

/// The alignment O_DIRECT needs on the file behind `fd`: from `statx`'s DIO
/// alignment where the kernel reports it (Linux 6.1+), else 4096 (a page, which every
/// device's logical block divides).
fn direct_alignment(fd: BorrowedFd<'_>) -> DirectAlignment {
    const FALLBACK: DirectAlignment = DirectAlignment {
        memory: 4096,
        offset: 4096,
    };
    match rustix::fs::statx(
        fd,
        "",
        rustix::fs::AtFlags::EMPTY_PATH,
        rustix::fs::StatxFlags::DIOALIGN,
    ) {
        Ok(s)
            if s.stx_mask & rustix::fs::StatxFlags::DIOALIGN.bits() != 0
                && s.stx_dio_offset_align != 0 =>
        {
            DirectAlignment {
                memory: s.stx_dio_mem_align.max(1),
                offset: s.stx_dio_offset_align,
            }
        }
        _ => FALLBACK,
    }
}

/// A block device's size, from sysfs (in 512-byte sectors).
fn block_device_size(rdev: u64) -> std::io::Result<u64> {
    let (major, minor) = (rustix::fs::major(rdev), rustix::fs::minor(rdev));
    let s = std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/size"))?;
    s.trim()
        .parse::<u64>()
        .map(|sectors| sectors * 512)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// What [`query`] finds at a path: whether a file is there, and its length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileInfo {
    /// Length in bytes.
    pub len: u64,
    /// A regular file (else a block device).
    pub regular: bool,
}

/// Whether `path` names a regular file or block device, and its length (NIXL's
/// `queryMem` for files): `Ok(None)` when nothing is there.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] for something other than a file or block device;
/// the error of `stat` other than "not found" ([`ErrorKind::NotAllowed`] for
/// permissions, [`ErrorKind::Io`] else).
pub fn query(path: impl AsRef<Path>) -> Result<Option<FileInfo>> {
    let path = path.as_ref();
    let st = match rustix::fs::stat(path) {
        Ok(st) => st,
        Err(rustix::io::Errno::NOENT) => return Ok(None),
        Err(e) => return Err(io_err(format!("cannot stat {}", path.display()), e)),
    };
    match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => Ok(Some(FileInfo {
            len: st.st_size as u64,
            regular: true,
        })),
        FileType::BlockDevice => Ok(Some(FileInfo {
            len: block_device_size(st.st_rdev)
                .map_err(|e| io_err(format!("size of {}", path.display()), e))?,
            regular: false,
        })),
        other => err(
            ErrorKind::InvalidArgument,
            "query file",
            format!("{} is a {other:?}, not a file", path.display()),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nixl_testkit::TempDir;
    use std::io::Write;

    fn temp(bytes: usize) -> (TempDir, PathBuf) {
        let d = TempDir::new("nixl-file-test");
        let p = d.file("f");
        std::fs::File::create(&p)
            .unwrap()
            .write_all(&vec![7u8; bytes])
            .unwrap();
        (d, p)
    }

    #[test]
    fn a_failed_flush_is_counted_for_the_flushes_after_it() {
        let (_d, p) = temp(4096);
        let f = std::fs::File::open(&p).unwrap();
        let h = std::sync::Arc::new(FileHandle::from_fd(f.as_fd(), 0).unwrap());
        assert_eq!(h.flush_failures(), 0);
        // The one flush Linux tells of a lost write: counted before it returns.
        let eio = h.flush_with(|_| Err(std::io::Error::from_raw_os_error(libc::EIO)));
        assert_eq!(eio.unwrap_err().raw_os_error(), Some(libc::EIO));
        assert_eq!(h.flush_failures(), 1);
        h.flush_with(|fd| rustix::fs::fsync(fd).map_err(Into::into))
            .unwrap();
        assert_eq!(h.flush_failures(), 1, "a success does not reset the count");
        h.flush_failed();
        assert_eq!(h.flush_failures(), 2);
        // One flush at a time: a second waits for the first to return and count.
        let (started, release) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
        std::thread::scope(|s| {
            s.spawn(|| {
                h.flush_with(|_| {
                    started.wait();
                    release.wait();
                    Err(std::io::Error::from_raw_os_error(libc::EIO))
                })
            });
            started.wait();
            let second = s.spawn(|| h.flush_with(|_| Ok(())).map(|()| h.flush_failures()));
            std::thread::sleep(std::time::Duration::from_millis(50));
            release.wait();
            assert_eq!(
                second.join().unwrap().unwrap(),
                3,
                "ran after the failure counted"
            );
        });
    }

    #[test]
    fn a_registration_takes_its_own_handle_and_the_files_length() {
        let (_d, p) = temp(10_000);
        let f = std::fs::File::open(&p).unwrap();
        let h = FileHandle::from_fd(f.as_fd(), 0).unwrap();
        assert_eq!(h.len(), 10_000);
        assert_eq!(h.device(), f.as_raw_fd() as u32);
        assert!(h.readable() && !h.writable() && h.direct().is_none());
        drop(f);
        assert_eq!(
            h.current_len().unwrap(),
            10_000,
            "still open after the caller closed its fd"
        );
    }

    #[test]
    fn append_only_descriptors_are_refused() {
        let (_d, p) = temp(4096);
        let f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
        let e = FileHandle::from_fd(f.as_fd(), 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.to_string().contains("O_APPEND"), "{e}");
    }

    #[test]
    fn a_shorter_file_grows_only_when_writable() {
        let (_d, p) = temp(100);
        let ro = std::fs::File::open(&p).unwrap();
        let e = FileHandle::from_fd(ro.as_fd(), 4096).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.to_string().contains("cannot grow"), "{e}");
        let rw = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        let h = FileHandle::from_fd(rw.as_fd(), 4096).unwrap();
        assert_eq!(h.len(), 4096);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 4096);
        // Never shrinks.
        let h = FileHandle::from_fd(rw.as_fd(), 10).unwrap();
        assert_eq!(h.len(), 10);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 4096);
    }

    #[test]
    fn empty_files_pipes_and_missing_paths_are_refused_clearly() {
        let (d, p) = temp(0);
        let e = FileHandle::open(&p, &FileOptions::default()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ZeroLength);
        let e = FileHandle::open(&d.path.join("missing"), &FileOptions::default()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert!(e.to_string().contains("missing"), "{e}");
        let (r, _w) = rustix::pipe::pipe().unwrap();
        let e = FileHandle::from_fd(r.as_fd(), 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let created = FileHandle::open(
            &d.path.join("new"),
            &FileOptions {
                create: true,
                len: Some(1 << 20),
                ..FileOptions::default()
            },
        )
        .unwrap();
        assert_eq!(created.len(), 1 << 20);
        assert_eq!(query(d.path.join("new")).unwrap().unwrap().len, 1 << 20);
        assert_eq!(query(d.path.join("none")).unwrap(), None);
        assert_eq!(
            query(&d.path).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }

    #[test]
    fn a_path_registration_is_named_by_the_device_asked_for() {
        let (_d, p) = temp(4096);
        let h = FileHandle::open(
            &p,
            &FileOptions {
                device: Some(77_777),
                ..FileOptions::default()
            },
        )
        .unwrap();
        assert_eq!(h.device(), 77_777);
        let own = FileHandle::open(&p, &FileOptions::default()).unwrap();
        assert_ne!(own.device(), 77_777, "without one: the descriptor's number");
    }
}
