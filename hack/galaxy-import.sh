#!/usr/bin/env bash
# make galaxy-import: build the collection tarball as `ansible-galaxy
# collection build` does and run Galaxy's own importer (galaxy-importer,
# pinned in requirements-dev.txt) on it, offline (hack/galaxy-importer.cfg).
# Prints every finding; fails when the importer rejects the tarball or warns.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bin="$root/.venv/bin"
out="$root/.local/galaxy-import"
rm -rf "$out"; mkdir -p "$out/tmp"
mkdir -p .local/results
report=.local/results/galaxy-import.txt
start=$SECONDS
# The tarball of the tree as it is, built once per content (tests/support/microvm_tarball.py: .local/dist/<digest>/).
tarball=$("$bin/python" tests/support/microvm_tarball.py) || {
  echo "galaxy-import: ansible-galaxy collection build failed" | tee "$report"; exit 1; }
# As Galaxy runs it: a clean environment (no PYTHONPATH or ANSIBLE_* from make,
# a private HOME), the venv's tools first on PATH (the importer runs ansible-doc
# and ansible-lint from PATH on a copy it unpacks under tmp_root_dir), and its
# working directory under .local, where it writes importer_result.json.
mkdir -p "$out/home"
import_once() {
  (cd "$out" && env -i PATH="$bin:/usr/local/bin:/usr/bin:/bin" HOME="$out/home" LANG=C.UTF-8 \
    GALAXY_IMPORTER_CONFIG="$root/hack/galaxy-importer.cfg" GALAXY_IMPORTER_TMP_ROOT_DIR="$out/tmp" \
    "$bin/python" -m galaxy_importer.main --print-result "$tarball" >"$out/log" 2>&1)
}
import_once
rc=$?
# The importer gives ansible-lint a fixed 180 s; on a loaded machine that can
# run out. One more try then, said so; a second timeout is a finding.
if grep -q "Timeout on call to ansible-lint" "$out/log"; then
  echo "galaxy-import: the importer's ansible-lint call timed out (180 s, fixed by galaxy-importer); trying once more"
  import_once
  rc=$?
fi
# Its narrative and findings; the JSON result (contents, docs) stays in the log.
sed '/^{/,$d' "$out/log"
echo "(full result: $out/log)"
# Findings are the importer's WARNING/ERROR lines (its INFO lines narrate).
findings=$(grep -cE '^(WARNING|ERROR)|(WARNING|ERROR):' "$out/log")
if [ "$rc" != 0 ]; then
  echo "galaxy-import: the importer rejected $(basename "$tarball") (exit $rc) in $((SECONDS - start)) s" | tee "$report"
  exit 1
fi
if [ "$findings" != 0 ]; then
  echo "galaxy-import: $findings findings on $(basename "$tarball") in $((SECONDS - start)) s" | tee "$report"
  grep -E '^(WARNING|ERROR)|(WARNING|ERROR):' "$out/log"
  exit 1
fi
echo "galaxy-import: $(basename "$tarball") imported, 0 findings in $((SECONDS - start)) s" | tee "$report"
