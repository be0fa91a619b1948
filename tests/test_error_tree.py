"""The error tree's rule (common/errors.py's docstring): every error a user can meet is defined in
``common/errors.py``, derives from ``RollstreamError`` and is drawn in the docstring's tree; the
one importer of user code is ``common/imports.py``. Read from the source (ast), like test_layers."""

from __future__ import annotations

import ast
import inspect

import pytest
from rollstream.common import errors
from rollstream.common.errors import ConfigError, RollstreamError
from test_layers import ROOT, library_files

ERRORS = ROOT / "common" / "errors.py"
PRIVATE_OK = {"_Answer", "_BadRequest", "_ShuttingDown", "_Broken", "_Stale", "_Done"}
"""Control flow inside one module, never seen by a user: an HTTP answer raised in a handler (the
simulator's and the endpoints'), a malformed HTTP answer or a stale keep-alive connection inside
the engine transport (``http11``: both reach the client as ``ConnectionError``), and the signal
that stops llhttp once an answer is settled (``http11._Done``, never leaves the module)."""


def _exception_classes() -> list[tuple[str, int, str]]:
    found = []
    for _, path in library_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if any(b.endswith(("Error", "Exception", "Broken", "Invalid", "Refused", "Failed")) for b in bases):
                    found.append((str(path.relative_to(ROOT)), node.lineno, node.name))
    return found


def test_every_user_facing_error_is_defined_in_common_errors() -> None:
    elsewhere = [
        f"{path}:{line} {name}"
        for path, line, name in _exception_classes()
        if path != "common/errors.py" and name not in PRIVATE_OK
    ]
    assert not elsewhere, "define these in common/errors.py (and re-export them):\n" + "\n".join(elsewhere)


def test_every_error_is_in_the_tree_and_the_drawing() -> None:
    doc = errors.__doc__ or ""
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, BaseException)]
    assert classes
    for cls in classes:
        assert issubclass(cls, RollstreamError), cls
        assert f" {cls.__name__} " in doc or f" {cls.__name__}\n" in doc, f"{cls.__name__} is not drawn in the tree"


def diamonds(classes: list[type]) -> list[str]:
    """The classes with two ``RollstreamError`` parents."""
    return [c.__name__ for c in classes if sum(issubclass(b, RollstreamError) for b in c.__bases__) > 1]


def test_no_error_has_two_parents_in_the_tree() -> None:
    """One node per error: a class derives from one ``RollstreamError`` class (``ValueError`` may
    sit beside it), so an ``except`` per node reads as what the caller does, in any order."""
    from rollstream.common.errors import EngineError, EngineRejected, EpisodeAborted, PromptNotSupported

    assert not diamonds([c for _, c in inspect.getmembers(errors, inspect.isclass)])
    assert not issubclass(EpisodeAborted, EngineError) and not issubclass(EngineRejected, EngineError)
    assert not issubclass(PromptNotSupported, ConfigError)


def test_the_diamond_check_catches_one() -> None:
    class Both(ConfigError, errors.EngineRejected):
        pass

    assert diamonds([Both, errors.PromptNotSupported]) == ["Both"]


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("rollstream.producer.rewards", "RewardBroken"),
        ("rollstream.producer.engine", "EngineReplyInvalid"),  # the engine client re-exports it
        ("rollstream.producer.episode", "EpisodeAborted"),
        ("rollstream.producer.episode", "GenerateBroken"),
        ("rollstream.producer.session", "InvalidResult"),
        ("rollstream.integrations.endpoints", "EndpointRefused"),
        ("rollstream.integrations.endpoints", "ConversationDiverged"),
        ("rollstream.weight_sync", "WeightSyncError"),
    ],
)
def test_errors_stay_importable_where_they_were(module: str, name: str) -> None:
    assert getattr(__import__(module, fromlist=[name]), name) is getattr(errors, name)


def test_rollout_settings_check_with_config_error() -> None:
    from rollstream.producer.rollout import Rollout
    from rollstream.producer.settings import EpisodeSettings

    with pytest.raises(ConfigError, match="n_samples"):
        Rollout(None, None, 0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="reward_failure_limit"):
        EpisodeSettings(reward_failure_limit=0)


def test_user_code_is_imported_in_one_place() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for _, path in library_files()
        if path != ROOT / "common" / "imports.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Attribute) and node.attr in ("spec_from_file_location", "module_from_spec")
    ]
    assert not found, "import user code with rollstream.common.imports:\n" + "\n".join(found)
