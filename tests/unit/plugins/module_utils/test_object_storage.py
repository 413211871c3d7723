"""S3 archive storage with sha256 sidecars (module_utils/object_storage.py) against moto's in-process S3."""
import hashlib

import pytest

moto = pytest.importorskip("moto")

from ansible_collections.microvm.sandbox.plugins.module_utils import object_storage as store  # noqa: E402

SECRET = "unit-secret-never-shown-0123456789"


@pytest.fixture
def client(monkeypatch):
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    with moto.mock_aws():
        yield store.make_client(region="us-east-1", access_key="AKIAUNITTEST", secret_key=SECRET)


@pytest.fixture
def archive(tmp_path):
    p = tmp_path / "ws.tar.gz"
    p.write_bytes(b"pretend this is a tar.gz " * 100)
    return p


def test_missing_bucket_is_created_only_when_asked(client):
    with pytest.raises(store.ObjectMissing) as err:
        store.ensure_bucket(client, "snaps")
    assert "s3://snaps" in str(err.value) and "does not exist" in str(err.value)
    assert store.ensure_bucket(client, "snaps", create=True) is True
    assert store.ensure_bucket(client, "snaps", create=True) is False


def test_round_trip_with_sidecar_and_metadata(client, archive, tmp_path):
    store.ensure_bucket(client, "snaps", create=True)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    up = store.upload(client, "snaps", "p/ws.tar.gz", str(archive))
    assert up["changed"] and up["sha256"] == digest and up["sidecar_key"] == "p/ws.tar.gz.sha256"
    side = client.get_object(Bucket="snaps", Key="p/ws.tar.gz.sha256")["Body"].read().decode()
    assert side == "%s  ws.tar.gz\n" % digest
    assert client.head_object(Bucket="snaps", Key="p/ws.tar.gz")["Metadata"]["sha256"] == digest
    assert store.upload(client, "snaps", "p/ws.tar.gz", str(archive))["changed"] is False
    dest = tmp_path / "back" / "ws.tar.gz"
    down = store.download(client, "snaps", "p/ws.tar.gz", str(dest))
    assert down["changed"] and dest.read_bytes() == archive.read_bytes()
    assert store.download(client, "snaps", "p/ws.tar.gz", str(dest))["changed"] is False


@pytest.mark.parametrize("tamper", ["object", "sidecar", "expected"])
def test_checksum_mismatch_leaves_nothing(client, archive, tmp_path, tamper):
    store.ensure_bucket(client, "snaps", create=True)
    store.upload(client, "snaps", "ws.tar.gz", str(archive))
    expected = None
    if tamper == "object":  # replaced behind our back, sidecar and metadata stay
        client.put_object(Bucket="snaps", Key="ws.tar.gz", Body=b"evil", Metadata={})
    elif tamper == "sidecar":
        client.put_object(Bucket="snaps", Key="ws.tar.gz.sha256", Body=b"0" * 64 + b"  ws.tar.gz\n")
    else:
        expected = "1" * 64
    dest = tmp_path / "dl" / "ws.tar.gz"
    with pytest.raises(store.ChecksumMismatch) as err:
        store.download(client, "snaps", "ws.tar.gz", str(dest), expected_sha256=expected)
    assert "sha256" in str(err.value) and "s3://snaps/ws.tar.gz" in str(err.value)
    assert not dest.exists()
    assert not list(dest.parent.iterdir()) if dest.parent.exists() else True


def test_missing_object_and_missing_sidecar(client, archive, tmp_path):
    store.ensure_bucket(client, "snaps", create=True)
    with pytest.raises(store.ObjectMissing) as err:
        store.download(client, "snaps", "nope.tar.gz", str(tmp_path / "x"))
    assert "s3://snaps/nope.tar.gz" in str(err.value) and "does not exist" in str(err.value)
    client.upload_file(str(archive), "snaps", "bare.tar.gz")
    with pytest.raises(store.ObjectMissing) as err:
        store.download(client, "snaps", "bare.tar.gz", str(tmp_path / "x"))
    assert "bare.tar.gz.sha256" in str(err.value) and "cannot be verified" in str(err.value)
    assert not (tmp_path / "x").exists()


def test_messages_never_carry_the_secret(client):
    with pytest.raises(store.StorageError) as err:
        store.download(client, "no-such-bucket", "k", "/nonexistent/x")
    assert SECRET not in str(err.value)


def test_bucket_outside_us_east_1_is_created_with_its_region(monkeypatch):
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    with moto.mock_aws():
        client = store.make_client(region="eu-central-1", access_key="AKIAUNITTEST", secret_key=SECRET)
        assert store.ensure_bucket(client, "snaps-eu", create=True) is True
        assert client.get_bucket_location(Bucket="snaps-eu")["LocationConstraint"] == "eu-central-1"


def test_a_refusal_is_reported_with_its_code_and_message(client):
    """A ClientError other than "missing" (403 AccessDenied) becomes a StorageError naming S3's code and message.

    _explain once applied .strip() to the tuple instead of the formatted text (found by mypy) and raised
    AttributeError in place of the report.
    """
    from botocore.stub import Stubber
    with Stubber(client) as stub:
        stub.add_client_error("head_bucket", service_error_code="AccessDenied", service_message="Access Denied",
                              http_status_code=403)
        with pytest.raises(store.StorageError) as err:
            store.ensure_bucket(client, "locked")
    assert "cannot reach the bucket s3://locked" in str(err.value)
    assert str(err.value).endswith(": AccessDenied Access Denied")
