#!/usr/bin/env bash
# make molecule: run every Molecule scenario under extensions/molecule/ against
# a local control plane of its own, check through the REST API that no
# session (and no template but the built-in one) is left behind, and stop the
# plane whatever happens. Exits non-zero when a scenario fails or something is
# left behind; prints how many scenarios passed.
#
#   MOLECULE_SCENARIOS="default credentials"  run only these (default: all but failing_converge and interrupted,
#                                              which tests/integration/test_molecule.py drives)
#   MICROVM_MOLECULE_PLANE_DIR=DIR             the plane's state dir (default .local/molecule-plane)
#   MICROVM_MOLECULE_LISTEN=127.0.0.1:PORT     where it listens (default: 8787, or a free port)
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

export PATH="$root/.venv/bin:$PATH"
export ANSIBLE_COLLECTIONS_PATH="${ANSIBLE_COLLECTIONS_PATH:-$root/.local/collections}"
export PYTHONPATH="${PYTHONPATH:-$root/.local/collections:$root/localplane}"
export ANSIBLE_FORCE_COLOR="${ANSIBLE_FORCE_COLOR:-0}"
export MOLECULE_REPORT="${MOLECULE_REPORT:-1}"

python=python3
[ -x "$root/.venv/bin/python" ] && python="$root/.venv/bin/python"
state="${MICROVM_MOLECULE_PLANE_DIR:-$root/.local/molecule-plane}"
envfile="$state/../$(basename "$state").env"
runs="$state/../$(basename "$state").runs"
listen=()
[ -n "${MICROVM_MOLECULE_LISTEN:-}" ] && listen=(--listen "$MICROVM_MOLECULE_LISTEN")

if [ ! -e "$ANSIBLE_COLLECTIONS_PATH/ansible_collections/microvm/sandbox" ]; then
  echo "molecule: the collection is not on ANSIBLE_COLLECTIONS_PATH; run make collection" >&2
  exit 2
fi
command -v molecule >/dev/null || { echo "molecule: molecule is not installed in .venv (make venv)" >&2; exit 2; }

stop_plane() {
  "$python" -m microvm_localplane down --state-dir "$state" >/dev/null 2>&1 || true
}
trap stop_plane EXIT
trap 'exit 130' INT TERM

mkdir -p "$state" "$runs"
"$python" -m microvm_localplane up --state-dir "$state" --env-file "$envfile" "${listen[@]}" || exit 1
# shellcheck disable=SC1090
source "$envfile"

if [ -n "${MOLECULE_SCENARIOS:-}" ]; then
  read -r -a scenarios <<<"$MOLECULE_SCENARIOS"
else
  scenarios=()
  for f in extensions/molecule/*/molecule.yml; do
    name=$(basename "$(dirname "$f")")
    case "$name" in failing_converge | interrupted) continue ;; esac
    scenarios+=("$name")
  done
fi

passed=0
failed=()
start=$(date +%s)
for s in "${scenarios[@]}"; do
  t0=$(date +%s)
  echo "=== molecule test -s $s"
  # Each scenario keeps its Molecule state (inventory, instance config, the
  # ledger of sessions) apart from interactive runs in this checkout.
  if MOLECULE_EPHEMERAL_DIRECTORY="$runs/$s" molecule test -s "$s"; then
    passed=$((passed + 1))
    echo "=== $s passed in $(( $(date +%s) - t0 )) s"
  else
    failed+=("$s")
    echo "=== $s FAILED after $(( $(date +%s) - t0 )) s"
  fi
done

# Nothing may be left on the plane: no live session, no template but `base`.
leftovers=$("$python" - <<'PY'
import os
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient

client = ApiClient(os.environ["DO_AGENTS_API_URL"], os.environ["DO_AGENTS_API_TOKEN"])
gone = ("SESSION_STATUS_DESTROYING", "SESSION_STATUS_DESTROYED", "SESSION_STATUS_FAILED")
for s in client.list_sessions():
    if s.get("status") not in gone:
        print("session %s (%s, %s)" % (s.get("name"), s.get("session_id"), s.get("status")))
for t in client.list_templates():
    if t.get("name") != "base":
        print("template %s (%s)" % (t.get("name"), t.get("status")))
PY
) || { echo "molecule: could not list what is left on the plane" >&2; leftovers="(listing failed)"; }

rc=0
if [ -n "$leftovers" ]; then
  echo "molecule: left behind on the local control plane:"
  echo "$leftovers" | sed 's/^/  /'
  rc=1
fi
if [ "${#failed[@]}" -gt 0 ]; then
  echo "molecule: failed: ${failed[*]}"
  rc=1
fi
mkdir -p .local/results
summary="$passed of ${#scenarios[@]} scenarios passed in $(( $(date +%s) - start )) s, $( [ -z "$leftovers" ] && echo "nothing left behind" || echo "LEFTOVERS" )"
# Written to the run's own output and to the report apart: `tee /dev/stderr` would reopen stderr with O_TRUNC and,
# with `make test > log 2>&1`, erase everything the run had logged before this line.
echo "molecule: $summary"
echo "$summary" > .local/results/molecule.txt
exit "$rc"
