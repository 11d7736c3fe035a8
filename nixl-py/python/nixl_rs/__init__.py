"""nixl-rs for Python: NIXL's Python API (``nixl_rs._api``) over the Rust agent.

Switching a NIXL connector is one import line::

    from nixl_rs._api import nixl_agent, nixl_agent_config   # was: from nixl._api import ...

Errors are exceptions of NIXL's classes (``nixlBackendError``, ``nixlNotFoundError``, ...),
all subclasses of :class:`NixlError`, each with ``kind`` (nixl-rs' error kind),
``operation`` and ``context``.
"""

from ._native import (  # noqa: F401
    VERSION as __version__,
    native_libraries,
    NixlError,
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
