#!/usr/bin/env bash
# Run one pytest suite, record its counts for the summary, and never let "nothing collected" (exit 5) pass silently.
#
#   pytest-count.sh NAME PYTEST-ARGS...
#   PYTEST_WORKERS=N (N > 1): the tests run on N pytest-xdist workers (each its own plane and mux dir), a test
#     file's tests on one worker (--dist loadfile, so module fixtures are made once); then the tests marked
#     `serial` (host-wide: the sweep, the disk reserve, the fleet load, /etc/hosts) run alone, after them.
#   PYTEST_PYTHON: the interpreter (default .venv/bin/python); PYTEST_ARGS: more arguments for every pass.
#
# The output goes to stdout only (make test keeps each step's whole output in .local/results/NAME.log); the
# counts go to .local/results/NAME.txt, a JUnit report of each pass to .local/results/NAME*.xml.
set -uo pipefail
name=$1; shift
mkdir -p .local/results
report=.local/results/$name.txt
py=${PYTEST_PYTHON:-.venv/bin/python}
workers=${PYTEST_WORKERS:-1}
out=$(mktemp); trap 'rm -f "$out"' EXIT

pass() {  # pass LABEL ARGS...: one pytest run; its output to stdout and to $out for the counts
  local label=$1; shift
  echo "---- pytest ($label): $*"
  # shellcheck disable=SC2086
  "$py" -m pytest -q -p no:cacheprovider --junitxml=".local/results/$name$label.xml" "$@" ${PYTEST_ARGS:-} 2>&1 \
    | tee -a "$out"
  return "${PIPESTATUS[0]}"
}

rcs=()
if [ "$workers" -gt 1 ]; then
  pass "" -n "$workers" --dist loadfile -m "not serial" "$@"; rcs+=($?)
  pass "-serial" -p no:xdist -m serial "$@"; rcs+=($?)
else
  pass "" "$@"; rcs+=($?)
fi

# The pytest summary lines ("1 failed, 67 passed, 12 skipped in 40.1s"; asyncio may log after them, so search
# rather than take the last line), summed over the passes.
counts=$(grep -E '^=* ?[0-9]+ (passed|failed|error|errors|skipped|deselected|xfailed|xpassed)' "$out" \
  | sed 's/=//g; s/ in [0-9.]*s.*$//' | tr ',' '\n' | awk '
    $2 == "deselected" { next }
    NF >= 2 { n[$2] += $1 }
    END { split("failed passed error errors skipped xfailed xpassed", order, " "); s = ""
          for (i = 1; i in order; i++) if (order[i] in n) s = s (s ? ", " : "") n[order[i]] " " order[i]; print s }')
rc=0
for r in "${rcs[@]}"; do
  case "$r" in 0|5) ;; *) rc=$r ;; esac
done
if [ -z "$counts" ]; then
  echo "$name: no tests were collected (pytest exit 5): this suite must not be empty" | tee "$report"
  exit 1
fi
echo "$counts" > "$report"
exit "$rc"
