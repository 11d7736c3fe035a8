#!/usr/bin/env python3
"""nixl-rs against NIXL's POSIX storage backend and fio, on the same files, in one run.

Every cell (op x buffered/O_DIRECT x layout x batch x block size) is measured by:
  1. NIXL 1.5.1 (Python API), once per queue type of its POSIX backend (default, io_uring,
     Linux AIO, POSIX AIO), each in its own child process: one agent, a DRAM buffer
     (page-aligned), the files opened with os.open (O_DIRECT when direct) and registered as
     FILE (fd-mode); initialize_xfer once per cell, then per iteration transfer() and a
     busy check_xfer_state() poll until DONE;
  2. nixl-bench --backend posix (ours; skipped, with a note, while the binary is missing);
  3. fio (io_uring engine, iodepth = batch, time based, same blocks of the same files);
and one table prints them side by side (GB = 10^9 bytes).

Layouts: "large" puts descriptor j of a batch at offset j*block of file 0; "many" puts it in
file j at offset 0 (for batch 1 both are the same, the cell is run once, as "large").
Files are DIR/nixl-bench-<i>.dat; the script creates them, full of real data, before any
tool runs (existing files that are big enough and not sparse are kept).

Usage (from the repository root):
  PYTHONPATH=/opt/nixl-wheel python3 scripts/storage_side_by_side.py [--quick]
      [--dir DIR] [--blocks 4K,64K,1M,16M] [--batches 1,32] [--ops WRITE,READ]
      [--direct off,on] [--layouts large,many] [--queues default,uring,aio,posix_aio]
      [--iters N] [--warmup N] [--runtime SECONDS] [--fio-batched]
      [--nixl-bench PATH] [--skip-ours] [--skip-nixl] [--skip-fio]
      [--verbose] [--json FILE] [--keep]
  e.g. ... --blocks 4K,1M --batches 32 --ops WRITE --direct off --layouts large

CPU per transfer: NIXL's is the child's process CPU time (all threads, user + system, so
including its Python poll loop and whatever its queue's threads use) over the timed
iterations, divided by their number; ours is getrusage(RUSAGE_CHILDREN) of the nixl-bench
run divided by (num_iter + warmup_iter), so it includes process start and setup.
"""

import argparse
import collections
import datetime
import json
import math
import mmap
import os
import platform
import queue
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
# POSIX backend parameters per queue type (NIXL 1.5.1: at most one of them may be "true";
# none means the build's default, which is Linux AIO when NIXL was built with libaio).
QUEUES = {
    "default": {},
    "uring": {"use_uring": "true"},
    "aio": {"use_aio": "true"},
    "posix_aio": {"use_posix_aio": "true"},
}
OPS = ("WRITE", "READ")
LAYOUTS = ("large", "many")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def parse_size(s):
    m = re.fullmatch(r"(\d+)\s*([kmg]?)(i?b)?", s.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r} (use e.g. 4096, 4K, 1M)")
    return int(m.group(1)) * {"": 1, "k": KiB, "m": MiB, "g": GiB}[m.group(2)]


def fmt_size(n):
    for unit, name in ((GiB, "G"), (MiB, "M"), (KiB, "K")):
        if n % unit == 0:
            return f"{n // unit}{name}"
    return str(n)


def csv_list(kind, allowed=None, conv=str):
    def parse(s):
        out = []
        for item in s.split(","):
            item = item.strip()
            if not item:
                continue
            v = conv(item)
            if allowed is not None and v not in allowed:
                raise argparse.ArgumentTypeError(
                    f"bad {kind} {item!r} (one of {', '.join(map(str, allowed))})")
            if v not in out:
                out.append(v)
        if not out:
            raise argparse.ArgumentTypeError(f"empty {kind} list")
        return out
    return parse


def parse_onoff(s):
    s = s.lower()
    if s in ("on", "1", "true", "yes", "direct"):
        return True
    if s in ("off", "0", "false", "no", "buffered"):
        return False
    raise argparse.ArgumentTypeError(f"bad --direct value {s!r} (on/off)")


def file_path(d, i):
    return os.path.join(d, f"nixl-bench-{i}.dat")


