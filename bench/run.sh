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
export PYTHONPATH=".local/collections:localplane:tests/support${PYTHONPATH:+:$PYTHONPATH}"

if [ ! -x "$MITOGEN_VENV/bin/ansible-playbook" ] || ! cmp -s bench/requirements-mitogen.txt "$MITOGEN_VENV/.requirements"; then
    echo "== the Mitogen peer's venv ($MITOGEN_VENV)"
    rm -rf "$MITOGEN_VENV"
    python3 -m venv "$MITOGEN_VENV"
    "$MITOGEN_VENV/bin/pip" install --quiet --disable-pip-version-check -r bench/requirements-mitogen.txt
    cp bench/requirements-mitogen.txt "$MITOGEN_VENV/.requirements"
fi

echo "== local control plane (bench/localplane_bench.py)"
"$PY" bench/localplane_bench.py
echo "== connection: 30-task playbook vs local and SSH, 256 MiB copies (the mux with the bulk path on and off, on 2.19 and the newest core) vs scp over the bench's own ControlMaster, fresh files each round, each side's CPU per MiB (bench/connection_bench.py)"
"$PY" bench/connection_bench.py --repeat "${BENCH_REPEAT:-5}" --newest-venv .venv-newest
echo "== warm runner on ansible-core 2.19 and the newest (.venv-newest) vs cold, local, SSH and Mitogen, with core's per-task floor and each mode's CPU per task (bench/fastpath_bench.py)"
"$PY" bench/fastpath_bench.py --repeat "$REPEAT" --mitogen-venv "$MITOGEN_VENV" --newest-venv .venv-newest
echo "== the api road: per command task vs the agent road on 2.19 and the newest core, a 30-task playbook and 256 MiB copies on each road and SSH (bench/api_road_bench.py)"
"$PY" bench/api_road_bench.py --repeat "$REPEAT" --newest-venv .venv-newest
echo "== directory trees: microvm.sandbox.sync vs rsync over SSH and copy (bench/sync_bench.py)"
"$PY" bench/sync_bench.py --repeat "$REPEAT"
echo "== load: 50 sessions x 30 tasks, forks 25 (bench/load_bench.py)"
"$PY" bench/load_bench.py
echo "== fleet: 100 sessions vs SSH to 100 hosts, 10 tasks, forks 50 (bench/fleet_bench.py)"
"$PY" bench/fleet_bench.py
echo "== fairness: one mux, a session flooding output and helper output next to one running small commands (bench/fairness_bench.py)"
"$PY" bench/fairness_bench.py --repeat "$REPEAT"
echo "== CI job: microvm.sandbox.ci with 3 shards vs podman with 3 containers on one pytest suite, wall and overhead outside pytest (bench/ci_job_bench.py)"
"$PY" bench/ci_job_bench.py --repeat "$REPEAT" --stages
echo "results: bench/results/"
