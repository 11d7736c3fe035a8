#!/usr/bin/env bash
# DRAM-to-DRAM bandwidth: ucx_perftest (ucx-utils) beside nixl-ucx's ucx_bw bench, same
# UCX, same UCX_TLS, same sizes, one run, with the ratio of the two.
#
# Usage (from the repository root):
#   UCX_TLS=shm,self nixl-ucx/benches/compare.sh                     # Debian's UCX 1.13
#   UCX_TLS=shm,self NIXL_UCX_LIB=/opt/nixl-ucx-wheel/libucx/lib/libucp.so.0 \
#       nixl-ucx/benches/compare.sh                                  # the 1.22 wheel
# With NIXL_UCX_LIB set, the ucx_perftest next to that libucp (../bin) is used, so
# both sides run the same UCX. On shared memory also export
#   UCX_POSIX_ERROR_HANDLING=y UCX_SYSV_ERROR_HANDLING=y
#
# ucx_perftest puts into memory UCX allocates (ucp_mem_map with ALLOCATE): the ratio
# columns compare it with nixl-ucx on the same kind of memory (UcxBackend::alloc).
# The `host` columns are ordinary application memory (AlignedBuf), which UCX reaches
# by CMA (1.14+) or by active messages (1.13), for reference.
# ucx_perftest streams puts (many in flight, one flush at the end) into one buffer;
# ucx_bw waits for each request (batch descriptors, then a flush) before the next.
# By default the batch's descriptors here also all cover one block (NIXL_UCX_BW_SPAN=0),
# the same cache footprint as perftest's; NIXL_UCX_BW_SPAN=134217728 spreads them
# (32 x 1 MiB no longer fits in cache and runs at memory speed).
export NIXL_UCX_BW_SPAN=${NIXL_UCX_BW_SPAN:-0}
set -euo pipefail
SIZES=${SIZES:-4096 16384 65536 262144 1048576 4194304 16777216}
PORT=${PORT:-13377}
ITERS=${ITERS:-2000}

if [ -n "${NIXL_UCX_LIB:-}" ] && [ -z "${PERFTEST:-}" ]; then
    libdir=$(dirname "$NIXL_UCX_LIB")
    PERFTEST="$libdir/../bin/ucx_perftest"
    export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
PERFTEST=${PERFTEST:-ucx_perftest}

perf() { # test size -> bytes/s
    local t=$1 s=$2 n=$ITERS
    [ "$s" -ge 4194304 ] && n=200
    "$PERFTEST" -p "$PORT" >/dev/null 2>&1 &
    local srv=$!
    sleep 0.3
    local out
    out=$(timeout 120 "$PERFTEST" 127.0.0.1 -p "$PORT" -t "$t" -s "$s" -n "$n" 2>/dev/null |
        awk '/^Final:/ {printf "%.0f", $6 * 1048576}')
    wait "$srv" 2>/dev/null || true
    echo "${out:-0}"
}

pt=$(mktemp)
bw=$(mktemp)
trap 'rm -f "$pt" "$bw"' EXIT
for s in $SIZES; do
    echo "$s $(perf ucp_put_bw "$s") $(perf ucp_get "$s")" >>"$pt"
done
# The perftest above ran with nothing else on the machine; so does this.
NIXL_UCX_BW_SIZES=$(echo "$SIZES" | tr ' ' ',') cargo bench -q -p nixl-ucx --bench ucx_bw \
    | tee /dev/stderr | awk '$1 ~ /^[0-9]+$/' >"$bw"

echo
echo "UCX_TLS=${UCX_TLS:-<default>}; GB/s = 10^9 bytes/s; ratio = nixl-ucx (UCX-allocated memory) / ucx_perftest"
printf "%9s %5s | %9s %9s | %9s %9s %7s %7s | %9s %9s | %8s\n" \
    size batch perf_put perf_get ucx_WRITE ucx_READ W/put R/get host_WRITE host_READ p50_us
awk 'NR == FNR { put[$1] = $2 / 1e9; get[$1] = $3 / 1e9; next }
     {
       p = put[$1]; g = get[$1]
       rw = (p > 0) ? sprintf("%.0f%%", 100 * $3 / p) : "n/a"
       rr = (g > 0) ? sprintf("%.0f%%", 100 * $4 / g) : "n/a"
       printf "%9s %5s | %9.2f %9.2f | %9.2f %9.2f %7s %7s | %9.2f %9.2f | %8.2f\n",
              $1, $2, p, g, $3, $4, rw, rr, $6, $7, $5
     }' "$pt" "$bw"
