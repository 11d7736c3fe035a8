"""NIXL's etcd metadata exchange: the metadata calls given no ``ip_addr`` use the etcd
at ``NIXL_ETCD_ENDPOINTS``. Runs against a real etcd server started here (Debian's
``etcd-server``); skips visibly without one, or when nixl_rs was built without the
``etcd`` feature."""

import os
import shutil
import socket
import subprocess
import tempfile

import pytest

from conftest import HANG, addr, buf, pattern, system_ucx, unique, wait_done, wait_for

import nixl_rs


from test_two_process import free_port  # noqa: E402 - below the ephemeral range


@pytest.fixture
def etcd(monkeypatch):
    """A fresh etcd on loopback; NIXL_ETCD_ENDPOINTS points at it."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("no etcd binary (apt-get install etcd-server)")
    with tempfile.TemporaryDirectory() as data:
        # Ports are picked free, then bound by etcd: another process may take one
        # meanwhile, so a start that exits is tried again on new ports.
        for attempt in range(3):
            client, peer = free_port(), free_port()
            url = f"http://127.0.0.1:{client}"
            p = subprocess.Popen(
                [binary, "--name", "nixl-py-test", "--data-dir", f"{data}/{attempt}",
                 "--listen-client-urls", url, "--advertise-client-urls", url,
                 "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-cluster", f"nixl-py-test=http://127.0.0.1:{peer}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

            def up():
                try:
                    socket.create_connection(("127.0.0.1", client), timeout=0.2).close()
                    return True
                except OSError:
                    return p.poll() is not None
            wait_for(up, "etcd to listen")
            if p.poll() is None:
                break
        else:
            pytest.fail(f"etcd exited with {p.returncode} three times")
        try:
            monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", url)
            monkeypatch.setenv("NIXL_ETCD_NAMESPACE", f"/nixl-py-test/{os.getpid()}/")
            yield url
        finally:
            p.kill()
            p.wait()


def publish_or_skip(agent):
    try:
        agent.send_local_metadata()
    except nixl_rs.nixlNotSupportedError as e:
        if "has none" in str(e):
            pytest.skip("nixl_rs was built without the etcd feature")
        raise


def exchange_through_etcd(a, b):
    """b publishes, a fetches b by name, a WRITEs into b; b withdraws, a forgets b."""
    n = 1 << 16
    src, dst = pattern(n, 9), buf(n)
    a.register_memory([(addr(src), n, 0, "")], "DRAM")
    b.register_memory([(addr(dst), n, 0, "")], "DRAM")
    publish_or_skip(b)
    a.fetch_remote_metadata(b.name)
    wait_for(lambda: a.check_remote_metadata(b.name), "b's metadata through etcd")
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(addr(src), n, 0)], "DRAM"),
                          a.get_xfer_descs([(addr(dst), n, 0)], "DRAM"), b.name, b"etcd")
    assert a.transfer(h) in ("DONE", "PROC")
    wait_done(a, h)
    assert (dst == src).all()
    # Withdrawn: a follows b's keys and forgets it.
    b.invalidate_local_metadata()
    wait_for(lambda: not a.check_remote_metadata(b.name), "a forgets b", HANG)


def test_tcp_agents_exchange_through_etcd(etcd, agents):
    a, b = agents(unique("etcd-a")), agents(unique("etcd-b"))
    exchange_through_etcd(a, b)


def test_ucx_agents_use_nixls_layout(etcd, agents):
    if not system_ucx():
        pytest.skip("no UCX on this machine (libucp.so.0 or NIXL_UCX_LIB)")
    a = agents(unique("etcd-ua"), backends=["UCX"])
    b = agents(unique("etcd-ub"), backends=["UCX"])
    # Agents that speak NIXL publish in NIXL's key layout and format, as NIXL does.
    exchange_through_etcd(a, b)


def test_without_endpoints_etcd_calls_say_how_to_enable_it(agents, monkeypatch):
    monkeypatch.delenv("NIXL_ETCD_ENDPOINTS", raising=False)
    a = agents(unique("etcd-off"))
    with pytest.raises(nixl_rs.nixlNotSupportedError) as e:
        a.send_local_metadata()
    assert "NIXL_ETCD_ENDPOINTS" in str(e.value) or "has none" in str(e.value)
