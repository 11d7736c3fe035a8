# SPDX-License-Identifier: Apache-2.0
"""NIXL's Python API (``nixl._api`` of NIXL 1.5.1) over nixl-rs.

Same classes, method names, argument names, defaults and return values as NIXL's
``_api.py`` (the package ``nixl`` of this distribution re-exports this module as
``nixl._api``, so connectors run unchanged). No ``backends`` means ``["UCX"]`` as in
NIXL; ``"TCP"`` names nixl-tcp, which needs no system library. Where they differ
(see the README's Python section):

- Errors raise: a failed transfer raises from ``check_xfer_state``/``transfer``
  (NIXL's bindings raise too for every error status; "ERR" is never returned), and
  bad descriptor inputs raise ``TypeError``/``nixlInvalidParamError`` where NIXL logs
  and returns None. Every nixl-rs exception carries ``kind``, ``operation`` and
  ``context``, and its message starts with NIXL's status name.
- Releasing a transfer in flight cancels it; ``deregister_memory`` waits (bounded)
  for transfers still using the memory.
- A backend can be added with ``create_backend`` only before memory is registered,
  metadata handed out or peers added (nixl-rs fixes an agent's backends when it
  starts; the agent is rebuilt until then).
- Calls without ``ip_addr`` use etcd at ``NIXL_ETCD_ENDPOINTS`` as NIXL's do (NIXL's
  key layout under ``NIXL_ETCD_NAMESPACE`` for agents with UCX; a wheel built with
  the ``etcd`` feature); a fetch waits up to 30 s for the peer's key, then follows
  it. Partial metadata sent to a listener or etcd, ``estimate_xfer_cost`` and
  memory views raise ``nixlNotSupportedError``.
- Files: ``backends=["POSIX"]`` (nixl-posix: io_uring, or a thread pool where it is
  refused), FILE registrations ``(0, length, fd, meta)`` or NIXL's path mode
  ``(0, length, devId, "rw,create:PATH")``, transfer descriptors
  ``(file offset, length, fd or devId)``, a storage transfer naming the agent itself, and
  ``query_memory`` of file paths, as NIXL's POSIX backend takes them. The
  registration keeps its own duplicate of the descriptor; a notification on a
  storage transfer raises, as in NIXL.

Beyond NIXL: ``await agent.transfer_async(handle)``, ``await agent.wait_xfer(handle)``,
``async for peer, msg in agent.notifications()``, ``agent.shutdown()`` and use as a
context manager.

Memory handed in by address (tuples, numpy Nx3 arrays, torch tensors) stays the
caller's: from ``register_memory`` until ``deregister_memory`` returns (or the agent
is shut down), each range must stay allocated, not be reused, and be valid for its
memory type; peers may read and write it whenever the application's protocol lets
them. The agent keeps its registrations alive while transfers use them
(deregistering memory in flight waits for them, then raises ``nixlNotAllowedError``),
and the
``nixlRegDList`` returned for tensors keeps those tensors referenced.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import operator
import os
import pickle
import struct
import sys
import threading
import weakref
from enum import Enum, IntEnum
from typing import Optional, Union

from . import _native
from ._native import (  # noqa: F401
    NixlError,
    nixl_prepped_dlist_handle,
    nixl_xfer_handle,
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

logger = logging.getLogger("nixl_rs")

DEFAULT_COMM_PORT = _native.DEFAULT_COMM_PORT
NIXL_INIT_AGENT = "NIXL_INIT_AGENT"

_MEM_TYPES = {"DRAM": "DRAM", "VRAM": "VRAM", "cpu": "DRAM", "cuda": "VRAM",
              "FILE": "FILE", "BLOCK": "BLOCK", "OBJ": "OBJ"}


class nixl_mem_t(IntEnum):
    """NIXL's memory types (``nixl._bindings.nixl_mem_t``), same values."""

    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


_SEG_NAMES = {nixl_mem_t.DRAM_SEG: "DRAM", nixl_mem_t.VRAM_SEG: "VRAM",
              nixl_mem_t.BLK_SEG: "BLOCK", nixl_mem_t.OBJ_SEG: "OBJ",
              nixl_mem_t.FILE_SEG: "FILE"}
_SEGS = {v: k for k, v in _SEG_NAMES.items()}


def _is_torch_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _is_ndarray(obj: object) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, np.ndarray)


_STATUS = {"nixlInvalidParamError": "NIXL_ERR_INVALID_PARAM", "nixlNotFoundError": "NIXL_ERR_NOT_FOUND",
           "nixlNotSupportedError": "NIXL_ERR_NOT_SUPPORTED", "nixlNotAllowedError": "NIXL_ERR_NOT_ALLOWED",
           "nixlBackendError": "NIXL_ERR_BACKEND", "nixlMismatchError": "NIXL_ERR_MISMATCH",
           "nixlNotPostedError": "NIXL_ERR_NOT_POSTED",
           "nixlRemoteDisconnectError": "NIXL_ERR_REMOTE_DISCONNECT",
           "nixlCancelledError": "NIXL_ERR_CANCELED", "nixlRepostActiveError": "NIXL_ERR_REPOST_ACTIVE"}


