#!/usr/bin/env python3
"""nixl-tcp's data paths against the machine's own baselines, in one run.

Runs nixl-bench (two processes on this machine) for every path nixl-tcp has
(same-host shared memory, same-host cross-memory attach, TCP on one connection,
TCP on several), consecutive and scattered blocks, batch 1 and 32, WRITE and
READ (one invocation each, so both start on fresh connections), each with --baselines (memcpy of the same bytes, a loopback TCP
stream and ping-pongs measured by the same program right before), and prints one
Markdown table with the ratios the targets are stated in.

    cargo build --release -p nixl-bench
    python3 scripts/tcp_matrix.py [--bench target/release/nixl-bench] [--quick]

Figures are single runs on a shared machine: compare ratios within a row (the
baselines come from the same invocation), not absolute times across runs.
"""

import argparse
import json
import os
import subprocess
import sys

SIZES = [4096, 65536, 1 << 20, 16 << 20]

PATHS = [
    ("same-host memfd", ["--memory", "backend"]),
    ("same-host CMA", ["--memory", "host"]),
    ("TCP, 1 connection", ["--backend-param", "same_host=off", "--backend-param", "connections=1"]),
    ("TCP, default connections", ["--backend-param", "same_host=off"]),
]


def run(bench, extra, layout, batch, op, quick):
    top = "16M" if batch == 1 else "1M"
    cmd = [
        bench, "--op-type", op, "--descriptor-layout", layout,
        "--start-batch-size", str(batch), "--max-batch-size", str(batch),
        "--start-block-size", "4K", "--max-block-size", top,
        "--baselines", "--json",
    ] + (["--num-iter", "128", "--warmup-iter", "16"] if quick else []) + extra
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--bench", default=os.path.join(here, "..", "target", "release", "nixl-bench"))
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    args = ap.parse_args()
    print("| path | layout, batch | op | 4 KiB | 64 KiB | 1 MiB | 16 MiB | baselines |")
    print("|---|---|---|---|---|---|---|---|")
    for name, extra in PATHS:
        for layout in ("consecutive", "scattered"):
            for batch in (1, 32):
                for op in ("WRITE", "READ"):
                    # One invocation per op: each starts on fresh connections.
                    r = run(args.bench, extra, layout, batch, op, args.quick)
                    b = r["run"]["baselines"]
                    memcpy = {n: g for n, g in b["memcpy"]}
                    tcp = name.startswith("TCP")
                    path = r["run"]["transport"]["data_path"] or "?"
                    cells = []
                    for size in SIZES:
                        row = next((x for x in r["results"] if x["op"] == op
                                    and x["block_size"] == size), None)
                        if row is None:
                            cells.append("–")
                            continue
                        gbps, lat = row["bw_gbps"], row["avg_lat_us"]
                        if size == 4096 and batch == 1:
                            half = b["tcp_half_rtt_4k_us"] if op == "WRITE" else b["tcp_half_rtt_4k_read_us"]
                            ratio = f", {lat / half:.2f}x half RTT" if tcp else ""
                            cells.append(f"{lat:.1f} µs{ratio} (Tx p50 {row['p50_tx_us']:.1f}, p99 {row['p99_tx_us']:.1f})")
                        elif tcp and size >= 1 << 20:
                            cells.append(f"{gbps:.2f} GB/s ({gbps / b['tcp_stream_gbps']:.2f}x stream)")
                        elif size >= 1 << 20:
                            ref = memcpy.get(size * batch)
                            ratio = f" ({gbps / ref:.2f}x memcpy)" if ref else ""
                            cells.append(f"{gbps:.2f} GB/s{ratio}")
                        else:
                            cells.append(f"{gbps:.2f} GB/s")
                    base = (f"stream {b['tcp_stream_gbps']:.2f} GB/s, half RTT W {b['tcp_half_rtt_4k_us']:.1f} / "
                            f"R {b['tcp_half_rtt_4k_read_us']:.1f} µs")
                    print(f"| {name} | {layout}, {batch} | {op} | " + " | ".join(cells) + f" | {base} |")
                    sys.stdout.flush()
                print(f"<!-- {name}, {layout}, {batch}: {path} -->")


if __name__ == "__main__":
    main()
