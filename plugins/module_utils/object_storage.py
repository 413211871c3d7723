# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""S3-compatible object storage (DigitalOcean Spaces, AWS S3, MinIO, moto) through boto3: the one place.

Every archive is stored with its sha256 twice: as the object's metadata ``sha256``
and as a sidecar object ``<key>.sha256`` (``<hex>  <file name>``, the format of
``sha256sum``). A download is written to a temporary file beside the destination,
checked against the sidecar (and the metadata when present), and only then renamed
into place: a mismatch leaves nothing behind.

Credentials and the endpoint come from the arguments when given, else from boto3's
usual chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, the
shared credentials file, AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL). They are never
put into messages.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import os
import re
import tempfile
from typing import Any

from ansible_collections.microvm.sandbox.plugins.module_utils.archive_check import sha256_file

try:
    import boto3
    import botocore.config
    from botocore.exceptions import BotoCoreError, ClientError
    HAS_BOTO3 = True
    BOTO3_IMPORT_ERROR = None
except ImportError as e:  # pragma: no cover - exercised only without boto3
    HAS_BOTO3 = False
    BOTO3_IMPORT_ERROR = e

    class BotoCoreError(Exception):  # type: ignore[no-redef]
        pass

    class ClientError(Exception):  # type: ignore[no-redef]
        pass

SIDECAR_SUFFIX = ".sha256"
META_KEY = "sha256"
HEX64 = re.compile(r"^[0-9a-f]{64}$")
MISSING_CODES = ("404", "NoSuchKey", "NotFound")
MISSING_BUCKET_CODES = ("NoSuchBucket",)


class StorageError(Exception):
    """A clear, credential-free message about what went wrong with the object store."""


class ObjectMissing(StorageError):
    pass


class ChecksumMismatch(StorageError):
    pass


def missing_boto3_message() -> str:
    return ("the Python package boto3 is needed for object storage on the controller "
            "(pip install boto3, or pip install -r requirements.txt of microvm.sandbox): %s" % BOTO3_IMPORT_ERROR)