def _error(cls, kind: str, operation: str, message: str):
    status = _STATUS.get(cls.__name__, "NIXL_ERR_UNKNOWN")
    e = cls(f"{status}: {operation}: {message}")
    e.kind, e.operation, e.context = kind, operation, message
    return e


def _not_supported(operation: str, message: str):
    return _error(nixlNotSupportedError, "NotSupported", operation, message)


def _bytes(msg, what: str = "notif_msg") -> bytes:
    if msg.__class__ is bytes:
        return msg
    if isinstance(msg, str):
        return msg.encode()
    if isinstance(msg, (bytearray, memoryview)):
        return bytes(msg)
    raise TypeError(f"{what} must be bytes or str, not {type(msg).__name__}")


def _name(name, what: str = "agent name") -> str:
    """An agent name as str: NIXL hands names out as bytes (add_remote_agent) and
    takes str or bytes."""
    if name.__class__ is str:
        return name
    if isinstance(name, (bytes, bytearray)):
        return bytes(name).decode()
    raise TypeError(f"{what} must be str or bytes, not {type(name).__name__}")


def _mem_type(mem_type) -> str:
    if isinstance(mem_type, nixl_mem_t):
        return _SEG_NAMES[mem_type]
    if not isinstance(mem_type, str) or mem_type not in _MEM_TYPES:
        raise _error(nixlInvalidParamError, "InvalidArgument", "descriptor list",
                     f"unknown memory type {mem_type!r}; expected \"DRAM\" or \"VRAM\"")
    return _MEM_TYPES[mem_type]


class _DList:
    """A descriptor list: a memory type and rows of (address, length, device ID).

    Built by the agent's helpers (``get_xfer_descs``, ``get_reg_descs``), or as
    NIXL's bindings build them: ``nixlXferDList(nixl_mem_t.DRAM_SEG)`` (empty),
    ``nixlXferDList(DRAM_SEG, [(addr, len, dev), ...])`` or with an Nx3 numpy
    array; ``addDesc``/``append``, ``remDesc``, ``index``, item assignment and
    ``clear`` edit it."""

    __slots__ = ("_mem_type", "_rows", "_packed", "_meta", "_owners")
    _width = 3

    def __init__(self, mem_type, descs=None, *, rows=None, packed: Optional[bytes] = None,
                 meta=None, owners=None):
        self._mem_type = _mem_type(mem_type)
        if descs is not None:
            # NIXL's bindings: (type, init_size), (type, ndarray), (type, list).
            rows, packed, meta = self._from_bindings(descs)
        self._rows = rows if rows is not None or packed is not None else []
        self._packed = packed
        self._meta = meta
        self._owners = owners

    def _from_bindings(self, arg):
        if _is_ndarray(arg):
            return None, _packed_rows(arg, 3), None
        if isinstance(arg, int):
            if arg < 0:
                raise ValueError("init_size must be non-negative")
            return [], None, None
        if isinstance(arg, list):
            return _rows([tuple(d) for d in arg], self._width, "descriptor"), None, None
        raise TypeError(f"{type(self).__name__}(type, descs): descs must be a list of "
                        f"tuples or an Nx3 numpy array, not {type(arg).__name__}")

    def _wire(self):
        return self._packed if self._packed is not None else self._rows

    def _unpack(self):
        """Rows as a list, for editing."""
        if self._packed is not None:
            self._rows = [tuple(_DList.__getitem__(self, i)[:3]) for i in range(len(self))]
            if self._meta is None:
                self._meta = [""] * len(self._rows)
            self._packed = None

    def getType(self) -> nixl_mem_t:
        """The memory type, as NIXL's bindings return it (an ``nixl_mem_t``, an int)."""
        return _SEGS[self._mem_type]

    @property
    def mem_type(self) -> str:
        return self._mem_type

    def descCount(self) -> int:
        return len(self)

    def isEmpty(self) -> bool:
        return len(self) == 0

    def __len__(self) -> int:
        if self._packed is not None:
            return len(self._packed) // (8 * self._width)
        return len(self._rows)

    def __bool__(self) -> bool:
        # NIXL's lists are always true (callers test `if not descs` for None).
        return True

    def __getitem__(self, i: int) -> tuple:
        if self._packed is not None:
            n = len(self)
            if i < 0:
                i += n
            if not 0 <= i < n:
                raise IndexError("descriptor index out of range")
            row = 8 * self._width
            return struct.unpack_from(f"<{self._width}Q", self._packed, i * row)
        return self._rows[i]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __eq__(self, other) -> bool:
        return (type(self) is type(other) and self._mem_type == other._mem_type
                and list(self) == list(other))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._mem_type}, {len(self)} descriptors)"

    def __getstate__(self):
        return (self._mem_type, self._rows, self._packed, self._meta)

    def __setstate__(self, state):
        self._mem_type, self._rows, self._packed, self._meta = state
        self._owners = None

    # NIXL's bindings' editing methods.

    def _row(self, desc) -> tuple:
        rows = _rows([tuple(desc)], self._width, "descriptor")
        return rows[0]

    def addDesc(self, desc: tuple) -> None:
        """Append one descriptor."""
        self._unpack()
        self._rows.append(self._row(desc))

    def append(self, desc: tuple) -> None:
        self.addDesc(desc)

    def remDesc(self, index: int) -> None:
        """Remove the descriptor at ``index``."""
        self._unpack()
        del self._rows[index]

    def __setitem__(self, index: int, desc: tuple) -> None:
        self._unpack()
        self._rows[index] = self._row(desc)

    def index(self, desc: tuple) -> int:
        """Position of ``desc``; raises ``nixlNotFoundError`` when absent."""
        want = tuple(desc)[:3]
        for i, row in enumerate(self):
            if tuple(row[:3]) == want:
                return i
        raise _error(nixlNotFoundError, "NotFound", "descriptor list",
                     f"no descriptor {want!r} in the list")

    def clear(self) -> None:
        self._rows, self._packed, self._meta = [], None, ([] if self._meta is not None else None)

    def print(self) -> None:
        print(repr(self), list(self))


