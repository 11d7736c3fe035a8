#!/usr/bin/env python3
"""Host memory on one host: NIXL (two processes, UCX) against nixl-bench (nixl-tcp).

For every point (block size x batch x layout), in one run and interleaved so that
both sides see the same machine:
  1. two NIXL 1.5.1 agents, each in its own process (NIXL's Python API, UCX backend;
     on one host UCX moves host memory by cross-memory attach or shared memory), one
     the target, one the initiator (metadata in-band): READ then WRITE, one
     request in flight, one prepared handle re-posted (transfer() then
     check_xfer_state() polled until DONE), as nixlbench does;
  2. nixl-bench on its default backend (nixl-tcp, same-host path), local mode (the
     target is its child process): READ then WRITE, the same iterations.
Both sides' buffers ask for transparent huge pages (madvise(MADV_HUGEPAGE), as numpy
and PyTorch buffers do) and are at least 4 MiB, 2 MiB-aligned, so the kernel can back
them with huge pages; the NIXL processes report how much of their buffers is.

Layouts: `consecutive` = batch adjacent blocks (NIXL merges them, and so does
nixl-bench by default); `scattered` = every block its own descriptor, a block-sized
gap after each (nothing can merge). Batch 1 is the same in both and runs once.

NIXL's figures are measured through its Python binding, so they include its per-call
cost (transfer() and each check_xfer_state() poll); the header gives that cost. It
matters at 4 KiB only.

Usage (from the repository root, after `cargo build --release -p nixl-bench`):
  PYTHONPATH=/opt/nixl-wheel python3 scripts/nixl_host_side_by_side.py \
      [--bench target/release/nixl-bench] [--sizes 4K,64K,1M,16M,64M] [--batches 1,32] \
      [--bytes-per-point 2G] [--raw FILE.json]
(The wheel directory must hold nixl_cu12 and numpy.) GB = 10^9 bytes.
"""

import argparse
import ctypes
import json
import os
import platform
import select
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HUGE = 2 << 20
MIN_BUF = 4 << 20
MADV_HUGEPAGE = 14


def parse_size(s):
    s = s.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s[:-1] if mult > 1 else s) * mult


def human(n):
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def stride(block, layout):
    return 2 * block if layout == "scattered" else block


def buffer_bytes(block, batch, layout):
    return max(MIN_BUF, stride(block, layout) * batch)


