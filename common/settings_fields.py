"""Settings fields that carry their command-line flag, so a command's flags are derived, not listed.

A settings dataclass declares each field with :func:`option` (its flag, help and parser; the
default is the field's own) or :func:`set_by` (no flag: code sets it, and says from what); a
field declared with :func:`branch` is another settings dataclass, a branch of the tree. Then:

* :func:`add_flags` adds a tree's flags to an ``argparse`` parser, the help ending with the
  field's default;
* :func:`build` builds the tree from the parsed arguments: a flag given wins, then (for fields
  declared ``stored``) a stored value of the same name, then the field's default; the
  dataclasses' own ``__post_init__`` checks validate the result, once;
* :func:`walk` lists every field of the tree with its declaration, for the test that keeps
  flags and fields in step (``tests/test_produce_options.py``).

Every parsed default is None ("not given"), so a flag left out never hides a stored value.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import itertools
import re
import textwrap
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from .errors import ConfigError

OPTION = "rollstream.option"
"""The dataclass-metadata key of a field's :class:`Option`."""
BRANCH = "rollstream.branch"
"""The dataclass-metadata key of a branch: the settings class the field holds."""


@dataclass(frozen=True, slots=True)
class Option:
    """How a field is set from the command line (``flag`` None: not at all, see ``source``)."""

    flag: str | None
    """``--max-retries``; "" derives ``--field-name``; None: no flag."""
    help: str = ""
    parse: Callable[[str], Any] | None = None
    """The flag's parser (argparse ``type``); None: the default's own type."""
    convert: Callable[[Any], Any] | None = None
    """The parsed value (a list, with ``repeat``) -> the field's value."""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    repeat: bool = False
    """The flag may be given more than once (argparse ``append``)."""
    stored: bool = False
    """When not given, taken from the stored values under the field's name (a run's stored
    rollout flags, ``rollstream.integrations.flags.RolloutFlags``)."""
    source: str = ""
    """For a field without a flag: what sets it."""


def option(
    default: Any = MISSING,
    *,
    help: str,
    flag: str = "",
    factory: Callable[[], Any] | Any = MISSING,
    parse: Callable[[str], Any] | None = None,
    convert: Callable[[Any], Any] | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    repeat: bool = False,
    stored: bool = False,
) -> Any:
    """A settings field set by a flag (``--field-name`` unless ``flag`` says otherwise)."""
    declared = Option(flag, help, parse, convert, metavar, choices, repeat, stored)
    return field(default=default, default_factory=factory, metadata={OPTION: declared})


def set_by(source: str, default: Any = MISSING, *, factory: Callable[[], Any] | Any = MISSING) -> Any:
    """A settings field no flag sets: ``source`` says what does (shown by the flags test)."""
    return field(default=default, default_factory=factory, metadata={OPTION: Option(None, source=source)})


def branch(cls: type, *, required: bool = False) -> Any:
    """A field holding another settings class of the tree (built with its defaults unless required)."""
    return field(default_factory=MISSING if required else cls, metadata={BRANCH: cls})


@dataclass(frozen=True, slots=True)
class Declared:
    """One field of a settings tree, as :func:`walk` yields it."""

    path: str
    """Dotted from the root: ``engine.max_retries``."""
    field: Field[Any]
    option: Option | None
    """None: the field declares nothing (a defect the flags test reports)."""

    @property
    def flag(self) -> str | None:
        if self.option is None or self.option.flag is None:
            return None
        return self.option.flag or "--" + self.field.name.replace("_", "-")

    @property
    def dest(self) -> str:
        flag = self.flag
        return flag.lstrip("-").replace("-", "_") if flag else self.path

    @property
    def default(self) -> Any:
        if self.field.default is not MISSING:
            return self.field.default
        if self.field.default_factory is not MISSING:
            return self.field.default_factory()
        return MISSING


def walk(cls: type, prefix: str = "") -> Iterator[Declared]:
    """Every leaf field of the tree rooted at ``cls``, depth first, in declaration order."""
    for f in fields(cls):
        if BRANCH in f.metadata:
            yield from walk(f.metadata[BRANCH], f"{prefix}{f.name}.")
        else:
            yield Declared(prefix + f.name, f, f.metadata.get(OPTION))


def add_flags(parser: argparse.ArgumentParser, cls: type, *, stored_note: str = "") -> None:
    """Add the tree's flags to ``parser``, a group per settings class (its docstring's first
    line the group's description); ``stored_note`` ends the help of the stored ones."""
    groups: dict[str, Any] = {}
    for leaf in walk(cls):
        flag, declared = leaf.flag, leaf.option
        if flag is None or declared is None:
            continue
        owner = leaf.path.rpartition(".")[0]
        if owner not in groups:
            doc = (_class_at(cls, owner).__doc__ or "").strip().split("\n")[0].replace("``", "")
            groups[owner] = parser.add_argument_group(owner or parser.prog.split()[-1], doc or None)
        default = leaf.default
        kwargs: dict[str, Any] = {"dest": leaf.dest, "default": None,
                                  "help": _help(declared, leaf.field.default, stored_note)}
        if isinstance(default, bool) and declared.parse is None:
            kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        else:
            parse = declared.parse or _parser_of(leaf, default)
            kwargs.update(type=parse, metavar=declared.metavar, choices=declared.choices)
            if declared.repeat:
                kwargs["action"] = "append"
        groups[owner].add_argument(flag, **kwargs)


