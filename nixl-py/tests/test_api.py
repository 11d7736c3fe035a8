"""Every call of NIXL's Python API surface on nixl_rs, on DRAM, with bytes checked."""

import os
import pickle

import pytest
from conftest import (addr, buf, connect, np, pattern, system_ucx, unique, wait_done,
                      wait_for, wait_notif)

import nixl_rs
from nixl_rs import _api
from nixl_rs._api import nixl_agent, nixl_agent_config

N = 64 << 10


def test_config_keeps_nixl_arguments():
    c = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=True, listen_port=0,
                          capture_telemetry=True, num_threads=4, backends=["TCP"])
    assert (c.enable_pthread, c.enable_listen, c.port, c.capture_telemetry, c.num_threads,
            c.backends) == (False, True, 0, True, 4, ["TCP"])
    assert nixl_agent_config().backends == ["UCX"]
    assert nixl_agent_config().port == _api.DEFAULT_COMM_PORT == 8888
    with pytest.raises(TypeError):
        nixl_agent_config(sync_mode="strict")


def test_agent_name_plugins_and_backends(agents):
    a = agents(unique("named"))
    assert a.name.startswith("named-")
    plugins = a.get_plugin_list()
    assert "TCP" in plugins and "UCX" in plugins
    assert a.get_plugin_mem_types("TCP") == ["DRAM", "VRAM"]
    assert "listen" in a.get_plugin_params("TCP")
    assert a.get_plugin_params("GDS") == {}
    assert a.backends == {"TCP": "TCP"}
    assert "DRAM" in a.get_backend_mem_types("TCP")
    assert a.get_backend_mem_types("UCX") == []
    assert "listen" in a.get_backend_params("TCP")
    # An unknown backend in the config is skipped with a warning, as NIXL does.
    b = agents(backends=["TCP", "GDS"])
    assert list(b.backends) == ["TCP"]


def test_create_backend_before_use(agents):
    a = agents(backends=[])
    assert a.backends == {}
    a.create_backend("TCP", {"listen": "127.0.0.1:0"})
    assert a.backends == {"TCP": "TCP"}
    # A backend whose library is missing: a clear error, and the agent is unchanged.
    with pytest.raises(nixl_rs.nixlNotSupportedError) as e:
        a.create_backend("UCX", {"lib": "/nonexistent/libucp.so.0"})
    assert e.value.kind == "UnavailableLibrary" and "/nonexistent/libucp.so.0" in str(e.value)
    assert a.backends == {"TCP": "TCP"} and a.agent.backends() == ["TCP"]
    assert "DRAM" in a.get_backend_mem_types("TCP")
    # Once memory is registered the agent's backends are fixed.
    m = buf(4096)
    a.register_memory([(addr(m), 4096, 0, "")], "DRAM")
    with pytest.raises(nixl_rs.nixlNotSupportedError) as e:
        a.create_backend("UCX")
    assert e.value.kind == "NotSupported"
    with pytest.raises(nixl_rs.nixlNotAllowedError):
        a.create_backend("TCP")


@pytest.mark.skipif(not system_ucx(), reason="libucp.so.0 not found (apt-get install libucx0)")
def test_ucx_agent_gives_nixl_metadata(agents):
    a = agents(backends=["UCX"])
    assert a.backends == {"UCX": "UCX"}
    md = a.get_agent_metadata()
    assert md.startswith(b"nixlSerDes|"), md[:16]


def test_descriptor_lists(agents):
    a = agents()
    m = buf(N)
    reg = a.get_reg_descs([(addr(m), N, 0, "meta")], "DRAM")
    assert isinstance(reg, _api.nixlRegDList)
    assert reg.descCount() == len(reg) == 1 and reg.getType() == nixl_rs._api.nixl_mem_t.DRAM_SEG and reg.mem_type == "DRAM"
    assert reg[0] == (addr(m), N, 0, "meta")
    assert a.get_reg_descs(reg) is reg
    arr = np.array([[addr(m), 4096, 0], [addr(m) + 4096, 4096, 0]], dtype=np.uint64)
    r2 = a.get_reg_descs(arr, "DRAM")
    assert len(r2) == 2 and r2[1][:3] == (addr(m) + 4096, 4096, 0)
    x = a.get_xfer_descs([(addr(m), 4096, 0)], "DRAM")
    assert isinstance(x, _api.nixlXferDList) and x[0] == (addr(m), 4096, 0)
    x2 = a.get_xfer_descs(arr, "DRAM")
    assert list(x2) == [(addr(m), 4096, 0), (addr(m) + 4096, 4096, 0)]
    assert a.get_xfer_descs(x2) is x2
    # Serialization round trip (NIXL pickles).
    back = a.deserialize_descs(a.get_serialized_descs(x2))
    assert back == x2 and isinstance(back, _api.nixlXferDList)
    assert pickle.loads(pickle.dumps(reg)) == reg


