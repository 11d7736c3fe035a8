"""Files through NIXL's POSIX backend API on nixl_rs: the call sequence of NIXL's
storage examples and of KV-offload connectors (one large file with a block per
offset, and a pool of files with one block each), bytes checked on disk."""

import os

import pytest
from conftest import addr, buf, np, pattern, unique, wait_done

from nixl_rs._api import nixl_agent, nixl_agent_config

BLOCK = 64 << 10


@pytest.fixture
def storage(tmp_path):
    a = nixl_agent(unique("storage"), nixl_agent_config(backends=["POSIX"]))
    yield a, tmp_path
    a.shutdown()


def xfer(agent, op, mem_descs, file_descs):
    h = agent.initialize_xfer(op, mem_descs, file_descs, agent.name)
    assert agent.transfer(h) in ("DONE", "PROC")
    wait_done(agent, h)
    agent.release_xfer_handle(h)


def test_posix_plugin_and_params(storage):
    a, _ = storage
    assert "POSIX" in a.get_plugin_list()
    assert a.get_plugin_mem_types("POSIX") == ["DRAM", "FILE"]
    assert a.get_backend_mem_types("POSIX") == ["DRAM", "FILE"]
    assert {"use_uring", "use_aio", "use_posix_aio"} <= set(a.get_plugin_params("POSIX"))


def test_one_large_file_write_then_read(storage):
    a, d = storage
    n = 16
    src = pattern(BLOCK * n, seed=3)
    dst = buf(BLOCK * n)
    a.register_memory([(addr(src), src.nbytes, 0, ""), (addr(dst), dst.nbytes, 0, "")], "DRAM")
    path = str(d / "cache.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        # NIXL's example registers a freshly created (empty) file with its length.
        a.register_memory([(0, BLOCK * n, fd, "")], "FILE")
        # Blocks in reverse order at their offsets.
        mem = a.get_xfer_descs([(addr(src) + j * BLOCK, BLOCK, 0) for j in range(n)], "DRAM")
        files = a.get_xfer_descs([((n - 1 - j) * BLOCK, BLOCK, fd) for j in range(n)], "FILE")
        xfer(a, "WRITE", mem, files)
        on_disk = np.fromfile(path, dtype=np.uint8)
        for j in range(n):
            at = (n - 1 - j) * BLOCK
            assert (on_disk[at:at + BLOCK] == src[j * BLOCK:(j + 1) * BLOCK]).all(), j
        back = a.get_xfer_descs([(addr(dst) + j * BLOCK, BLOCK, 0) for j in range(n)], "DRAM")
        xfer(a, "READ", back, files)
        assert (dst == src).all()
        # A notification on a storage transfer is an error, as in NIXL.
        h = a.initialize_xfer("READ", back, files, a.name, b"nope")
        with pytest.raises(Exception):
            a.transfer(h)
            wait_done(a, h)
        a.release_xfer_handle(h)
        a.deregister_memory(a.get_reg_descs([(0, BLOCK * n, fd, "")], "FILE"))
    finally:
        os.close(fd)


def test_pool_of_files_one_request(storage):
    a, d = storage
    n = 8
    src = pattern(BLOCK * n, seed=9)
    dst = buf(BLOCK * n)
    a.register_memory([(addr(src), src.nbytes, 0, ""), (addr(dst), dst.nbytes, 0, "")], "DRAM")
    paths = [str(d / f"block-{j}.bin") for j in range(n)]
    fds = [os.open(p, os.O_RDWR | os.O_CREAT) for p in paths]
    try:
        a.register_memory([(0, BLOCK, fd, p) for fd, p in zip(fds, paths)], "FILE")
        mem = a.get_xfer_descs([(addr(src) + j * BLOCK, BLOCK, 0) for j in range(n)], "DRAM")
        files = a.get_xfer_descs([(0, BLOCK, fd) for fd in fds], "FILE")
        xfer(a, "WRITE", mem, files)
        for j, p in enumerate(paths):
            assert (np.fromfile(p, dtype=np.uint8) == src[j * BLOCK:(j + 1) * BLOCK]).all()
        back = a.get_xfer_descs([(addr(dst) + j * BLOCK, BLOCK, 0) for j in range(n)], "DRAM")
        xfer(a, "READ", back, files)
        assert (dst == src).all()
        # query_memory: the file paths in the meta, one answer each.
        found = a.query_memory([(0, 0, 0, paths[0]), (0, 0, 0, str(d / "missing"))],
                               "POSIX", mem_type="FILE")
        assert found[0]["size"] == str(BLOCK) and found[1] is None
    finally:
        for fd in fds:
            os.close(fd)


def test_append_only_descriptors_are_refused(storage):
    a, d = storage
    fd = os.open(str(d / "log.bin"), os.O_RDWR | os.O_CREAT | os.O_APPEND)
    try:
        with pytest.raises(Exception, match="O_APPEND"):
            a.register_memory([(0, BLOCK, fd, "")], "FILE")
    finally:
        os.close(fd)


def test_read_past_a_truncated_file_raises(storage):
    a, d = storage
    dst = buf(BLOCK)
    a.register_memory([(addr(dst), dst.nbytes, 0, "")], "DRAM")
    path = str(d / "short.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        a.register_memory([(0, BLOCK, fd, "")], "FILE")
        os.truncate(path, 4096)
        h = a.initialize_xfer("READ", a.get_xfer_descs([(addr(dst), BLOCK, 0)], "DRAM"),
                              a.get_xfer_descs([(0, BLOCK, fd)], "FILE"), a.name)
        with pytest.raises(Exception, match="end of file"):
            a.transfer(h)
            wait_done(a, h)
    finally:
        os.close(fd)


def test_queue_type_params(tmp_path):
    a = nixl_agent(unique("pool"), nixl_agent_config(backends=[]))
    try:
        # The usual pattern: the plugin's defaults with one queue type switched on.
        params = dict(a.get_plugin_params("POSIX"))
        params["use_posix_aio"] = "true"
        a.create_backend("POSIX", params)
        assert a.get_backend_mem_types("POSIX") == ["DRAM", "FILE"]
    finally:
        a.shutdown()
    b = nixl_agent(unique("two"), nixl_agent_config(backends=[]))
    try:
        with pytest.raises(Exception, match="both choose the queue"):
            b.create_backend("POSIX", {"use_uring": "true", "use_aio": "true"})
    finally:
        b.shutdown()
