#!/usr/bin/env bash
# Build the collection's HTML docsite with antsibull-docs into docs/build/html.
set -euo pipefail
root=$(pwd)
.venv/bin/pip install --quiet -r docs/docsite/requirements.txt
work=$root/docs/build
rm -rf "$work"; mkdir -p "$work/rst"; chmod 700 "$work" "$work/rst"  # antsibull-docs insists on owner-only dirs
cp docs/docsite/conf.py docs/docsite/antsibull-docs.cfg "$work/"
cd "$work"
"$root/.venv/bin/antsibull-docs" --config-file antsibull-docs.cfg collection --cleanup everything --fail-on-error \
  --use-current --squash-hierarchy --dest-dir rst microvm.sandbox
# The guides come in as the collection's extra docs (docs/docsite/extra-docs.yml, written by
# hack/gen_docsite.py from docs/*.md and the README's quick start).
"$root/.venv/bin/sphinx-build" -M html rst . -c . -q  # no -W: links into the Ansible docs need intersphinx, which is offline here
echo "docsite: $work/html/index.html"