class nixlXferDList(_DList):
    """Transfer descriptors: (address, length, device ID) rows of one memory type."""

    __slots__ = ()


class nixlRegDList(_DList):
    """Registration descriptors: (address, length, device ID, meta) of one memory type."""

    __slots__ = ()

    def __init__(self, mem_type, descs=None, *, rows=None, packed: Optional[bytes] = None,
                 meta=None, owners=None):
        if isinstance(descs, list) and descs and len(descs[0]) == 4:
            # NIXL's bindings: (type, [(addr, len, dev, meta), ...]).
            descs = [tuple(d) for d in descs]
            rows, meta = _rows(descs, 4, "registration descriptor"), [str(d[3]) for d in descs]
            descs = None
        super().__init__(mem_type, descs, rows=rows, packed=packed, meta=meta, owners=owners)
        if self._meta is None and self._packed is None:
            self._meta = [""] * len(self._rows)

    def __getitem__(self, i: int) -> tuple:
        row = super().__getitem__(i)
        meta = self._meta[i] if self._meta else ""
        return (*row[:3], meta)

    def addDesc(self, desc: tuple) -> None:
        desc = tuple(desc)
        if len(desc) != 4:
            raise TypeError("a registration descriptor is (address, length, device ID, meta)")
        self._unpack()
        self._rows.append(_rows([desc], 4, "registration descriptor")[0])
        self._meta.append(str(desc[3]))

    def remDesc(self, index: int) -> None:
        self._unpack()
        del self._rows[index]
        del self._meta[index]

    def __setitem__(self, index: int, desc: tuple) -> None:
        desc = tuple(desc)
        self._unpack()
        self._rows[index] = _rows([desc], 4, "registration descriptor")[0]
        self._meta[index] = str(desc[3])

    def trim(self) -> nixlXferDList:
        """The same descriptors without their meta, as transfer descriptors."""
        return nixlXferDList(self._mem_type, rows=[tuple(r[:3]) for r in self])


class nixlRemoteDList(_DList):
    """Remote descriptors (address, length, device ID, agent name); for memory views,
    which nixl-rs does not offer."""

    __slots__ = ()


def _int(x) -> int:
    """A non-negative int from an int or an integer scalar (numpy's included, as
    NIXL accepts them); -1 for anything else."""
    if x.__class__ is int:
        return x
    if isinstance(x, (bool, float)):
        return -1
    try:
        return operator.index(x)
    except TypeError:
        return -1


def _rows(descs, width: int, what: str) -> list:
    """Validated (addr, len, dev) rows from tuples of `width` elements."""
    rows = []
    for i, d in enumerate(descs):
        if not isinstance(d, tuple) or len(d) != width:
            raise TypeError(f"{what} {i} must be a {width}-tuple, got {d!r}")
        a, n, dev = _int(d[0]), _int(d[1]), _int(d[2])
        if a < 0 or n < 0 or dev < 0:
            raise TypeError(f"{what} {i}: address, length and device ID must be "
                            f"non-negative ints, got {d!r}")
        rows.append((a, n, dev))
    return rows


def _packed_rows(arr, width: int) -> bytes:
    np = sys.modules["numpy"]
    if arr.ndim != 2 or arr.shape[1] != width:
        raise _error(nixlInvalidParamError, "InvalidArgument", "descriptor list",
                     f"a numpy descriptor array must be Nx{width}, got shape {arr.shape}")
    if arr.size and (arr < 0).any():
        raise _error(nixlInvalidParamError, "InvalidArgument", "descriptor list",
                     "negative address, length or device ID")
    return np.ascontiguousarray(arr, dtype="<u8").tobytes()


def _tensor_row(t):
    if not t.is_contiguous():
        raise _error(nixlInvalidParamError, "InvalidArgument", "descriptor list",
                     "please use contiguous tensors")
    dev = t.get_device()
    mem = "DRAM" if dev == -1 else "VRAM"
    return mem, (t.data_ptr(), t.numel() * t.element_size(), max(dev, 0))


def _pip_ucx() -> Optional[str]:
    """libucp of an installed UCX wheel (``libucx-cu12``/``libucx-cu13``: UCX with
    its CUDA transports, what NIXL's wheels bundle), if there is one."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        lib = os.path.join(d, "lib", "libucp.so.0")
        if os.path.exists(lib):
            return lib
    return None


def _with_ucx_lib(params: dict) -> dict:
    """UCX backend parameters naming the libucp to bind: the caller's ``lib``, else
    ``NIXL_UCX_LIB``, else an installed UCX wheel, else the host's ``libucp.so.0``."""
    if "lib" in params or os.environ.get("NIXL_UCX_LIB"):
        return params
    lib = _pip_ucx()
    return {**params, "lib": lib} if lib else params


