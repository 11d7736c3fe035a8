"""Bad inputs raise clear exceptions, of NIXL's classes, carrying nixl-rs' error kind,
and change nothing."""

import pytest
from conftest import addr, buf, connect, pattern, unique, wait_done

import nixl_rs
from nixl_rs._api import nixl_agent, nixl_agent_config

N = 16 << 10


@pytest.fixture
def two(agents):
    a, b = agents(unique("e-a")), agents(unique("e-b"))
    src, dst = pattern(N), buf(N)
    a.register_memory([(addr(src), N, 0, "")], "DRAM")
    b.register_memory([(addr(dst), N, 0, "")], "DRAM")
    connect(a, b)
    return a, b, src, dst


def test_unknown_agent(two):
    a, b, src, dst = two
    with pytest.raises(nixl_rs.nixlNotFoundError) as e:
        a.prep_xfer_dlist("nobody", [(addr(dst), 16, 0)], "DRAM")
    assert e.value.kind == "UnknownPeer" and "nobody" in str(e.value)
    with pytest.raises(nixl_rs.nixlNotFoundError):
        a.send_notif("nobody", b"x")
    with pytest.raises(nixl_rs.nixlNotFoundError):
        a.initialize_xfer("WRITE", a.get_xfer_descs([(addr(src), 16, 0)], "DRAM"),
                          a.get_xfer_descs([(addr(dst), 16, 0)], "DRAM"), "nobody")
    # NIXL 1.5.1 returns for an unknown name (and for one removed twice).
    assert a.remove_remote_agent("nobody") is None
    assert a.remove_remote_agent(b"nobody") is None


def test_out_of_range_descriptors(two):
    a, b, src, dst = two
    # Remote: past the end of what the peer registered.
    with pytest.raises(nixl_rs.nixlInvalidParamError) as e:
        a.prep_xfer_dlist(b.name, [(addr(dst) + N - 8, 16, 0)], "DRAM")
    assert e.value.kind == "OutOfRange"
    assert e.value.operation and e.value.context
    # Local: memory never registered.
    other = buf(64)
    with pytest.raises(nixl_rs.nixlInvalidParamError) as e:
        a.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr(other), 64, 0)], "DRAM")
    assert e.value.kind == "OutOfRange"
    # Index past the end of a prepared list.
    loc = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr(src), 16, 0)], "DRAM")
    rem = a.prep_xfer_dlist(b.name, [(addr(dst), 16, 0)], "DRAM")
    with pytest.raises(nixl_rs.NixlError) as e:
        a.make_prepped_xfer("WRITE", loc, [1], rem, [0])
    assert e.value.kind == "NotFound"
    with pytest.raises(nixl_rs.nixlInvalidParamError):
        a.make_prepped_xfer("WRITE", loc, [-1], rem, [0])
    # Lengths that do not pair up.
    rem2 = a.prep_xfer_dlist(b.name, [(addr(dst), 32, 0)], "DRAM")
    with pytest.raises(nixl_rs.nixlInvalidParamError) as e:
        a.make_prepped_xfer("WRITE", loc, [0], rem2, [0])
    assert e.value.kind == "LengthMismatch"
    with pytest.raises(nixl_rs.nixlInvalidParamError):
        a.make_prepped_xfer("WRITE", loc, [0], rem, [0, 0])
    # Zero-length descriptors.
    with pytest.raises(nixl_rs.nixlInvalidParamError) as e:
        a.prep_xfer_dlist(b.name, [(addr(dst), 0, 0)], "DRAM")
    assert e.value.kind == "ZeroLength"


