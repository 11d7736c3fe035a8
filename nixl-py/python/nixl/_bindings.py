# SPDX-License-Identifier: Apache-2.0
"""``nixl._bindings``: the names NIXL's compiled bindings module offers that its
callers use (``nixlBind`` in ``nixl._api``), over nixl-rs.

Constants and enums carry NIXL 1.5.1's values; the descriptor lists are the ones
``nixl._api`` returns and accept NIXL's constructors (``nixlXferDList(DRAM_SEG,
[(addr, len, dev), ...])``, an Nx3 numpy array, or an initial size) and editing
methods; the exception classes are the ones nixl-rs raises. ``nixlAgentConfig`` and
``nixlAgent`` make a native agent for ``nixl_agent.agent`` (what SGLang's HiCache
does); NIXL's C++ methods on it are not offered: use ``nixl._api.nixl_agent``'s.
"""

from enum import IntEnum

from nixl_rs import _native
from nixl_rs._api import (  # noqa: F401
    nixl_mem_t,
    nixl_thread_sync_t,
    nixlRegDList,
    nixlRemoteDList,
    nixlXferDList,
    nixlXferTelemetry,
)
from nixl_rs._native import (  # noqa: F401
    nixlBackendError,
    nixlCancelledError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlUnknownError,
)

DEFAULT_COMM_PORT = _native.DEFAULT_COMM_PORT
NIXL_INIT_AGENT = ""
#: NIXL's UCX GPU device API (memory views): not offered by nixl-rs.
HAVE_UCX_GPU_DEVICE_API = False


class nixl_status_t(IntEnum):
    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9


class nixl_xfer_op_t(IntEnum):
    NIXL_READ = 0
    NIXL_WRITE = 1


class nixl_cost_t(IntEnum):
    NIXL_COST_ANALYTICAL_BACKEND = 0


# NIXL's bindings export every enum value at module level too.
for _enum in (nixl_mem_t, nixl_status_t, nixl_thread_sync_t, nixl_xfer_op_t, nixl_cost_t):
    globals().update(_enum.__members__)
del _enum

__all__ = [n for n in globals() if not n.startswith("_") and n not in ("IntEnum",)]


class nixlAgentConfig:
    """NIXL's bindings agent configuration, for code that builds its own
    ``nixlAgent`` (SGLang's HiCache storage does). ``captureTelemetry``,
    ``useListenThread`` and ``listenPort`` take effect; the thread settings are
    accepted (nixl-rs drives progress itself and its agents are thread-safe)."""

    def __init__(self, use_prog_thread: bool = True, use_listen_thread: bool = False,
                 port: int = 0, sync_mode: int = 0, num_workers: int = 1,
                 pthr_delay_us: int = 0, lthr_delay_us: int = 100000,
                 capture_telemetry: bool = False):
        self.useProgThread = use_prog_thread
        self.useListenThread = use_listen_thread
        self.listenPort = port
        self.syncMode = sync_mode
        self.pthrDelay = pthr_delay_us
        self.lthrDelay = lthr_delay_us
        self.captureTelemetry = capture_telemetry
        self.etcdWatchTimeout = 5_000_000


def nixlAgent(name: str, config: "nixlAgentConfig | None" = None):
    """NIXL's bindings agent: a native nixl-rs agent without backends, which
    ``nixl_agent`` can use as its ``agent`` (backends are added with
    ``nixl_agent.create_backend``)."""
    cfg = config if config is not None else nixlAgentConfig()
    port = cfg.listenPort if cfg.useListenThread else None
    return _native.Agent(name, [], bool(cfg.captureTelemetry), port)


__all__ += ["nixlAgentConfig", "nixlAgent"]
