# SPDX-License-Identifier: Apache-2.0
"""``nixl._api``: NIXL 1.5.1's Python API (``nixl_agent``, ``nixl_agent_config``, ...)
over nixl-rs; the same objects as ``nixl_rs._api``. ``nixlBind`` is ``nixl._bindings``,
as in NIXL."""

from nixl_rs._api import *  # noqa: F401,F403
from nixl_rs._api import __all__ as _rs_all

from . import _bindings as nixlBind  # noqa: F401

nixl_backend_handle = int

__all__ = [*_rs_all, "nixlBind", "nixl_backend_handle"]