def test_register_deregister(agents):
    a = agents()
    m = buf(N)
    reg = a.register_memory([(addr(m), N, 0, "")], "DRAM")
    # Registering the same range twice is refused; nothing else changes.
    with pytest.raises(nixl_rs.NixlError):
        a.register_memory([(addr(m), N, 0, "")], "DRAM")
    a.deregister_memory(reg)
    with pytest.raises(nixl_rs.nixlNotFoundError):
        a.deregister_memory(reg)
    # Numpy Nx3 registration, several regions at once.
    arr = np.array([[addr(m), 4096, 0], [addr(m) + 8192, 4096, 0]], dtype=np.uint64)
    reg = a.register_memory(arr, "DRAM", backends=["TCP"])
    a.deregister_memory(reg, backends=["TCP"])


def _two_with_memory(agents, n=N, telemetry=False):
    a = agents(unique("init"), capture_telemetry=telemetry)
    b = agents(unique("target"), capture_telemetry=telemetry)
    src, dst = pattern(n, 3), buf(n)
    a.register_memory([(addr(src), n, 0, "")], "DRAM")
    b.register_memory([(addr(dst), n, 0, "")], "DRAM")
    connect(a, b)
    return a, b, src, dst


def test_prepped_write_read_notifs_and_telemetry(agents):
    a, b, src, dst = _two_with_memory(agents, telemetry=True)
    blocks = 16
    bs = N // blocks
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT",
                              [(addr(src) + i * bs, bs, 0) for i in range(blocks)], "DRAM")
    remote = a.prep_xfer_dlist(b.name, [(addr(dst) + i * bs, bs, 0) for i in range(blocks)],
                               "DRAM")
    assert len(local) == len(remote) == blocks
    # WRITE blocks 0..7 reversed into 8..15, numpy indices.
    h = a.make_prepped_xfer("WRITE", local, np.arange(8, dtype=np.int32), remote,
                            np.arange(15, 7, -1), notif_msg=b"w1")
    assert a.transfer(h) in ("DONE", "PROC")
    wait_done(a, h)
    assert a.check_xfer_state(h) == "DONE"
    wait_notif(b, a.name, b"w1")
    for i in range(8):
        assert (dst[(15 - i) * bs:(16 - i) * bs] == src[i * bs:(i + 1) * bs]).all()
    t = a.get_xfer_telemetry(h)
    assert t.totalBytes == 8 * bs and t.descCount >= 1
    assert t.xferDuration >= t.postDuration >= 0 and t.startTime > 0
    assert a.query_xfer_backend(h) == "TCP"
    # Repost with another notification.
    assert a.transfer(h, b"w2") in ("DONE", "PROC")
    wait_done(a, h)
    wait_notif(b, a.name, b"w2")
    a.release_xfer_handle(h)
    # READ back from the target into other local blocks, list indices.
    dst[:bs] = 0xAB
    h = a.make_prepped_xfer("READ", local, [9], remote, [0], notif_msg="r1")
    a.transfer(h)
    wait_done(a, h)
    assert (src[9 * bs:10 * bs] == 0xAB).all()
    wait_notif(b, a.name, b"r1")
    a.release_xfer_handle(h)
    a.release_dlist_handle(local)
    a.release_dlist_handle(remote)
    with pytest.raises(nixl_rs.nixlNotFoundError):
        a.make_prepped_xfer("READ", local, [0], remote, [0])


