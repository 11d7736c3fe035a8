//! The same-host primitives: shared memory (memfd), the grant table, cross-memory
//! attach. This is the crate's one module with `unsafe` code; everything else reaches
//! memory through [`RegionSlice`]'s safe methods and the functions here.
//!
//! Invariants the `unsafe` blocks rely on:
//! - a [`Mapping`] owns a live `mmap` of `len` bytes until it is dropped;
//! - a [`RegionSlice`] is live host memory while the value lives (the core's
//!   guarantee), so its address range may be handed to the kernel or copied raw;
//! - the grant table is only ever accessed through atomics, by both processes.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use nixl::{MemKind, RegionSlice};

/// The kernel's boot id: two processes with the same one run on the same kernel.
pub(crate) fn boot_id() -> Option<String> {
    let s = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let s = s.trim();
    (!s.is_empty() && s.chars().all(|c| c.is_ascii_hexdigit() || c == '-')).then(|| s.to_owned())
}

/// A shared, read-write mapping of a file, unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a mapping is an address range; all access goes through raw copies and
// atomics, which are fine from any thread.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Map `len` bytes of `fd` shared, for reads and writes.
    fn map(fd: BorrowedFd<'_>, len: usize) -> io::Result<Self> {
        if len == 0 {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        // SAFETY: a fresh mapping chosen by the kernel (null hint); it aliases no Rust
        // object. The result is checked before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(Self { ptr, len })
    }

    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The 4-byte word at `offset` as an atomic (a futex word).
    fn word32(&self, offset: usize) -> &AtomicU32 {
        assert!(
            offset % 4 == 0 && offset + 4 <= self.len,
            "word {offset} outside the mapping"
        );
        // SAFETY: in range and 4-aligned (mmap is page-aligned), live while `self` is
        // borrowed; every access to it, in both processes, is atomic.
        unsafe { AtomicU32::from_ptr(self.ptr.as_ptr().add(offset).cast::<u32>()) }
    }

    /// The 8-byte word at `offset` as an atomic.
    fn word(&self, offset: usize) -> &AtomicU64 {
        assert!(
            offset % 8 == 0 && offset + 8 <= self.len,
            "word {offset} outside the mapping"
        );
        // SAFETY: in range and 8-aligned (mmap is page-aligned), live while `self` is
        // borrowed; every access to the table, in both processes, is atomic.
        unsafe { AtomicU64::from_ptr(self.ptr.as_ptr().add(offset).cast::<u64>()) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map` mapped; nothing refers to it any more (every
        // borrow of `self` has ended).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// Prefix of every memfd name this crate creates, as `/proc/<pid>/fd/<fd>` shows it
/// (`/memfd:<name> (deleted)`); an initiator maps nothing else.
const MEMFD_LINK_PREFIX: &str = "/memfd:nixl-tcp";

/// Seals on every memfd this crate creates: its size is fixed (a peer that shrank it
/// would make the other side's mapping fault with SIGBUS), and so are the seals.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// An anonymous shared-memory file (`memfd_create`) of at least `len` bytes, mapped,
/// its size sealed ([`SEALS`]).
#[derive(Debug)]
pub(crate) struct Memfd {
    map: Mapping,
    fd: OwnedFd,
}

impl Memfd {
    /// `name` must start with `nixl-tcp` (peers map only such memfds).
    pub(crate) fn new(name: &std::ffi::CStr, len: usize) -> io::Result<Self> {
        debug_assert!(name.to_bytes().starts_with(b"nixl-tcp"));
        let page = page_size();
        let len = len
            .checked_add(page - 1)
            .map(|l| l / page * page)
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: plain system call with a NUL-terminated name.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a new descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        File::from(fd.try_clone()?).set_len(len as u64)?;
        // SAFETY: fcntl on a descriptor we own, with an integer argument.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } < 0 {
            return Err(io::Error::last_os_error());
        }
        let map = Mapping::map(fd.as_fd(), len)?;
        Ok(Self { map, fd })
    }

    pub(crate) fn mapping(&self) -> &Mapping {
        &self.map
    }

    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Wrap as memory the agent can register: the mapping stays alive (and the
    /// descriptor open) until the agent lets go of the memory; `on_drop` runs then.
    pub(crate) fn into_memory(
        self,
        len: usize,
        on_drop: impl FnOnce() + Send + Sync + 'static,
    ) -> nixl::Result<nixl::Memory> {
        struct Owner<F: FnOnce()> {
            _memfd: Memfd,
            on_drop: Option<F>,
        }
        impl<F: FnOnce()> Drop for Owner<F> {
            fn drop(&mut self) {
                if let Some(f) = self.on_drop.take() {
                    f();
                }
            }
        }
        // The closure is FnOnce + Send + Sync, and so is Memfd.
        let ptr = self.map.ptr.as_ptr();
        let owner = Owner {
            _memfd: self,
            on_drop: Some(on_drop),
        };
        // SAFETY: `ptr..ptr+len` lies in the mapping (len <= the rounded length), which
        // `owner` keeps mapped until the memory is dropped.
        unsafe { nixl::Memory::from_raw_parts_with_owner(ptr, len, MemKind::Dram, Some(owner)) }
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// The seals on `fd` (`F_GET_SEALS`); an error for a file that is not a memfd.
fn seals(fd: BorrowedFd<'_>) -> io::Result<libc::c_int> {
    // SAFETY: fcntl on a live descriptor, no argument.
    let s = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if s < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(s)
    }
}

fn refused(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

/// Whether `link` (a `/proc/<pid>/fd/<fd>` target) names a memfd of this crate.
fn is_our_memfd(link: &std::path::Path) -> bool {
    link.to_str()
        .is_some_and(|l| l.starts_with(MEMFD_LINK_PREFIX))
}

/// Open another process's memfd through `/proc`, for reads and writes, after checking
/// what the network named: process `pid` runs as our user and its descriptor `fd` is
/// a memfd of this crate; once open, that the file is such a memfd, sealed against
/// shrinking ([`SEALS`]), and at least `len` bytes long. So a mapping of `len` bytes
/// of it can never fault (SIGBUS) however the other process treats the file, and no
/// other file of that process (or of another user) is ever opened. The kernel allows
/// the open only where this process may inspect the other (same user, or privileges).
pub(crate) fn open_peer_memfd(pid: u32, fd: i32, len: usize) -> io::Result<File> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    if pid == 0 || fd < 0 {
        return Err(refused(format!("no such descriptor: pid {pid}, fd {fd}")));
    }
    let me = std::fs::metadata("/proc/self")?.uid();
    let owner = std::fs::metadata(format!("/proc/{pid}"))?.uid();
    if owner != me {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("process {pid} runs as user {owner}, not as this process's {me}"),
        ));
    }
    let path = format!("/proc/{pid}/fd/{fd}");
    let link = std::fs::read_link(&path)?;
    if !is_our_memfd(&link) {
        return Err(refused(format!(
            "descriptor {fd} of process {pid} is {link:?}, not a nixl-tcp memfd"
        )));
    }
    // No controlling terminal, no blocking open, whatever the descriptor became since.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK)
        .open(&path)?;
    // What was opened, not what the link said a moment before.
    let opened = std::fs::read_link(format!("/proc/self/fd/{}", f.as_raw_fd()))?;
    if !is_our_memfd(&opened) {
        return Err(refused(format!(
            "descriptor {fd} of process {pid} became {opened:?}, not a nixl-tcp memfd"
        )));
    }
    let sealed = seals(f.as_fd()).map_err(|e| {
        refused(format!(
            "descriptor {fd} of process {pid} has no seals ({e})"
        ))
    })?;
    if sealed & libc::F_SEAL_SHRINK == 0 {
        return Err(refused(format!(
            "the memfd of process {pid} is not sealed against shrinking; mapping it could fault"
        )));
    }
    if f.metadata()?.len() < len as u64 {
        return Err(refused(
            "the peer's shared memory is shorter than its grant".to_owned(),
        ));
    }
    Ok(f)
}

/// Map `len` bytes of the peer's memfd `fd` (checked by [`open_peer_memfd`]).
pub(crate) fn map_peer(pid: u32, fd: i32, len: usize) -> io::Result<Mapping> {
    let f = open_peer_memfd(pid, fd, len)?;
    Mapping::map(f.as_fd(), len)
}

/// Slots of one grant table: how many registrations one agent can grant.
pub(crate) const SLOTS: u32 = 16384;
const HEADER: usize = 64;
const SLOT_LEN: usize = 128;
/// Header words: the nonce at 0 and 8, the closed flag at 16, the withdrawal epoch
/// (a futex word) at 24.
const CLOSED_AT: usize = 16;
const EPOCH_AT: usize = 24;
/// Slot word 5 (GPU memory): bit 63 set for GPU memory, bit 62 when an inter-process
/// handle follows, the device in the low 32 bits.
const GPU: u64 = 1 << 63;
const HAS_HANDLE: u64 = 1 << 62;
/// Where a slot's inter-process handle starts (8 words).
const HANDLE_AT: usize = 64;
/// Bytes of a grant table.
pub(crate) const TABLE_LEN: usize = HEADER + SLOTS as usize * SLOT_LEN;
pub(crate) const NONCE_LEN: usize = 16;
const VALID: u64 = 1 << 63;
const COUNT: u64 = VALID - 1;

/// One grant: a registration the target lets a same-host initiator touch directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Grant {
    pub(crate) key: u64,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    /// The target's memfd holding the registration (mapped at offset 0), if any.
    pub(crate) memfd: Option<i32>,
    /// GPU memory: the device, and how other processes open it.
    pub(crate) gpu: Option<GpuGrant>,
}

/// A granted registration in GPU memory.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct GpuGrant {
    pub(crate) device: u32,
    /// The inter-process handle of the allocation holding it and the allocation's
    /// start in the target; `None` where the driver gave none (then only an initiator
    /// in the target's own process can use the grant).
    pub(crate) export: Option<([u8; nixl::gpu::IPC_HANDLE_LEN], u64)>,
}

impl std::fmt::Debug for GpuGrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The handle is a capability: never in logs.
        f.debug_struct("GpuGrant")
            .field("device", &self.device)
            .field("exported", &self.export.is_some())
            .finish()
    }
}

/// A grant table: a page-aligned array of slots in shared memory that the target
/// writes and same-host initiators check before every direct access.
///
/// Slot (128 bytes): `state` (bit 63: valid; low bits: accesses in progress), key,
/// addr, len, memfd + 1 (0: none), GPU word (see [`GPU`]), the GPU allocation's base,
/// a spare word, and 64 bytes of inter-process handle. An initiator increments
/// `state` before touching the registration and decrements it after; the target
/// withdraws a grant by clearing the valid bit and then waits (its caller does) for
/// the count to drain, so once it has drained no initiator is touching the memory,
/// and none will. For GPU memory an initiator also counts each mapping it keeps open
/// (CUDA forbids freeing exported memory another process still has open), and the
/// target bumps the header's withdrawal epoch and wakes its futex after every
/// withdrawal, so an initiator's watcher closes mappings of withdrawn grants at once.
///
/// An initiator holds a shared `flock` on the table for as long as it has it mapped
/// (through its own open of the file, so the lock is its own), and the kernel drops
/// that lock when the process dies. A count that is up while nobody holds the lock
/// can therefore never come down: its initiator is gone ([`Table::peer_holds`]).
#[derive(Debug)]
pub(crate) struct Table {
    map: Mapping,
    /// The target's own memfd (its side only).
    fd: Option<OwnedFd>,
    /// The initiator's open of the target's memfd, locked shared (its side only).
    _lock: Option<File>,
}

impl Table {
    /// A new, empty table (target side), stamped with `nonce`.
    pub(crate) fn create(nonce: &[u8; NONCE_LEN]) -> io::Result<Self> {
        let memfd = Memfd::new(c"nixl-tcp-grants", TABLE_LEN)?;
        let Memfd { map, fd } = memfd;
        let t = Self {
            map,
            fd: Some(fd),
            _lock: None,
        };
        let (a, b) = nonce.split_at(8);
        t.map.word(0).store(
            u64::from_le_bytes(a.try_into().expect("8")),
            Ordering::Relaxed,
        );
        t.map.word(8).store(
            u64::from_le_bytes(b.try_into().expect("8")),
            Ordering::Release,
        );
        Ok(t)
    }

    /// Map the target's table (initiator side), lock it shared for as long as it is
    /// mapped, and check it carries `nonce`.
    pub(crate) fn open(pid: u32, fd: i32, nonce: &[u8; NONCE_LEN]) -> io::Result<Self> {
        let f = open_peer_memfd(pid, fd, TABLE_LEN)?;
        // Before any access: a count of ours is only ever up while the lock is held.
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } < 0 {
            return Err(io::Error::last_os_error());
        }
        let map = Mapping::map(f.as_fd(), TABLE_LEN)?;
        let t = Self {
            map,
            fd: None,
            _lock: Some(f),
        };
        if t.nonce() != *nonce {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the table found through /proc is not the peer's (another process or pid namespace)",
            ));
        }
        Ok(t)
    }

    fn nonce(&self) -> [u8; NONCE_LEN] {
        let mut n = [0u8; NONCE_LEN];
        n[..8].copy_from_slice(&self.map.word(0).load(Ordering::Acquire).to_le_bytes());
        n[8..].copy_from_slice(&self.map.word(8).load(Ordering::Acquire).to_le_bytes());
        n
    }

    /// The target's descriptor number for the table.
    pub(crate) fn raw_fd(&self) -> Option<RawFd> {
        self.fd.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// Where the table is mapped in this process.
    pub(crate) fn addr(&self) -> u64 {
        self.map.addr()
    }

    fn words(&self, slot: u32) -> Option<[&AtomicU64; 7]> {
        if slot >= SLOTS {
            return None;
        }
        let at = HEADER + slot as usize * SLOT_LEN;
        Some([0, 8, 16, 24, 32, 40, 48].map(|o| self.map.word(at + o)))
    }

    /// The 8 words of a slot's inter-process handle.
    fn handle_words(&self, slot: u32) -> [&AtomicU64; 8] {
        let at = HEADER + slot as usize * SLOT_LEN + HANDLE_AT;
        [0, 8, 16, 24, 32, 40, 48, 56].map(|o| self.map.word(at + o))
    }

    /// Publish `g` in `slot` (target side). The slot must be free (never granted, or
    /// withdrawn) and [`idle`](Self::idle); false (nothing published) if it is not.
    pub(crate) fn grant(&self, slot: u32, g: Grant) -> bool {
        let Some([state, key, addr, len, memfd, gpu, base]) = self.words(slot) else {
            return false;
        };
        if state.load(Ordering::Acquire) != 0 {
            return false;
        }
        key.store(g.key, Ordering::Relaxed);
        addr.store(g.addr, Ordering::Relaxed);
        len.store(g.len, Ordering::Relaxed);
        memfd.store(g.memfd.map_or(0, |fd| fd as u64 + 1), Ordering::Relaxed);
        let (word, at) = match g.gpu {
            None => (0, 0),
            Some(GpuGrant { device, export }) => {
                let mut word = GPU | u64::from(device);
                let mut at = 0;
                if let Some((handle, b)) = export {
                    word |= HAS_HANDLE;
                    at = b;
                    for (w, chunk) in self.handle_words(slot).iter().zip(handle.chunks(8)) {
                        w.store(
                            u64::from_le_bytes(chunk.try_into().expect("8 bytes")),
                            Ordering::Relaxed,
                        );
                    }
                }
                (word, at)
            }
        };
        gpu.store(word, Ordering::Relaxed);
        base.store(at, Ordering::Relaxed);
        state.fetch_or(VALID, Ordering::Release);
        true
    }

    /// Withdraw `slot` (target side): no new access starts. Accesses in progress end
    /// when [`idle`](Self::idle) says so.
    pub(crate) fn withdraw(&self, slot: u32) {
        if let Some([state, ..]) = self.words(slot) {
            state.fetch_and(!VALID, Ordering::AcqRel);
        }
        self.bump_epoch();
    }

    /// Tell watchers a grant was withdrawn: bump the epoch and wake its futex.
    fn bump_epoch(&self) {
        let epoch = self.map.word32(EPOCH_AT);
        epoch.fetch_add(1, Ordering::AcqRel);
        futex_wake(epoch);
    }

    /// The withdrawal epoch (initiator side: what a watcher has seen).
    pub(crate) fn epoch(&self) -> u32 {
        self.map.word32(EPOCH_AT).load(Ordering::Acquire)
    }

    /// Sleep until the withdrawal epoch moves on from `seen` (returns at once if it
    /// already has; may return early, callers recheck), or `timeout` passes.
    pub(crate) fn wait_epoch(&self, seen: u32, timeout: std::time::Duration) {
        futex_wait(self.map.word32(EPOCH_AT), seen, timeout);
    }

    /// Wake every watcher of this table (initiator side: its own, to stop it). The
    /// epoch moves too, so a watcher between reading it and sleeping does not sleep
    /// (others only look again).
    pub(crate) fn wake_watchers(&self) {
        self.bump_epoch();
    }

    /// No access to `slot` is in progress (out of range: none can be).
    pub(crate) fn idle(&self, slot: u32) -> bool {
        self.words(slot)
            .is_none_or(|[state, ..]| state.load(Ordering::Acquire) & COUNT == 0)
    }

    /// Start an access to `slot` (initiator side): `None` when the slot is out of
    /// range or not granted. The access lasts until the guard drops.
    pub(crate) fn acquire(&self, slot: u32) -> Option<(Access<'_>, Grant)> {
        let [state, ..] = self.words(slot)?;
        let before = state.fetch_add(1, Ordering::Acquire);
        let access = Access { state };
        if before & VALID == 0 {
            return None;
        }
        Some((access, self.read_grant(slot)))
    }

    /// Count an access to `slot` whether or not it is granted (tests: an initiator
    /// caught between looking at a free slot and leaving it).
    #[cfg(test)]
    pub(crate) fn hold(&self, slot: u32) -> Access<'_> {
        let [state, ..] = self.words(slot).expect("in range");
        state.fetch_add(1, Ordering::Acquire);
        Access { state }
    }

    /// [`acquire`](Self::acquire) with an access that holds the table itself, for
    /// accesses that end on another thread (GPU copies end in a driver callback).
    pub(crate) fn acquire_owned(self: &Arc<Self>, slot: u32) -> Option<(OwnedAccess, Grant)> {
        let [state, ..] = self.words(slot)?;
        let before = state.fetch_add(1, Ordering::Acquire);
        let access = OwnedAccess {
            table: self.clone(),
            slot,
        };
        if before & VALID == 0 {
            return None;
        }
        Some((access, self.read_grant(slot)))
    }

    /// Whether `slot` still holds a valid grant with `key` (initiator side).
    pub(crate) fn still_granted(&self, slot: u32, key: u64) -> bool {
        self.words(slot).is_some_and(|[state, k, ..]| {
            state.load(Ordering::Acquire) & VALID != 0 && k.load(Ordering::Relaxed) == key
        })
    }

    /// The grant in `slot` (an access to it is held, so it is not rewritten).
    fn read_grant(&self, slot: u32) -> Grant {
        let [_, key, addr, len, memfd, gpu, base] = self.words(slot).expect("in range");
        let fd = memfd.load(Ordering::Relaxed);
        let word = gpu.load(Ordering::Relaxed);
        let gpu = (word & GPU != 0).then(|| GpuGrant {
            device: word as u32,
            export: (word & HAS_HANDLE != 0).then(|| {
                let mut handle = [0u8; nixl::gpu::IPC_HANDLE_LEN];
                for (chunk, w) in handle.chunks_mut(8).zip(self.handle_words(slot)) {
                    chunk.copy_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
                }
                (handle, base.load(Ordering::Relaxed))
            }),
        });
        Grant {
            key: key.load(Ordering::Relaxed),
            addr: addr.load(Ordering::Relaxed),
            len: len.load(Ordering::Relaxed),
            memfd: fd.checked_sub(1).and_then(|f| i32::try_from(f).ok()),
            gpu,
        }
    }

    /// Mark the table closed (target side): its connection or agent is going away.
    /// Revokes nothing by itself; initiators use it to tell "shut down" from "revoked".
    pub(crate) fn close(&self) {
        self.map.word(CLOSED_AT).store(1, Ordering::Release);
    }

    /// Whether the target closed the table.
    pub(crate) fn is_closed(&self) -> bool {
        self.map.word(CLOSED_AT).load(Ordering::Acquire) != 0
    }

    /// Close the table and withdraw every grant in it (target side), without waiting.
    pub(crate) fn withdraw_all(&self) {
        self.close();
        for slot in 0..SLOTS {
            if let Some([state, ..]) = self.words(slot) {
                state.fetch_and(!VALID, Ordering::AcqRel);
            }
        }
        self.bump_epoch();
    }

    /// No access to any slot is in progress.
    pub(crate) fn all_idle(&self) -> bool {
        (0..SLOTS).all(|slot| self.idle(slot))
    }

    /// Whether an initiator holds the table (target side): false once every process
    /// that mapped it has dropped it or died, so that no count still up in it can come
    /// down. A probe the kernel refuses for another reason counts as held.
    pub(crate) fn peer_holds(&self) -> bool {
        let Some(fd) = &self.fd else {
            return true;
        };
        // SAFETY: flock on the table's descriptor, which `self` owns; a lock taken
        // here is released at once, and only ever by this open of the file.
        unsafe {
            if libc::flock(fd.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) < 0 {
                return true;
            }
            libc::flock(fd.as_raw_fd(), libc::LOCK_UN);
        }
        false
    }
}

/// An access in progress to one granted slot that holds its table; ends on drop.
#[derive(Debug)]
pub(crate) struct OwnedAccess {
    table: Arc<Table>,
    slot: u32,
}

impl Drop for OwnedAccess {
    fn drop(&mut self) {
        if let Some([state, ..]) = self.table.words(self.slot) {
            state.fetch_sub(1, Ordering::Release);
        }
    }
}

/// Wake every waiter on the futex word `w` (shared: waiters in other processes too).
fn futex_wake(w: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a live, aligned 32-bit word of a shared mapping; the
    // kernel only reads its address.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            w.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
        );
    }
}

/// Sleep while the futex word `w` holds `seen`, at most `timeout` (any wake, signal
/// or change ends it: callers recheck what they wait for).
fn futex_wait(w: &AtomicU32, seen: u32, timeout: std::time::Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a live, aligned 32-bit word of a shared mapping with a
    // relative timeout that lives across the call.
    unsafe {
        libc::syscall(libc::SYS_futex, w.as_ptr(), libc::FUTEX_WAIT, seen, &ts);
    }
}

/// An access in progress to one granted slot; ends on drop.
#[derive(Debug)]
pub(crate) struct Access<'a> {
    state: &'a AtomicU64,
}

impl Drop for Access<'_> {
    fn drop(&mut self) {
        self.state.fetch_sub(1, Ordering::Release);
    }
}

/// Copy `len` bytes between a local registered slice and `map` at `offset`: into the
/// mapping for a WRITE (`to_map`), out of it for a READ.
pub(crate) fn copy_mapped(
    local: &RegionSlice,
    map: &Mapping,
    offset: usize,
    to_map: bool,
) -> io::Result<()> {
    let len = local.len();
    if local.kind() != MemKind::Dram || offset.checked_add(len).is_none_or(|e| e > map.len) {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    let l = local.addr() as usize as *mut u8;
    // SAFETY: `offset..offset+len` lies in the live mapping (checked); `local` is live
    // host memory of `len` bytes (the core's guarantee while the value lives). Raw
    // `memmove`, no Rust reference into either range: peers may touch both.
    unsafe {
        let m = map.ptr.as_ptr().add(offset);
        if to_map {
            std::ptr::copy(l.cast_const(), m, len);
        } else {
            std::ptr::copy(m.cast_const(), l, len);
        }
    }
    Ok(())
}

/// Most iovecs one cross-memory-attach call takes (the kernel's `UIO_MAXIOV`).
pub(crate) const IOV_MAX: usize = 1024;

/// Most bytes one cross-memory-attach call is given. The kernel moves at most
/// `MAX_RW_COUNT` (`INT_MAX` rounded down to a page, 2 GiB - 4 KiB) per call and
/// returns a short count beyond it; a power of two below keeps pieces page-aligned.
/// Fewer, larger calls are faster: cut into 512 KiB calls (as UCX does), copies of
/// 1-64 MiB were 4-12% slower on one thread (2-core VM, 2026-12-05).
pub(crate) const CMA_CALL_MAX: usize = 1 << 30;

/// One vectored cross-memory-attach call (`process_vm_writev` when `write`, else
/// `process_vm_readv`) between local slices and `(addr, len)` ranges of process `pid`.
/// At most [`IOV_MAX`] of each and [`CMA_CALL_MAX`] bytes. Returns the bytes moved,
/// which is less than asked only when part of the remote range could not be reached.
pub(crate) fn cma(
    pid: u32,
    write: bool,
    local: &[RegionSlice],
    remote: &[(u64, u64)],
) -> io::Result<usize> {
    if local.len() > IOV_MAX
        || remote.len() > IOV_MAX
        || local.iter().any(|s| s.kind() != MemKind::Dram)
    {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    let liov: Vec<libc::iovec> = local
        .iter()
        .map(|s| libc::iovec {
            iov_base: s.addr() as usize as *mut libc::c_void,
            iov_len: s.len(),
        })
        .collect();
    let riov: Vec<libc::iovec> = remote
        .iter()
        .map(|&(a, l)| libc::iovec {
            iov_base: a as usize as *mut libc::c_void,
            iov_len: l as usize,
        })
        .collect();
    let pid =
        libc::pid_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let call = if write {
        libc::process_vm_writev
    } else {
        libc::process_vm_readv
    };
    // SAFETY: the local iovecs name live host memory (each `RegionSlice` keeps its
    // registration alive for the call); the kernel reads them (writev) or writes them
    // (readv) and checks the remote ranges itself against the other process's
    // address space, which is never ours to corrupt by a bad address.
    let n = unsafe {
        call(
            pid,
            liov.as_ptr(),
            liov.len() as _,
            riov.as_ptr(),
            riov.len() as _,
            0,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Read `N` bytes at `addr` of process `pid` by cross-memory attach (the probe that
/// proves the path works between two processes).
pub(crate) fn cma_peek<const N: usize>(pid: u32, addr: u64) -> io::Result<[u8; N]> {
    let mut out = [0u8; N];
    let pid =
        libc::pid_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let l = libc::iovec {
        iov_base: out.as_mut_ptr().cast(),
        iov_len: N,
    };
    let r = libc::iovec {
        iov_base: addr as usize as *mut libc::c_void,
        iov_len: N,
    };
    // SAFETY: the local iovec is `out`, a live buffer of N bytes we own exclusively.
    let n = unsafe { libc::process_vm_readv(pid, &l, 1, &r, 1, 0) };
    match n {
        n if n < 0 => Err(io::Error::last_os_error()),
        n if n as usize == N => Ok(out),
        _ => Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "short cross-memory read",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_withdraw_after_accesses_drain() {
        let nonce = [7u8; NONCE_LEN];
        let target = Table::create(&nonce).unwrap();
        let me = std::process::id();
        assert!(!target.peer_holds(), "nobody opened it yet");
        let peer = Table::open(me, target.raw_fd().unwrap(), &nonce).unwrap();
        assert!(target.peer_holds(), "the initiator's lock");
        assert!(Table::open(me, target.raw_fd().unwrap(), &[8u8; NONCE_LEN]).is_err());
        assert!(peer.acquire(3).is_none(), "nothing granted yet");
        assert!(peer.acquire(SLOTS).is_none(), "out of range");
        let g = Grant {
            key: 9,
            addr: 0x1000,
            len: 64,
            memfd: Some(5),
            gpu: None,
        };
        assert!(target.grant(3, g));
        let (access, seen) = peer.acquire(3).unwrap();
        assert_eq!(seen, g);
        // An access in progress keeps the slot busy after the withdrawal.
        target.withdraw(3);
        assert!(!target.idle(3));
        assert!(!target.grant(3, g), "not while an access is in progress");
        assert!(peer.acquire(3).is_none(), "withdrawn: no new access");
        drop(access);
        assert!(target.idle(3));
        // Reusable after the withdrawal.
        let g2 = Grant { memfd: None, ..g };
        assert!(target.grant(3, g2));
        assert_eq!(peer.acquire(3).unwrap().1, g2);
        assert!(!peer.is_closed());
        target.withdraw_all();
        assert!(target.all_idle());
        assert!(peer.acquire(3).is_none());
        assert!(peer.is_closed());
    }

    /// A GPU grant carries its device and handle across; a withdrawal moves the epoch
    /// on and wakes a watcher sleeping on it in another thread.
    #[test]
    fn gpu_grants_and_the_withdrawal_epoch() {
        let nonce = [4u8; NONCE_LEN];
        let target = Table::create(&nonce).unwrap();
        let peer =
            Arc::new(Table::open(std::process::id(), target.raw_fd().unwrap(), &nonce).unwrap());
        let mut handle = [0u8; nixl::gpu::IPC_HANDLE_LEN];
        handle
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = i as u8 * 3);
        let g = Grant {
            key: 11,
            addr: 0x7000_0000_1000,
            len: 1 << 20,
            memfd: None,
            gpu: Some(GpuGrant {
                device: 1,
                export: Some((handle, 0x7000_0000_0000)),
            }),
        };
        assert!(target.grant(5, g));
        let (access, seen) = peer.acquire_owned(5).unwrap();
        assert_eq!(seen, g);
        assert!(peer.still_granted(5, 11));
        assert!(!peer.still_granted(5, 12), "another key");
        // A watcher sleeping on the epoch wakes when the grant is withdrawn.
        let before = peer.epoch();
        let watcher = {
            let peer = peer.clone();
            std::thread::spawn(move || {
                while peer.epoch() == before {
                    peer.wait_epoch(before, std::time::Duration::from_secs(30));
                }
                peer.still_granted(5, 11)
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        target.withdraw(5);
        assert!(!watcher.join().unwrap(), "the watcher saw the withdrawal");
        assert!(!target.idle(5), "the owned access is still in progress");
        drop(access);
        assert!(target.idle(5));
        // Without a handle: the device only.
        let local = Grant {
            gpu: Some(GpuGrant {
                device: 0,
                export: None,
            }),
            ..g
        };
        assert!(target.grant(6, local));
        assert_eq!(peer.acquire(6).unwrap().1, local);
    }

    /// A count left up by an initiator that went away without ending its access (as
    /// one killed inside a copy does) is told apart by the table's lock.
    #[test]
    fn an_initiator_gone_inside_an_access_is_seen_gone() {
        let nonce = [3u8; NONCE_LEN];
        let target = Table::create(&nonce).unwrap();
        let peer = Table::open(std::process::id(), target.raw_fd().unwrap(), &nonce).unwrap();
        let g = Grant {
            key: 1,
            addr: 0x1000,
            len: 8,
            memfd: None,
            gpu: None,
        };
        assert!(target.grant(0, g));
        let (access, _) = peer.acquire(0).unwrap();
        std::mem::forget(access);
        target.withdraw(0);
        assert!(!target.idle(0));
        assert!(target.peer_holds(), "alive: its copy may still be running");
        drop(peer);
        assert!(!target.idle(0), "the count stays up");
        assert!(!target.peer_holds(), "but nobody holds the table any more");
    }

    fn ftruncate(fd: RawFd, len: i64) -> io::Result<()> {
        // SAFETY: plain system call on a descriptor the caller owns.
        if unsafe { libc::ftruncate(fd, len) } < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// Every memfd this crate makes (grant table, `alloc` memory) has its size sealed:
    /// shrinking it, which would make a peer's mapping fault, fails.
    #[test]
    fn our_memfds_cannot_be_truncated() {
        let m = Memfd::new(c"nixl-tcp", 3 * page_size()).unwrap();
        let t = Table::create(&[1u8; NONCE_LEN]).unwrap();
        for fd in [m.raw_fd(), t.raw_fd().unwrap()] {
            // SAFETY: borrowed for the call only; the owner outlives it.
            let seals = seals(unsafe { BorrowedFd::borrow_raw(fd) }).unwrap();
            assert_eq!(seals & SEALS, SEALS, "sealed: {seals:#x}");
            let e = ftruncate(fd, 0).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
            assert!(ftruncate(fd, 1 << 40).is_err(), "nor grown");
        }
        // Still whole, and usable.
        m.mapping()
            .word(2 * page_size())
            .store(5, Ordering::Release);
        assert_eq!(
            map_peer(std::process::id(), m.raw_fd(), 3 * page_size())
                .unwrap()
                .word(2 * page_size())
                .load(Ordering::Acquire),
            5
        );
    }

    /// A memfd made by hand, with our name prefix but without the seals.
    fn unsealed(len: u64) -> OwnedFd {
        // SAFETY: plain system call with a NUL-terminated name.
        let raw = unsafe { libc::memfd_create(c"nixl-tcp-forged".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0, "{}", io::Error::last_os_error());
        // SAFETY: a new descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        File::from(fd.try_clone().unwrap()).set_len(len).unwrap();
        fd
    }

    /// What a hostile target could offer is refused before anything is mapped: a
    /// memfd it could truncate under our mapping (the SIGBUS), a sealed memfd that is
    /// not ours, any other file.
    #[test]
    fn the_initiator_maps_only_sealed_nixl_memfds() {
        let me = std::process::id();
        let len = TABLE_LEN as u64;
        let bad = unsealed(len);
        let e = map_peer(me, bad.as_raw_fd(), 4096).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        assert!(e.to_string().contains("not sealed"), "{e}");
        let e = Table::open(me, bad.as_raw_fd(), &[0; NONCE_LEN]).unwrap_err();
        assert!(e.to_string().contains("not sealed"), "{e}");
        // Had it been mapped, this truncation would fault the next access.
        ftruncate(bad.as_raw_fd(), 0).unwrap();

        // SAFETY: as above.
        let raw = unsafe { libc::memfd_create(c"other".as_ptr(), libc::MFD_CLOEXEC) };
        // SAFETY: a new descriptor nobody else owns.
        let other = unsafe { OwnedFd::from_raw_fd(raw) };
        File::from(other.try_clone().unwrap()).set_len(len).unwrap();
        let e = map_peer(me, other.as_raw_fd(), 4096).unwrap_err();
        assert!(e.to_string().contains("not a nixl-tcp memfd"), "{e}");

        let file = File::open("/proc/self/status").unwrap();
        let e = map_peer(me, file.as_raw_fd(), 1).unwrap_err();
        assert!(e.to_string().contains("not a nixl-tcp memfd"), "{e}");
        assert!(map_peer(me, 1 << 20, 1).is_err(), "no such descriptor");
        assert!(map_peer(0, 3, 1).is_err());
    }

    #[test]
    fn the_probe_reads_this_process() {
        let nonce = [0xA5u8; NONCE_LEN];
        let t = Table::create(&nonce).unwrap();
        match cma_peek::<NONCE_LEN>(std::process::id(), t.addr()) {
            Ok(got) => assert_eq!(got, nonce),
            Err(e) => nixl_testkit::skip(
                "cma probe",
                format!("cross-memory attach refused here: {e}"),
            ),
        }
    }

    #[test]
    fn memfd_maps_twice_with_shared_pages() {
        let m = Memfd::new(c"nixl-tcp-test", 10).unwrap();
        assert_eq!(m.mapping().len(), page_size());
        let other = map_peer(std::process::id(), m.raw_fd(), 10).unwrap();
        other.word(0).store(0x1122_3344, Ordering::Release);
        assert_eq!(m.mapping().word(0).load(Ordering::Acquire), 0x1122_3344);
        assert!(
            map_peer(std::process::id(), m.raw_fd(), 1 << 30).is_err(),
            "longer than the file"
        );
    }
}
