#!/usr/bin/env bash
# mypy over the package laid out as it is installed (the configuration: pyproject.toml's [tool.mypy]).
#
# hookspecs/ and builtin_participants/ are installed as nemo_gym_checkpoint_plugin.hookspecs and
# .builtin_participants (package-dir). In .venv they are subpackages only through setuptools' editable
# finder, an import hook, which a static checker never runs. mypy reads a tree of links laid out like
# the wheel instead (build/typecheck, rebuilt each run), and its messages name the source files again.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PACKAGE=nemo_gym_checkpoint_plugin
TREE=build/typecheck

rm -rf "$TREE"
mkdir -p "$TREE/$PACKAGE"
for entry in "$PACKAGE"/*; do
  ln -s "$ROOT/$entry" "$TREE/$entry"
done
ln -s "$ROOT/hookspecs" "$TREE/$PACKAGE/hookspecs"
ln -s "$ROOT/builtin_participants" "$TREE/$PACKAGE/builtin_participants"

cd "$TREE"
"$ROOT/.venv/bin/python" -m mypy --config-file "$ROOT/pyproject.toml" --cache-dir "$ROOT/.mypy_cache" \
  -p "$PACKAGE" "$@" \
  | sed -e "s#^$PACKAGE/hookspecs/#hookspecs/#" -e "s#^$PACKAGE/builtin_participants/#builtin_participants/#"
