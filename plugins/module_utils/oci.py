# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""OCI image references: checked before a template call, so a malformed one fails without touching the platform."""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type


def parse_image_ref(ref: str) -> dict[str, str]:
    """'registry/repo:tag@digest' (or 'oci:/layout:tag') -> {registry, repository, tag, digest}.

    The first path part must name the registry host (it has a dot, a colon or is 'localhost'): the platform builds
    from an image the team pushed to its own registry, so there is no default registry to fall back on.
    No tag and no digest means 'latest'.
    """
    if not isinstance(ref, str) or not ref.strip() or any(c.isspace() for c in ref):
        raise ValueError("%r is not an image reference such as registry.example.com/repo:tag" % (ref,))
    if ref.startswith("oci:"):
        path, _sep, tag = ref[4:].partition(":")
        if not path.startswith("/"):
            raise ValueError("an OCI layout reference needs an absolute path: oci:/path/to/layout:tag")
        return {"registry": "oci", "repository": path, "tag": tag or "latest", "digest": ""}
    name = ref[len("docker://"):] if ref.startswith("docker://") else ref
    name, _sep, digest = name.partition("@")
    first, slash, rest = name.partition("/")
    if not (slash and ("." in first or ":" in first or first == "localhost")):
        raise ValueError("%r names no registry host: use registry.example.com/repo:tag (or localhost:5000/repo:tag)"
                         % (ref,))
    registry, repository = first, rest
    tag = ""
    if ":" in repository.rsplit("/", 1)[-1]:
        repository, tag = repository.rsplit(":", 1)
    if not repository or not all(repository.split("/")):
        raise ValueError("%r names no repository" % (ref,))
    if not tag and not digest:
        tag = "latest"
    return {"registry": registry, "repository": repository, "tag": tag, "digest": digest}