def test_wrong_types(two):
    a, b, src, dst = two
    with pytest.raises(TypeError):
        a.register_memory([(addr(src), N, 0)], "DRAM")          # 3-tuples: a transfer list
    with pytest.raises(TypeError):
        a.register_memory([(addr(src), N, 0, "")])             # no mem type
    with pytest.raises(TypeError):
        a.get_xfer_descs([("0x10", 16, 0)], "DRAM")
    with pytest.raises(TypeError):
        a.get_xfer_descs([(-1, 16, 0)], "DRAM")
    with pytest.raises(TypeError):
        a.get_xfer_descs("not a list", "DRAM")
    with pytest.raises(TypeError):
        a.get_xfer_descs(a.get_reg_descs([(addr(src), N, 0, "")], "DRAM"))
    with pytest.raises(nixl_rs.nixlInvalidParamError) as e:
        a.get_xfer_descs([(addr(src), 16, 0)], "HBM")
    assert "HBM" in str(e.value)
    with pytest.raises(nixl_rs.nixlNotSupportedError):
        a.get_xfer_descs([(addr(src), 16, 0)], "BLOCK").getType() is not None and a.prep_xfer_dlist(
            "NIXL_INIT_AGENT", a.get_xfer_descs([(addr(src), 16, 0)], "BLOCK"))
    # A file that was never registered: nothing to reach.
    with pytest.raises(nixl_rs.nixlInvalidParamError):
        a.prep_xfer_dlist("NIXL_INIT_AGENT", a.get_xfer_descs([(0, 16, 0)], "FILE"))
    loc = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr(src), 16, 0)], "DRAM")
    rem = a.prep_xfer_dlist(b.name, [(addr(dst), 16, 0)], "DRAM")
    with pytest.raises(nixl_rs.nixlInvalidParamError):
        a.make_prepped_xfer("COPY", loc, [0], rem, [0])
    with pytest.raises(TypeError):
        a.make_prepped_xfer("WRITE", loc, "0", rem, [0])
    with pytest.raises(TypeError):
        a.make_prepped_xfer("WRITE", loc, [0], rem, [0], notif_msg=42)
    with pytest.raises(TypeError):
        a.add_remote_agent(12)
    with pytest.raises(TypeError):
        a.deregister_memory([(addr(src), N, 0, "")])
    with pytest.raises(TypeError):
        nixl_agent(42, nixl_agent_config(backends=["TCP"]))


def test_bad_metadata_and_backends(two, agents):
    a, b, src, dst = two
    with pytest.raises(nixl_rs.NixlError) as e:
        a.add_remote_agent(b"garbage that is no metadata")
    assert e.value.kind in ("Corrupt", "NotSupported")
    with pytest.raises(nixl_rs.nixlInvalidParamError):
        a.add_remote_agent(a.get_agent_metadata())               # its own
    with pytest.raises(nixl_rs.nixlNotFoundError):
        agents(backends=[]).create_backend("GDS")
    with pytest.raises(nixl_rs.nixlInvalidParamError):
        agents(backends=[]).create_backend("TCP", {"listen": "nowhere"})
    with pytest.raises(nixl_rs.nixlNotFoundError):
        a.register_memory([(addr(buf(16)), 16, 0, "")], "DRAM", backends=["NOPE"])
    with pytest.raises(nixl_rs.nixlInvalidParamError):
        a.fetch_remote_metadata(b.name, "not an address!", 1)


def test_transfer_state_errors(two):
    a, b, src, dst = two
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(addr(src), N, 0)], "DRAM"),
                          a.get_xfer_descs([(addr(dst), N, 0)], "DRAM"), b.name)
    with pytest.raises(nixl_rs.nixlNotPostedError):
        a.check_xfer_state(h)
    with pytest.raises(nixl_rs.nixlNoTelemetryError):
        a.get_xfer_telemetry(h)                                  # capture_telemetry off
    a.transfer(h)
    wait_done(a, h)
    # Memory in use by a request's post is kept registered; a finished one can go.
    a.release_xfer_handle(h)
    with pytest.raises(nixl_rs.nixlNotFoundError):
        a.transfer(h)
    with pytest.raises(nixl_rs.nixlNotFoundError):
        a.check_xfer_state(h)


def test_notification_too_long(two):
    a, b, src, dst = two
    with pytest.raises(nixl_rs.nixlInvalidParamError):
        a.send_notif(b.name, b"x" * (2 << 20))


def test_unsupported_calls_say_so(two):
    a, b, src, dst = two
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(addr(src), 16, 0)], "DRAM"),
                          a.get_xfer_descs([(addr(dst), 16, 0)], "DRAM"), b.name)
    for call in (lambda: a.estimate_xfer_cost(h),
                 lambda: a.query_memory([(addr(src), 16, 0, "")], "TCP", "DRAM"),
                 lambda: a.prep_mem_view(None),
                 lambda: a.send_partial_agent_metadata([], True, ip_addr="127.0.0.1")):
        with pytest.raises(nixl_rs.nixlNotSupportedError) as e:
            call()
        assert e.value.kind == "NotSupported"
