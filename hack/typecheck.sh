#!/usr/bin/env bash
# make typecheck: mypy over plugins/ as the package ansible_collections.microvm.sandbox.plugins
# (pyproject.toml [tool.mypy]; `make collection` puts the checkout on mypy's path), then the share of
# annotated functions in plugins/ against its floor (hack/typed_share.py, per file).
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${VENV_BIN:-.venv/bin}
[ -d .local/collections/ansible_collections/microvm/sandbox ] || { echo "run make collection first"; exit 1; }
# mypy's cache is shared by every clone on this machine, one per mypy and Python version (mypy checks each entry
# against the source's content and the options itself); pyproject.toml's cache_dir is the fallback.
cache=${MICROVM_SANDBOX_CACHE:-$(python3 hack/cached_venv.py --cache-root)}/mypy/$("$bin/python" -c \
  'import platform, sys, mypy.version; print("mypy-%s-py%s" % (mypy.version.__version__, platform.python_version()))') \
  || { echo "typecheck: mypy is not installed in $bin (make venv)"; exit 1; }
rc=0
"$bin/mypy" --cache-dir "$cache" -p ansible_collections.microvm.sandbox.plugins || rc=1
"$bin/python" hack/typed_share.py || rc=1
exit $rc
