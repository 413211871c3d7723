#!/usr/bin/env bash
# Run one pytest suite, record its counts for the summary, and never let
# "nothing collected" (exit 5) pass silently.
set -uo pipefail
name=$1; shift
mkdir -p .local/results
report=.local/results/$name.txt
"${PYTEST_PYTHON:-.venv/bin/python}" -m pytest -q -p no:cacheprovider "$@" ${PYTEST_ARGS:-} 2>&1 | tee .local/results/$name.log
rc=${PIPESTATUS[0]}
# The pytest summary line (asyncio may log after it, so search rather than take the last line).
grep -E '^=* ?[0-9]+ (passed|failed|error|skipped|deselected)|no tests ran' .local/results/$name.log | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//' > "$report"
if [ "$rc" = 5 ]; then echo "$name: no tests were collected (pytest exit 5): this suite must not be empty" | tee "$report"; exit 1; fi
exit "$rc"