def iterations(block, batch, per_point):
    """Measured iterations of a point, the same on both sides: about `per_point`
    bytes, at least 8, at most 20,000; warmup a tenth (at least 2)."""
    iters = int(min(20000, max(8, per_point // (block * batch))))
    return iters, max(2, iters // 10)


# ---------------------------------------------------------------- NIXL processes


def huge_buffer(n):
    """n bytes of host memory, 2 MiB-aligned, madvise(MADV_HUGEPAGE), touched."""
    import numpy as np

    raw = np.empty(n + HUGE, dtype=np.uint8)
    off = (-raw.ctypes.data) % HUGE
    buf = raw[off:off + n]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    span = n - n % HUGE
    if span and libc.madvise(buf.ctypes.data, span, MADV_HUGEPAGE) != 0:
        print(f"madvise failed: errno {ctypes.get_errno()}", file=sys.stderr)
    buf[:] = 1
    return raw, buf


def huge_kib(addr, n):
    """AnonHugePages (KiB) of the mappings overlapping addr..addr+n, from smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < addr + n and hi > addr
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


def nixl_agent(name):
    """A NIXL agent on UCX without its listener thread: metadata travels in-band
    through the pipes here (NIXL's listener thread polls without sleeping and would
    take a core of this machine away from the copies)."""
    from nixl_cu12._api import nixl_agent as agent, nixl_agent_config

    return agent(name, nixl_agent_config(
        enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]))


def nixl_target(n):
    agent = nixl_agent("nixl-target")
    raw, buf = huge_buffer(n)
    agent.register_memory([(buf.ctypes.data, n, 0, "")], "DRAM")
    md = agent.get_agent_metadata().hex()
    print(f"@@ ready {buf.ctypes.data} {huge_kib(buf.ctypes.data, n)} {md}", flush=True)
    # No progress thread: progress the worker (the initiator's connection setup needs
    # it) every 10 ms until told to exit.
    while not select.select([sys.stdin], [], [], 0.01)[0]:
        agent.get_new_notifs()
    os._exit(0)


def nixl_initiator(taddr, plan):
    """plan: {"n": buffer bytes, "points": [[op, block, batch, layout, iters, warmup]]}.
    Prints "@@ " + JSON: per point the seconds per request and the polls per request,
    plus the cost of one check_xfer_state() call and the buffer's huge-page KiB."""
    agent = nixl_agent("nixl-initiator")
    n = plan["n"]
    raw, buf = huge_buffer(n)
    laddr = buf.ctypes.data
    agent.register_memory([(laddr, n, 0, "")], "DRAM")
    agent.add_remote_agent(bytes.fromhex(sys.stdin.readline().strip()))
    out = {"huge_kib": huge_kib(laddr, n), "points": []}
    for op, block, batch, layout, iters, warmup in plan["points"]:
        st = stride(block, layout)
        local = [(laddr + i * st, block, 0) for i in range(batch)]
        remote = [(taddr + i * st, block, 0) for i in range(batch)]
        if plan.get("api") == "initialize":
            h = agent.initialize_xfer(op, agent.get_xfer_descs(local, "DRAM"),
                                      agent.get_xfer_descs(remote, "DRAM"), "nixl-target")
        else:
            lp = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
            rp = agent.prep_xfer_dlist("nixl-target", remote, "DRAM")
            h = agent.make_prepped_xfer(op, lp, list(range(batch)), rp, list(range(batch)))
        polls = 0
        for i in range(warmup + iters):
            if i == warmup:
                start = time.perf_counter()
                polls = 0
            state = agent.transfer(h)
            while state == "PROC":
                polls += 1
                state = agent.check_xfer_state(h)
            if state != "DONE":
                sys.exit(f"NIXL {op} {block}x{batch}: {state}")
        secs = (time.perf_counter() - start) / iters
        if "poll_us" not in out:
            # One check_xfer_state() on a finished handle: the binding's per-call cost.
            k = 20000
            t = time.perf_counter()
            for _ in range(k):
                agent.check_xfer_state(h)
            out["poll_us"] = (time.perf_counter() - t) / k * 1e6
        out["points"].append([op, block, batch, layout, secs, polls / iters])
        agent.release_xfer_handle(h)
    print("@@ " + json.dumps(out), flush=True)
    os._exit(0)


def run_nixl(block, batch, layout, iters, warmup, env):
    """One point on NIXL (READ then WRITE), each agent in a fresh process."""
    n = buffer_bytes(block, batch, layout)
    target = subprocess.Popen(
        [sys.executable, __file__, "--nixl-target", str(n)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        while True:
            line = target.stdout.readline()
            if not line:
                sys.exit("the NIXL target did not start")
            if line.startswith("@@ ready"):
                _, _, taddr, thuge, md = line.split()
                break
        plan = {"n": n, "points": [[op, block, batch, layout, iters, warmup]
                                   for op in ("READ", "WRITE")]}
        child = subprocess.run(
            [sys.executable, __file__, "--nixl-initiator", taddr, json.dumps(plan)],
            input=md + "\n", env=env, capture_output=True, text=True, timeout=600)
        line = [l for l in child.stdout.splitlines() if l.startswith("@@ ")]
        if not line:
            sys.exit("the NIXL initiator failed:\n" + child.stdout + child.stderr[-4000:])
        res = json.loads(line[0][3:])
        res["target_huge_kib"] = int(thuge)
        res["n"] = n
        return res
    finally:
        try:
            target.stdin.write("EXIT\n")
            target.stdin.flush()
            target.wait(timeout=10)
        except Exception:
            target.kill()


# ---------------------------------------------------------------- nixl-bench


def run_bench(bench, block, batch, layout, iters, warmup, extra):
    """One point on nixl-bench (READ then WRITE) in local mode: its JSON report."""
    n = buffer_bytes(block, batch, layout)
    cmd = [bench, "--op-type", "READ,WRITE",
           "--start-block-size", str(block), "--max-block-size", str(block),
           "--start-batch-size", str(batch), "--max-batch-size", str(batch),
           "--num-iter", str(iters), "--warmup-iter", str(warmup),
           "--large-blk-iter-ftr", "1", "--descriptor-layout", layout,
           "--total-buffer-size", str(n), "--json"] + extra
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit("nixl-bench failed:\n" + " ".join(cmd) + "\n" + out.stderr[-4000:])
    report = json.loads(out.stdout[out.stdout.index("{"):])
    report["command"] = cmd
    return report


# ---------------------------------------------------------------- main


def machine():
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "?"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} cores ({model}), {mem:.0f} GiB, Linux {platform.release()},"
            f" THP enabled={thp}")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--nixl-target":
        nixl_target(int(sys.argv[2]))
    if len(sys.argv) > 1 and sys.argv[1] == "--nixl-initiator":
        nixl_initiator(int(sys.argv[2]), json.loads(sys.argv[3]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", default=os.path.join(ROOT, "target/release/nixl-bench"))
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--layouts", default="consecutive,scattered")
    ap.add_argument("--bytes-per-point", default="2G",
                    help="bytes each measured point moves (iterations: 8 to 20,000)")
    ap.add_argument("--bench-arg", action="append", default=[],
                    help="extra nixl-bench argument (repeatable), e.g. --bench-arg=--backend-param=...")
    ap.add_argument("--skip-nixl", action="store_true", help="only nixl-bench (for A/B runs)")
    ap.add_argument("--raw", help="write every figure and command as JSON here")
    args = ap.parse_args()

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    layouts = args.layouts.split(",")
    per_point = parse_size(args.bytes_per_point)
    points = [(b, n, l) for b in sizes for n in batches
              for l in (layouts[:1] if n == 1 else layouts)]

    import nixl_cu12
    wheel = os.path.dirname(os.path.dirname(nixl_cu12.__file__))
    libs = os.path.join(wheel, "nixl_cu12.libs")
    ucx = sorted(f for f in os.listdir(libs) if f.startswith("libucp")) if os.path.isdir(libs) else []
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"),
               UCX_MODULES=os.environ.get("UCX_MODULES", "^ib"))

    started = time.time()
    rows, raw, info = [], [], {}
    for block, batch, layout in points:
        iters, warmup = iterations(block, batch, per_point)
        nixl = None if args.skip_nixl else run_nixl(block, batch, layout, iters, warmup, env)
        ours = run_bench(args.bench, block, batch, layout, iters, warmup, args.bench_arg)
        info.setdefault("bench", ours["run"])
        if nixl:
            info.setdefault("poll_us", nixl["poll_us"])
            info.setdefault("huge", []).append(
                (nixl["n"], nixl["huge_kib"], nixl["target_huge_kib"]))
        ours_rows = {r["op"]: r for r in ours["results"]}
        for op in ("READ", "WRITE"):
            r = ours_rows[op]
            bytes_req = block * batch
            ours_s = bytes_req / (r["bw_gbps"] * 1e9)
            n = next((p for p in nixl["points"] if p[0] == op), None) if nixl else None
            rows.append((op, block, batch, layout, iters, n[4] if n else None,
                         n[5] if n else None, ours_s, r["segments"]))
        raw.append({"point": [block, batch, layout, iters, warmup], "nixl": nixl,
                    "nixl_bench": {"command": ours["command"], "results": ours["results"]}})

    run = info["bench"]
    print(f"Host memory on one host, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))};"
          f" {machine()}")
    print(f"NIXL 1.5.1 ({wheel}), UCX backend, UCX from the wheel"
          f" ({', '.join(ucx) or '?'}), UCX_NET_DEVICES={env['UCX_NET_DEVICES']}"
          f" UCX_MODULES={env['UCX_MODULES']} UCX_TLS={env.get('UCX_TLS', 'default')};"
          " target and initiator in two fresh processes per point, metadata in-band,"
          " no progress or listener thread (nixlbench's default; on this machine those"
          " threads poll without sleeping and take a core each); the target progresses"
          " its worker every 10 ms")
    if "poll_us" in info:
        huge = ", ".join(f"{human(n)}: {a // 1024}/{b // 1024} MiB" for n, a, b in info["huge"][:3])
        print(f"NIXL timed through Python: one check_xfer_state() call costs"
              f" {info['poll_us']:.2f} us (transfer() is of the same order), included in its"
              f" figures; huge pages backing its buffers (initiator/target): {huge}, ...")
    v = run["versions"]
    print(f"nixl-bench {v['nixl_bench']} (nixl-tcp {v['nixl_tcp']}), backend {run['backend']}"
          f" {run['backend_params'] or ''}, local mode (target in a child process);"
          f" data path: {run['transport']['data_path']}")
    print(f"Buffers: host memory asking for transparent huge pages (at least {human(MIN_BUF)},"
          f" 2 MiB-aligned) on both sides; consecutive = adjacent blocks, merged by both;"
          f" scattered = a block-sized gap after every block, one descriptor each;"
          f" one request in flight; prepared requests re-posted; iterations per point ="
          f" {human(per_point)} / request bytes, 8 to 20,000, warmup a tenth, the same on both sides")
    print("GB/s per request (GB = 10^9 bytes); 4 KiB x 1 in us per request; ratio ="
          " nixl-rs speed / NIXL speed (above 1: nixl-rs faster)")
    print()
    print(f"| {'op':5} | {'block x batch':15} | {'layout':11} | {'iters':>5} | {'NIXL':>9} |"
          f" {'polls':>5} | {'nixl-rs':>9} | {'ratio':>5} |")
    print(f"|{'-' * 7}|{'-' * 17}|{'-' * 13}|{'-' * 7}|{'-' * 11}|{'-' * 7}|{'-' * 11}|{'-' * 7}|")
    for op, block, batch, layout, iters, n, polls, o, segs in rows:
        req = block * batch
        small = block == 4096 and batch == 1

        def fmt(s):
            if s is None:
                return f"{'-':>9}"
            return f"{s * 1e6:6.2f} us" if small else f"{req / s / 1e9:9.2f}"

        ratio = f"{n / o:5.2f}" if n else f"{'-':>5}"
        polls = f"{polls:5.1f}" if polls is not None else f"{'-':>5}"
        print(f"| {op:5} | {human(block) + ' x ' + str(batch):15} | {layout:11} | {iters:5} |"
              f" {fmt(n)} | {polls} | {fmt(o)} | {ratio} |")
    print(f"\n({time.time() - started:.0f} s)")
    if args.raw:
        with open(args.raw, "w") as f:
            json.dump({"machine": machine(), "bench_run": run, "points": raw}, f, indent=1)
    os._exit(0)


if __name__ == "__main__":
    main()