def test_initialize_xfer_and_loopback(agents):
    a, b, src, dst = _two_with_memory(agents)
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(addr(src), N, 0)], "DRAM"),
                          a.get_xfer_descs([(addr(dst), N, 0)], "DRAM"), b.name, b"whole")
    a.transfer(h)
    wait_done(a, h)
    assert (dst == src).all()
    wait_notif(b, a.name, b"whole")
    # Loopback: the remote side prepared with the agent's own name.
    other = buf(N)
    a.register_memory([(addr(other), N, 0, "")], "DRAM")
    lo = a.prep_xfer_dlist(a.name, [(addr(other), N, 0)], "DRAM")
    loc = a.prep_xfer_dlist("", [(addr(src), N, 0)], "DRAM")
    h = a.make_prepped_xfer("WRITE", loc, [0], lo, [0])
    a.transfer(h)
    wait_done(a, h)
    assert (other == src).all()


def test_strided_prep(agents):
    a, b, src, dst = _two_with_memory(agents)
    bs, count = 1024, 8
    # (address, len, dev, stride, count): every other 1 KiB block.
    loc = a.prep_xfer_dlist("NIXL_INIT_AGENT",
                            np.array([[addr(src), bs, 0, 2 * bs, count]], dtype=np.uint64),
                            "DRAM")
    rem = a.prep_xfer_dlist(b.name,
                            np.array([[addr(dst), bs, 0, bs, count]], dtype=np.uint64), "DRAM")
    assert len(loc) == len(rem) == count
    h = a.make_prepped_xfer("WRITE", loc, list(range(count)), rem, list(range(count)))
    a.transfer(h)
    wait_done(a, h)
    for i in range(count):
        assert (dst[i * bs:(i + 1) * bs] == src[2 * i * bs:(2 * i + 1) * bs]).all()


def test_notifications_standalone(agents):
    a, b, _, _ = _two_with_memory(agents)
    a.send_notif(b.name, b"hello")
    a.send_notif(b.name, "text works too")
    got = []
    wait_for(lambda: got.extend(b.get_new_notifs().get(a.name, [])) or len(got) >= 2,
             "two notifications")
    assert got == [b"hello", b"text works too"]
    assert b.get_new_notifs() == {}
    b.send_notif(a.name, b"tag-123-rest")
    wait_for(lambda: a.update_notifs().get(b.name), "the notification")
    assert not a.check_remote_xfer_done(b.name, b"rest")          # not a prefix
    assert a.check_remote_xfer_done(b.name, b"rest", tag_is_prefix=False)
    assert not a.check_remote_xfer_done(b.name, b"tag")          # removed once found


def test_metadata_calls(agents):
    a, b, src, dst = _two_with_memory(agents)
    assert a.check_remote_metadata(b.name)
    assert a.check_remote_metadata(b.name, a.get_xfer_descs([(addr(dst), 4096, 0)], "DRAM"))
    assert not a.check_remote_metadata(b.name, a.get_xfer_descs([(addr(dst) + N, 16, 0)], "DRAM"))
    assert not a.check_remote_metadata("nobody")
    a.make_connection(b.name)
    # Partial metadata: connection info plus one registration.
    c = agents(unique("partial"))
    part = b.get_partial_agent_metadata(b.get_reg_descs([(addr(dst), N, 0, "")], "DRAM"), True)
    assert c.add_remote_agent(part) == b.name.encode()
    assert c.check_remote_metadata(b.name, c.get_xfer_descs([(addr(dst), N, 0)], "DRAM"))
    assert b.get_partial_agent_metadata([], inc_conn_info=True)
    a.remove_remote_agent(b.name)
    assert not a.check_remote_metadata(b.name)
    with pytest.raises(nixl_rs.nixlNotFoundError):
        a.prep_xfer_dlist(b.name, [(addr(dst), 4096, 0)], "DRAM")


