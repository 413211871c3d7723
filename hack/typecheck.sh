#!/usr/bin/env bash
# make typecheck: mypy over plugins/ as the package ansible_collections.microvm.sandbox.plugins
# (pyproject.toml [tool.mypy]; `make collection` puts the checkout on mypy's path), then the share of
# annotated functions in plugins/ against its floor (hack/typed_share.py, per file).
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${VENV_BIN:-.venv/bin}
[ -d .local/collections/ansible_collections/microvm/sandbox ] || { echo "run make collection first"; exit 1; }
rc=0
"$bin/mypy" -p ansible_collections.microvm.sandbox.plugins || rc=1
"$bin/python" hack/typed_share.py || rc=1
exit $rc