def endpoint_from_env(explicit: str | None = None) -> str | None:
    return explicit or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def make_client(endpoint_url: str | None = None, region: str | None = None, access_key: str | None = None, secret_key: str | None = None,
                session_token: str | None = None, validate_certs: bool = True, addressing_style: str = "path") -> Any:
    """A boto3 S3 client; unset values fall back to boto3's own chain (environment, shared files)."""
    if not HAS_BOTO3:
        raise StorageError(missing_boto3_message())
    session = boto3.session.Session(aws_access_key_id=access_key or None, aws_secret_access_key=secret_key or None,
                                    aws_session_token=session_token or None,
                                    region_name=region or os.environ.get("AWS_REGION")
                                    or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")
    options = {"s3": {"addressing_style": addressing_style}, "retries": {"max_attempts": 5, "mode": "standard"}}
    try:
        # botocore >= 1.36 adds CRC checksums to every upload by default, which some S3-compatible stores
        # refuse; this module carries its own sha256, so ask for them only where S3 requires them.
        config = botocore.config.Config(request_checksum_calculation="when_required",
                                        response_checksum_validation="when_required", **options)
    except TypeError:
        config = botocore.config.Config(**options)
    return session.client("s3", endpoint_url=endpoint_from_env(endpoint_url), verify=validate_certs, config=config)


def where(client: Any, bucket: str, key: str | None = None) -> str:
    """s3://bucket/key at the endpoint, for messages (no credentials in it)."""
    endpoint = getattr(getattr(client, "meta", None), "endpoint_url", None) or "the default endpoint"
    return "s3://%s%s at %s" % (bucket, "/" + key if key else "", endpoint)


def _code(err: Exception) -> str:
    return str(err.response.get("Error", {}).get("Code", "")) if isinstance(err, ClientError) else ""


def _explain(err: Exception) -> str:
    if isinstance(err, ClientError):
        e = err.response.get("Error", {})
        return ("%s %s" % (e.get("Code", ""), e.get("Message", ""))).strip()
    return str(err)


def sidecar_key(key: str) -> str:
    return key + SIDECAR_SUFFIX


def ensure_bucket(client: Any, bucket: str, create: bool = False) -> bool:
    """-> True when the bucket was created. Fails clearly when it is missing and create is off."""
    try:
        client.head_bucket(Bucket=bucket)
        return False
    except ClientError as e:
        if _code(e) not in MISSING_CODES + MISSING_BUCKET_CODES:
            raise StorageError("cannot reach the bucket %s: %s" % (where(client, bucket), _explain(e))) from e
    except BotoCoreError as e:
        raise StorageError("cannot reach the bucket %s: %s" % (where(client, bucket), _explain(e))) from e
    if not create:
        raise ObjectMissing("the bucket %s does not exist (set create_bucket to create it)" % where(client, bucket))
    kwargs: dict[str, Any] = {"Bucket": bucket}
    region = getattr(getattr(client, "meta", None), "region_name", None)
    if region and region != "us-east-1":  # S3 wants the region spelled out everywhere else
        kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
    try:
        client.create_bucket(**kwargs)
    except (ClientError, BotoCoreError) as e:
        raise StorageError("cannot create the bucket %s: %s" % (where(client, bucket), _explain(e))) from e
    return True


def head(client: Any, bucket: str, key: str) -> dict[str, Any] | None:
    """The object's head (dict), or None when it does not exist."""
    try:
        return client.head_object(Bucket=bucket, Key=key)
    except ClientError as e:
        if _code(e) in MISSING_CODES:
            return None
        if _code(e) in MISSING_BUCKET_CODES:
            raise ObjectMissing("the bucket %s does not exist" % where(client, bucket)) from e
        raise StorageError("cannot read %s: %s" % (where(client, bucket, key), _explain(e))) from e
    except BotoCoreError as e:
        raise StorageError("cannot read %s: %s" % (where(client, bucket, key), _explain(e))) from e


def stored_sha256(client: Any, bucket: str, key: str) -> str | None:
    """The sha256 in the sidecar <key>.sha256; ObjectMissing when there is none."""
    skey = sidecar_key(key)
    try:
        body = client.get_object(Bucket=bucket, Key=skey)["Body"].read(4096)
    except ClientError as e:
        if _code(e) in MISSING_CODES + MISSING_BUCKET_CODES:
            raise ObjectMissing("the checksum %s does not exist, so the archive cannot be verified"
                                % where(client, bucket, skey)) from e
        raise StorageError("cannot read %s: %s" % (where(client, bucket, skey), _explain(e))) from e
    except BotoCoreError as e:
        raise StorageError("cannot read %s: %s" % (where(client, bucket, skey), _explain(e))) from e
    words = body.decode("utf-8", "replace").split()
    digest = words[0].lower() if words else ""
    if not HEX64.match(digest):
        raise ChecksumMismatch("the checksum %s does not hold a sha256 (%r)" % (where(client, bucket, skey), body[:80]))
    return digest


def upload(client: Any, bucket: str, key: str, path: str, check_mode: bool = False, force: bool = False) -> dict[str, Any]:
    """Store the file at path as key with its sha256 (metadata and sidecar).

    -> dict(changed, sha256, size, key, sidecar_key). Unchanged when the object and its sidecar already
    carry the same sha256 (unless force).
    """
    digest = sha256_file(path)
    size = os.path.getsize(path)
    result = {"changed": True, "sha256": digest, "size": size, "key": key, "sidecar_key": sidecar_key(key)}
    current = head(client, bucket, key)
    if current is not None and not force and current.get("Metadata", {}).get(META_KEY) == digest:
        try:
            if stored_sha256(client, bucket, key) == digest:
                result["changed"] = False
                return result
        except StorageError:
            pass
    if check_mode:
        return result
    try:
        client.upload_file(path, bucket, key, ExtraArgs={"Metadata": {META_KEY: digest},
                                                         "ContentType": "application/gzip"})
        client.put_object(Bucket=bucket, Key=sidecar_key(key), ContentType="text/plain",
                          Body=("%s  %s\n" % (digest, _basename(key))).encode("utf-8"))
    except (ClientError, BotoCoreError) as e:
        raise StorageError("cannot upload %s to %s: %s" % (path, where(client, bucket, key), _explain(e))) from e
    # read it back: what the store holds is what we meant to store
    after = head(client, bucket, key)
    if after is None or int(after.get("ContentLength", -1)) != size:
        raise StorageError("%s does not hold the %d bytes just uploaded" % (where(client, bucket, key), size))
    return result


def _basename(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def download(client: Any, bucket: str, key: str, dest: str, expected_sha256: str | None = None, check_mode: bool = False) -> dict[str, Any]:
    """Fetch key to dest and verify it against its sidecar (and metadata, and expected_sha256 when given).

    -> dict(changed, sha256, size, dest). Nothing is left at dest when the object is missing or does not verify.
    """
    current = head(client, bucket, key)
    if current is None:
        raise ObjectMissing("the archive %s does not exist" % where(client, bucket, key))
    want = stored_sha256(client, bucket, key)
    meta = current.get("Metadata", {}).get(META_KEY)
    if meta and meta.lower() != want:
        raise ChecksumMismatch("%s carries sha256 %s in its metadata but %s in its sidecar %s"
                               % (where(client, bucket, key), meta, want, sidecar_key(key)))
    if expected_sha256 and expected_sha256.lower() != want:
        raise ChecksumMismatch("%s is recorded with sha256 %s, not the expected %s"
                               % (where(client, bucket, key), want, expected_sha256.lower()))
    result: dict[str, Any] = {"changed": True, "sha256": want, "size": None, "dest": dest}
    if os.path.isfile(dest) and sha256_file(dest) == want:
        result.update(changed=False, size=os.path.getsize(dest))
        return result
    if check_mode:
        return result
    directory = os.path.dirname(os.path.abspath(dest))
    if not os.path.isdir(directory):
        os.makedirs(directory)
    fd, tmp = tempfile.mkstemp(prefix=".%s." % os.path.basename(dest), dir=directory)
    moved = False
    os.close(fd)
    try:
        try:
            client.download_file(bucket, key, tmp)
        except (ClientError, BotoCoreError) as e:
            if _code(e) in MISSING_CODES:
                raise ObjectMissing("the archive %s does not exist" % where(client, bucket, key)) from e
            raise StorageError("cannot download %s: %s" % (where(client, bucket, key), _explain(e))) from e
        got = sha256_file(tmp)
        if got != want:
            raise ChecksumMismatch("the archive downloaded from %s has sha256 %s, but its checksum %s says %s: "
                                   "it was changed or damaged, so it was not used"
                                   % (where(client, bucket, key), got, sidecar_key(key), want))
        os.chmod(tmp, 0o600)
        os.rename(tmp, dest)
        moved = True
    finally:
        if not moved and os.path.exists(tmp):
            os.unlink(tmp)
    result["size"] = os.path.getsize(dest)
    return result
