#!/usr/bin/env bash
# ansible-test sanity on a copy of the tracked tree at the path ansible-test
# requires (ansible_collections/microvm/sandbox). Works offline: ansible-test's
# pip bootstrap script is replaced by a stand-in that uses ensurepip.
set -euo pipefail
root=$(pwd)
# A private copy per run (concurrent runs never share one), outside hidden dirs
# such as .local, which ansible-test would skip.
work=$(mktemp -d "${SANITY_TMP:-/tmp}/microvm-sandbox-sanity.XXXXXX")
trap 'rm -rf "$work"' EXIT
dest=$work/ansible_collections/microvm/sandbox
mkdir -p "$dest"
git ls-files -z --cached --others --exclude-standard | rsync -a --from0 --files-from=- ./ "$dest/"
pyver=$("${VENV_BIN:-.venv/bin}/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
cache=$HOME/.ansible/test/cache
mkdir -p "$cache"
pipver=$("${VENV_BIN:-.venv/bin}/python" -c 'from ansible_test._internal.python_requirements import get_venv_packages as g
from ansible_test._internal.host_configs import NativePythonConfig as N
p = N(); p.version = "'"$pyver"'"; print(g(p)["pip"])')
standin=$cache/get_pip_${pipver//./_}.py
if ! grep -q "microvm.sandbox stand-in" "$standin" 2>/dev/null; then
  cat > "$standin" <<'PY'
# microvm.sandbox stand-in for get-pip.py (offline): ensurepip, then pip install the arguments
import os, subprocess, sys
subprocess.check_call([sys.executable, "-m", "ensurepip", "--upgrade"])
env = dict(os.environ)
env.pop("PIP_CONFIG_FILE", None)  # ensurepip's isolated config hides the machine's index and CA settings
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
if args:
    subprocess.check_call([sys.executable, "-m", "pip", "install"] + args, env=env)
PY
fi
cd "$dest"
"${VENV_BIN:-$root/.venv/bin}/ansible-test" sanity --color no --python "$pyver" --requirements "$@"