def desc_place(j, nfiles, block):
    """(file index, offset) of descriptor j of a batch (the same rule nixl-bench uses)."""
    return j % nfiles, (j // nfiles) * block


# --------------------------------------------------------------------------------------
# NIXL: one child process per queue type
# --------------------------------------------------------------------------------------

def emit(kind, obj):
    sys.stdout.write(f"@@ {kind} {json.dumps(obj)}\n")
    sys.stdout.flush()


def nixl_make_agent(name, params):
    from nixl_cu12._api import nixl_agent, nixl_agent_config
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("POSIX", params)
    return agent


def nixl_probe(params):
    """Creates the backend once (NIXL_LOG_LEVEL=INFO set by the parent) and says whether it worked."""
    try:
        nixl_make_agent("nixl-probe", params)
    except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
        emit("FAIL", {"error": f"{type(e).__name__}: {e}"})
        os._exit(3)
    emit("OK", {})
    os._exit(0)


def nixl_cell(agent, np, d, cell):
    op, block, batch, nfiles, direct = (cell["op"], cell["block"], cell["batch"],
                                        cell["nfiles"], cell["direct"])
    iters, warmup = cell["iters"], cell["warmup"]
    total = block * batch
    m = mmap.mmap(-1, total)  # anonymous mappings are page aligned (O_DIRECT needs it)
    buf = np.frombuffer(m, dtype=np.uint8)
    rng = np.random.default_rng(cell["index"] + 1)
    chunk = rng.integers(0, 256, 4096, dtype=np.uint8)
    buf.reshape(-1, 4096)[:] = chunk  # block sizes are multiples of 4 KiB
    buf.reshape(-1, 4096)[:, :8] = np.arange(total // 4096, dtype=np.uint64).view(
        np.uint8).reshape(-1, 8)  # makes each 4 KiB page different
    addr = buf.ctypes.data
    flags = os.O_RDWR | (os.O_DIRECT if direct else 0)
    fds, regs, handle = [], [], None
    try:
        for i in range(nfiles):
            fds.append(os.open(file_path(d, i), flags))
        regs.append(agent.register_memory([(addr, total, 0, "")], "DRAM", backends=["POSIX"]))
        regs.append(agent.register_memory(
            [(0, os.fstat(fd).st_size, fd, "") for fd in fds], "FILE", backends=["POSIX"]))
        places = [desc_place(j, nfiles, block) for j in range(batch)]
        local = agent.get_xfer_descs([(addr + j * block, block, 0) for j in range(batch)], "DRAM")
        remote = agent.get_xfer_descs([(off, block, fds[f]) for f, off in places], "FILE")
        handle = agent.initialize_xfer(op, local, remote, agent.name, backends=["POSIX"])
        xfer, check = agent.transfer, agent.check_xfer_state
        polls = 0
        for i in range(warmup + iters):
            if i == warmup:
                polls = 0
                t0, c0 = time.perf_counter(), time.process_time()
            state = xfer(handle)
            while state == "PROC":
                state = check(handle)
                polls += 1
            if state != "DONE":
                raise RuntimeError(f"transfer {i} ended in state {state}")
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        # Check the first and the last descriptor's first 4 KiB against the file (buffered
        # read of the same range; O_DIRECT writes invalidate the page cache).
        for j in sorted({0, batch - 1}):
            f, off = places[j]
            with open(file_path(d, f), "rb") as fh:
                fh.seek(off)
                got = fh.read(4096)
            if got != bytes(buf[j * block:j * block + 4096]):
                raise RuntimeError(f"data check failed: descriptor {j} (file {f}, offset {off})")
        return {"gbps": total * iters / dt / 1e9, "avg_us": dt / iters * 1e6,
                "cpu_us": dc / iters * 1e6, "polls": polls / iters,
                "iters": iters, "warmup": warmup}
    finally:
        if handle is not None:
            agent.release_xfer_handle(handle)
        for r in reversed(regs):
            agent.deregister_memory(r, backends=["POSIX"])
        for fd in fds:
            os.close(fd)
        del buf
        m.close()


def nixl_child(name, params, d):
    import numpy as np
    try:
        agent = nixl_make_agent(name, params)
    except Exception as e:  # noqa: BLE001
        emit("UNAVAILABLE", {"error": f"{type(e).__name__}: {e}"})
        os._exit(3)
    emit("READY", {})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        if line == "EXIT":
            break
        cell = json.loads(line)
        try:
            res = nixl_cell(agent, np, d, cell)
        except Exception as e:  # noqa: BLE001 - reported per cell, the child goes on
            res = {"error": f"{type(e).__name__}: {e}"}
        emit("RES", res)
    os._exit(0)


def nixl_error_lines(stderr_text):
    """NIXL's own error lines (absl format: E<mmdd> <time> ... ] message)."""
    out = []
    for line in stderr_text.splitlines():
        m = re.match(r"^[EF]\d{4} [\d:.]+\s+\d+\s+\S+\] (.*)$", line.strip())
        if m:
            out.append(m.group(1))
    return out


def probe_queue(qname, env, timeout):
    """Returns (available, resolved queue type, message)."""
    penv = dict(env, NIXL_LOG_LEVEL="INFO")
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--nixl-probe",
                            json.dumps(QUEUES[qname])],
                           env=penv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, None, f"probe timed out after {timeout} s"
    m = re.search(r"POSIX backend initialized using io queue type: (\w+)", p.stderr)
    resolved = m.group(1) if m else None
    errs = nixl_error_lines(p.stderr)
    if p.returncode == 0 and "@@ OK" in p.stdout:
        return True, resolved, ""
    msg = [l[len("@@ FAIL "):] for l in p.stdout.splitlines() if l.startswith("@@ FAIL ")]
    text = "; ".join(errs) or (json.loads(msg[0])["error"] if msg else "")
    if not text:
        tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
        text = f"probe exited with {p.returncode}: " + " | ".join(tail)
    return False, resolved, text


