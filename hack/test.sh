#!/usr/bin/env bash
# `make test`: run every check and suite, keep going past a failure so one run
# shows everything, print the counts, and fail if anything failed.
set -uo pipefail
mkdir -p .local/results
rm -f .local/results/*.txt .local/results/*.log
failed=()
step() {  # step NAME COMMAND...: run one check, record its outcome
  local name=$1; shift
  local t0=$SECONDS
  echo; echo "==== $name ===="
  if "$@"; then
    [ -s ".local/results/$name.txt" ] || echo "ok" > ".local/results/$name.txt"
  else
    failed+=("$name")
    [ -s ".local/results/$name.txt" ] && sed -i 's/^/FAILED: /' ".local/results/$name.txt" || echo "FAILED" > ".local/results/$name.txt"
  fi
  echo " ($((SECONDS - t0)) s)" >> ".local/results/$name.txt.time"
}
suites=(localplane:localplane/tests unit:tests/unit integration:tests/integration)
[ -d tests/faults ] && suites+=(faults:tests/faults)

step proto-check .venv/bin/python hack/gen_proto.py --check
step docsite-check .venv/bin/python hack/gen_docsite.py --check
step ruff .venv/bin/ruff check .
step typecheck bash hack/typecheck.sh
step changelog-lint .venv/bin/antsibull-changelog lint
step docs-lint .venv/bin/antsibull-docs lint-collection-docs --plugin-docs --skip-rstcheck .
step ansible-lint .venv/bin/ansible-lint --profile production --offline --nocolor -q
step sanity bash hack/sanity.sh
step bindep .venv/bin/python hack/bindep-check.py
step galaxy-import bash hack/galaxy-import.sh
for s in "${suites[@]}"; do
  step "${s%%:*}" bash hack/pytest-count.sh "${s%%:*}" "${s#*:}"
done
step integration-api make --no-print-directory integration-api
step molecule bash hack/molecule.sh
step ee-test bash hack/ee-test.sh
if [ "${SKIP_NEWEST:-0}" != 1 ]; then
  step newest-core make --no-print-directory test-newest
  step core-220 make --no-print-directory test-core220
fi

echo
echo "==== microvm.sandbox test summary ===="
for f in .local/results/*.txt; do
  [ -e "$f" ] || continue
  printf '%-16s %s%s\n' "$(basename "$f" .txt)" "$(tail -n 1 "$f")" "$(cat "$f.time" 2>/dev/null)"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all checks passed"
