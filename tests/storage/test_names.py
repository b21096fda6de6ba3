"""Storage names that could put pages somewhere the URL does not name are refused, naming the argument.

Guards against issue 9 finding 5: S3 buckets `.` and `..` were accepted (objects landed in another
bucket) and a prefix with `%2e%2e` or `%2F` passed the `..` check. Buckets follow the S3 naming rules,
prefixes and `file://` roots are percent-decoded once before their segments are checked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache import HiCacheConfig, KVLayout
from hicache.cli import main
from storage_backends.file import FileBackend
from storage_backends.names import (
    check_url_names,
    file_root_from_url_path,
    prefix_from_url_path,
    validate_bucket,
    validate_prefix,
)
from storage_backends.registry import open_backend
from storage_backends.s3 import S3Backend

NAMESPACE = bytes(range(16))
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=4)
ENDPOINT = "endpoint=http://127.0.0.1:9"

BAD_BUCKETS = [
    ".",
    "..",
    "...",
    "a..b",
    "My-Bucket",
    "UPPER",
    "ab",
    "a",
    "x" * 64,
    "192.168.5.4",
    "10.0.0.1",
    "under_score",
    "-leading",
    "trailing-",
    ".leading",
    "trailing.",
    "dot.-dash",
    "dash-.dot",
    "has space",
    "%2e%2e",
    "xn--bucket",
    "sthree-bucket",
    "bucket-s3alias",
    "bucket--ol-s3",
]
GOOD_BUCKETS = ["abc", "hicache", "my-bucket.example", "a1-b2.c3", "x" * 63, "1.2.3", "192.168.5.4a"]


@pytest.mark.parametrize("bucket", BAD_BUCKETS)
def test_bad_bucket_names_are_refused_naming_bucket(bucket: str) -> None:
    with pytest.raises(ValueError, match=r"^bucket: "):
        validate_bucket(bucket)
    with pytest.raises(ValueError, match=r"^bucket: "):
        S3Backend(bucket, namespace_digest=NAMESPACE, endpoint="http://127.0.0.1:9")


@pytest.mark.parametrize("bucket", [".", "..", "UPPER", "under_score", "192.168.5.4"])
def test_bad_bucket_in_a_url_is_refused_by_the_backend_and_the_config(bucket: str) -> None:
    url = f"s3://{bucket}/prefix?{ENDPOINT}"
    with pytest.raises(ValueError, match=r"^bucket: "):
        S3Backend.from_url(url, namespace_digest=NAMESPACE)
    with pytest.raises(ValueError, match=r"^bucket: "):
        open_backend(url, namespace_digest=NAMESPACE)
    with pytest.raises(ValueError, match=r"^storage_url: bucket: "):
        HiCacheConfig(layout=LAYOUT, device_pages=4, host_pages=4, storage_url=url)


def test_bucket_must_be_a_str() -> None:
    with pytest.raises(TypeError, match=r"^bucket: "):
        validate_bucket(b"bucket")


@pytest.mark.parametrize("bucket", GOOD_BUCKETS)
async def test_valid_bucket_names_are_accepted(bucket: str) -> None:
    assert validate_bucket(bucket) == bucket
    async with S3Backend.from_url(f"s3://{bucket}/p?{ENDPOINT}", namespace_digest=NAMESPACE) as backend:
        assert f"bucket={bucket!r}" in repr(backend)


BAD_URL_PREFIXES = [
    "/%2e%2e/other",
    "/%2E%2E",
    "/p/%2e",
    "/a%2Fb",
    "/%2F",
    "/a%2f..%2fb",
    "/a%5Cb",
    "/a%5c..",
    "/a/../b",
    "/a/./b",
    "/a//b",
    "/a%00b",
    "/a%0ab",
    "/%252e%252e",
    "/%ff",
]


@pytest.mark.parametrize("path", BAD_URL_PREFIXES)
def test_encoded_and_dotted_prefixes_in_urls_are_refused_naming_prefix(path: str) -> None:
    with pytest.raises(ValueError, match=r"^prefix: "):
        prefix_from_url_path(path)
    url = f"s3://bucket{path}?{ENDPOINT}"
    with pytest.raises(ValueError, match=r"^prefix: "):
        S3Backend.from_url(url, namespace_digest=NAMESPACE)
    with pytest.raises(ValueError, match=r"^storage_url: prefix: "):
        HiCacheConfig(layout=LAYOUT, device_pages=4, host_pages=4, storage_url=url)


@pytest.mark.parametrize("prefix", ["..", ".", "a/../b", "a//b", "a\\b", "a%2e%2e", "%2F", "a\x00b", "a\nb"])
def test_bad_literal_prefixes_are_refused_by_the_constructor(prefix: str) -> None:
    with pytest.raises(ValueError, match=r"^prefix: "):
        validate_prefix(prefix)
    with pytest.raises(ValueError, match=r"^prefix: "):
        S3Backend("bucket", prefix, namespace_digest=NAMESPACE, endpoint="http://127.0.0.1:9")


@pytest.mark.parametrize(
    ("path", "prefix"),
    [("", ""), ("/", ""), ("/a/b/", "a/b"), ("/my%20models/v1", "my models/v1"), ("/a.b/c-d_e", "a.b/c-d_e")],
)
async def test_valid_prefixes_are_decoded_once_and_accepted(path: str, prefix: str) -> None:
    assert prefix_from_url_path(path) == prefix
    async with S3Backend.from_url(f"s3://bucket{path}?{ENDPOINT}", namespace_digest=NAMESPACE) as backend:
        assert f"prefix={prefix!r}" in repr(backend)
        assert backend.object_path("ab" * 16) == (f"{prefix}/" if prefix else "") + "ab/" + "ab" * 16


BAD_FILE_PATHS = [
    "/tmp/x/../etc",
    "/tmp/x/%2e%2e/etc",
    "/tmp/x/%2E%2e",
    "/tmp/./x",
    "/tmp/x%2F..%2Fy",
    "/tmp/x%5C..",
    "/tmp/a\\b",
    "/tmp/x%00y",
    "/tmp/%252e%252e",
]


@pytest.mark.parametrize("path", BAD_FILE_PATHS)
def test_file_roots_that_could_escape_are_refused(path: str) -> None:
    with pytest.raises(ValueError, match=r"^root: "):
        file_root_from_url_path(path)
    url = f"file://{path}"
    with pytest.raises(ValueError, match=r"^url: "):
        FileBackend.from_url(url, namespace_digest=NAMESPACE)
    with pytest.raises(ValueError, match=r"^storage_url: root: "):
        HiCacheConfig(layout=LAYOUT, device_pages=4, host_pages=4, storage_url=url)


def test_file_roots_must_be_absolute() -> None:
    with pytest.raises(ValueError, match=r"^root: expected an absolute path"):
        file_root_from_url_path("relative/path")


async def test_file_roots_collapse_repeated_and_trailing_slashes(tmp_path: Path) -> None:
    """Normalised, not refused: `//` and a trailing `/` cannot leave the directory."""
    assert file_root_from_url_path("/a//b/") == "/a/b"
    root = tmp_path / "my pages"
    url = f"file://{tmp_path}//my%20pages/"
    async with FileBackend.from_url(url, namespace_digest=NAMESPACE) as backend:
        assert backend.root == root
    assert root.is_dir()


def test_file_urls_take_no_query() -> None:
    with pytest.raises(ValueError, match=r"^url: file URLs take no query"):
        FileBackend.from_url("file:///tmp/x?durable=1", namespace_digest=NAMESPACE)


def test_check_url_names_leaves_other_schemes_to_their_backends() -> None:
    check_url_names("memory://shared")
    check_url_names("custom://Any_Thing/../x")
    with pytest.raises(ValueError, match=r"^bucket: "):
        check_url_names("s3://../x")


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("s3://../x?secret_access_key=hidden-value", "bucket"),
        ("s3://b-1/%2e%2e/x", "prefix"),
        ("file:///a/../b", "root"),
    ],
)
def test_the_demo_refuses_a_bad_backend_url_as_a_usage_error(
    url: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--backend", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hicache demo: --backend: {named}: ")
    assert "hidden-value" not in err


@pytest.mark.parametrize("url", ["s3://AKIAEXAMPLE:Sup3rS3cr/etKey@bucket/p", "s3://bucket:Sup3rS3cretKey/p"])
def test_user_info_cut_at_a_slash_is_never_echoed(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A password holding a raw `/` makes `urlsplit` take `user:pass-head` for the bucket: it is refused
    without being shown, by every path that checks a bucket (config, registry, demo CLI)."""
    messages = []
    for check in (
        check_url_names,
        lambda u: open_backend(u, namespace_digest=NAMESPACE),
        lambda u: HiCacheConfig(layout=LAYOUT, device_pages=4, host_pages=4, storage_url=u),
    ):
        with pytest.raises(ValueError, match="bucket") as info:
            check(url)
        messages.append(str(info.value))
    assert main(["demo", "--backend", url]) == 2
    messages.append(capsys.readouterr().err)
    for message in messages:
        assert "Sup3rS3c" not in message
        assert "AKIAEXAMPLE" not in message