class NixlChild:
    """A persistent child running NIXL cells for one queue type, restarted after a crash."""

    def __init__(self, qname, d, env, start_timeout):
        self.qname, self.d, self.env, self.start_timeout = qname, d, env, start_timeout
        self.proc = None
        self.unavailable = None

    def _reader(self, stream, sink):
        for line in stream:
            sink(line.rstrip("\n"))
        sink(None)

    def _start(self):
        self.lines = queue.Queue()
        self.err = collections.deque(maxlen=60)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--nixl-child", self.qname,
             json.dumps(QUEUES[self.qname]), self.d],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1, env=self.env)
        threading.Thread(target=self._reader, args=(self.proc.stdout, self.lines.put),
                         daemon=True).start()
        threading.Thread(target=self._reader,
                         args=(self.proc.stderr, lambda l: l is not None and self.err.append(l)),
                         daemon=True).start()
        kind, obj = self._next(self.start_timeout)
        if kind == "READY":
            return None
        if kind == "UNAVAILABLE":
            self.proc.wait(timeout=10)
            time.sleep(0.1)  # let the stderr reader drain
            errs = nixl_error_lines("\n".join(self.err))
            self.unavailable = "; ".join(errs) or obj["error"]
            self.proc = None
            return self.unavailable
        return self._died(kind, obj, "at start")

    def _next(self, timeout):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "TIMEOUT", None
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                return "TIMEOUT", None
            if line is None:
                return "EOF", None
            if line.startswith("@@ "):
                kind, _, rest = line[3:].partition(" ")
                return kind, json.loads(rest) if rest else {}

    def _died(self, kind, obj, when):
        p, self.proc = self.proc, None
        if kind == "TIMEOUT":
            p.kill()
        try:
            rc = p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            rc = "?"
        time.sleep(0.1)
        tail = " | ".join(list(self.err)[-4:])
        what = "timed out" if kind == "TIMEOUT" else f"died (exit status {rc})"
        return f"NIXL child {what} {when}" + (f": {tail}" if tail else "")

    def run(self, cell, timeout):
        if self.unavailable:
            return {"error": "unavailable: " + self.unavailable}
        if self.proc is not None and self.proc.poll() is not None:
            log(f"    NIXL {self.qname}: {self._died('EOF', None, 'between cells')}; restarting it")
        if self.proc is None:
            err = self._start()
            if err:
                return {"error": err}
        self.err.clear()
        try:
            self.proc.stdin.write(json.dumps(cell) + "\n")
            self.proc.stdin.flush()
        except OSError:
            return {"error": self._died("EOF", None, "before the cell")}
        kind, obj = self._next(timeout)
        if kind == "RES":
            return obj
        return {"error": self._died(kind, obj, f"during the cell (limit {timeout:.0f} s)")}

    def close(self):
        if self.proc is None:
            return
        try:
            self.proc.stdin.write("EXIT\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc = None


# --------------------------------------------------------------------------------------
# nixl-bench (ours) and fio
# --------------------------------------------------------------------------------------

def ours_cmd(binary, d, cell):
    cmd = [binary, "--backend", "posix", "--filepath", d, "--num-files", str(cell["nfiles"])]
    if cell["direct"]:
        cmd.append("--storage-enable-direct")
    cmd += ["--op-type", cell["op"],
            "--start-block-size", str(cell["block"]), "--max-block-size", str(cell["block"]),
            "--start-batch-size", str(cell["batch"]), "--max-batch-size", str(cell["batch"]),
            "--num-iter", str(cell["iters"]), "--warmup-iter", str(cell["warmup"]), "--json"]
    return cmd


def run_ours(binary, d, cell, timeout):
    cmd = ours_cmd(binary, d, cell)
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "cmd": " ".join(cmd)}
    except OSError as e:
        return {"error": f"could not run: {e}", "cmd": " ".join(cmd)}
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    res = {"cmd": " ".join(cmd), "wall_s": wall,
           "cpu_us": cpu / (cell["iters"] + cell["warmup"]) * 1e6}
    if p.returncode != 0:
        tail = " | ".join((p.stderr or p.stdout).strip().splitlines()[-4:])
        res["error"] = f"exit status {p.returncode}: {tail}"
        return res
    try:
        report = json.loads(p.stdout[p.stdout.index("{"):])
        rows = report["results"]
        match = [r for r in rows if str(r.get("op", "")).upper() == cell["op"]
                 and int(r.get("block_size", -1)) == cell["block"]
                 and int(r.get("batch_size", -1)) == cell["batch"]]
        row = match[0] if match else rows[0] if len(rows) == 1 else None
        if row is None:
            raise ValueError(f"no result for {cell['op']} {cell['block']} x{cell['batch']}")
        res["gbps"] = float(row["bw_gbps"])
        if row.get("avg_lat_us") is not None:
            res["avg_us"] = float(row["avg_lat_us"])
        res["raw"] = row
        res["run"] = report.get("run")
    except (ValueError, KeyError, TypeError) as e:
        res["error"] = f"could not parse its JSON ({e}): {p.stdout[:200]!r}"
    return res


