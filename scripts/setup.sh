#!/usr/bin/env bash
# Create .venv with a Python 3.13, install nemo-gym 0.7.0 and this plugin (editable, with test extras).
# Idempotent: a second run only checks a stamp and returns.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
STAMP="$VENV/.setup-stamp"
# The stamp records what the install was made from; any change to it re-runs pip.
want_stamp() { cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1; }

find_python() {
  local cand
  for cand in "${NG_PYTHON:-}" python3.13 /root/.pyenv/versions/3.13*/bin/python3.13 "$HOME"/.pyenv/versions/3.13*/bin/python3.13; do
    [ -n "$cand" ] || continue
    # pyenv shims answer `command -v` but fail to run: ask the interpreter itself.
    if "$cand" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 13) else 1)' >/dev/null 2>&1; then
      echo "$cand"; return 0
    fi
  done
  return 1
}

if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(want_stamp)" ]; then
  echo "setup: $VENV is up to date"
  exit 0
fi

echo "setup: [1/3] finding a Python 3.13"
PY=$(find_python) || { echo "setup: no Python 3.13 found (tried python3.13 and pyenv's 3.13); set NG_PYTHON" >&2; exit 1; }
echo "setup: using $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
echo "setup: [2/3] creating $VENV"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"

# No --quiet: pip's own lines (Collecting, Downloading, Installing) show that the long first install is working.
PIP_FLAGS=(--disable-pip-version-check)
if ! "$VENV/bin/python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 13, 14) else 1)'; then
  echo "setup: Python $("$VENV/bin/python" -c 'import sys; print(sys.version.split()[0])') is older than 3.13.14, which nemo-gym 0.7.0 declares; installing with --ignore-requires-python"
  PIP_FLAGS+=(--ignore-requires-python)
fi
echo "setup: [3/3] installing nemo-gym 0.7.0 and the plugin (first run: a few minutes, ~1.4 GB; pip's progress follows)"
# Some machines' pip config names local find-links folders that do not exist: drop that noise only.
"$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" -e '.[test]' \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
want_stamp > "$STAMP"
echo "setup: done"
