#!/usr/bin/env bash
# make ee-test: build a real execution environment and run a playbook inside it.
#  1. A Debian base image made here, with no registry pull: a debootstrap
#     rootfs (python3, pip, venv) imported into podman as
#     localhost/microvm-ee-base:bookworm; the rootfs tarball is cached under
#     .local/ee/ and the image kept in podman's store.
#  2. `ansible-builder create` from hack/ee/execution-environment.yml with the
#     built collection tarball and this machine's pip configuration (index,
#     CA bundle: hack/ee/pip_config.py), then `podman build` on the host
#     network (layers cached between runs). The image is tagged by a digest of
#     its inputs (localhost/microvm-sandbox-ee:<digest16>): when that image
#     exists, neither ansible-builder nor podman build runs.
#  3. A local control plane of its own, and tests/ee/project/session.yml run
#     by ansible-runner inside the image (podman, host network): it starts a
#     session, runs tasks over the agent connection and deletes it. Nothing
#     may be left on the plane. The container runs as root: ansible-runner
#     writes its artifacts into the mounted private data dir as this user.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bin="$root/.venv/bin"
export PATH="$bin:$PATH"
export PYTHONPATH="${PYTHONPATH:-$root/.local/collections:$root/localplane}"
work="$root/.local/ee"
base_image=localhost/microvm-ee-base:bookworm
ee_repo=localhost/microvm-sandbox-ee   # tagged by the digest of its inputs (step 2)
mkdir -p "$work" .local/results
report=.local/results/ee-test.txt
start=$SECONDS
# Every image this script builds carries the checkout's label (make clean-images).
label=$(bash "$root/hack/checkout-label.sh")
fail() { echo "ee-test: $*" | tee "$report" >&2; exit 1; }
command -v podman >/dev/null || fail "podman is missing (make system-deps installs it)"
# podman's settings for this machine, for the build and for ansible-runner's
# podman run: runc (crun refuses hybrid cgroup v1 hosts), cgroupfs without
# systemd, and rlimits no higher than this shell's (podman's defaults raise
# them, which needs CAP_SYS_RESOURCE).
nproc=$(ulimit -Hu); [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ] && nproc=32768
cat > "$work/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
export CONTAINERS_CONF="$work/containers.conf"