def _explain_missing_ucx(e: Exception) -> Exception:
    """A missing UCX, explained: what to install, or how to choose nixl-rs' TCP."""
    if getattr(e, "kind", None) != "UnavailableLibrary" or "UCX" not in str(e):
        return e
    return _error(
        nixlNotSupportedError, "UnavailableLibrary", e.operation,
        f"{e.context}. The UCX backend (NIXL's default) needs UCX: pip install libucx-cu12 "
        "(UCX with CUDA transports, as NIXL's wheels bundle), or apt-get install libucx0, or "
        "set NIXL_UCX_LIB to a libucp.so.0; or choose nixl-rs' TCP backend, which needs no "
        "system library: nixl_agent_config(backends=[\"TCP\"])")


def _need(descs):
    """A descriptor list the helpers made, or the error for the list they refused."""
    if descs is None:
        raise _error(nixlInvalidParamError, "InvalidArgument", "descriptor list",
                     "no descriptor list: tensors on different devices")
    return descs


def _tensor_rows(descs):
    """(memory type, rows, tensors), or None for tensors on different devices (NIXL
    returns no list for those)."""
    rows, mem = [], None
    tensors = [descs] if _is_torch_tensor(descs) else list(descs)
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            logger.error("all tensors of a descriptor list must be on one device")
            return None
        m, row = _tensor_row(t)
        mem = m
        rows.append(row)
    return mem, rows, tensors


class nixl_thread_sync_t(IntEnum):
    """NIXL's thread synchronization modes, with NIXL's bindings' values (DEFAULT is
    NONE's value there too); nixl-rs agents are always thread-safe."""

    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0


