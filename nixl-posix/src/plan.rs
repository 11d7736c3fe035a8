//! A storage transfer as a list of positional I/O operations: what each engine submits.
//! Pure logic, no I/O: every check that can be made before anything moves (access
//! mode, O_DIRECT alignment, memory kind) is made here, once, at prepare time.

use std::sync::Arc;

use nixl::file::FileHandle;
use nixl::{Error, ErrorKind, MemKind, Op, Result, Segments, TargetRegion};

/// The most bytes one operation moves: Linux caps a single `pread`/`pwrite` (and an
/// io_uring read/write) at 0x7fff_f000 bytes, so longer segments are cut.
pub(crate) const MAX_OP: u64 = 1 << 30;

/// The most bytes one operation on a buffered file moves: large page-cache copies are
/// cut so the thread pool's workers share them.
pub(crate) const BUFFERED_PIECE: u64 = 2 << 20;

/// One positional read or write between host memory and a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct IoOp {
    /// Index into [`Plan::files`].
    pub(crate) file: u32,
    /// Offset in the file.
    pub(crate) offset: u64,
    /// Host memory address.
    pub(crate) addr: u64,
    /// Bytes (at most [`MAX_OP`]).
    pub(crate) len: u32,
    /// The segment of the transfer it belongs to (for errors).
    pub(crate) segment: u32,
}

/// A prepared storage transfer.
#[derive(Debug)]
pub(crate) struct Plan {
    /// READ loads memory from the files, WRITE stores memory into them.
    pub(crate) op: Op,
    /// The files the operations name, each once.
    pub(crate) files: Vec<Arc<FileHandle>>,
    /// Every operation, in segment order.
    pub(crate) ops: Vec<IoOp>,
    /// Bytes in all operations.
    pub(crate) bytes: u64,
    /// Run on the posting thread first ([`crate::PosixOptions::inline_max`]): every
    /// file is buffered and the transfer small.
    pub(crate) inline: bool,
    /// No file has O_DIRECT.
    pub(crate) buffered: bool,
}

const OP: &str = "prepare storage transfer";

impl Plan {
    /// Build the operations of `segments`: local side host memory, target side files
    /// of this agent.
    ///
    /// # Errors
    /// [`ErrorKind::NotSupported`] for memory other than DRAM on the local side or
    /// anything but a registered file on the other; [`ErrorKind::NotAllowed`] for a
    /// WRITE into a file not open for writing or a READ from one not open for
    /// reading; [`ErrorKind::InvalidArgument`] for an O_DIRECT file and a segment
    /// whose offset, length or memory address is not aligned, naming the segment.
    pub(crate) fn new(op: Op, segments: &Segments, inline_max: u64) -> Result<Self> {
        let mut files: Vec<Arc<FileHandle>> = Vec::new();
        // Per target registration: the index of its file in `files`.
        let mut slots: Vec<u32> = Vec::with_capacity(segments.targets().len());
        for t in segments.targets() {
            let TargetRegion::Local(r) = t else {
                return err(
                    ErrorKind::NotSupported,
                    "files are reached only by their own agent",
                );
            };
            let Some(f) = r.file() else {
                return err(
                    ErrorKind::NotSupported,
                    format!("the other side is {} memory, not a file", r.kind()),
                );
            };
            match op {
                Op::Write if !f.writable() => {
                    return err(
                        ErrorKind::NotAllowed,
                        format!(
                            "{} is not open for writing: a WRITE stores into it",
                            f.describe()
                        ),
                    )
                }
                Op::Read if !f.readable() => {
                    return err(
                        ErrorKind::NotAllowed,
                        format!(
                            "{} is not open for reading: a READ loads from it",
                            f.describe()
                        ),
                    )
                }
                _ => {}
            }
            let slot = match files.iter().position(|g| Arc::ptr_eq(g, f)) {
                Some(i) => i,
                None => {
                    files.push(f.clone());
                    files.len() - 1
                }
            };
            slots.push(slot as u32);
        }
        for l in segments.locals() {
            if l.kind() != MemKind::Dram {
                return err(
                    ErrorKind::NotSupported,
                    format!(
                        "{} memory: the posix backend moves host memory (stage GPU memory through a host buffer)",
                        l.kind()
                    ),
                );
            }
        }
        let mut ops = Vec::with_capacity(segments.len());
        let mut bytes = 0u64;
        let mut segment = 0u32;
        for run in segments.runs() {
            let file_slot = slots[run.target as usize];
            let file = &files[file_slot as usize];
            let base = segments.locals()[run.local as usize].segment().addr();
            for i in 0..run.count {
                let (offset, addr) = (run.target_at(i), base + run.local_at(i));
                if let Some(a) = file.direct() {
                    let (mem, off) = (u64::from(a.memory), u64::from(a.offset));
                    if offset % off != 0 || run.len % off != 0 || addr % mem != 0 {
                        return err(
                            ErrorKind::InvalidArgument,
                            format!(
                                "segment {segment} ({} offset {offset}, {} bytes, memory {addr:#x}): O_DIRECT needs file offsets and lengths in multiples of {off} bytes and memory aligned to {mem}",
                                file.describe(),
                                run.len
                            ),
                        );
                    }
                }
                // Buffered I/O is a copy the pool's threads share: cut it finer.
                let piece = if file.direct().is_some() {
                    MAX_OP
                } else {
                    BUFFERED_PIECE
                };
                let mut done = 0;
                while done < run.len {
                    let n = (run.len - done).min(piece);
                    ops.push(IoOp {
                        file: file_slot,
                        offset: offset + done,
                        addr: addr + done,
                        len: n as u32,
                        segment,
                    });
                    done += n;
                }
                bytes += run.len;
                segment = segment.saturating_add(1);
            }
        }
        let buffered = files.iter().all(|f| f.direct().is_none());
        Ok(Self {
            op,
            files,
            ops,
            bytes,
            inline: buffered && bytes <= inline_max,
            buffered,
        })
    }
}

