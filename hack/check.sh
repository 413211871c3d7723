#!/usr/bin/env bash
# make check: the fast tier, for every merge (at most 3 minutes on two cores): ruff, the changelog lint, mypy over plugins/ with the
# share of annotated functions, the proto and docsite drift checks, the collection's unit tests and the local
# plane's unit tests (no guest boots). The whole suite is `make test`.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTEST_WORKERS=${PYTEST_WORKERS:-2}
failed=()
start=$SECONDS
check() {  # check NAME COMMAND...
  local name=$1 t0=$SECONDS; shift
  echo "==== $name"
  if "$@"; then echo "==== $name: ok ($((SECONDS - t0)) s)"; else failed+=("$name"); echo "==== $name: FAILED ($((SECONDS - t0)) s)"; fi
}
check ruff .venv/bin/ruff check .
check proto-check .venv/bin/python hack/gen_proto.py --check
check docsite-check .venv/bin/python hack/gen_docsite.py --check
check typecheck bash hack/typecheck.sh
check changelog-lint .venv/bin/antsibull-changelog lint
check unit bash hack/pytest-count.sh unit tests/unit
check plane-units bash hack/pytest-count.sh plane-units localplane/tests/test_*_units.py localplane/tests/test_guestproc.py
if [ ${#failed[@]} -gt 0 ]; then
  echo "make check: FAILED: ${failed[*]} ($((SECONDS - start)) s)"
  exit 1
fi
echo "make check: all passed in $((SECONDS - start)) s"
