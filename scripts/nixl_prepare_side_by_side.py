#!/usr/bin/env python3
"""NIXL's descriptor preparation on the lists nixl-bench/benches/prepare.rs uses.

Two NIXL agents in one process (UCX backend), N descriptors of 64 bytes in one
registration per side. Times prep_xfer_dlist (local and remote) and
make_prepped_xfer (all indices, no merging) for:
  regular   - consecutive blocks as an Nx3 array (the ordinary way)
  strided   - the same blocks as one Nx5 row (NIXL 1.5's compressed form)
  shuffled  - the same blocks in the bench's permutation, Nx3
Prints the best of several runs, in milliseconds.

Needs NIXL's wheel, not part of nixl-rs:
  pip install --no-deps --target /tmp/nixlpy nixl-cu12==1.5.1 numpy
  PYTHONPATH=/tmp/nixlpy UCX_NET_DEVICES=lo UCX_MODULES=^ib \
      python3 scripts/nixl_prepare_side_by_side.py [N ...]
"""
import os
import sys
import time

import numpy as np
from nixl_cu12._api import nixl_agent, nixl_agent_config

DESC = 64


def shuffle(n):
    """The bench's permutation: xorshift-driven Fisher-Yates over 0..n."""
    v = np.arange(n, dtype=np.uint64)
    x = 0x9E3779B97F4A7C15
    m = (1 << 64) - 1
    for i in range(n - 1, 0, -1):
        x ^= (x << 13) & m
        x ^= x >> 7
        x ^= (x << 17) & m
        j = x % (i + 1)
        v[i], v[j] = v[j], v[i]
    return v


def best(f, runs):
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        r = f()
        out.append(time.perf_counter() - t)
        if r is not None:
            r.release()
    return min(out) * 1e3


def measure(a, n, layout, lo, re, idx, runs):
    """Time preparing `lo` (local) and `re` (at "target"), then a request over all."""
    pl = best(lambda: a.prep_xfer_dlist("NIXL_INIT_AGENT", lo, "DRAM"), runs)
    pr = best(lambda: a.prep_xfer_dlist("target", re, "DRAM"), runs)
    hl = a.prep_xfer_dlist("NIXL_INIT_AGENT", lo, "DRAM")
    hr = a.prep_xfer_dlist("target", re, "DRAM")
    mk = best(lambda: a.make_prepped_xfer("WRITE", hl, idx, hr, idx, skip_desc_merge=True), runs)
    print(f"nixl {n:>9} {layout:<8} prep_local {pl:9.3f} ms  prep_remote {pr:9.3f} ms  make_request {mk:9.3f} ms", flush=True)
    hl.release()
    hr.release()


def main():
    sizes = [int(s) for s in sys.argv[1:]] or [1_000, 1_000_000, 10_000_000]
    conf = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    a = nixl_agent("initiator", conf)
    b = nixl_agent("target", conf)
    for n in sizes:
        runs = 5 if n <= 1_000_000 else 3
        la = np.zeros(n * DESC, dtype=np.uint8)
        lb = np.zeros(n * DESC, dtype=np.uint8)
        ra = a.register_memory([(la.ctypes.data, la.nbytes, 0, "")], "DRAM")
        rb = b.register_memory([(lb.ctypes.data, lb.nbytes, 0, "")], "DRAM")
        a.add_remote_agent(b.get_agent_metadata())
        offs = {
            "regular": np.arange(n, dtype=np.uint64) * DESC,
        }
        perm = shuffle(n) if n <= 1_000_000 or os.environ.get("SHUFFLE_10M") else None
        if perm is not None:
            offs["shuffled"] = perm * DESC
        idx = np.arange(n, dtype=np.int32)
        for layout, off in offs.items():
            def arr(base):
                m = np.empty((n, 3), dtype=np.uint64)
                m[:, 0] = base + off
                m[:, 1] = DESC
                m[:, 2] = 0
                return m
            measure(a, n, layout, arr(la.ctypes.data), arr(lb.ctypes.data), idx, runs)
        strided = lambda base: np.array([[base, DESC, 0, DESC, n]], dtype=np.uint64)
        measure(a, n, "strided", strided(la.ctypes.data), strided(lb.ctypes.data), idx, runs)
        a.remove_remote_agent("target")
        a.deregister_memory(ra)
        b.deregister_memory(rb)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