def test_listener_exchange(agents):
    # TCP agents serve nixl-rs' side channel on the listener port.
    srv = agents(unique("srv"), enable_listen_thread=True, listen_port=0)
    cli = agents(unique("cli"), enable_listen_thread=True, listen_port=0)
    assert srv.listen_port and cli.listen_port
    m = buf(4096)
    srv.register_memory([(addr(m), 4096, 0, "")], "DRAM")
    cli.fetch_remote_metadata(srv.name, "127.0.0.1", srv.listen_port)
    wait_for(lambda: cli.check_remote_metadata(srv.name), "fetched metadata")
    assert cli.check_remote_metadata(srv.name, cli.get_xfer_descs([(addr(m), 4096, 0)], "DRAM"))
    cli.send_local_metadata("127.0.0.1", srv.listen_port)
    wait_for(lambda: srv.check_remote_metadata(cli.name), "sent metadata")
    cli.invalidate_local_metadata("127.0.0.1", srv.listen_port)
    wait_for(lambda: not srv.check_remote_metadata(cli.name), "invalidated metadata")
    # Without an address NIXL uses etcd, which needs NIXL_ETCD_ENDPOINTS (test_etcd.py).
    if "NIXL_ETCD_ENDPOINTS" not in os.environ:
        with pytest.raises(nixl_rs.nixlNotSupportedError):
            cli.send_local_metadata()


def test_shutdown_and_context_manager():
    with nixl_agent(unique("ctx"), nixl_agent_config(backends=["TCP"])) as a:
        m = buf(4096)
        a.register_memory([(addr(m), 4096, 0, "")], "DRAM")
    tasks, ours, threads = a.agent.running_tasks()
    assert (tasks, ours, threads) == (0, 0, [])
    with pytest.raises(nixl_rs.nixlNotAllowedError) as e:
        a.register_memory([(addr(m), 4096, 0, "")], "DRAM")
    assert e.value.kind == "ShutDown"
    a.shutdown()  # idempotent


def _socket_pair(agents, n, prefix):
    """Two agents over TCP with the same-host path off (a 32 MiB WRITE stays in
    flight for a while), each with one n-byte registration, metadata loaded."""
    a, b = agents(unique(prefix + "-a"), backends=[]), agents(unique(prefix + "-b"), backends=[])
    for x in (a, b):
        x.create_backend("TCP", {"same_host": "off"})
    src, dst = pattern(n, 4), buf(n)
    reg = a.register_memory([(addr(src), n, 0, "")], "DRAM")
    b.register_memory([(addr(dst), n, 0, "")], "DRAM")
    connect(a, b)
    return a, b, src, dst, reg


def test_deregistration_waits_for_transfers_in_flight(agents):
    # NIXL lets memory go under a running transfer; nixl-rs' deregister_memory waits
    # for the transfers using it to end (bounded), so the data still lands whole.
    n = 32 << 20
    a, b, src, dst, reg = _socket_pair(agents, n, "keep")
    waited = 0
    for _ in range(20):
        h = a.initialize_xfer("WRITE", a.get_xfer_descs([(addr(src), n, 0)], "DRAM"),
                              a.get_xfer_descs([(addr(dst), n, 0)], "DRAM"), b.name)
        if a.transfer(h) == "PROC":
            waited += 1
        a.deregister_memory(reg)
        wait_done(a, h)
        assert (dst == src).all()
        dst[:] = 0
        a.release_xfer_handle(h)
        reg = a.register_memory([(addr(src), n, 0, "")], "DRAM")
        if waited >= 3:
            break
    assert waited >= 1, "no deregistration met a transfer in flight"
    a.deregister_memory(reg)


def test_release_in_flight_then_deregister(agents):
    # vLLM's shutdown and sleep: release_xfer_handle of a transfer in flight, then
    # deregister_memory at once, without retrying; NIXL 1.5.1 returns from both.
    n = 32 << 20
    a, b, src, dst, reg = _socket_pair(agents, n, "release")
    posted = 0
    for _ in range(10):
        h = a.initialize_xfer("WRITE", a.get_xfer_descs([(addr(src), n, 0)], "DRAM"),
                              a.get_xfer_descs([(addr(dst), n, 0)], "DRAM"), b.name)
        posted += a.transfer(h) == "PROC"
        a.release_xfer_handle(h)
        a.deregister_memory(reg)
        reg = a.register_memory([(addr(src), n, 0, "")], "DRAM")
    assert posted >= 1, "no transfer was in flight when released"
    a.deregister_memory(reg)
    # The agent still works after cancelled transfers.
    reg = a.register_memory([(addr(src), n, 0, "")], "DRAM")
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(addr(src), n, 0)], "DRAM"),
                          a.get_xfer_descs([(addr(dst), n, 0)], "DRAM"), b.name)
    a.transfer(h)
    wait_done(a, h)
    assert (dst == src).all()
