#!/usr/bin/env python3
"""nixl-rs against NIXL on one NIXL target, in one run.

One NIXL agent (the target, its own process: tests/nixl_peer.py) registers a DRAM
buffer and listens for metadata. Then, one after the other, against that same target:
  1. a NIXL initiator (this process, NIXL's Python API) READs and WRITEs blocks of
     each size, one request in flight, a prepared handle re-posted;
  2. nixl-bench (--peer-kind nixl) does the same from a nixl-rs agent, bound to the
     wheel's own libucp.
and prints both side by side (average latency per transfer, GB = 10^9 bytes).

Usage (from the repository root, after `cargo build --release -p nixl-bench --features ucx`):
  PYTHONPATH=<nixl-cu12 wheel dir> python3 scripts/nixl_side_by_side.py [--iters N]

NIXL's numbers include its Python binding's per-call cost (transfer() and the
check_xfer_state() polls); nixl-bench's are its own (post and await, in Rust).
"""

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def nixl_initiator(port, taddr, iters_arg):
    """NIXL's own initiator against the target: prints "@@ [[op, size, us], ...]"."""
    import numpy as np
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    total = max(SIZES)
    agent = nixl_agent("nixl-initiator", nixl_agent_config(
        enable_listen_thread=True, listen_port=free_port(), backends=["UCX"]))
    buf = np.ones(total, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, total, 0, "")], "DRAM")
    agent.fetch_remote_metadata("nixl-target", "127.0.0.1", port)
    deadline = time.time() + 20
    while not agent.check_remote_metadata("nixl-target"):
        if time.time() > deadline:
            sys.exit("NIXL could not fetch the target's metadata")
        time.sleep(0.01)
    res = []
    for op in ("READ", "WRITE"):
        for size in SIZES:
            local = agent.get_xfer_descs([(buf.ctypes.data, size, 0)], "DRAM")
            remote = agent.get_xfer_descs([(taddr, size, 0)], "DRAM")
            h = agent.initialize_xfer(op, local, remote, "nixl-target")
            iters = max(10, iters_arg if size < (1 << 20) else iters_arg // 4)
            for i in range(iters + 10):
                if i == 10:
                    start = time.perf_counter()
                state = agent.transfer(h)
                while state == "PROC":
                    state = agent.check_xfer_state(h)
                if state != "DONE":
                    sys.exit(f"NIXL {op} {size}: {state}")
            res.append([op, size, (time.perf_counter() - start) / iters * 1e6])
            agent.release_xfer_handle(h)
    print("@@ " + json.dumps(res), flush=True)
    os._exit(0)


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--nixl-initiator":
        nixl_initiator(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--bench", default=os.path.join(ROOT, "target/release/nixl-bench"))
    args = ap.parse_args()

    wheel = next(p for p in sys.path if os.path.isdir(os.path.join(p, "nixl_cu12")))
    libucp = glob.glob(os.path.join(wheel, "nixl_cu12.libs", "libucp-*.so*"))[0]
    env = dict(os.environ, UCX_NET_DEVICES="lo", UCX_MODULES="^ib")

    total = max(SIZES)
    port = free_port()
    target = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "tests/nixl_peer.py"), "nixl-target",
         str(total + 4096), str(port)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    while True:
        line = target.stdout.readline()
        if not line:
            sys.exit("the NIXL target did not start")
        if line.startswith("@@ OK ready"):
            taddr = int(line.split()[3])
            break

    # The NIXL initiator runs in a child process that exits before nixl-bench starts
    # (its progress threads would compete for the CPUs).
    child = subprocess.run(
        [sys.executable, __file__, "--nixl-initiator", str(port), str(taddr), str(args.iters)],
        env=env, capture_output=True, text=True, timeout=300)
    line = [l for l in child.stdout.splitlines() if l.startswith("@@ ")]
    if not line:
        sys.exit("the NIXL initiator failed:\n" + child.stdout + child.stderr)
    nixl = {(op, int(size)): us for op, size, us in json.loads(line[0][3:])}

    out = subprocess.run(
        [args.bench, "--role", "initiator", "--peer-kind", "nixl", "--peer",
         f"127.0.0.1:{port}", "--backend", "ucx", "--op-type", "READ,WRITE",
         "--start-block-size", str(min(SIZES)), "--max-block-size", str(total),
         "--total-buffer-size", str(total), "--num-iter", str(args.iters), "--json"],
        env=dict(env, NIXL_UCX_LIB=libucp), capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        sys.exit("nixl-bench failed:\n" + out.stderr)
    report = json.loads(out.stdout[out.stdout.index("{"):])
    ours = {(r["op"], r["block_size"]): r["avg_lat_us"] for r in report["results"]}
    target.stdin.write("EXIT\n")
    target.stdin.flush()
    target.wait(timeout=10)

    ucx = os.path.basename(libucp)
    print(f"One NIXL 1.5.1 target agent (own process, DRAM); UCX from the wheel ({ucx}),"
          f" UCX_TLS={os.environ.get('UCX_TLS', 'default')}; one request in flight")
    print(f"{'op':6} {'block':>9}  {'NIXL->NIXL us':>14} {'GB/s':>7}  "
          f"{'nixl-rs->NIXL us':>17} {'GB/s':>7}  {'NIXL/ours':>9}")
    for op in ("READ", "WRITE"):
        for size in SIZES:
            n = nixl[(op, size)]
            r = ours.get((op, size))
            rs = f"{r:17.1f} {size / r / 1e3:7.2f}  {n / r:9.2f}" if r else f"{'?':>17}"
            print(f"{op:6} {size:>9}  {n:14.1f} {size / n / 1e3:7.2f}  {rs}")
    os._exit(0)


if __name__ == "__main__":
    main()
