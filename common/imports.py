"""Loading user code named by ``module.path:attribute`` (reward functions, keep filters, tokenizers),
and optional dependencies (install extras) on first use."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from .errors import ConfigError, ExtraNotInstalled


def import_object(spec: str, what: str) -> Any:
    """The object named by ``module.path:attr.path``; ConfigError, prefixed by ``what``, for a
    malformed path, a module that is missing or fails to import, or a missing attribute."""
    module_name, _, attr_path = spec.partition(":")
    module_name, attr_path = module_name.strip(), attr_path.strip()
    if not module_name or not attr_path:
        raise ConfigError(f"{what} {spec!r} must look like 'module.path:function'")
    if not all(part.isidentifier() for part in (*module_name.split("."), *attr_path.split("."))):
        raise ConfigError(f"{what} {spec!r} is not a valid 'module.path:function' import path")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise ConfigError(
                f"{what} {spec!r}: cannot load it: no module named {module_name!r} (is it on sys.path?)"
            ) from exc
        raise ConfigError(f"{what} {spec!r}: cannot load it: importing {module_name!r} failed: {exc}") from exc
    except Exception as exc:  # the user's module itself raised while importing
        raise ConfigError(
            f"{what} {spec!r}: cannot load it: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(
                f"{what} {spec!r}: cannot load it: module {module_name!r} has no attribute {attr_path!r}"
            ) from None
    return obj


def import_callable(spec: str, what: str) -> Any:
    obj = import_object(spec, what)
    if not callable(obj):
        raise ConfigError(f"{what} {spec!r}: {spec.partition(':')[2]!r} is a {type(obj).__name__}, not a callable")
    return obj


def require_extra(module: str, extra: str, purpose: str) -> ModuleType:
    """Import an optional dependency on first use; ``ExtraNotInstalled`` names the extra that
    provides it, so a light install (trainer, producer) fails with an instruction, not a traceback."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ExtraNotInstalled(module, extra, purpose) from exc
