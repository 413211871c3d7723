# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The options every object-storage (S3-compatible) module uses."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type


class ModuleDocFragment(object):

    DOCUMENTATION = r"""
options:
  bucket:
    description:
      - Name of the bucket (a DigitalOcean Spaces bucket, an S3 bucket, ...).
    type: str
    required: true
  endpoint_url:
    description:
      - URL of the S3-compatible endpoint, for example V(https://fra1.digitaloceanspaces.com) for DigitalOcean Spaces.
      - If not set, the environment variable E(AWS_ENDPOINT_URL_S3) is used, then E(AWS_ENDPOINT_URL), then AWS S3.
    type: str
  region:
    description:
      - Region of the bucket (Spaces ignores it but needs one to sign requests).
      - If not set, E(AWS_REGION) is used, then E(AWS_DEFAULT_REGION), then V(us-east-1).
    type: str
  access_key:
    description:
      - Access key id.
      - If not set, boto3's usual chain is used (E(AWS_ACCESS_KEY_ID), the shared credentials file, ...).
    type: str
    aliases: [aws_access_key_id]
  secret_key:
    description:
      - Secret access key. Never printed, logged or returned; keep it in a vault.
      - If not set, boto3's usual chain is used (E(AWS_SECRET_ACCESS_KEY), the shared credentials file, ...).
    type: str
    aliases: [aws_secret_access_key]
  session_token:
    description:
      - Session token of temporary credentials. Never printed, logged or returned.
      - If not set, E(AWS_SESSION_TOKEN) is used when present.
    type: str
    aliases: [aws_session_token]
  validate_certs:
    description:
      - Whether to verify the endpoint's TLS certificate.
    type: bool
    default: true
requirements:
  - boto3 (on the host the module runs on, usually the controller)
notes:
  - Objects are addressed path-style (C(endpoint/bucket/key)), which S3, Spaces, MinIO and moto all accept.
"""
