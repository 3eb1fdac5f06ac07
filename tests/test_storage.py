"""Tests of agoractl.storage against local files and a real loopback S3 API server (moto_server)."""

import pytest

from agoractl.storage import filesystem, join, write_bytes_atomic


def test_local_atomic_write(tmp_path):
    url = str(tmp_path / "a" / "b.bin")
    write_bytes_atomic(url, b"hello")
    assert (tmp_path / "a" / "b.bin").read_bytes() == b"hello"
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.bin"]


def test_s3_roundtrip(s3_env):
    bucket = s3_env["make_bucket"]("storage-test")
    url = join(bucket, "x", "y.bin")
    write_bytes_atomic(url, b"payload")
    fs, path = filesystem(url)
    assert fs.cat_file(path) == b"payload"


def test_s3_missing_bucket(s3_env):
    with pytest.raises(Exception):
        write_bytes_atomic("s3://no-such-bucket-here/x.bin", b"x")
