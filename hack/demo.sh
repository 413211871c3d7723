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
# The images the demo builds carry this checkout's label (make clean-images removes them).
if [ -z "${MICROVM_DEMO_IMAGE_LABELS:-}" ]; then
  label=$(bash "$root/hack/checkout-label.sh")
  export MICROVM_DEMO_IMAGE_LABELS="{\"${label%%=*}\": \"${label#*=}\"}"
fi

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
s3_pid=""
stop_plane() {
  # A plane that was already running (make local-up) is left running.
  if [ "$started_here" = 1 ]; then
    echo "demo: stopping the local control plane"
    "$python" -m microvm_localplane down --state-dir "$state" >/dev/null 2>&1 || true
  fi
  # The S3 server this script started (by its pid), if any.
  if [ -n "$s3_pid" ]; then
    echo "demo: stopping the S3 server (moto, pid $s3_pid)"
    kill "$s3_pid" 2>/dev/null || true
    wait "$s3_pid" 2>/dev/null || true
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

# The snapshot/restore step stores the workspace in S3-compatible object storage.
# Without MICROVM_DEMO_S3_ENDPOINT, a moto S3 server is started on loopback with
# throwaway credentials (MICROVM_DEMO_S3=false skips it: the snapshot then stays
# on the controller, and the summary says so).
if [ -z "${MICROVM_DEMO_S3_ENDPOINT:-}" ] && [ "${MICROVM_DEMO_S3:-true}" != false ]; then
  if [ -x "$root/.venv/bin/moto_server" ]; then
    s3_port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    "$root/.venv/bin/moto_server" -H 127.0.0.1 -p "$s3_port" >"$state/moto.log" 2>&1 &
    s3_pid=$!
    if "$python" - "http://127.0.0.1:$s3_port/" <<'PY'
import sys, time, urllib.error, urllib.request
deadline = time.time() + 60
while time.time() < deadline:
    try:
        urllib.request.urlopen(sys.argv[1], timeout=2)
        sys.exit(0)
    except urllib.error.HTTPError:
        sys.exit(0)  # it answers
    except OSError:
        time.sleep(0.2)
sys.exit(1)
PY
    then
      echo "demo: S3 server (moto) on http://127.0.0.1:$s3_port"
      export MICROVM_DEMO_S3_ENDPOINT="http://127.0.0.1:$s3_port"
      export AWS_ACCESS_KEY_ID="demo-$(od -An -tx1 -N6 /dev/urandom | tr -d ' \n')"
      AWS_SECRET_ACCESS_KEY="$(od -An -tx1 -N20 /dev/urandom | tr -d ' \n')"
      export AWS_SECRET_ACCESS_KEY
      export AWS_DEFAULT_REGION=us-east-1
      unset AWS_SESSION_TOKEN AWS_PROFILE AWS_ENDPOINT_URL AWS_ENDPOINT_URL_S3
    else
      echo "demo: the S3 server did not answer (see $state/moto.log); the snapshot stays on the controller"
      kill "$s3_pid" 2>/dev/null || true
      s3_pid=""
    fi
  else
    echo "demo: moto_server not found in .venv (make setup installs it); the snapshot stays on the controller"
  fi
fi

start=$(date +%s)
rc=0
ansible-playbook -i "$root/hack/demo-inventory.ini" microvm.sandbox.demo "$@" || rc=$?
echo "demo: ansible-playbook exited $rc after $(( $(date +%s) - start )) s"
exit "$rc"
