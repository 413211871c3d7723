#!/usr/bin/env bash
# Prints the label this checkout puts on every container image it builds
# (make demo, make ee-test), so `make clean-images` removes this checkout's
# images and no other checkout's: io.microvm.sandbox.checkout=<12 hex of sha256(path)>.
# MICROVM_CHECKOUT_LABEL (key=value) overrides it (tests use their own).
set -euo pipefail
if [ -n "${MICROVM_CHECKOUT_LABEL:-}" ]; then printf '%s\n' "$MICROVM_CHECKOUT_LABEL"; exit 0; fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
printf 'io.microvm.sandbox.checkout=%s\n' "$(printf '%s' "$root" | sha256sum | cut -c1-12)"
