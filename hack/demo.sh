#!/usr/bin/env bash
# make demo: start the local control plane, run the demo playbook against it,
# and stop the plane whatever happens. Exits non-zero when the demo fails.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

export PATH="$root/.venv/bin:$PATH"
export ANSIBLE_COLLECTIONS_PATH="${ANSIBLE_COLLECTIONS_PATH:-$root/.local/collections}"
export PYTHONPATH="${PYTHONPATH:-$root/.local/collections:$root/localplane}"
# The image cache (debootstrap base, local registry storage) and the demo's
# output (the exported workspace) live under .local/.
export MICROVM_SANDBOX_STATE_DIR="${MICROVM_SANDBOX_STATE_DIR:-$root/.local}"
export ANSIBLE_FORCE_COLOR="${ANSIBLE_FORCE_COLOR:-1}"

python=python3
[ -x "$root/.venv/bin/python" ] && python="$root/.venv/bin/python"
# MICROVM_DEMO_PLANE_DIR / MICROVM_DEMO_LISTEN let a second plane run beside `make local-up`.
state="${MICROVM_DEMO_PLANE_DIR:-$root/.local/plane}"
envfile="$state/../env"
[ -z "${MICROVM_DEMO_PLANE_DIR:-}" ] && envfile="$root/.local/env"
listen=()
[ -n "${MICROVM_DEMO_LISTEN:-}" ] && listen=(--listen "$MICROVM_DEMO_LISTEN")
mkdir -p "$state"

started_here=1
stop_plane() {
  # A plane that was already running (make local-up) is left running.
  if [ "$started_here" = 1 ]; then
    echo "demo: stopping the local control plane"
    "$python" -m microvm_localplane down --state-dir "$state" >/dev/null 2>&1 || true
  fi
}
trap stop_plane EXIT
trap 'exit 130' INT TERM

up_out=$("$python" -m microvm_localplane up --state-dir "$state" --env-file "$envfile" "${listen[@]}") || {
  echo "$up_out"; echo "demo: the local control plane did not start"; exit 1; }
echo "$up_out"
case "$up_out" in *reusing*) started_here=0 ;; esac
# shellcheck disable=SC1090
source "$envfile"

start=$(date +%s)
rc=0
ansible-playbook microvm.sandbox.demo "$@" || rc=$?
echo "demo: ansible-playbook exited $rc after $(( $(date +%s) - start )) s"
exit "$rc"
