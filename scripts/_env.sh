# Sourced by scripts/demo and scripts/test: create .venv and install rollstream with its dev
# extra when pyproject.toml changed since the last install. Needs only python3 >= 3.11 and pip.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "rollstream needs Python >= 3.11 (found $("$PYTHON" --version 2>&1)); set PYTHON=..." >&2
    exit 2
fi
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=".venv/.rollstream-installed-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
    echo "installing rollstream and its dev dependencies into .venv ..." >&2
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e '.[dev]'
    rm -f .venv/.rollstream-installed-*
    touch "$stamp"
fi
