#!/usr/bin/python
# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: workspace_object
short_description: Store a workspace archive in S3-compatible object storage, or fetch one, with its sha256
version_added: 0.1.0
description:
  - With O(mode=put), uploads a local archive to O(bucket) as O(key), with its sha256 both as the object's
    metadata C(sha256) and as a sidecar object C(<key>.sha256) (the format of C(sha256sum)).
  - With O(mode=get), downloads O(key) to O(dest) and verifies it against the sidecar (and the metadata); a
    missing object, a missing sidecar or a mismatch fails with a clear message and leaves nothing at O(dest).
  - Uses boto3, so it works with DigitalOcean Spaces, AWS S3, MinIO or any S3-compatible store.
  - Runs where it is executed, usually the controller (C(delegate_to=localhost)).
  - The roles C(microvm.sandbox.workspace_export) and C(microvm.sandbox.workspace_restore) use it.
author:
  - microvm.sandbox maintainers (@microvm)
extends_documentation_fragment:
  - microvm.sandbox.object_storage
options:
  mode:
    description:
      - V(put) uploads O(src); V(get) downloads to O(dest).
    type: str
    choices: [put, get]
    required: true
  key:
    description:
      - Object key of the archive, for example V(snapshots/ci-42/workspace.tar.gz). The sidecar is C(<key>.sha256).
    type: str
    required: true
  src:
    description:
      - The local archive to upload (O(mode=put)).
    type: path
  dest:
    description:
      - Where the downloaded archive is written (O(mode=get)); its directory is created when missing.
      - An existing file with the recorded sha256 is left as it is (not changed).
    type: path
  expected_sha256:
    description:
      - With O(mode=get), the sha256 the archive must have, on top of its sidecar.
    type: str
  create_bucket:
    description:
      - With O(mode=put), create the bucket when it does not exist. Otherwise a missing bucket fails.
    type: bool
    default: false
  force:
    description:
      - With O(mode=put), upload even when the object already carries the same sha256.
    type: bool
    default: false
attributes:
  check_mode:
    description: Can run in C(check_mode) and return changed status prediction without modifying the target.
    support: full
    details:
      - Reads the store and reports what would change, without writing.
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in C(check_mode)), when in diff mode.
    support: none
seealso:
  - module: microvm.sandbox.workspace_archive
"""

EXAMPLES = r"""
- name: Store a workspace archive in a Spaces bucket
  microvm.sandbox.workspace_object:
    mode: put
    src: out/ci-42-workspace.tar.gz
    bucket: team-snapshots
    key: snapshots/ci-42/workspace.tar.gz
    endpoint_url: https://fra1.digitaloceanspaces.com
    access_key: "{{ vault_spaces_key }}"
    secret_key: "{{ vault_spaces_secret }}"
  delegate_to: localhost

- name: Fetch it back and verify it (credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)
  microvm.sandbox.workspace_object:
    mode: get
    bucket: team-snapshots
    key: snapshots/ci-42/workspace.tar.gz
    dest: /tmp/restore/workspace.tar.gz
    endpoint_url: https://fra1.digitaloceanspaces.com
  delegate_to: localhost
"""

RETURN = r"""
sha256:
  description: The archive's sha256 (lowercase hex), as stored beside it and verified.
  returned: success
  type: str
  sample: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
size:
  description: Size of the archive in bytes (null in check mode when nothing was downloaded).
  returned: success
  type: int
  sample: 4666
bucket:
  description: The bucket.
  returned: success
  type: str
key:
  description: The archive's object key.
  returned: success
  type: str
sidecar_key:
  description: The key of the sha256 sidecar object.
  returned: success
  type: str
  sample: snapshots/ci-42/workspace.tar.gz.sha256
uri:
  description: C(s3://bucket/key) of the archive.
  returned: success
  type: str
dest:
  description: The local path of the downloaded archive (O(mode=get)).
  returned: when O(mode=get)
  type: str
bucket_created:
  description: Whether the bucket was created (O(mode=put) with O(create_bucket)).
  returned: when O(mode=put)
  type: bool
"""

import os  # noqa: E402

from ansible.module_utils.basic import AnsibleModule, env_fallback, missing_required_lib  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils import object_storage as store  # noqa: E402


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            mode=dict(type="str", required=True, choices=["put", "get"]),
            bucket=dict(type="str", required=True),
            key=dict(type="str", required=True, no_log=False),
            src=dict(type="path"),
            dest=dict(type="path"),
            expected_sha256=dict(type="str"),
            create_bucket=dict(type="bool", default=False),
            force=dict(type="bool", default=False),
            endpoint_url=dict(type="str"),
            region=dict(type="str"),
            access_key=dict(type="str", aliases=["aws_access_key_id"], no_log=False,
                            fallback=(env_fallback, ["AWS_ACCESS_KEY_ID"])),
            secret_key=dict(type="str", aliases=["aws_secret_access_key"], no_log=True,
                            fallback=(env_fallback, ["AWS_SECRET_ACCESS_KEY"])),
            session_token=dict(type="str", aliases=["aws_session_token"], no_log=True,
                               fallback=(env_fallback, ["AWS_SESSION_TOKEN"])),
            validate_certs=dict(type="bool", default=True),
        ),
        required_if=[("mode", "put", ["src"]), ("mode", "get", ["dest"])],
        supports_check_mode=True,
    )
    if not store.HAS_BOTO3:
        module.fail_json(msg=missing_required_lib("boto3"), exception=str(store.BOTO3_IMPORT_ERROR))
    p = module.params
    bucket, key = p["bucket"], p["key"].lstrip("/")
    if not key or key.endswith("/"):
        module.fail_json(msg="key must name an object, not a prefix: %r" % p["key"])
    try:
        client = store.make_client(p["endpoint_url"], p["region"], p["access_key"], p["secret_key"],
                                   p["session_token"], p["validate_certs"])
        base = {"bucket": bucket, "key": key, "sidecar_key": store.sidecar_key(key), "uri": "s3://%s/%s" % (bucket, key)}
        if p["mode"] == "put":
            if not os.path.isfile(p["src"]):
                module.fail_json(msg="the archive to upload does not exist: %s" % p["src"], **base)
            created = False
            if module.check_mode:
                try:
                    store.ensure_bucket(client, bucket, create=False)
                except store.ObjectMissing:
                    if not p["create_bucket"]:
                        raise
                    module.exit_json(changed=True, bucket_created=True, sha256=store.sha256_file(p["src"]),
                                     size=os.path.getsize(p["src"]), **base)
            else:
                created = store.ensure_bucket(client, bucket, create=p["create_bucket"])
            res = store.upload(client, bucket, key, p["src"], check_mode=module.check_mode, force=p["force"])
            module.exit_json(changed=res["changed"] or created, bucket_created=created, sha256=res["sha256"],
                             size=res["size"], **base)
        res = store.download(client, bucket, key, p["dest"], expected_sha256=p["expected_sha256"],
                             check_mode=module.check_mode)
        module.exit_json(changed=res["changed"], sha256=res["sha256"], size=res["size"], dest=res["dest"], **base)
    except store.StorageError as e:
        module.fail_json(msg=str(e), bucket=bucket, key=key)


if __name__ == "__main__":
    main()