def fio_cmd(d, cell, runtime, batched):
    block, batch, nfiles = cell["block"], cell["batch"], cell["nfiles"]
    per_file = math.ceil(batch / nfiles) * block  # the blocks the cell covers in each file
    names = ":".join(file_path(d, i) for i in range(nfiles))
    if nfiles == 1:
        rw = cell["op"].lower()
        layout = []
    else:
        # One block per file: with rw=read/write fio closes and reopens a file each time it
        # reaches the end of that file's region (so once per I/O here); random I/O with
        # norandommap over a one-block region never "finishes" a file and its offset is 0.
        rw = "rand" + cell["op"].lower()
        layout = ["--norandommap=1", "--randrepeat=0", "--file_service_type=roundrobin",
                  f"--filesize={per_file}"]
    cmd = ["fio", "--name=cell", "--ioengine=io_uring", f"--rw={rw}", f"--bs={block}",
           f"--iodepth={batch}", f"--direct={int(cell['direct'])}", f"--filename={names}",
           f"--size={per_file * nfiles}", *layout,
           "--time_based=1", f"--runtime={max(1, int(runtime * 1000))}ms",
           "--invalidate=0", "--allow_file_create=0", "--fallocate=none",
           "--output-format=json"]
    if batched:
        cmd += [f"--iodepth_batch_submit={batch}", f"--iodepth_batch_complete_min={batch}"]
    return cmd


def run_fio(d, cell, runtime, batched, timeout):
    cmd = fio_cmd(d, cell, runtime, batched)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "cmd": " ".join(cmd)}
    res = {"cmd": " ".join(cmd)}
    try:
        job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]
    except (ValueError, KeyError, IndexError) as e:
        tail = " | ".join((p.stderr + p.stdout).strip().splitlines()[-4:])
        res["error"] = f"exit status {p.returncode}, no JSON ({e}): {tail}"
        return res
    side = job["read" if cell["op"] == "READ" else "write"]
    if job.get("error") or p.returncode != 0:
        res["error"] = f"fio error {job.get('error')}: {p.stderr.strip()[-300:]}"
        return res
    ios, run_ms = side["total_ios"], job["job_runtime"]
    res.update(gbps=side["bw_bytes"] / 1e9, ios=ios, runtime_ms=run_ms,
               lat_us=side.get("clat_ns", {}).get("mean", 0) / 1e3,
               usr_cpu=job["usr_cpu"], sys_cpu=job["sys_cpu"])
    if ios:  # CPU per batch-equivalent (batch I/Os), from fio's own accounting
        res["cpu_us"] = (job["usr_cpu"] + job["sys_cpu"]) / 100 * run_ms * 1e3 / (ios / cell["batch"])
    return res


