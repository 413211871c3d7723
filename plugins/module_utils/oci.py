# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""OCI image references, compared the way the platform reports a template's image."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCKER_HUB = "docker.io"
_HUB_ALIASES = ("docker.io", "index.docker.io", "registry-1.docker.io")


def parse_image_ref(ref):
    """'reg/repo:tag@digest' (or 'oci:/layout:tag') -> {registry, repository, tag, digest}.

    Docker's rules: the first path part is a registry only when it has a dot,
    a colon or is 'localhost'; no tag and no digest means 'latest'.
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
    if slash and ("." in first or ":" in first or first == "localhost"):
        registry, repository = first, rest
    else:
        registry, repository = DOCKER_HUB, name
    tag = ""
    if ":" in repository.rsplit("/", 1)[-1]:
        repository, tag = repository.rsplit(":", 1)
    if not repository or not all(repository.split("/")):
        raise ValueError("%r names no repository" % (ref,))
    if not tag and not digest:
        tag = "latest"
    return {"registry": registry, "repository": repository, "tag": tag, "digest": digest}


def _normal(image):
    registry = (image.get("registry") or "").lower()
    repository = image.get("repository") or ""
    if registry in _HUB_ALIASES:
        registry = DOCKER_HUB
        if repository.startswith("library/"):
            repository = repository[len("library/"):]
    return registry, repository


def image_matches(wanted, have):
    """Whether the image a template was built from (`have`) is the one `wanted` names.

    A digest decides when the reference has one; otherwise registry, repository
    and tag must match (a tag that moved cannot be seen from here).
    """
    if not have or not have.get("repository"):
        return False
    if _normal(wanted) != _normal(have):
        return False
    if wanted.get("digest"):
        return wanted["digest"] == have.get("digest")
    return (wanted.get("tag") or "latest") == (have.get("tag") or "latest")
