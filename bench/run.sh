#!/usr/bin/env bash
# make bench: every benchmark, one after the other, on this machine; results in bench/results/*.json.
# Each bench measures its peers in the same run and reports ratios, never a pass/fail time.
# BENCH_REPEAT (default 3) sets how many timed runs each comparison takes; the connection bench's copies take 5
# unless it is set (issue 44: min and median of 5).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
REPEAT="${BENCH_REPEAT:-3}"
MITOGEN_VENV=.local/bench/mitogen-venv
MITOGEN_NEWEST_VENV=.local/bench/mitogen-newest-venv
export PYTHONPATH=".local/collections:localplane:tests/support${PYTHONPATH:+:$PYTHONPATH}"

# mitogen_venv DIR REQUIREMENTS PYTHON: (re)build a Mitogen peer's venv when its pinned requirements changed
mitogen_venv() {
    if [ ! -x "$1/bin/ansible-playbook" ] || ! cmp -s "$2" "$1/.requirements"; then
        echo "== the Mitogen peer's venv ($1, $("$3" -V))"
        rm -rf "$1"
        "$3" -m venv "$1"
        "$1/bin/pip" install --quiet --disable-pip-version-check -r "$2"
        cp "$2" "$1/.requirements"
    fi
}
mitogen_venv "$MITOGEN_VENV" bench/requirements-mitogen.txt python3
# the newest core's peer runs on the Python .venv-newest is made with (the Makefile's PYTHON_NEWEST)
NEWEST_PYTHON="${PYTHON_NEWEST:-$(.venv-newest/bin/python -c 'import sys; print(sys._base_executable)')}"
mitogen_venv "$MITOGEN_NEWEST_VENV" bench/requirements-mitogen-newest.txt "$NEWEST_PYTHON"

echo "== local control plane (bench/localplane_bench.py)"
"$PY" bench/localplane_bench.py
echo "== connection: 30-task playbook vs local and SSH, 256 MiB copies (the mux with the bulk path on and off, on 2.19 and the newest core) vs scp over the bench's own ControlMaster, fresh files each round, each side's CPU per MiB (bench/connection_bench.py)"
"$PY" bench/connection_bench.py --repeat "${BENCH_REPEAT:-5}" --newest-venv .venv-newest
echo "== warm runner on ansible-core 2.19 and the newest (.venv-newest) vs cold, local, SSH and Mitogen (on both cores), the mux's GIL switch interval rule vs 0.5 ms and 5 ms fixed, with core's per-task floor, each mode's CPU per task and issue 45's targets (bench/fastpath_bench.py)"
"$PY" bench/fastpath_bench.py --repeat "$REPEAT" --mitogen-venv "$MITOGEN_VENV" --mitogen-newest-venv "$MITOGEN_NEWEST_VENV" \
    --newest-venv .venv-newest --switch-intervals
echo "== where a warm task's time goes, hop by hop, on 2.19 and the newest core (bench/hops_bench.py)"
"$PY" bench/hops_bench.py --repeat "$REPEAT" --newest-venv .venv-newest
echo "== the api road: per command task vs the agent road on 2.19 and the newest core, a 30-task playbook and 256 MiB copies on each road and SSH (bench/api_road_bench.py)"
"$PY" bench/api_road_bench.py --repeat "$REPEAT" --newest-venv .venv-newest
echo "== directory trees: microvm.sandbox.sync vs rsync over SSH and copy (bench/sync_bench.py)"
"$PY" bench/sync_bench.py --repeat "$REPEAT"
echo "== load: 50 sessions x 30 tasks, forks 25 (bench/load_bench.py)"
"$PY" bench/load_bench.py
echo "== fleet: 100 sessions vs SSH to 100 hosts, 10 tasks, forks 50, cold and warm (bench/fleet_bench.py; 500 too: make bench-fleet)"
"$PY" bench/fleet_bench.py --counts 100 --phases cold,warm
echo "== fairness: one mux, a session flooding output and helper output next to one running small commands (bench/fairness_bench.py)"
"$PY" bench/fairness_bench.py --repeat "$REPEAT"
echo "== fairness with the mux's GIL switch interval fixed at 0.5 ms (the rule before issue 45) and at Python's 5 ms"
"$PY" bench/fairness_bench.py --repeat "$REPEAT" --switch-interval 0.0005
"$PY" bench/fairness_bench.py --repeat "$REPEAT" --switch-interval 0.005
echo "== CI job: microvm.sandbox.ci with 3 shards vs podman with 3 containers on one pytest suite, wall and overhead outside pytest (bench/ci_job_bench.py)"
"$PY" bench/ci_job_bench.py --repeat "$REPEAT" --stages
echo "results: bench/results/"
