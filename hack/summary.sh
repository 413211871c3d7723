#!/usr/bin/env bash
# Print the counts of every suite that ran in `make test`.
echo
echo "==== microvm.sandbox test summary ===="
for f in .local/results/*.txt; do
  [ -e "$f" ] || continue
  printf '%-14s %s\n' "$(basename "$f" .txt)" "$(cat "$f")"
done
