"""The one importer of user code named on a command line (rewards, ``--generate``, keep filters,
tokenizers, the frameworks' functions), and optional dependencies (install extras) on first use.

A spec names an object three ways, all through :func:`import_object`:

* ``module.path:attr.path``: a module on ``sys.path`` and an attribute path in it;
* ``path/to/file.py:attr``: a Python file (a script, ``examples/calculator.py``), imported as a
  module named after the file;
* ``package.module.attr``: slime's and miles' own style (``--custom-rm-path``), only where a
  framework's function is named (``dotted=True``): the last dot splits module from attribute.

Every failure is a :class:`ConfigError` whose message starts with ``what`` and the spec, so the
user sees which flag was wrong, not a traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

from .errors import ConfigError, ExtraNotInstalled


def split_spec(spec: str, what: str, *, dotted: bool = False) -> tuple[str, str]:
    """``(module or file, attribute path)`` of ``spec``; ConfigError when it has no such shape."""
    if ":" in spec or not dotted:
        module_name, _, attr_path = spec.rpartition(":") if _is_file(spec) else spec.partition(":")
    else:
        module_name, _, attr_path = spec.rpartition(".")
    module_name, attr_path = module_name.strip(), attr_path.strip()
    if not module_name or not attr_path:
        shape = "'package.module.name' or 'package.module:name'" if dotted else "'module.path:function'"
        raise ConfigError(f"{what} {spec!r} must look like {shape}")
    return module_name, attr_path


def _is_file(spec: str) -> bool:
    return spec.rpartition(":")[0].strip().endswith(".py")


def import_object(spec: str, what: str, *, dotted: bool = False) -> Any:
    """The object named by ``spec`` (the forms in the module docstring); ConfigError, prefixed by
    ``what``, for a malformed spec, a module or file that is missing or fails to import, or a
    missing attribute."""
    module_name, attr_path = split_spec(spec, what, dotted=dotted)
    if module_name.endswith(".py"):
        module = _import_file(Path(module_name), spec, what)
    else:
        if not all(part.isidentifier() for part in (*module_name.split("."), *attr_path.split("."))):
            raise ConfigError(f"{what} {spec!r} is not a valid 'module.path:function' import path")
        module = _import_module(module_name, spec, what)
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(
                f"{what} {spec!r}: cannot load it: module {module_name!r} has no attribute {attr_path!r}"
            ) from None
    return obj


def import_callable(spec: str, what: str, *, dotted: bool = False) -> Any:
    """:func:`import_object`, and ConfigError when the object is not callable."""
    obj = import_object(spec, what, dotted=dotted)
    if not callable(obj):
        attr = split_spec(spec, what, dotted=dotted)[1]
        raise ConfigError(f"{what} {spec!r}: {attr!r} is a {type(obj).__name__}, not a callable")
    return obj


def _import_module(module_name: str, spec: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
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


def _import_file(path: Path, spec: str, what: str) -> ModuleType:
    """The Python file at ``path``, imported as a module named after the file."""
    if not path.is_file():
        raise ConfigError(f"{what} {spec!r}: no file {str(path)!r}")
    module_spec = importlib.util.spec_from_file_location(f"rollstream_user_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"{what} {spec!r}: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise ConfigError(f"{what} {spec!r}: importing {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
    return module


def require_extra(module: str, extra: str, purpose: str) -> ModuleType:
    """Import an optional dependency on first use; ``ExtraNotInstalled`` names the extra that
    provides it, so a light install (trainer, producer) fails with an instruction, not a traceback."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ExtraNotInstalled(module, extra, purpose) from exc
