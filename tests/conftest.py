"""Fixtures shared by every test folder.

``s3_server``: a real S3-compatible server (moto's standalone server, a subprocess on loopback)
for the whole session, with the standard AWS_* variables pointing at it, so that
``open_store("s3://...")`` works as it would against MinIO or AWS. ``s3_bucket``: a fresh bucket
per test, as a job root URI ``s3://bucket/job``. Mark such tests ``@pytest.mark.s3``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from tests.s3server import CREDENTIALS, start_moto_server, stop


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """The endpoint URL. AWS_* variables are replaced for the rest of the session: the user's
    profiles, tokens and endpoints must never leak into tests."""
    proc, url = start_moto_server()
    mp = pytest.MonkeyPatch()
    try:
        for name in [k for k in os.environ if k.startswith("AWS_")]:
            mp.delenv(name)
        for name, value in CREDENTIALS.items():
            mp.setenv(name, value)
        mp.setenv("AWS_ENDPOINT_URL", url)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no slow instance-metadata lookups
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        for name in ("NO_PROXY", "no_proxy"):  # loopback must not go through a proxy
            mp.setenv(name, ",".join(filter(None, [os.environ.get(name), "127.0.0.1", "localhost"])))
        yield url
    finally:
        mp.undo()
        stop(proc)


@pytest.fixture
def s3_bucket(s3_server: str) -> Iterator[str]:
    """A new, empty bucket; yields ``s3://<bucket>/job``. Emptied and removed afterwards."""
    import boto3

    bucket = f"ckptd-test-{uuid.uuid4().hex[:16]}"
    client = boto3.client("s3", endpoint_url=s3_server, region_name=CREDENTIALS["AWS_REGION"])
    try:
        client.create_bucket(Bucket=bucket)
        yield f"s3://{bucket}/job"
        for up in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objects:
                client.delete_objects(Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
        client.delete_bucket(Bucket=bucket)
    finally:
        client.close()
