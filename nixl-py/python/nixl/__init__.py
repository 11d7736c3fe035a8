# SPDX-License-Identifier: Apache-2.0
"""NIXL's Python package ``nixl``, implemented by nixl-rs.

Installed by the distribution ``nixl-rs`` beside ``nixl_rs``, so code written for NIXL
(``from nixl._api import nixl_agent``, ``import nixl._bindings``, ``from nixl._api
import nixlBind``, ``nixl.logging``) runs on nixl-rs unchanged. Like NIXL's own
package, the public names of ``nixl._bindings``, ``nixl.logging`` and ``nixl._api``
are also names of ``nixl``.

Which implementation runs: ``nixl.IMPLEMENTATION`` (``"nixl-rs"``, or the NIXL
package chosen below) and ``nixl.implementation()`` (name, versions, and the native
libraries bound). ``NIXL_PY_IMPLEMENTATION=nixl`` makes this package hand every
name to NIXL's own ``nixl_cu13``/``nixl_cu12`` (``pip install nixl-cu12``) instead,
to compare the two without reinstalling.

NIXL's meta-distribution ``nixl`` installs files of the same package; if both are
installed, the one installed last owns them: this package then warns at import
(``RuntimeWarning``) naming both. Install one of the two per environment.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

#: The NIXL release whose Python API this package implements.
NIXL_API_VERSION = "1.5.1"

_SUBMODULES = ("_bindings", "logging", "_api")


def _nixl_package():
    """NIXL's own implementation package, as NIXL's meta-package picks it."""
    for name in ("nixl_cu13", "nixl_cu12", "nixl_rocm"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
    raise ImportError("NIXL_PY_IMPLEMENTATION=nixl, but no NIXL package is installed "
                      "(tried nixl_cu13, nixl_cu12, nixl_rocm: pip install nixl-cu12)")


def _check_coexistence() -> None:
    """Warn when NIXL's own distribution ``nixl`` is installed too: both write the
    files of this package, so whichever was installed last runs."""
    from importlib import metadata

    try:
        dist = metadata.distribution("nixl")
    except metadata.PackageNotFoundError:
        return
    if dist.metadata.get("Name", "").lower() != "nixl":
        return
    warnings.warn(
        f"both nixl-rs and NIXL's distribution 'nixl' {dist.version} install the Python "
        "package 'nixl'; their files overwrite each other, and this process runs nixl-rs "
        "(installed last). Uninstall one of them (pip uninstall nixl, or pip uninstall "
        "nixl-rs); NIXL_PY_IMPLEMENTATION=nixl selects NIXL's nixl_cu12/nixl_cu13 from here.",
        RuntimeWarning,
        stacklevel=2,
    )


def _export(module) -> None:
    for attr in getattr(module, "__all__", dir(module)):
        if not attr.startswith("_"):
            globals()[attr] = getattr(module, attr)


if os.environ.get("NIXL_PY_IMPLEMENTATION", "nixl-rs").lower() == "nixl":
    _pkg = _nixl_package()
    IMPLEMENTATION = _pkg.__name__
    for _sub in _SUBMODULES:
        _mod = importlib.import_module(f"{_pkg.__name__}.{_sub}")
        sys.modules[f"{__name__}.{_sub}"] = _mod
        globals()[_sub] = _mod
        _export(_mod)
else:
    IMPLEMENTATION = "nixl-rs"
    _check_coexistence()
    from . import _bindings, _api  # noqa: E402
    from . import logging as logging  # noqa: E402,F401

    for _mod in (_bindings, _api):
        _export(_mod)


def implementation() -> dict:
    """Which implementation this process runs: ``{"implementation", "nixl_api",
    "version", "native_libraries"}`` (the last: the native libraries its backends
    bound so far, with their paths)."""
    if IMPLEMENTATION != "nixl-rs":
        return {"implementation": IMPLEMENTATION, "nixl_api": NIXL_API_VERSION,
                "version": getattr(sys.modules[IMPLEMENTATION], "__version__", NIXL_API_VERSION),
                "native_libraries": []}
    import nixl_rs

    return {"implementation": "nixl-rs", "nixl_api": NIXL_API_VERSION,
            "version": nixl_rs.__version__,
            "native_libraries": nixl_rs.native_libraries()}
