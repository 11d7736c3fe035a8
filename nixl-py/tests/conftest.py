"""Shared helpers for the nixl_rs pytest suite.

Run from the repository root: ``pytest nixl-py/tests`` after ``maturin develop``
(or ``pip install`` of the built wheel) in a venv with numpy and pytest. Cases that
need something absent (UCX, the NIXL wheel) skip with a visible reason; scripts/test
lists the skips.
"""

import glob
import itertools
import os
import time

import pytest

nixl_rs = pytest.importorskip("nixl_rs", reason="nixl_rs is not installed (maturin develop)")
np = pytest.importorskip("numpy")

from nixl_rs._api import nixl_agent, nixl_agent_config  # noqa: E402

# Bound for waits that detect hangs; never a timing assertion.
HANG = 30.0

_names = itertools.count()


def unique(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_names)}"


def wait_for(cond, what: str, timeout: float = HANG):
    """Poll `cond` until it returns a truthy value; fail after the hang bound."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.001)


def wait_done(agent, handle):
    return wait_for(lambda: agent.check_xfer_state(handle) == "DONE", "the transfer")


def wait_notif(agent, peer: str, msg: bytes):
    """Wait until `msg` from `peer` arrived (check_remote_xfer_done semantics)."""
    wait_for(lambda: agent.check_remote_xfer_done(peer, msg, tag_is_prefix=False)
             and True, f"notification {msg!r} from {peer}")


def buf(n: int, fill=None):
    a = np.zeros(n, dtype=np.uint8) if fill is None else np.full(n, fill, dtype=np.uint8)
    return a


def pattern(n: int, seed: int = 1):
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + seed) >> 7).astype(np.uint8)


def addr(a) -> int:
    return a.ctypes.data


def ucp_wheel_lib():
    """The NIXL wheel's bundled libucp (both sides of interop must bind one UCX)."""
    d = os.environ.get("NIXL_TEST_NIXL_WHEEL_DIR")
    if not d or not os.path.isdir(os.path.join(d, "nixl_cu12")):
        return None, None
    libs = glob.glob(os.path.join(d, "nixl_cu12.libs", "libucp-*.so*"))
    return d, (libs[0] if libs else None)


def system_ucx() -> bool:
    if os.environ.get("NIXL_UCX_LIB"):
        return True
    try:
        import ctypes

        ctypes.CDLL("libucp.so.0")
        return True
    except OSError:
        return False


@pytest.fixture
def agents():
    """Make agents by name (TCP unless `backends` is given); all shut down at the end
    of the test."""
    made = []

    def make(name=None, **cfg):
        cfg.setdefault("backends", ["TCP"])
        a = nixl_agent(name or unique("agent"), nixl_agent_config(**cfg))
        made.append(a)
        return a

    yield make
    for a in made:
        a.shutdown()


def connect(a, b):
    """Each agent loads the other's full metadata (after their registrations)."""
    # NIXL 1.5.1 returns the name as bytes; so do we.
    assert a.add_remote_agent(b.get_agent_metadata()) == b.name.encode()
    assert b.add_remote_agent(a.get_agent_metadata()) == a.name.encode()