fn err<T>(kind: ErrorKind, context: impl Into<String>) -> Result<T> {
    Err(Error::new(kind, OP, context))
}

/// What an operation did, as its engine saw it.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// All its bytes moved.
    Done,
    /// Some moved (`n` of them); the rest must go again from where it stopped.
    Short(u32),
    /// It failed; what it says, for the transfer's error.
    Failed(String, Option<std::io::Error>),
}

/// Judge a read or write that returned `res` (bytes, or a negative errno) for `op`
/// after `done` of its bytes had already moved; `align` is the file's O_DIRECT
/// alignment (1 for buffered files): the rest of an O_DIRECT operation cut short at
/// an unaligned point cannot go again, so that fails at once with what happened.
pub(crate) fn judge(dir: Op, op: &IoOp, done: u32, res: i64, align: u32) -> Outcome {
    let rest = op.len - done;
    if res < 0 {
        let e = std::io::Error::from_raw_os_error((-res) as i32);
        return Outcome::Failed(e.to_string(), Some(e));
    }
    let n = res as u64;
    if n >= u64::from(rest) {
        return Outcome::Done;
    }
    if n == 0 {
        let why = match dir {
            Op::Read => "end of file: the file is shorter than the registration (truncated since?)",
            Op::Write => "the file took no more bytes",
        };
        return Outcome::Failed(why.to_owned(), None);
    }
    if (u64::from(done) + n) % u64::from(align.max(1)) != 0 {
        return Outcome::Failed(
            format!(
                "the file took {n} of the O_DIRECT operation's {rest} bytes, not a multiple of its {align}-byte alignment (out of space?)"
            ),
            None,
        );
    }
    Outcome::Short(n as u32)
}

impl Plan {
    /// The O_DIRECT alignment of `op`'s file (1 for a buffered file).
    pub(crate) fn align(&self, op: &IoOp) -> u32 {
        self.files[op.file as usize]
            .direct()
            .map_or(1, |a| a.offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(len: u32) -> IoOp {
        IoOp {
            file: 0,
            offset: 0,
            addr: 0x1000,
            len,
            segment: 3,
        }
    }

    #[test]
    fn an_o_direct_operation_cut_short_unaligned_fails_at_once() {
        assert!(matches!(
            judge(Op::Write, &op(8192), 0, 4096, 512),
            Outcome::Short(4096)
        ));
        match judge(Op::Write, &op(8192), 0, 1000, 512) {
            Outcome::Failed(why, None) => assert!(why.contains("1000 of"), "{why}"),
            o => panic!("{o:?}"),
        }
    }

    #[test]
    fn short_transfers_continue_and_zero_ends_them() {
        assert!(matches!(
            judge(Op::Write, &op(100), 0, 100, 1),
            Outcome::Done
        ));
        assert!(matches!(
            judge(Op::Write, &op(100), 60, 40, 1),
            Outcome::Done
        ));
        assert!(matches!(
            judge(Op::Read, &op(100), 0, 30, 1),
            Outcome::Short(30)
        ));
        match judge(Op::Read, &op(100), 30, 0, 1) {
            Outcome::Failed(why, None) => assert!(why.contains("end of file"), "{why}"),
            o => panic!("{o:?}"),
        }
        match judge(Op::Write, &op(100), 0, -(libc::ENOSPC as i64), 1) {
            Outcome::Failed(why, Some(e)) => {
                assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
                assert!(why.contains("No space left"), "{why}");
            }
            o => panic!("{o:?}"),
        }
    }
}
