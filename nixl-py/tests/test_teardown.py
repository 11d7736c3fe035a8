"""Teardown: an agent collected by Python, or still alive at interpreter exit with
transfers and asyncio waits in flight, stops and joins everything it started,
without a crash."""

import gc
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import HANG, addr, buf, connect, system_ucx, unique, wait_done

from nixl_rs._api import nixl_agent, nixl_agent_config


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


BACKENDS = ["TCP", pytest.param("UCX", marks=pytest.mark.skipif(
    not system_ucx(), reason="libucp.so.0 not found (apt-get install libucx0)"))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_collected_agents_let_go_of_everything(backend):
    # Warm the shared runtime so its worker threads are in the baseline.
    warm = nixl_agent(unique("warm"), nixl_agent_config(backends=["TCP"]))
    warm.shutdown()
    del warm
    gc.collect()
    before = os_threads()
    made = [nixl_agent(unique("gc"), nixl_agent_config(backends=[backend])) for _ in range(4)]
    mems = [buf(1 << 20) for _ in made]
    for a, m in zip(made, mems):
        a.register_memory([(addr(m), m.nbytes, 0, "")], "DRAM")
    for a, b in zip(made[::2], made[1::2]):
        connect(a, b)
        h = a.initialize_xfer("WRITE", a.get_xfer_descs([(addr(mems[made.index(a)]), 4096, 0)], "DRAM"),
                              a.get_xfer_descs([(addr(mems[made.index(b)]), 4096, 0)], "DRAM"),
                              b.name)
        a.transfer(h)
        wait_done(a, h)
    monitors = [a.agent for a in made]
    del made, a, b, h
    gc.collect()
    # Every agent was shut down when collected: its tasks and threads are gone.
    for n in monitors:
        assert n.is_shut_down
        tasks, ours, threads = n.running_tasks()
        assert (tasks, ours, threads) == (0, 0, [])
    assert os_threads() <= before


EXIT_SCRIPT = textwrap.dedent("""
    import asyncio, sys, threading
    import numpy as np
    from nixl_rs._api import nixl_agent, nixl_agent_config
    backend = sys.argv[1]
    agents = [nixl_agent(f"exit-{i}", nixl_agent_config(backends=[backend])) for i in range(6)]
    mems = [np.zeros(16 << 20, dtype=np.uint8) for _ in agents]
    for a, m in zip(agents, mems):
        a.register_memory([(m.ctypes.data, m.nbytes, 0, "")], "DRAM")
    for a, b in zip(agents[::2], agents[1::2]):
        a.add_remote_agent(b.get_agent_metadata())
        b.add_remote_agent(a.get_agent_metadata())
    handles = []
    for i, (a, b) in enumerate(zip(agents[::2], agents[1::2])):
        src, dst = mems[2 * i], mems[2 * i + 1]
        h = a.initialize_xfer("WRITE", a.get_xfer_descs([(src.ctypes.data, src.nbytes, 0)], "DRAM"),
                              a.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM"),
                              b.name, b"bye")
        a.transfer(h)          # left in flight (16 MiB) or done
        handles.append(h)
    # An asyncio notification wait left pending in a thread's event loop.
    loop = asyncio.new_event_loop()
    it = agents[1].notifications()
    threading.Thread(target=lambda: loop.run_until_complete(it.__anext__()), daemon=True).start()
    print("posted", flush=True)
    # Exit with everything alive: atexit shuts the agents down and joins them.
""")


@pytest.mark.parametrize("backend", BACKENDS)
def test_interpreter_exit_with_work_in_flight(backend):
    p = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, backend], capture_output=True,
                       text=True, timeout=HANG * 2)
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert "posted" in p.stdout
    assert "panicked" not in p.stderr and "Segmentation" not in p.stderr, p.stderr[-3000:]


def test_many_agents_in_one_process():
    made = [nixl_agent(unique("many"), nixl_agent_config(backends=["TCP"])) for _ in range(16)]
    assert len({a.name for a in made}) == 16
    for a in made:
        a.shutdown()
    assert all(a.agent.running_tasks() == (0, 0, []) for a in made)
