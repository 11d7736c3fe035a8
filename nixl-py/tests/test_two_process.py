"""Agents in separate processes, each driven through NIXL's Python API (peer.py):
two nixl_rs agents (TCP, and UCX where installed), and a nixl_rs agent with a real
NIXL 1.5.1 agent (the nixl-cu12 wheel, NIXL_TEST_NIXL_WHEEL_DIR), exchanging data
and notifications both ways. Every child exits normally (exit status checked: no
crash at interpreter exit)."""

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import HANG, system_ucx, ucp_wheel_lib, unique, wait_done

import nixl_rs

PEER = os.path.join(os.path.dirname(__file__), "peer.py")
SIZE = 1 << 20


class Peer:
    def __init__(self, impl, name, backend, env=None, listen=None, size=SIZE):
        self.impl, self.name = impl, name
        args = [sys.executable, PEER, impl, name, str(size), backend]
        if listen is not None:
            args.append(str(listen))
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  env={**os.environ, **(env or {})}, text=True)
        ready = self._answer()
        _, self.addr, self.len, port = ready.split()
        self.addr, self.len, self.port = int(self.addr), int(self.len), int(port)

    def _answer(self):
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise AssertionError(f"{self.impl} peer {self.name} exited ({self.p.wait()})")
            if line.startswith("@@ OK"):
                return line[5:].strip()
            if line.startswith("@@ ERR"):
                raise AssertionError(f"{self.impl} peer {self.name}: {line[6:].strip()}")

    def cmd(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self._answer()

    def metadata(self):
        return bytes.fromhex(self.cmd("MD"))

    def load(self, md):
        return self.cmd("LOAD " + md.hex())

    def dump(self, off, n):
        return bytes.fromhex(self.cmd(f"DUMP {off} {n}"))

    def notifs(self, count):
        got = self.cmd(f"NOTIFS {count} {HANG}").split()
        return [(p, bytes.fromhex(m) if m != "-" else b"") for p, m in (w.rsplit(":", 1) for w in got)]

    def exit(self):
        try:
            self.cmd("EXIT")
        finally:
            rc = self.p.wait(timeout=HANG)
        return rc


def exchange_both_ways(x, y):
    """x and y know each other; data and notifications both ways, both request kinds."""
    n = 64 << 10
    # x WRITEs a pattern into y, with a notification after the data.
    x.cmd(f"PATTERN 0 {n} 7")
    x.cmd(f"XFER WRITE {y.name} 0 {n} {y.addr + 4096} {b'x-wrote'.hex()}")
    assert y.notifs(1) == [(x.name, b"x-wrote")]
    assert y.dump(4096, n) == x.dump(0, n)
    # y READs it back from x through prepared lists into another place.
    x.cmd(f"PATTERN {n} {n} 8")
    y.cmd(f"PREP READ {x.name} {2 * n} {n} {x.addr + n} {b'y-read'.hex()}")
    assert y.dump(2 * n, n) == x.dump(n, n)
    assert x.notifs(1) == [(y.name, b"y-read")]
    # y WRITEs into x with prepared lists; x READs from y with initialize_xfer.
    y.cmd(f"PATTERN {3 * n} {n} 9")
    y.cmd(f"PREP WRITE {x.name} {3 * n} {n} {x.addr + 3 * n} {b'y-wrote'.hex()}")
    assert x.notifs(1) == [(y.name, b"y-wrote")]
    assert x.dump(3 * n, n) == y.dump(3 * n, n)
    x.cmd(f"XFER READ {y.name} {4 * n} {n} {y.addr + 3 * n} {b'x-read'.hex()}")
    assert x.dump(4 * n, n) == y.dump(3 * n, n)
    assert y.notifs(1) == [(x.name, b"x-read")]
    # Standalone notifications both ways.
    x.cmd(f"NOTIF {y.name} {b'ping'.hex()}")
    assert y.notifs(1) == [(x.name, b"ping")]
    y.cmd(f"NOTIF {x.name} {b'pong'.hex()}")
    assert x.notifs(1) == [(y.name, b"pong")]


UCX = pytest.param("UCX", marks=pytest.mark.skipif(
    not system_ucx(), reason="libucp.so.0 not found (apt-get install libucx0)"))


@pytest.mark.parametrize("backend", ["TCP", UCX])
def test_two_nixl_rs_processes(backend):
    x = Peer("nixl_rs", unique("px"), backend)
    y = Peer("nixl_rs", unique("py"), backend)
    try:
        assert x.load(y.metadata()) == y.name
        assert y.load(x.metadata()) == x.name
        exchange_both_ways(x, y)
    finally:
        assert x.exit() == 0
        assert y.exit() == 0


def test_two_processes_listener_exchange():
    # Metadata through the listener (nixl-rs' side channel with TCP).
    x = Peer("nixl_rs", unique("lx"), "TCP", listen=0)
    y = Peer("nixl_rs", unique("ly"), "TCP", listen=0)
    try:
        y.cmd(f"FETCH {x.name} 127.0.0.1 {x.port}")
        y.cmd(f"SEND 127.0.0.1 {x.port}")
        x.cmd(f"CHECK {y.name} {HANG}")
        exchange_both_ways(x, y)
    finally:
        assert x.exit() == 0
        assert y.exit() == 0


def free_port():
    """A free port below the kernel's ephemeral range: a port 0 handed out and
    taken back is soon handed out again to a process connecting out, so a server
    told it a moment later could find it taken (see nixl_testkit::free_port)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError):
        low = 32768
    lo = 10_000
    if low <= lo + 1000:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    start = (os.getpid() * 7919 + time.monotonic_ns()) % (low - lo)
    for i in range(low - lo):
        port = lo + (start + i * 104_729) % (low - lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between {lo} and {low}")


def nixl_wheel_env():
    d, ucp = ucp_wheel_lib()
    if not d or not ucp:
        pytest.skip("no nixl-cu12 wheel: pip install --no-deps --target DIR nixl-cu12==1.5.1 "
                    "numpy; set NIXL_TEST_NIXL_WHEEL_DIR=DIR")
    # Both sides bind the wheel's UCX; loopback only (the wheel's UCX crashes at exit
    # on hosts without RDMA unless its ib module is off).
    ucx = {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib"}
    nixl_env = {**ucx, "PYTHONPATH": d}
    ours_env = {**ucx, "NIXL_UCX_LIB": ucp}
    return nixl_env, ours_env


def test_nixl_rs_and_real_nixl_exchange_both_ways():
    nixl_env, ours_env = nixl_wheel_env()
    ours = Peer("nixl_rs", unique("rs"), "UCX", env=ours_env)
    theirs = Peer("nixl", unique("nixl"), "UCX", env=nixl_env)
    try:
        md = ours.metadata()
        assert md.startswith(b"nixlSerDes|")          # NIXL's format: NIXL loads it
        assert theirs.load(md) == ours.name
        assert ours.load(theirs.metadata()) == theirs.name
        exchange_both_ways(ours, theirs)
        exchange_both_ways(theirs, ours)
    finally:
        assert ours.exit() == 0
        theirs.exit()


def test_real_nixl_fetches_from_our_listener():
    nixl_env, ours_env = nixl_wheel_env()
    # Our UCX agent serves NIXL's listener protocol; NIXL fetches and sends through it
    # (NIXL runs those requests on its own listener thread, so it listens too).
    ours = Peer("nixl_rs", unique("rsl"), "UCX", env=ours_env, listen=0)
    theirs = Peer("nixl", unique("nixll"), "UCX", env=nixl_env, listen=free_port())
    try:
        assert ours.port
        theirs.cmd(f"FETCH {ours.name} 127.0.0.1 {ours.port}")
        theirs.cmd(f"SEND 127.0.0.1 {ours.port}")
        ours.cmd(f"CHECK {theirs.name} {HANG}")
        exchange_both_ways(theirs, ours)
    finally:
        assert ours.exit() == 0
        theirs.exit()


def test_exceptions_are_nixl_errors():
    # The classes a NIXL caller catches exist with NIXL's names.
    for n in ("nixlBackendError", "nixlNotFoundError", "nixlInvalidParamError",
              "nixlNotAllowedError", "nixlNotSupportedError", "nixlRemoteDisconnectError"):
        assert issubclass(getattr(nixl_rs, n), nixl_rs.NixlError)


@contextlib.contextmanager
def stalled_write(prefix, params=None, connect_first=False):
    """A nixl_rs agent (nixl-tcp over sockets, with `params`) holding one list of two
    registrations, 4 KiB and 64 MiB, and a prepared WRITE of the 64 MiB one into a
    peer process that is then stopped (SIGSTOP), so the WRITE stalls: in its
    connect (10 s bound), or with `connect_first` in the data, once a 4 KiB WRITE
    has connected. Yields (agent, handle, registration list, peer); the peer resumes and
    is killed, and the agent shut down, at the end."""
    import numpy as np
    from nixl_rs._api import nixl_agent, nixl_agent_config

    size = 64 << 20
    peer = Peer("nixl_rs", unique(f"{prefix}-peer"), "TCP-SOCKET", size=size)
    a = nixl_agent(unique(prefix), nixl_agent_config(backends=[]))
    a.create_backend("TCP", {"same_host": "off", **(params or {})})
    small, big = np.ones(4096, dtype=np.uint8), np.ones(size, dtype=np.uint8)
    reg = a.register_memory(a.get_reg_descs(
        [(small.ctypes.data, 4096, 0, ""), (big.ctypes.data, size, 0, "")], "DRAM"))
    name = a.add_remote_agent(peer.metadata()).decode()
    peer.load(a.get_agent_metadata())
    if connect_first:
        w = a.initialize_xfer("WRITE", a.get_xfer_descs([(small.ctypes.data, 4096, 0)], "DRAM"),
                              a.get_xfer_descs([(peer.addr, 4096, 0)], "DRAM"), name)
        a.transfer(w)
        wait_done(a, w)
        a.release_xfer_handle(w)
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(big.ctypes.data, size, 0)], "DRAM"),
                          a.get_xfer_descs([(peer.addr, size, 0)], "DRAM"), name)
    os.kill(peer.p.pid, signal.SIGSTOP)
    try:
        yield a, h, reg, peer
    finally:
        os.kill(peer.p.pid, signal.SIGCONT)
        peer.p.kill()
        peer.p.wait(timeout=HANG)
        a.shutdown()


def test_an_awaited_transfer_ends_when_its_agent_shuts_down():
    """A transfer awaited through asyncio to a peer that stopped raises when its
    agent shuts down, instead of never returning."""
    with stalled_write("async-shutdown") as (a, h, _, _):
        async def main():
            t = asyncio.ensure_future(a.transfer_async(h))
            await asyncio.sleep(0.5)
            assert not t.done(), "the WRITE to a stopped peer finished"
            await asyncio.get_running_loop().run_in_executor(None, a.shutdown)
            with pytest.raises(nixl_rs.nixlNotAllowedError, match="shut down"):
                await asyncio.wait_for(t, HANG)

        asyncio.run(main())


def test_releasing_an_awaited_handle_cancels_its_transfer():
    """release_xfer_handle cancels a transfer an asyncio waiter holds, as it does one
    polled with check_xfer_state: the waiter raises, and the memory deregisters."""
    with stalled_write("async-release") as (a, h, reg, _):
        async def main():
            t = asyncio.ensure_future(a.transfer_async(h))
            await asyncio.sleep(0.5)
            assert not t.done(), "the WRITE to a stopped peer finished"
            a.release_xfer_handle(h)
            with pytest.raises(nixl_rs.nixlCancelledError, match="released"):
                await asyncio.wait_for(t, HANG)

        asyncio.run(main())
        a.deregister_memory(reg)


def test_a_refused_deregistration_leaves_the_whole_list_registered():
    """deregister_memory of a list whose second region a transfer still uses (a
    stopped peer) raises after its bound and deregisters nothing: the same list
    deregisters once the transfer is done."""
    # A stopped peer is declared dead after dead_peer_timeout (10 s by default, the
    # deregistration's bound too): longer here, so the transfer outlives the bound;
    # one connection, so no extra lane's connect stalls instead of the data.
    params = {"dead_peer_timeout": "120s", "connections": "1"}
    with stalled_write("dereg-list", params, connect_first=True) as (a, h, reg, peer):
        assert a.transfer(h) == "PROC"
        time.sleep(0.5)
        assert a.check_xfer_state(h) == "PROC", "64 MiB went into a stopped peer's socket buffers"
        with pytest.raises(nixl_rs.nixlNotAllowedError, match="nothing was deregistered"):
            a.deregister_memory(reg)
        os.kill(peer.p.pid, signal.SIGCONT)
        wait_done(a, h)
        a.release_xfer_handle(h)
        a.deregister_memory(reg)