class nixlXferTelemetry:
    """Telemetry of a transfer's latest post: times in microseconds."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes",
                 "descCount", "backend")

    def __init__(self, startTime=0, postDuration=0, xferDuration=0, totalBytes=0,
                 descCount=0, backend=""):
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount
        self.backend = backend

    def __repr__(self) -> str:
        return ("nixlXferTelemetry(startTime=%d, postDuration=%d, xferDuration=%d, "
                "totalBytes=%d, descCount=%d)" % (self.startTime, self.postDuration,
                                                  self.xferDuration, self.totalBytes,
                                                  self.descCount))


class nixl_agent_config:
    """Configuration of an agent (NIXL's arguments).

    Args:
        enable_prog_thread: accepted for NIXL compatibility; nixl-rs backends drive
            their own progress.
        enable_listen_thread: serve a metadata listener (NIXL's listener protocol when
            a backend speaks NIXL's, e.g. UCX; nixl-rs' side channel otherwise).
        listen_port: the listener's port (0: any free port, see
            ``nixl_agent.listen_port``).
        capture_telemetry: record per-transfer telemetry (``get_xfer_telemetry``).
        num_threads: passed to backends as NIXL does (UCX ``num_threads``, UCCL
            ``num_cpus``); nixl-rs backends size themselves.
        backends: backend names ("UCX", "TCP", "VERBS", "UCCL", "POSIX"); None:
            ["UCX"], as NIXL (name "TCP" for nixl-rs' TCP backend, which needs no
            system library).
        sync_mode: accepted for NIXL compatibility (agents are always thread-safe).
    """

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: Optional[list[str]] = None,
        sync_mode: Optional[nixl_thread_sync_t] = None,
    ):
        self.backends = list(backends) if backends is not None else ["UCX"]
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        if sync_mode is not None and (isinstance(sync_mode, bool)
                                      or sync_mode not in (0, 1, 2)):
            raise TypeError(
                f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})"
            )
        self.sync_mode = sync_mode


# Agents alive in this process, shut down at interpreter exit.
_live: "weakref.WeakSet[nixl_agent]" = weakref.WeakSet()
_live_lock = threading.Lock()


def _shutdown_all():
    with _live_lock:
        agents = list(_live)
    for a in agents:
        try:
            a.shutdown()
        except Exception:  # noqa: BLE001 - exit path: log and go on
            logger.exception("shutting down nixl_rs agent at exit")
    _native.finalize()


atexit.register(_shutdown_all)


class _NotifStream:
    """Async iterator of (agent name, message) notifications."""

    def __init__(self, agent: "nixl_agent"):
        self._agent = agent

    def __aiter__(self):
        return self

    async def __anext__(self):
        native = self._agent.agent
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def deliver(item):
            if fut.done():
                if item is not None:
                    native.requeue(item[0], item[1])
            else:
                fut.set_result(item)

        item = native.next_notif(loop, deliver)
        if item is None:
            try:
                item = await fut
            except asyncio.CancelledError:
                # Cancelled after the notification arrived but before this task
                # resumed: it goes back to the front, not lost.
                if fut.done() and not fut.cancelled():
                    got = fut.result()
                    if got is not None:
                        native.requeue(got[0], got[1])
                raise
        if item is None:
            raise StopAsyncIteration
        return item


class nixl_agent:
    """An agent: backends, registered memory, peers, transfers and notifications.

    Args:
        agent_name: the agent's name, unique among the agents it works with.
        nixl_conf: configuration (``nixl_agent_config``); None: defaults.
        instantiate_all: instantiate every backend of this build.
    """

    def __init__(
        self,
        agent_name: str,
        nixl_conf: Optional[nixl_agent_config] = None,
        instantiate_all: bool = False,
    ):
        if not isinstance(agent_name, str):
            raise TypeError(f"agent_name must be a str, not {type(agent_name).__name__}")
        if nixl_conf and instantiate_all:
            instantiate_all = False
            logger.warning("Ignoring instantiate_all based on the provided config in agent creation.")
        if not nixl_conf:
            nixl_conf = nixl_agent_config()
        self.plugin_list = list(_native.plugins())
        if instantiate_all:
            nixl_conf.backends = list(self.plugin_list)
        init_list = []
        for bknd in nixl_conf.backends:
            if bknd not in self.plugin_list and bknd.upper() not in self.plugin_list:
                logger.warning("Skipping backend registration %s due to the missing plugin.", bknd)
                continue
            init: dict[str, str] = {}
            if nixl_conf.num_threads > 0:
                if bknd in ("UCX", "OBJ", "LIBFABRIC"):
                    init["num_threads"] = str(nixl_conf.num_threads)
                elif bknd == "UCCL":
                    init["num_cpus"] = str(nixl_conf.num_threads)
            init_list.append((bknd.upper(), init))
        port = nixl_conf.port if nixl_conf.enable_listen else None
        init_list = [(b, _with_ucx_lib(p) if b == "UCX" else p) for b, p in init_list]
        try:
            self.agent = _native.Agent(agent_name, init_list,
                                         bool(nixl_conf.capture_telemetry), port)
        except NixlError as e:
            raise _explain_missing_ucx(e) from None
        self.name = agent_name
        self.notifs: dict[str, list[bytes]] = {}
        self.backends: dict[str, str] = {b: b for b in self.agent.backends()}
        self.backend_mems: dict[str, list[str]] = {
            b: self.agent.backend_mem_types(b) or [] for b in self.backends}
        self.backend_options: dict[str, dict[str, str]] = {
            b: dict(_native.plugin_params(b)) for b in self.backends}
        self.nixl_mems = dict(_MEM_TYPES)
        self.nixl_ops = {"WRITE": "WRITE", "READ": "READ"}
        with _live_lock:
            _live.add(self)
        logger.info("Initialized nixl_rs agent: %s", agent_name)

    # Teardown ---------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop everything the agent started and join it (beyond NIXL). Transfers in
        flight are drained (bounded), then cancelled; registrations are released.
        Idempotent; also done when the agent is collected and at interpreter exit."""
        native = getattr(self, "agent", None)
        if native is None:
            return
        report = native.shutdown()
        if report:
            logger.warning("nixl_rs agent %s shut down with: %s", self.name, report)
        else:
            logger.info("nixl_rs agent %s shut down cleanly", self.name)

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - finalizer
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False

    @property
    def listen_port(self) -> Optional[int]:
        """The metadata listener's port (beyond NIXL: with listen_port=0, the one bound)."""
        addr = self.agent.listen_addr
        return addr[1] if addr else None

    # Backends ---------------------------------------------------------------

    def get_plugin_list(self) -> list[str]:
        """Names of the backends this build offers."""
        return self.plugin_list

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        """Memory types a backend may support."""
        if backend in self.backend_mems:
            return self.backend_mems[backend]
        if backend not in self.plugin_list:
            logger.warning("Plugin %s is not available to get its supported mem types.", backend)
            return []
        if backend == "POSIX":
            return ["DRAM", "FILE"]
        return ["DRAM", "VRAM"]

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        """A backend's initialization parameters and their defaults."""
        if backend not in self.plugin_list:
            logger.warning("Plugin %s is not available to get its parameters.", backend)
            return {}
        return dict(_native.plugin_params(backend))

    def get_backend_mem_types(self, backend: str) -> list[str]:
        """Memory types an instantiated backend supports."""
        if backend in self.backend_mems:
            return self.backend_mems[backend]
        logger.warning("Backend %s not instantiated to get its supported mem types.", backend)
        return []

    def get_backend_params(self, backend: str) -> dict[str, str]:
        """Parameters of an instantiated backend."""
        if backend in self.backend_options:
            return self.backend_options[backend]
        logger.warning("Backend %s not instantiated to get its parameters.", backend)
        return {}

    def create_backend(self, backend: str, initParams: dict[str, str] = {}):  # noqa: B006
        """Instantiate a backend (before memory is registered, metadata handed out or
        peers added; see the module docs)."""
        params = {str(k): str(v) for k, v in initParams.items()}
        if backend.upper() == "UCX":
            params = _with_ucx_lib(params)
        try:
            self.agent.create_backend(backend, params)
        except NixlError as e:
            raise _explain_missing_ucx(e) from None
        name = backend.upper()
        self.backends[name] = name
        self.backend_mems[name] = self.agent.backend_mem_types(name) or []
        self.backend_options[name] = {**_native.plugin_params(name), **initParams}
        logger.info("Backend %s was instantiated", backend)

    # Memory -----------------------------------------------------------------

    def register_memory(self, reg_list, mem_type: Optional[str] = None,
                        backends: list[str] = []) -> nixlRegDList:  # noqa: B006
        """Register memory: (addr, len, dev, meta) tuples with ``mem_type``, an Nx3
        numpy array with ``mem_type``, a tensor or a list of tensors, or an
        ``nixlRegDList``. See the module docs for the memory contract."""
        reg_descs = _need(self.get_reg_descs(reg_list, mem_type))
        metas = None
        if reg_descs._mem_type == "FILE" and reg_descs._meta:
            metas = [str(m) for m in reg_descs._meta]
        self.agent.register(reg_descs._mem_type, reg_descs._wire(), list(backends), metas)
        return reg_descs

    def deregister_memory(self, dereg_list: nixlRegDList, backends: list[str] = []):  # noqa: B006
        """Deregister memory registered before. Transfers still using any of it are
        waited for (those released in flight are cancelled) up to 10 s for the whole
        list; then ``nixlNotAllowedError``, and nothing of the list changes. (A
        transfer another thread posts on this memory while the call runs can still
        make it refuse part way, after the regions before it were deregistered.)"""
        if not isinstance(dereg_list, nixlRegDList):
            raise TypeError("deregister_memory takes the nixlRegDList register_memory returned")
        self.agent.deregister(dereg_list._mem_type, dereg_list._wire())

    def query_memory(self, reg_list, backend: str, mem_type: Optional[str] = None
                     ) -> list[Optional[dict[str, str]]]:
        """Whether each file exists, as NIXL's file backends answer: per registration
        descriptor (the file's path in its meta), ``None`` when nothing is there, else
        ``{"size", "mode", "mtime"}`` as strings."""
        reg_descs = _need(self.get_reg_descs(reg_list, mem_type))
        if backend not in self.backends:
            raise ValueError(
                f"Backend '{backend}' not found. Available backends: {list(self.backends.keys())}")
        if "FILE" not in self.backend_mems.get(backend, []):
            raise _not_supported("query memory", f"backend {backend} holds no files to query")
        out: list[Optional[dict[str, str]]] = []
        for i in range(len(reg_descs)):
            path = reg_descs[i][3]
            try:
                st = os.stat(path)
            except (FileNotFoundError, NotADirectoryError):
                out.append(None)
                continue
            out.append({"size": str(st.st_size), "mode": str(st.st_mode),
                        "mtime": str(int(st.st_mtime))})
        return out

    def get_reg_descs(self, descs, mem_type: Optional[str] = None) -> nixlRegDList:
        """A registration descriptor list from (addr, len, dev, meta) tuples with a
        memory type, an Nx3 numpy array with a memory type, a tensor or a list of
        tensors; an ``nixlRegDList`` passes through."""
        if isinstance(descs, nixlRegDList):
            return descs
        if isinstance(descs, _DList):
            raise TypeError(f"{type(descs).__name__} given for registration, please use nixlRegDList")
        if _is_ndarray(descs):
            if mem_type is None:
                raise TypeError("please specify a mem_type with a numpy descriptor array")
            return nixlRegDList(mem_type, packed=_packed_rows(descs, 3))
        if _is_torch_tensor(descs) or (isinstance(descs, (list, tuple)) and descs
                                       and _is_torch_tensor(descs[0])):
            made = _tensor_rows(descs)
            if made is None:
                return None
            mem, rows, tensors = made
            return nixlRegDList(mem, rows=rows, meta=[""] * len(rows), owners=tensors)
        if isinstance(descs, (list, tuple)):
            if mem_type is None:
                raise TypeError("please specify a mem_type if not using tensors")
            if descs and not (isinstance(descs[0], tuple) and len(descs[0]) == 4):
                raise TypeError("4-tuple list (address, length, device ID, meta) needed for registration")
            rows = _rows(descs, 4, "registration descriptor")
            return nixlRegDList(mem_type, rows=rows, meta=[d[3] for d in descs])
        raise TypeError(f"cannot make registration descriptors from {type(descs).__name__}")

    def get_xfer_descs(self, descs, mem_type: Optional[str] = None) -> nixlXferDList:
        """A transfer descriptor list from (addr, len, dev) tuples with a memory type,
        an Nx3 numpy array with a memory type, a tensor or a list of tensors; an
        ``nixlXferDList`` passes through."""
        if isinstance(descs, nixlXferDList):
            return descs
        if isinstance(descs, _DList):
            raise TypeError(f"{type(descs).__name__} given for a transfer, please use nixlXferDList")
        if _is_ndarray(descs):
            if mem_type is None:
                raise TypeError("please specify a mem_type with a numpy descriptor array")
            return nixlXferDList(mem_type, packed=_packed_rows(descs, 3))
        if _is_torch_tensor(descs) or (isinstance(descs, (list, tuple)) and descs
                                       and _is_torch_tensor(descs[0])):
            made = _tensor_rows(descs)
            if made is None:
                return None
            mem, rows, tensors = made
            return nixlXferDList(mem, rows=rows, owners=tensors)
        if isinstance(descs, (list, tuple)):
            if mem_type is None:
                raise TypeError("please specify a mem_type if not using tensors")
            if descs and not (isinstance(descs[0], tuple) and len(descs[0]) == 3):
                raise TypeError("3-tuple list (address, length, device ID) needed for transfer")
            return nixlXferDList(mem_type, rows=_rows(descs, 3, "transfer descriptor"))
        raise TypeError(f"cannot make transfer descriptors from {type(descs).__name__}")

    def get_remote_descs(self, descs, mem_type: Optional[str] = None) -> nixlRemoteDList:
        if isinstance(descs, nixlRemoteDList):
            return descs
        if mem_type is None:
            raise TypeError("please specify a mem_type")
        return nixlRemoteDList(mem_type, rows=[tuple(d) for d in descs])

    def get_serialized_descs(self, descs) -> bytes:
        """Pickle a descriptor list."""
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes):
        """Unpickle a descriptor list."""
        return pickle.loads(serialized_descs)

    # Metadata ---------------------------------------------------------------

    def get_agent_metadata(self) -> bytes:
        """This agent's full metadata: NIXL's format when a backend speaks NIXL's
        protocol (UCX), so NIXL agents load it; nixl-rs' otherwise."""
        return self.agent.metadata()

    def get_partial_agent_metadata(self, descs, inc_conn_info: bool = False,
                                   backends: list[str] = []) -> bytes:  # noqa: B006
        """Metadata of the registrations holding ``descs`` (an nixlRegDList; may be
        empty), with or without connection info."""
        if isinstance(descs, (list, tuple)) and not descs:
            descs = nixlRegDList("DRAM", rows=[])
        descs = self.get_reg_descs(descs)
        return self.agent.partial_metadata(descs._mem_type, descs._wire(), bool(inc_conn_info))

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Load a peer's metadata (NIXL's format or nixl-rs'); returns its name, as
        bytes like NIXL 1.5.1 (every call taking an agent name takes str or bytes)."""
        return self.agent.load_metadata(_bytes(metadata, "metadata")).encode()

    def remove_remote_agent(self, agent: str):
        """Forget a peer: transfers to it are refused from now on."""
        self.agent.forget(_name(agent))

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT):
        """Send this agent's metadata to the listener at ip_addr:port, or without
        ``ip_addr`` publish it in etcd (in the background)."""
        self.agent.send_metadata(ip_addr, port)

    def send_partial_agent_metadata(self, descs, inc_conn_info: bool = False,
                                    backends: list[str] = [], ip_addr: str = "",  # noqa: B006
                                    port: int = DEFAULT_COMM_PORT, label: str = ""):
        raise _not_supported("send partial metadata",
                             "not offered by nixl_rs (NIXL's listener takes full metadata only); "
                             "carry get_partial_agent_metadata() yourself")

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "",
                              port: int = DEFAULT_COMM_PORT, label: str = ""):
        """Fetch a peer's metadata from its listener at ip_addr:port, or without
        ``ip_addr`` from etcd (in the background; ``check_remote_metadata`` says when
        it arrived)."""
        self.agent.fetch_metadata(_name(remote_agent), ip_addr, port, label)

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT):
        """Tell the listener at ip_addr:port to forget this agent, or without
        ``ip_addr`` withdraw its etcd keys (in the background)."""
        self.agent.invalidate_metadata(ip_addr, port)

    def check_remote_metadata(self, agent: str, descs=None) -> bool:
        """Whether the peer's metadata is loaded (and covers ``descs``, if given)."""
        if descs is None:
            return self.agent.has_peer(_name(agent))
        descs = _need(self.get_xfer_descs(descs))
        return self.agent.has_peer(_name(agent), descs._mem_type, descs._wire())

    def make_connection(self, remote_agent: str, backends: list[str] = []):  # noqa: B006
        """Connect to a peer now rather than at the first transfer (waits, GIL released)."""
        self.agent.connect(_name(remote_agent))

    # Transfers --------------------------------------------------------------

    def prep_xfer_dlist(self, agent_name: str, xfer_list, mem_type: Optional[str] = None,
                        backends: list[str] = []) -> nixl_prepped_dlist_handle:  # noqa: B006
        """Check a descriptor list once, to make requests from by index:
        "NIXL_INIT_AGENT" (or "") for local descriptors, this agent's name for
        loopback, a peer's name for its descriptors. An Nx5 numpy array is a strided
        list of (address, len, device ID, stride, count)."""
        agent_name = _name(agent_name, "agent_name")
        if _is_ndarray(xfer_list) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5:
            if mem_type is None:
                raise ValueError("Please specify a mem type for strided descriptors")
            return self.agent.prep(agent_name, _mem_type(mem_type),
                                     _packed_rows(xfer_list, 5), True)
        descs = _need(self.get_xfer_descs(xfer_list, mem_type))
        return self.agent.prep(agent_name, descs._mem_type, descs._wire(), False)

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: nixl_prepped_dlist_handle,
        local_indices,
        remote_xfer_side: nixl_prepped_dlist_handle,
        remote_indices,
        notif_msg: bytes = b"",
        backends: list[str] = [],  # noqa: B006
        skip_desc_merge: bool = False,
    ) -> nixl_xfer_handle:
        """A transfer request from prepared lists by index (lists of ints or integer
        numpy arrays); ``notif_msg`` is sent after each post's data unless the post
        names another."""
        return self.agent.make_request(
            operation, local_xfer_side, _indices(local_indices), remote_xfer_side,
            _indices(remote_indices), _bytes(notif_msg), list(backends), not skip_desc_merge)

    def initialize_xfer(
        self,
        operation: str,
        local_descs: nixlXferDList,
        remote_descs: nixlXferDList,
        remote_agent: str,
        notif_msg: bytes = b"",
        backends: list[str] = [],  # noqa: B006
    ) -> nixl_xfer_handle:
        """A transfer request from two descriptor lists (prepared here)."""
        if not isinstance(local_descs, nixlXferDList) or not isinstance(remote_descs, nixlXferDList):
            raise TypeError("initialize_xfer takes nixlXferDList lists (see get_xfer_descs)")
        return self.agent.create_request(
            operation, local_descs._mem_type, local_descs._wire(), remote_descs._mem_type,
            remote_descs._wire(), _name(remote_agent), _bytes(notif_msg), list(backends))

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        """Post a transfer: "DONE" if it finished within the call, else "PROC". Never
        blocks. Raises (a nixl-rs exception with the error kind) when it cannot be
        posted or failed at once."""
        if notif_msg.__class__ is not bytes:
            notif_msg = _bytes(notif_msg)
        return handle._post(notif_msg)

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """"DONE" or "PROC"; raises the error a failed transfer ended with."""
        return handle._state()

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlXferTelemetry:
        """Telemetry of the latest post (needs capture_telemetry)."""
        return nixlXferTelemetry(*handle._telemetry())

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        """The backend serving a request ("agent" for the agent's own local copies)."""
        return handle._backend()

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle):
        raise _not_supported("estimate transfer cost", "no backend of nixl-rs estimates costs")

    def release_xfer_handle(self, handle: nixl_xfer_handle):
        """Free a request; an unfinished transfer is cancelled (its memory stays
        alive until the backend lets go of it)."""
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle):
        """Free a prepared list."""
        handle.release()

    def prep_mem_view(self, dlist, *, backends: Optional[list[str]] = None) -> int:
        raise _not_supported("prepare memory view", "memory views (UCX's GPU device API) are not offered")

    def release_mem_view(self, mvh: int) -> None:
        raise _not_supported("release memory view", "memory views are not offered")

    # Notifications ------------------------------------------------------------

    def get_new_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        """New notifications: agent name to list of messages."""
        return self.agent.notifs()

    def update_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        """Add new notifications to ``self.notifs`` and return it."""
        for peer, msgs in self.agent.notifs().items():
            self.notifs.setdefault(peer, []).extend(msgs)
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: str, lookup_tag: bytes,
                               backends: list[str] = [], tag_is_prefix=True) -> bool:  # noqa: B006
        """Whether a notification from ``remote_agent_name`` starting with (or, with
        tag_is_prefix=False, containing) ``lookup_tag`` arrived; removes that one."""
        self.update_notifs(backends)
        msgs = self.notifs.get(_name(remote_agent_name))
        if not msgs:
            return False
        lookup_tag = _bytes(lookup_tag, "lookup_tag")
        for i, msg in enumerate(msgs):
            if (tag_is_prefix and msg.startswith(lookup_tag)) or (
                    not tag_is_prefix and lookup_tag in msg):
                del msgs[i]
                return True
        return False

    def send_notif(self, remote_agent_name: str, notif_msg: bytes,
                   backend: Optional[str] = None):
        """Send a notification not bound to a transfer (delivered in the background)."""
        self.agent.notify(_name(remote_agent_name), _bytes(notif_msg))

    # Beyond NIXL: asyncio ----------------------------------------------------------

    async def transfer_async(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        """Post a transfer and await its end: "DONE", or the error it ended with.
        Cancelling the awaiting task does not cancel the transfer (release the
        handle for that)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if handle._post_async(_bytes(notif_msg), loop, _completer(fut)) == "DONE":
            return "DONE"
        return await fut

    async def wait_xfer(self, handle: nixl_xfer_handle) -> str:
        """Await the end of a transfer posted with ``transfer``: "DONE", or its error."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not handle._wait_async(loop, _completer(fut)):
            return handle._state()
        return await fut

    def notifications(self) -> _NotifStream:
        """An async iterator of (agent name, message) notifications; ends when the
        agent shuts down. While it waits, ``get_new_notifs`` sees none: use one or
        the other."""
        return _NotifStream(self)

    def __repr__(self) -> str:
        return f"nixl_agent({self.name!r}, backends={list(self.backends)})"


def _completer(fut):
    def done(err):
        if fut.done():
            return
        if err is None:
            fut.set_result("DONE")
        else:
            fut.set_exception(err)

    return done


def _indices(idx):
    if idx.__class__ is list:
        return idx
    if _is_ndarray(idx):
        np = sys.modules["numpy"]
        if idx.dtype.kind not in "iu":
            raise TypeError(f"index arrays must hold integers, not {idx.dtype}")
        return np.ascontiguousarray(idx.ravel(), dtype="<i8").tobytes()
    if isinstance(idx, (tuple, range)):
        return list(idx)
    raise TypeError(f"indices must be a list of ints or an integer numpy array, not {type(idx).__name__}")


__all__ = [
    "DEFAULT_COMM_PORT",
    "NIXL_INIT_AGENT",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
    "nixlRegDList",
    "nixlRemoteDList",
    "nixlXferDList",
    "nixlXferTelemetry",
    "NixlError",
]