# 1. The base image.
if ! podman image exists "$base_image"; then
  if [ ! -s "$work/base-bookworm.tar" ]; then
    command -v debootstrap >/dev/null || fail "debootstrap is missing (make system-deps installs it)"
    rm -rf "$work/rootfs"
    echo "ee-test: debootstrap bookworm (minbase, python3, pip, venv) with the machine's configured sources"
    debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
      bookworm "$work/rootfs" >"$work/debootstrap.log" 2>&1 || fail "debootstrap failed, see $work/debootstrap.log"
    rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/*
    tar -C "$work/rootfs" -cf "$work/base-bookworm.tar.partial" . && mv "$work/base-bookworm.tar.partial" "$work/base-bookworm.tar"
    rm -rf "$work/rootfs"
  fi
  podman import --quiet --change "LABEL $label" "$work/base-bookworm.tar" "$base_image" >/dev/null \
    || fail "podman import of the base failed"
fi
echo "ee-test: base image $base_image ready ($((SECONDS - start)) s)"

# 2. The build context and the image.
def="$work/definition"
rm -rf "$def" "$work/context"; mkdir -p "$def/collections"
cp hack/ee/execution-environment.yml hack/ee/requirements.yml "$def/"
# The tarball of the tree as it is, built once per content (tests/support/microvm_tarball.py: .local/dist/<digest>/).
tarball=$("$bin/python" tests/support/microvm_tarball.py) || fail "collection build failed"
# The same content keeps the same file, so podman's layer cache holds
# (ansible-galaxy writes a new gzip timestamp on every build).
collection_sum=$(gzip -dc "$tarball" | sha256sum)
if [ -s "$work/collection.tar.gz" ] && [ "$collection_sum" = "$(gzip -dc "$work/collection.tar.gz" | sha256sum)" ]; then :
else cp "$tarball" "$work/collection.tar.gz"; fi
cp -p "$work/collection.tar.gz" "$def/collections/microvm-sandbox.tar.gz"
"$bin/python" hack/ee/pip_config.py "$def/pip" || fail "could not write the pip configuration"
# What the image is made of: the definition (hack/ee/), the collection's content and its Python and system
# requirements, the base image, the pip configuration written above, the builder, and the checkout's label (each
# checkout's image carries its own, for make clean-images).
inputs_digest=$( {
  for f in hack/ee/* requirements.txt bindep.txt meta/execution-environment.yml; do
    printf '%s %s\n' "$f" "$(sha256sum <"$f")"; done
  printf 'collection %s\n' "$collection_sum"
  printf 'base %s\n' "$(podman image inspect --format '{{.Id}}' "$base_image")"
  (cd "$def/pip" && find . -type f | LC_ALL=C sort | xargs -r sha256sum)
  printf 'builder %s\nlabel %s\n' "$("$bin/ansible-builder" --version)" "$label"
} | sha256sum | cut -c1-16)
ee_image=$ee_repo:$inputs_digest
t0=$SECONDS
if podman image exists "$ee_image"; then
  echo "ee-test: $ee_image exists (the same inputs): no ansible-builder, no podman build"
else
  "$bin/ansible-builder" create -f "$def/execution-environment.yml" -c "$work/context" >/dev/null || fail "ansible-builder create failed"
  podman build --network host --layers --label "$label" -f "$work/context/Containerfile" -t "$ee_image" "$work/context" >"$work/build.log" 2>&1 \
    || { tail -n 30 "$work/build.log"; fail "podman build failed, see $work/build.log"; }
  echo "ee-test: built $ee_image in $((SECONDS - t0)) s"
fi
# make clean-images finds this checkout's images by their label: the image must carry it.
[ "$(podman image inspect --format "{{index .Labels \"${label%%=*}\"}}" "$ee_image")" = "${label#*=}" ] \
  || fail "$ee_image does not carry the checkout's label $label"
# Earlier builds (other digests) stay in podman's store as cache: `make clean-images` removes them.

# The image holds what the collection's plugins need, and not the local plane's.
podman run --rm --network host "$ee_image" python3 -c '
import importlib.util as u
missing = [m for m in ("grpc", "google.protobuf", "websockets", "h2", "boto3", "yaml") if u.find_spec(m) is None]
extra = [m for m in ("aiohttp",) if u.find_spec(m) is not None]
assert not missing and not extra, "missing %s, not wanted %s" % (missing, extra)' \
  || fail "the image's Python packages are not what requirements.txt says"

# 3. A plane, and the playbook inside the image.
state="$work/plane"
stop_plane() { "$bin/python" -m microvm_localplane down --state-dir "$state" >/dev/null 2>&1 || true; }
trap stop_plane EXIT
trap 'exit 130' INT TERM
# A plane of its own with no state from an earlier run, so what is left afterwards is this run's.
stop_plane; rm -rf "$state"; mkdir -p "$state"
"$bin/python" -m microvm_localplane up --state-dir "$state" --env-file "$work/plane.env" >/dev/null || fail "the local control plane did not start"
# shellcheck disable=SC1091
source "$work/plane.env"
# Nothing may be left on the plane after a run.
leftovers() {
  "$bin/python" - <<'PY' || echo "(listing failed)"
import os
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient

client = ApiClient(os.environ["DO_AGENTS_API_URL"], os.environ["DO_AGENTS_API_TOKEN"])
gone = ("SESSION_STATUS_DESTROYING", "SESSION_STATUS_DESTROYED")
print(" ".join(s.get("name", "?") for s in client.list_sessions() if s.get("status") not in gone))
PY
}
pdd="$work/runner"
rm -rf "$pdd"; mkdir -p "$pdd/env"; chmod 700 "$pdd/env"
cp -r tests/ee/project tests/ee/inventory "$pdd/"
( umask 077; printf 'DO_AGENTS_API_URL: "%s"\nDO_AGENTS_API_TOKEN: "%s"\nANSIBLE_NOCOLOR: "1"\n' \
    "$DO_AGENTS_API_URL" "$DO_AGENTS_API_TOKEN" > "$pdd/env/envvars" )
t0=$SECONDS
"$bin/ansible-runner" run "$pdd" -p session.yml --process-isolation --process-isolation-executable podman \
  --container-image "$ee_image" --container-option=--network=host --container-option=--user=root >"$work/run.log" 2>&1
rc=$?
cat "$work/run.log"
recap=$(grep -E '^localhost|^ee-sandbox' "$work/run.log" | tr -s ' ' | tr '\n' ';')
[ "$rc" = 0 ] || fail "the playbook failed in the execution environment (ansible-runner exit $rc, $((SECONDS - t0)) s)"
left=$(leftovers); [ -z "$left" ] || fail "left behind on the plane by ansible-runner's run: $left"

# The same playbook the way users run an execution environment: ansible-navigator
# (stdout mode, the image as built, never pulled). The plane's URL and token reach the
# container as passed-through environment variables, never on a command line.
t1=$SECONDS
# ansible-navigator refuses podman without a POSIX message queue mount point; some hosts have none.
if [ ! -d /dev/mqueue ]; then
  [ "$(id -u)" = 0 ] || fail "ansible-navigator needs /dev/mqueue: as root, mkdir /dev/mqueue && mount -t mqueue mqueue /dev/mqueue"
  echo "ee-test: creating /dev/mqueue (POSIX message queues), which ansible-navigator needs with podman"
  mkdir -p /dev/mqueue && { mount -t mqueue mqueue /dev/mqueue 2>/dev/null || true; }
fi
mkdir -p "$work/navigator-home"
# A clean environment, as a user's shell would be: make's ANSIBLE_COLLECTIONS_PATH and PYTHONPATH name
# host paths that mean nothing in the image.
( cd "$pdd/project" && env -i PATH="$bin:/usr/local/bin:/usr/bin:/bin" HOME="$work/navigator-home" LANG=C.UTF-8 \
  CONTAINERS_CONF="$CONTAINERS_CONF" DO_AGENTS_API_URL="$DO_AGENTS_API_URL" DO_AGENTS_API_TOKEN="$DO_AGENTS_API_TOKEN" \
  ANSIBLE_NOCOLOR=1 "$bin/ansible-navigator" run session.yml -i "$pdd/inventory" --mode stdout \
    --execution-environment true --container-engine podman --eei "$ee_image" --pull-policy never \
    --co=--network=host --co=--user=root \
    --penv DO_AGENTS_API_URL --penv DO_AGENTS_API_TOKEN --penv ANSIBLE_NOCOLOR \
    --playbook-artifact-enable false --log-file "$work/navigator.log" ) >"$work/navigator-run.log" 2>&1
nrc=$?
cat "$work/navigator-run.log"
grep -qF "$DO_AGENTS_API_TOKEN" "$work/navigator-run.log" "$work/navigator.log" && fail "the API token appeared in ansible-navigator's output or log"
[ "$nrc" = 0 ] || fail "the playbook failed under ansible-navigator (exit $nrc, $((SECONDS - t1)) s; log $work/navigator.log)"
grep -qE '^localhost .*failed=0' "$work/navigator-run.log" || fail "ansible-navigator's run shows no clean recap"
left=$(leftovers); [ -z "$left" ] || fail "left behind on the plane by ansible-navigator's run: $left"
echo "ee-test: playbook ran in $ee_image with ansible-runner and ansible-navigator in $((SECONDS - t0)) s, nothing left behind; $((SECONDS - start)) s in all" | tee "$report"
echo "recap: $recap"
