# SPDX-License-Identifier: Apache-2.0
"""``nixl._bindings``: the names NIXL's compiled bindings module offers that its
callers use (``nixlBind`` in ``nixl._api``), over nixl-rs.

Constants and enums carry NIXL 1.5.1's values; the descriptor lists are the ones
``nixl._api`` returns and accept NIXL's constructors (``nixlXferDList(DRAM_SEG,
[(addr, len, dev), ...])``, an Nx3 numpy array, or an initial size) and editing
methods; the exception classes are the ones nixl-rs raises. NIXL's C++ agent classes
(``nixlAgent``, ``nixlAgentConfig``) are not offered: use ``nixl._api.nixl_agent``.
"""

from enum import IntEnum

from nixl_rs import _native
from nixl_rs._api import (  # noqa: F401
    nixl_mem_t,
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


class nixl_thread_sync_t(IntEnum):
    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0


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
