#!/usr/bin/env bash
# make clean-images: remove the container images this checkout built (the
# demo's template and base images, the execution environment's), their build
# containers and their superseded (dangling) builds: every image that carries
# this checkout's label (hack/checkout-label.sh), and nothing else of the
# machine's containers store.
set -uo pipefail
command -v buildah >/dev/null || exit 0
label=$(bash "$(dirname "${BASH_SOURCE[0]}")/checkout-label.sh")
# "<id> <name>:<tag>" of each image with our label (a dangling build shows <none>:<none>).
mapfile -t rows < <(buildah images --all --noheading --no-trunc --format '{{.ID}} {{.Name}}:{{.Tag}}' \
  --filter "label=$label" | sort -u)
[ ${#rows[@]} -gt 0 ] || { echo "no images of this checkout ($label)"; exit 0; }
declare -A names=()
for row in "${rows[@]}"; do
  read -r id name <<<"$row"; id=${id#sha256:}
  [ "$name" = "<none>:<none>" ] && name="(superseded build ${id:0:12})"
  names[$id]="${names[$id]:+${names[$id]}, }$name"
done
# Build containers of those images first: an image in use cannot be removed.
while read -r ctr image; do
  [ -n "${names[${image#sha256:}]+x}" ] && buildah rm "$ctr" >/dev/null
done < <(buildah containers --all --noheading --notruncate --format '{{.ContainerID}} {{.ImageID}}')
for id in "${!names[@]}"; do
  buildah rmi -f "$id" >/dev/null 2>&1 && echo "removed image ${names[$id]}"
done
exit 0