def _class_at(cls: type, path: str) -> type:
    """The settings class of the branch at dotted ``path`` ("" is the root)."""
    for name in filter(None, path.split(".")):
        cls = next(f for f in fields(cls) if f.name == name).metadata[BRANCH]
    return cls


def _parser_of(leaf: Declared, default: Any) -> Callable[[str], Any]:
    for kind in (int, float, str):
        if type(default) is kind:
            return kind
    raise TypeError(f"{leaf.path}: declare parse= (its default {default!r} does not say the flag's type)")


def _help(declared: Option, default: Any, stored_note: str) -> str:
    """The help with the default said (a factory's is not: it varies, the help says it)."""
    if default is True:
        shown = "on"
    elif default is MISSING or default is None or isinstance(default, bool | tuple):
        shown = ""
    else:
        shown = str(default)
    if declared.stored:
        return f"{declared.help} (default: {stored_note}{', else ' + shown if shown else ''})"
    return f"{declared.help} (default {shown})" if shown else declared.help


def build(
    cls: type,
    args: argparse.Namespace,
    *,
    stored: Mapping[str, Any] | None = None,
    values: Mapping[str, Any] | None = None,
    command: str = "",
    hint: str = "",
) -> Any:
    """The tree rooted at ``cls`` from parsed ``args``; ``values`` (by dotted path) set the
    fields no flag sets. A required field with no value: ConfigError ``"{command} needs --a
    and --b{hint}"``."""
    missing: list[str] = []
    tree = _build(cls, args, stored or {}, values or {}, "", missing)
    if missing:
        raise ConfigError(f"{command} needs {' and '.join(missing)}{hint}".lstrip())
    return tree


def default_of(cls: type, name: str) -> Any:
    """The default of ``cls``'s field ``name`` (what a flag left out gives)."""
    return Declared(name, next(f for f in fields(cls) if f.name == name), None).default


def _build(
    cls: type, args: argparse.Namespace, stored: Mapping[str, Any], values: Mapping[str, Any], prefix: str,
    missing: list[str],
) -> Any:
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        path = prefix + f.name
        if path in values:
            kwargs[f.name] = values[path]
        elif BRANCH in f.metadata:
            kwargs[f.name] = _build(f.metadata[BRANCH], args, stored, values, path + ".", missing)
        else:
            leaf = Declared(path, f, f.metadata.get(OPTION))
            value = given(leaf, args, stored)
            if value is not None:
                kwargs[f.name] = value
            elif leaf.default is MISSING:
                missing.append(leaf.flag or path)
    if missing:
        return None
    return cls(**kwargs)


def given(leaf: Declared, args: argparse.Namespace, stored: Mapping[str, Any]) -> Any:
    """The value the command line (converted) or, failing it, the stored values give ``leaf``; None: neither."""
    if leaf.flag is None or leaf.option is None:
        return None
    value = getattr(args, leaf.dest, None)
    if value is not None:
        return leaf.option.convert(value) if leaf.option.convert is not None else value
    if leaf.option.stored:
        return stored.get(leaf.field.name)
    return None


def stored_taken(cls: type, args: argparse.Namespace, stored: Mapping[str, Any]) -> list[str]:
    """The fields that take their value from ``stored`` (not given on the command line)."""
    return [
        leaf.field.name for leaf in walk(cls)
        if leaf.option is not None and leaf.option.stored and leaf.flag is not None
        and getattr(args, leaf.dest, None) is None and stored.get(leaf.field.name) is not None
    ]


__all__ = ["BRANCH", "OPTION", "Declared", "Option", "add_flags", "branch", "build", "default_of", "given",
           "option", "set_by", "stored_taken", "walk"]


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of the dataclass ``cls`` (its declaration), one paragraph
    each, markup dropped: a plain dataclass's fields say what they are once, and its command's
    help is read from there."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef)).body
    docs: dict[str, str] = {}
    for field_node, doc_node in itertools.pairwise(body):
        if (isinstance(field_node, ast.AnnAssign) and isinstance(field_node.target, ast.Name)
                and isinstance(doc_node, ast.Expr) and isinstance(doc_node.value, ast.Constant)
                and isinstance(doc_node.value.value, str)):
            paragraph = " ".join(doc_node.value.value.strip().split("\n\n")[0].split())
            docs[field_node.target.id] = re.sub(r":\w+:`~?([^`]+)`", r"\1", paragraph).replace("``", "")
    return docs


def documented(cls: type, name: str, default: Any = MISSING, note: str = "") -> str:
    """The help of a flag that sets field ``name`` of ``cls``: the field's docstring, ``note`` (how
    the flag is written), and its default (or ``default``, what the command's flag defaults to),
    ``%`` escaped for argparse."""
    doc = field_docs(cls).get(name)
    if not doc:
        raise LookupError(f"{cls.__name__}.{name} has no docstring to derive its flag's help from")
    if default is MISSING:
        default = next(f for f in fields(cls) if f.name == name).default
    if default is MISSING or isinstance(default, bool):
        shown = ""
    else:
        shown = f" (default: {'unset' if default is None else default})"
    return (doc + (" " + note if note else "") + shown).replace("%", "%%")
