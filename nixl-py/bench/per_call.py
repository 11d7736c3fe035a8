"""Per-call cost of NIXL's Python API: nixl_rs against NIXL 1.5.1, in one run.

A 4 KiB WRITE between two agents of one process, posted and polled the way
connectors do it: ``transfer(handle)`` then ``check_xfer_state(handle)`` until
"DONE", repeated. Each implementation runs in its own child process (both bind
UCX; NIXL's wheel brings its own). Prints a Markdown table of time per iteration
and per call. A benchmark, not a test: nothing is asserted.

Usage: python per_call.py [--iters N] [--nixl-wheel DIR]
  DIR: where the nixl-cu12 wheel is installed (default $NIXL_TEST_NIXL_WHEEL_DIR);
  without it only nixl_rs rows are printed.
"""

import argparse
import glob
import json
import os
import platform
import subprocess
import sys

CHILD = r'''
import json, sys, time
import numpy as np
impl, backend, iters, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if impl == "nixl":
    from nixl_cu12._api import nixl_agent, nixl_agent_config
else:
    from nixl_rs._api import nixl_agent, nixl_agent_config
a = nixl_agent("bench-a", nixl_agent_config(backends=[backend]))
b = nixl_agent("bench-b", nixl_agent_config(backends=[backend]))
src = np.ones(size, dtype=np.uint8)
dst = np.zeros(size, dtype=np.uint8)
a.register_memory(a.get_reg_descs([(src.ctypes.data, size, 0, "")], "DRAM"))
b.register_memory(b.get_reg_descs([(dst.ctypes.data, size, 0, "")], "DRAM"))
peer = a.add_remote_agent(b.get_agent_metadata())
loc = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(src.ctypes.data, size, 0)], "DRAM")
rem = a.prep_xfer_dlist(peer, [(dst.ctypes.data, size, 0)], "DRAM")
h = a.make_prepped_xfer("WRITE", loc, [0], rem, [0])
transfer, check = a.transfer, a.check_xfer_state
clock = time.perf_counter_ns

def run(n):
    iters_ns, post_ns, checks = [], [], 0
    for _ in range(n):
        t0 = clock()
        st = transfer(h)
        t1 = clock()
        while st != "DONE":
            st = check(h)
            checks += 1
        t2 = clock()
        iters_ns.append(t2 - t0)
        post_ns.append(t1 - t0)
    return iters_ns, post_ns, checks

run(min(2000, iters))
iters_ns, post_ns, checks = run(iters)
assert (dst == 1).all()
# The cost of one check_xfer_state on a finished transfer.
t0 = clock()
for _ in range(iters):
    check(h)
check_ns = (clock() - t0) / iters
iters_ns.sort()
print("@@" + json.dumps({
    "mean_us": sum(iters_ns) / len(iters_ns) / 1e3,
    "p50_us": iters_ns[len(iters_ns) // 2] / 1e3,
    "p99_us": iters_ns[int(len(iters_ns) * 0.99)] / 1e3,
    "transfer_us": sum(post_ns) / len(post_ns) / 1e3,
    "check_us": check_ns / 1e3,
    "checks_per_iter": checks / iters,
}), flush=True)
if impl == "nixl":
    import os
    os._exit(0)    # the wheel may crash in its own exit path
'''


def run(impl, backend, iters, env):
    p = subprocess.run([sys.executable, "-c", CHILD, impl, backend, str(iters), str(4096)],
                       capture_output=True, text=True, env={**os.environ, **env}, timeout=600)
    for line in p.stdout.splitlines():
        if line.startswith("@@"):
            return json.loads(line[2:])
    sys.stderr.write(f"{impl}/{backend} failed ({p.returncode}):\n{p.stderr[-2000:]}\n")
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--nixl-wheel", default=os.environ.get("NIXL_TEST_NIXL_WHEEL_DIR"))
    args = ap.parse_args()
    ucx = {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib"}
    rows = []
    ucp = None
    if args.nixl_wheel and os.path.isdir(os.path.join(args.nixl_wheel, "nixl_cu12")):
        libs = glob.glob(os.path.join(args.nixl_wheel, "nixl_cu12.libs", "libucp-*.so*"))
        ucp = libs[0] if libs else None
        rows.append(("NIXL 1.5.1 (nixl_cu12)", "UCX (wheel's UCX)",
                     run("nixl", "UCX", args.iters, {**ucx, "PYTHONPATH": args.nixl_wheel})))
    if ucp:
        rows.append(("nixl_rs", "UCX (NIXL wheel's UCX)",
                     run("nixl_rs", "UCX", args.iters, {**ucx, "NIXL_UCX_LIB": ucp})))
    rows.append(("nixl_rs", "UCX (host's libucp)", run("nixl_rs", "UCX", args.iters, ucx)))
    rows.append(("nixl_rs", "TCP (nixl-tcp)", run("nixl_rs", "TCP", args.iters, {})))
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"4 KiB WRITE, transfer + check_xfer_state until DONE, {args.iters} iterations; "
          f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}\n")
    print("| implementation | backend | µs/iter mean | p50 | p99 | transfer() µs | "
          "check_xfer_state() µs | checks/iter |")
    print("|---|---|---|---|---|---|---|---|")
    for impl, backend, r in rows:
        if r is None:
            print(f"| {impl} | {backend} | failed | | | | | |")
            continue
        print(f"| {impl} | {backend} | {r['mean_us']:.2f} | {r['p50_us']:.2f} | {r['p99_us']:.2f} "
              f"| {r['transfer_us']:.2f} | {r['check_us']:.3f} | {r['checks_per_iter']:.1f} |")


if __name__ == "__main__":
    main()
