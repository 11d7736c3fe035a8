#!/usr/bin/env bash
# DRAM-to-DRAM bandwidth: ucx_perftest (ucx-utils) beside nixl-ucx's ucx_bw bench,
# same UCX_TLS, same sizes, one run. Usage (from the repository root):
#   UCX_TLS=shm,self nixl-ucx/benches/compare.sh
# With shared memory on UCX 1.13-1.22 also export
#   UCX_POSIX_ERROR_HANDLING=y UCX_SYSV_ERROR_HANDLING=y
# Set PERFTEST to another ucx_perftest (e.g. the libucx-cu12 wheel's) to compare 1.22.
# Note: ucx_perftest puts into UCX-allocated memory by default, which shared-memory
# transports can map directly; nixl registers application memory (ucp_mem_map of an
# existing buffer), which UCX reaches by CMA or by active-message emulation instead.
set -euo pipefail
PERFTEST=${PERFTEST:-ucx_perftest}
SIZES=${SIZES:-4096 16384 65536 262144 1048576 4194304 16777216}
PORT=${PORT:-13377}
ITERS=${ITERS:-2000}

perf() { # test size -> MB/s
    local t=$1 s=$2 n=$ITERS
    [ "$s" -ge 4194304 ] && n=200
    "$PERFTEST" -p "$PORT" >/dev/null 2>&1 &
    local srv=$!
    sleep 0.3
    local out
    out=$(timeout 120 "$PERFTEST" 127.0.0.1 -p "$PORT" -t "$t" -s "$s" -n "$n" 2>/dev/null | awk '/^Final:/ {print $6}')
    wait "$srv" 2>/dev/null || true
    echo "${out:-n/a}"
}

echo "ucx_perftest ($PERFTEST), UCX_TLS=${UCX_TLS:-<default>}; MB/s = 2^20 bytes/s"
printf "%10s %14s %14s\n" size put_bw get_bw
for s in $SIZES; do
    printf "%10s %14s %14s\n" "$s" "$(perf ucp_put_bw "$s")" "$(perf ucp_get "$s")"
done
echo
echo "nixl-ucx ucx_bw (GB/s = 10^9 bytes/s; batch = descriptors per request, one request in flight)"
NIXL_UCX_BW_SIZES=$(echo "$SIZES" | tr ' ' ',') cargo bench -q -p nixl-ucx --bench ucx_bw
