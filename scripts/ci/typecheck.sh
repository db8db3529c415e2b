#!/usr/bin/env bash
# mypy over the installed package's layout. pyproject.toml maps drafthead.ground, .heads, .train,
# .inference and .configs to folders at the repo root (package-dir), which static tools cannot follow through
# the editable install; so this builds the package's tree as symlinks under build/typecheck and
# checks that. Settings: pyproject.toml [tool.mypy], or the file in TYPECHECK_CONFIG; TYPECHECK_ROOT
# names another tree, so that two checks can run side by side.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=${TYPECHECK_ROOT:-build/typecheck}
config=$(realpath "${TYPECHECK_CONFIG:-pyproject.toml}")
rm -rf "$root" && mkdir -p "$root/drafthead"
for entry in drafthead/*; do
  case "$(basename "$entry")" in __pycache__) continue ;; esac
  ln -s "$PWD/$entry" "$root/drafthead/"
done
for package in ground heads train inference configs; do ln -s "$PWD/$package" "$root/drafthead/$package"; done
mypy=$(realpath "${MYPY:-.venv/bin/mypy}")
cd "$root" && exec "$mypy" --config-file "$config" -p drafthead
