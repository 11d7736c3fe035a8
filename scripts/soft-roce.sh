#!/usr/bin/env bash
# Soft-RoCE (rxe): an RDMA device in software over an Ethernet interface, to run
# nixl-verbs' conformance suite on a host without an RDMA NIC.
#
#   sudo scripts/soft-roce.sh up [NETDEV]   # add rxe0 over NETDEV (default: the
#                                           # interface of the default route)
#   NIXL_VERBS_DEVICE=rxe0 cargo nextest run -p nixl-conformance --test verbs
#   sudo scripts/soft-roce.sh down          # remove rxe0
#
# Needs root, a kernel with the rdma_rxe module (CONFIG_RDMA_RXE; most distribution
# kernels have it, some cloud and container kernels do not), the `rdma` tool
# (iproute2) and rdma-core's user space (Debian: rdma-core ibverbs-providers
# ibverbs-utils). rxe cannot use the loopback interface: give it a real (or veth)
# Ethernet interface with an IP address; both agents of the suite use the same
# device, which rxe supports.
set -euo pipefail

name=rxe0
cmd=${1:-up}

case "$cmd" in
up)
    netdev=${2:-$(ip -o route show default 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "dev") { print $(i + 1); exit }}')}
    if [ -z "$netdev" ]; then
        echo "soft-roce: no NETDEV given and no default route to take one from" >&2
        exit 2
    fi
    if ! modprobe rdma_rxe 2>/dev/null && ! [ -d /sys/module/rdma_rxe ]; then
        echo "soft-roce: this kernel has no rdma_rxe module (CONFIG_RDMA_RXE); soft-RoCE is impossible here" >&2
        exit 2
    fi
    if ! command -v rdma >/dev/null; then
        echo "soft-roce: the rdma tool is missing (apt-get install iproute2)" >&2
        exit 2
    fi
    if rdma link show "$name/1" >/dev/null 2>&1; then
        echo "soft-roce: $name exists already"
    else
        rdma link add "$name" type rxe netdev "$netdev"
        echo "soft-roce: added $name over $netdev"
    fi
    if command -v ibv_devinfo >/dev/null; then
        ibv_devinfo -d "$name"
    fi
    echo "run the suite: NIXL_VERBS_DEVICE=$name cargo nextest run -p nixl-conformance --test verbs"
    ;;
down)
    rdma link delete "$name" 2>/dev/null && echo "soft-roce: removed $name" || echo "soft-roce: no $name"
    ;;
*)
    echo "usage: $0 up [NETDEV] | down" >&2
    exit 2
    ;;
esac
