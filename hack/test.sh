#!/usr/bin/env bash
# `make test`: every check and suite. Keeps going past a failure so one run shows everything, prints each step's
# result, wall time and CPU, and the run's own CPU, and fails if anything failed.
#
# Two lanes run at once, sharing nothing: the checks that boot no guest of the test run (static checks, sanity,
# Galaxy's importer, the execution environment with a plane of its own) beside the suites that boot guests (those
# run on pytest-xdist workers, each with its own plane and mux dir; the tests marked `serial` run alone after).
#
# Logs: every step's whole output is kept in .local/results/<step>.log (pytest's JUnit reports beside it). The
# guest lane streams to this run's output as it goes; the checks lane's logs are printed here whole, one after
# the other, once it is done, so nothing interleaves and nothing is lost.
#
#   MICROVM_TEST_WORKERS=N  pytest-xdist workers per guest-bound suite (default 3: guests mostly wait)
#   SKIP_NEWEST=1           leave out the suites on the newest ansible-core and on 2.20
set -uo pipefail
cd "$(dirname "$0")/.."
results=.local/results
mkdir -p "$results"
rm -f "$results"/*.txt "$results"/*.log "$results"/*.xml "$results"/*.time "$results"/*.cpu "$results"/*.rc
workers=${MICROVM_TEST_WORKERS:-3}
export PYTEST_WORKERS=$workers

busy_ticks() {  # CPU time the whole machine spent busy since boot, in clock ticks (user+nice+system+irq+softirq+steal)
  awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9 }' /proc/stat
}
hz=$(getconf CLK_TCK)
run_start=$SECONDS
run_ticks=$(busy_ticks)

with_cpu() {  # with_cpu FILE COMMAND...: run it; FILE gets the CPU seconds (user + system) of it and its reaped children
  python3 -c 'import resource, subprocess, sys
rc = subprocess.call(sys.argv[2:])
r = resource.getrusage(resource.RUSAGE_CHILDREN)
open(sys.argv[1], "w").write("%d\n" % round(r.ru_utime + r.ru_stime))
sys.exit(rc)' "$@"
}

step() {  # step NAME COMMAND...: run one check; its output to .local/results/NAME.log (and to stdout unless QUIET)
  local name=$1; shift
  local t0=$SECONDS rc
  if [ "${QUIET:-0}" = 1 ]; then
    with_cpu "$results/$name.cpu" "$@" > "$results/$name.log" 2>&1
    rc=$?
  else
    echo; echo "==== $name ===="
    with_cpu "$results/$name.cpu" "$@" 2>&1 | tee "$results/$name.log"
    rc=${PIPESTATUS[0]}
  fi
  echo "$rc" > "$results/$name.rc"
  echo "$((SECONDS - t0))" > "$results/$name.time"
  if [ "$rc" = 0 ]; then
    [ -s "$results/$name.txt" ] || echo "ok" > "$results/$name.txt"
  else
    if [ -s "$results/$name.txt" ]; then sed -i 's/^/FAILED: /' "$results/$name.txt"; else echo "FAILED" > "$results/$name.txt"; fi
  fi
  [ "${QUIET:-0}" = 1 ] && echo "[checks lane] $name: $(tail -n 1 "$results/$name.txt") ($((SECONDS - t0)) s)"
  return 0
}

newest=1
[ "${SKIP_NEWEST:-0}" = 1 ] && newest=0

checks=(proto-check docsite-check ruff typecheck changelog-lint docs-lint ansible-lint bindep sanity galaxy-import ee-test)
[ "$newest" = 1 ] && checks+=(newest-sanity)
run_checks() {
  step proto-check .venv/bin/python hack/gen_proto.py --check
  step docsite-check .venv/bin/python hack/gen_docsite.py --check
  step ruff .venv/bin/ruff check .
  step typecheck bash hack/typecheck.sh
  step changelog-lint .venv/bin/antsibull-changelog lint
  step docs-lint .venv/bin/antsibull-docs lint-collection-docs --plugin-docs --skip-rstcheck .
  step ansible-lint .venv/bin/ansible-lint --profile production --offline --nocolor -q
  step bindep .venv/bin/python hack/bindep-check.py
  step sanity bash hack/sanity.sh
  step galaxy-import bash hack/galaxy-import.sh
  step ee-test bash hack/ee-test.sh
  if [ "$newest" = 1 ]; then
    step newest-sanity env VENV_BIN="$PWD/.venv-newest/bin" bash hack/sanity.sh
  fi
}

guests=(localplane unit integration integration-api faults molecule)
[ "$newest" = 1 ] && guests+=(newest-core core-220)
run_guests() {
  step localplane bash hack/pytest-count.sh localplane localplane/tests
  step unit bash hack/pytest-count.sh unit tests/unit
  step integration bash hack/pytest-count.sh integration tests/integration
  step integration-api make --no-print-directory integration-api
  step faults bash hack/pytest-count.sh faults tests/faults
  step molecule bash hack/molecule.sh
  if [ "$newest" = 1 ]; then
    step newest-core make --no-print-directory test-newest-suites
    step core-220 make --no-print-directory test-core220
  fi
}

echo "==== checks lane: ${checks[*]} (in the background; each step's log: $results/<step>.log) ===="
QUIET=1 run_checks &
checks_pid=$!
run_guests
echo; echo "==== waiting for the checks lane ===="
wait "$checks_pid"

echo
for name in "${checks[@]}"; do
  echo "==== $name (checks lane; $results/$name.log) ===="
  cat "$results/$name.log" 2>/dev/null
done

run_cpu=$(( ($(busy_ticks) - run_ticks) / hz ))
run_wall=$((SECONDS - run_start))
echo
echo "==== microvm.sandbox test summary ===="
printf '%-16s %-7s %8s %9s  %s\n' step result wall "CPU" counts
failed=()
for name in "${guests[@]}" "${checks[@]}"; do
  rc=$(cat "$results/$name.rc" 2>/dev/null || echo "?")
  cpu=$(cat "$results/$name.cpu" 2>/dev/null || echo "?")
  result=ok; [ "$rc" = 0 ] || { result=FAILED; failed+=("$name"); }
  printf '%-16s %-7s %7ss %8ss  %s\n' "$name" "$result" "$(cat "$results/$name.time" 2>/dev/null || echo "?")" \
    "$cpu" "$(tail -n 1 "$results/$name.txt" 2>/dev/null)"
done
echo "(a step's CPU counts its own processes; guests and planes that outlive their parent are counted only below)"
echo "run: $((run_wall / 60)) min $((run_wall % 60)) s wall, $((run_cpu / 60)) min $((run_cpu % 60)) s CPU" \
  "(the whole machine's busy time over the run, /proc/stat; $(nproc) cores)"
{ echo "wall_s $run_wall"; echo "cpu_s $run_cpu"; } > "$results/run.totals"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all checks passed"