# --------------------------------------------------------------------------------------
# Files, machine, cells
# --------------------------------------------------------------------------------------

def prepare_files(d, sizes):
    """Creates/sizes the files and writes real data once (kept when big enough and not sparse)."""
    chunk_len = 4 * MiB
    seed = os.urandom(chunk_len)
    for i, need in sorted(sizes.items()):
        path = file_path(d, i)
        try:
            st = os.stat(path)
            if st.st_size >= need and st.st_blocks * 512 >= st.st_size:
                continue
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            size = max(need, os.fstat(fd).st_size)
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError:
                pass  # not every filesystem has it; the writes below allocate anyway
            off = 0
            while off < size:
                n = min(chunk_len, size - off)
                # a different first 8 bytes per 4 KiB page of the data
                data = bytearray(seed[:n])
                for p in range(0, n, 4096):
                    data[p:p + 8] = ((off + p) // 4096).to_bytes(8, "little")
                os.pwrite(fd, data, off)
                off += n
            os.fsync(fd)
        finally:
            os.close(fd)
        log(f"  wrote {path} ({fmt_size(size)})")


def reset_cache(d, cell):
    """Gives every cell the same page-cache start, whatever ran before it: the cell's files are
    written back and dropped from the page cache (POSIX_FADV_DONTNEED), then, for a buffered
    READ, the cell's blocks are read once (buffered) so every tool reads cached data. Without
    this, small buffered writes into pages cached as large folios (left by bigger blocks or by
    the files' creation) ran ~10x slower than into freshly cached pages here."""
    for i in range(cell["nfiles"]):
        fd = os.open(file_path(d, i), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if cell["op"] == "READ" and not cell["direct"]:
        fds = [os.open(file_path(d, i), os.O_RDONLY) for i in range(cell["nfiles"])]
        try:
            for j in range(cell["batch"]):
                f, off = desc_place(j, cell["nfiles"], cell["block"])
                os.pread(fds[f], cell["block"], off)
        finally:
            for fd in fds:
                os.close(fd)


def findmnt(path):
    try:
        out = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,SOURCE,TARGET", "-T", path],
                             capture_output=True, text=True, timeout=10).stdout.split()
        return {"fstype": out[0], "source": out[1], "mount": out[2]}
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return {"fstype": "?", "source": "?", "mount": "?"}


def block_dev_info(source):
    name = os.path.basename(source)
    base = f"/sys/class/block/{name}"
    if not os.path.exists(base):
        return {}
    if os.path.exists(os.path.join(base, "partition")):
        base = os.path.dirname(os.path.realpath(base))
    info = {}
    for key, rel in (("rotational", "queue/rotational"), ("scheduler", "queue/scheduler"),
                     ("model", "device/model")):
        try:
            with open(os.path.join(base, rel)) as f:
                info[key] = f.read().strip()
        except OSError:
            pass
    return info


def machine_info(d):
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?")
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    mnt = findmnt(d)
    try:
        fio_v = subprocess.run(["fio", "--version"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        fio_v = None
    try:
        from importlib.metadata import version
        nixl_v = version("nixl_cu12")
    except Exception:  # noqa: BLE001
        nixl_v = None
    return {"nproc": os.cpu_count(), "kernel": platform.release(), "cpu": cpu,
            "mem_gib": mem / GiB, "dir": d, **mnt, "device": block_dev_info(mnt["source"]),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "fio": fio_v, "nixl": nixl_v, "python": platform.python_version()}


def auto_iters(xfer_bytes, args):
    if args.iters:
        iters = args.iters
    else:
        iters = max(args.min_iters, min(args.max_iters, args.budget // xfer_bytes))
    warmup = args.warmup if args.warmup is not None else max(1, min(50, iters // 10))
    return iters, warmup


def build_cells(args):
    cells = []
    for op in args.ops:
        for direct in args.direct:
            for layout in args.layouts:
                for batch in args.batches:
                    if layout == "many" and batch == 1 and "large" in args.layouts:
                        continue  # the same cell as "large"
                    for block in args.blocks:
                        iters, warmup = auto_iters(block * batch, args)
                        cells.append({"index": len(cells), "op": op, "direct": direct,
                                      "layout": layout, "block": block, "batch": batch,
                                      "nfiles": batch if layout == "many" else 1,
                                      "iters": iters, "warmup": warmup})
    return cells


def file_sizes(cells):
    sizes = {}
    for c in cells:
        for j in range(c["batch"]):
            f, off = desc_place(j, c["nfiles"], c["block"])
            sizes[f] = max(sizes.get(f, 0), off + c["block"])
    return sizes


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------

def cell_label(c):
    layout = "1 file" if c["nfiles"] == 1 else f"{c['nfiles']} files"
    return c["op"], "direct" if c["direct"] else "buffered", layout, fmt_size(c["block"]), str(c["batch"])


def gb(r):
    if r is None:
        return "-"
    if "gbps" not in r:
        return "ERR"
    return f"{r['gbps']:.2f}"


def ratio(a, b):
    if a is None or b is None or "gbps" not in a or "gbps" not in b or b["gbps"] <= 0:
        return "-"
    return f"{a['gbps'] / b['gbps']:.2f}"


def cpu(r):
    if r is None or "cpu_us" not in r or "gbps" not in r:
        return "-"
    return f"{r['cpu_us']:.1f}"


def md_table(header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    def line(vals):
        return "| " + " | ".join(str(v).rjust(w) if i >= 3 else str(v).ljust(w)
                                 for i, (v, w) in enumerate(zip(vals, widths))) + " |"
    sep = "|" + "|".join(("-" * (w + 1) + ":") if i >= 3 else ("-" * (w + 2))
                         for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), sep] + [line(r) for r in rows])


def best_nixl(rec):
    ok = [(q, r) for q, r in rec["nixl"].items() if r and "gbps" in r]
    if not ok:
        return None, None
    return max(ok, key=lambda qr: qr[1]["gbps"])


def print_report(info, args, queues, records, total_s):
    dev = info["device"]
    devs = ", ".join(f"{k} {v}" for k, v in dev.items() if v)
    print(f"Storage side by side: NIXL {info['nixl'] or '?'} POSIX backend vs nixl-rs "
          f"(nixl-bench) vs {info['fio'] or 'fio'} (io_uring), on the same files")
    print(f"machine: nproc {info['nproc']}, kernel {info['kernel']}, {info['cpu']}, "
          f"{info['mem_gib']:.1f} GiB RAM")
    print(f"files: {info['dir']}/nixl-bench-<i>.dat on {info['fstype']} ({info['source']}"
          f"{', ' + devs if devs else ''})")
    print(f"date: {info['date']}; run took {total_s:.0f} s")
    if args.skip_ours:
        print("ours: skipped (--skip-ours)")
    elif not info.get("ours"):
        print(f"ours: {args.nixl_bench} is missing, its columns are '-'")
    else:
        print(f"ours: {info['ours']}")
    qs = []
    for q, st in queues.items():
        if st["available"]:
            qs.append(f"{q}={st['resolved'] or '?'}")
        else:
            qs.append(f"{q}: unavailable ({st['error']})")
    if qs:
        print("NIXL queue types: " + "; ".join(qs))
    iters = "--iters %d" % args.iters if args.iters else (
        f"auto: {fmt_size(args.budget)} per cell, {args.min_iters}..{args.max_iters} transfers")
    print(f"NIXL and ours: {iters}, warmup "
          f"{args.warmup if args.warmup is not None else 'iters/10 (1..50)'}; "
          f"fio: time based {args.runtime:g} s, iodepth = batch"
          f"{', batched submit/complete' if args.fio_batched else ''}. GB = 10^9 bytes; "
          "CPU us per transfer (one batch): NIXL = its process CPU time, ours = rusage incl. "
          "process start. Before each cell its files are synced and dropped from the page "
          "cache (buffered READ: then read once); tools run NIXL queues, ours, fio in turn")
    print()
    header = ["op", "I/O", "layout", "block", "batch", "NIXL best GB/s", "(queue)",
              "ours GB/s", "ours/NIXL", "fio GB/s", "ours/fio",
              "NIXL CPU us/xfer", "ours CPU us/xfer"]
    rows = []
    for rec in records:
        q, b = best_nixl(rec)
        nixl_cell_txt = gb(b) if b else ("-" if not rec["nixl"] else "ERR")
        rows.append([*cell_label(rec["cell"]), nixl_cell_txt, q or "-",
                     gb(rec["ours"]), ratio(rec["ours"], b), gb(rec["fio"]),
                     ratio(rec["ours"], rec["fio"]), cpu(b), cpu(rec["ours"])])
    print(md_table(header, rows))

    if args.verbose:
        avail = [q for q, st in queues.items() if st["available"]]
        header = ["op", "I/O", "layout", "block", "batch", "iters"]
        for q in avail:
            header += [f"{q} GB/s", f"{q} CPU us", f"{q} polls"]
        header += ["NIXL best/fio", "fio CPU us/xfer", "ours lat us"]
        rows = []
        for rec in records:
            c = rec["cell"]
            row = [*cell_label(c), f"{c['iters']}+{c['warmup']}"]
            for q in avail:
                r = rec["nixl"].get(q)
                row += [gb(r), cpu(r), f"{r['polls']:.0f}" if r and "polls" in r else "-"]
            _, b = best_nixl(rec)
            o = rec["ours"]
            row += [ratio(b, rec["fio"]), cpu(rec["fio"]),
                    f"{o['avg_us']:.1f}" if o and "avg_us" in o else "-"]
            rows.append(row)
        print()
        print(md_table(header, rows))

    errors = []
    for rec in records:
        label = " ".join(cell_label(rec["cell"]))
        for q, r in rec["nixl"].items():
            if r and "error" in r and not r["error"].startswith("unavailable"):
                errors.append(f"{label}: NIXL {q}: {r['error']}")
        for tool in ("ours", "fio"):
            r = rec[tool]
            if r and "error" in r:
                errors.append(f"{label}: {tool}: {r['error']}")
    if errors:
        print()
        print("errors:")
        for e in errors:
            print("  " + (e if len(e) < 400 else e[:400] + "..."))


# --------------------------------------------------------------------------------------

def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--nixl-probe":
        nixl_probe(json.loads(sys.argv[2]))
    if len(sys.argv) == 5 and sys.argv[1] == "--nixl-child":
        nixl_child(f"nixl-storage-{sys.argv[2]}", json.loads(sys.argv[3]), sys.argv[4])

    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="4K and 1M blocks, a smaller byte budget per cell, fio 1 s")
    ap.add_argument("--dir", help="directory of the files (default: a new temp dir under /work)")
    ap.add_argument("--keep", action="store_true", help="keep the default temp dir's files")
    ap.add_argument("--blocks", type=csv_list("block", conv=parse_size), default=None,
                    help="block sizes (default 4K,64K,1M,16M; quick 4K,1M)")
    ap.add_argument("--batches", type=csv_list("batch", conv=int), default=[1, 32])
    ap.add_argument("--ops", type=csv_list("op", OPS, str.upper), default=list(OPS))
    ap.add_argument("--direct", type=csv_list("direct", None, parse_onoff), default=[False, True],
                    help="off,on (buffered, O_DIRECT)")
    ap.add_argument("--layouts", type=csv_list("layout", LAYOUTS, str.lower), default=list(LAYOUTS))
    ap.add_argument("--queues", type=csv_list("queue", list(QUEUES), str.lower), default=list(QUEUES),
                    help="NIXL POSIX queue types: default,uring,aio,posix_aio")
    ap.add_argument("--iters", type=int, default=0,
                    help="timed transfers per cell (default: auto from --budget)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up transfers (default iters/10, 1..50)")
    ap.add_argument("--budget", type=parse_size, default=None,
                    help="auto iterations: bytes per cell (default 1G, quick 64M)")
    ap.add_argument("--min-iters", type=int, default=None, help="auto iterations floor (default 5, quick 3)")
    ap.add_argument("--max-iters", type=int, default=None, help="auto iterations cap (default 2000, quick 300)")
    ap.add_argument("--runtime", type=float, default=None, help="fio seconds per cell (default 2, quick 1)")
    ap.add_argument("--fio-batched", action="store_true",
                    help="fio submits and reaps whole batches (iodepth_batch_submit = "
                         "iodepth_batch_complete_min = batch), like one NIXL transfer")
    ap.add_argument("--cell-timeout", type=float, default=180, help="seconds per tool per cell")
    ap.add_argument("--nixl-bench", default=os.path.join(target, "release", "nixl-bench"))
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--skip-nixl", action="store_true")
    ap.add_argument("--skip-fio", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="also a table per NIXL queue type")
    ap.add_argument("--json", metavar="FILE", help="write all raw figures to FILE")
    args = ap.parse_args()
    if args.blocks is None:
        args.blocks = [4 * KiB, MiB] if args.quick else [4 * KiB, 64 * KiB, MiB, 16 * MiB]
    args.budget = args.budget or (64 * MiB if args.quick else GiB)
    args.min_iters = args.min_iters or (3 if args.quick else 5)
    args.max_iters = args.max_iters or (300 if args.quick else 2000)
    args.runtime = args.runtime or (1.0 if args.quick else 2.0)
    for b in args.blocks:
        if b % 4096:
            ap.error(f"block {b}: use multiples of 4 KiB (O_DIRECT alignment)")
    if min(args.batches) < 1:
        ap.error("batches must be >= 1")

    started = time.monotonic()
    made_dir = None
    if args.dir:
        d = os.path.abspath(args.dir)
        os.makedirs(d, exist_ok=True)
    else:
        d = made_dir = tempfile.mkdtemp(prefix="nixl-storage-bench-", dir="/work")
    if ":" in d:
        sys.exit(f"{d}: fio separates file names with ':'; use a directory without one")
    info = machine_info(d)
    if info["fstype"] == "tmpfs":
        log(f"warning: {d} is on tmpfs: O_DIRECT cells will fail and buffered ones measure memory")

    cells = build_cells(args)
    sizes = file_sizes(cells)
    log(f"{len(cells)} cells; {len(sizes)} files in {d} "
        f"({fmt_size(sum(sizes.values()))} in all) on {info['fstype']} {info['source']}")
    prepare_files(d, sizes)

    env = dict(os.environ)
    queues, children = {}, {}
    if not args.skip_nixl:
        for q in args.queues:
            ok, resolved, msg = probe_queue(q, env, 120)
            queues[q] = {"available": ok, "resolved": resolved, "error": msg,
                         "params": QUEUES[q]}
            log(f"NIXL POSIX queue {q} {QUEUES[q]}: " +
                (f"ok ({resolved})" if ok else f"unavailable: {msg}"))
            if ok:
                children[q] = NixlChild(q, d, env, 120)

    ours_bin = None
    if not args.skip_ours:
        if os.path.isfile(args.nixl_bench) and os.access(args.nixl_bench, os.X_OK):
            ours_bin = args.nixl_bench
        else:
            log(f"nixl-bench not found at {args.nixl_bench}: the ours column stays '-' "
                "(build it with cargo build --release -p nixl-bench, or pass --nixl-bench)")
    info["ours"] = ours_bin
    have_fio = not args.skip_fio and shutil.which("fio") is not None
    if not args.skip_fio and not have_fio:
        log("fio not found (apt-get install -y fio): the fio column stays '-'")

    records = []
    try:
        for c in cells:
            rec = {"cell": c, "nixl": {}, "ours": None, "fio": None}
            records.append(rec)
            log(f"[{c['index'] + 1}/{len(cells)}] {' '.join(cell_label(c))} "
                f"({c['iters']}+{c['warmup']} transfers)")
            reset_cache(d, c)
            for q in queues:
                if q in children:
                    r = children[q].run(c, args.cell_timeout)
                else:
                    r = {"error": "unavailable: " + queues[q]["error"]}
                rec["nixl"][q] = r
                if queues[q]["available"]:
                    log(f"    NIXL {q:9} " + (f"{r['gbps']:8.3f} GB/s  {r['cpu_us']:9.1f} us CPU/xfer"
                                              if "gbps" in r else f"ERROR {r['error']}"))
            if ours_bin:
                r = rec["ours"] = run_ours(ours_bin, d, c, args.cell_timeout)
                log("    ours           " + (f"{r['gbps']:8.3f} GB/s  {r['cpu_us']:9.1f} us CPU/xfer"
                                             if "gbps" in r else f"ERROR {r['error']}"))
            if have_fio:
                r = rec["fio"] = run_fio(d, c, args.runtime, args.fio_batched,
                                         args.runtime + args.cell_timeout)
                log("    fio            " + (f"{r['gbps']:8.3f} GB/s" if "gbps" in r
                                             else f"ERROR {r['error']}"))
    except KeyboardInterrupt:
        log("interrupted: reporting the cells done so far")
        if records and not records[-1]["fio"] and not records[-1]["ours"]:
            records.pop()
    finally:
        for ch in children.values():
            ch.close()

    total_s = time.monotonic() - started
    print_report(info, args, queues, records, total_s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "settings": {k: v for k, v in vars(args).items()},
                       "queues": queues, "ours_binary": ours_bin, "total_s": total_s,
                       "cells": records}, f, indent=1)
        log(f"raw figures written to {args.json}")
    if made_dir and not args.keep:
        shutil.rmtree(made_dir, ignore_errors=True)
    elif made_dir:
        log(f"files kept in {made_dir}")


if __name__ == "__main__":
    main()
