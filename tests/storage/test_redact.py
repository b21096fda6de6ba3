"""The one redaction helper: what it hides (by option name, user info, known values) and what it keeps."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import pkgutil

import pytest

import hicache
import storage_backends
from storage_backends.redact import (
    LOGGERS,
    REDACTED,
    RedactingFilter,
    environment_secrets,
    is_secret_name,
    redact_options,
    redact_text,
    redact_url,
    remember_secrets,
    secret_values,
)
from storage_backends.registry import open_backend

SECRET = "fake-Secret-9f3a71c2"


@pytest.mark.parametrize(
    "name",
    [
        "secret_access_key",
        "AWS_SECRET_ACCESS_KEY",
        "access_key_id",
        "session_token",
        "password",
        "db-passwd",
        "X-Amz-Signature",
        "X-Amz-Credential",
        "X-Amz-Security-Token",
        "Authorization",
        "api_key",
        "cookie",
        "private_key",
        "sig",
        "pwd",
    ],
)
def test_secret_names_are_recognised(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "bucket",
        "endpoint",
        "region",
        "max_concurrency",
        "deadline_s",
        "allow_http",
        "prefix",
        "num_tokens",
        "keys",
    ],
)
def test_locating_names_stay_visible(name: str) -> None:
    assert not is_secret_name(name)


def test_redact_url_hides_user_info_and_secret_query_values_and_keeps_the_rest() -> None:
    url = (
        f"s3://bucket/some/prefix?endpoint=http://127.0.0.1:9000&region=eu-west-1"
        f"&access_key_id=AKIA{SECRET}&secret_access_key={SECRET}&max_concurrency=3"
    )
    shown = redact_url(url)
    assert SECRET not in shown
    assert shown == (
        "s3://bucket/some/prefix?endpoint=http://127.0.0.1:9000&region=eu-west-1"
        f"&access_key_id={REDACTED}&secret_access_key={REDACTED}&max_concurrency=3"
    )
    assert redact_url(f"s3://user:{SECRET}@bucket/p") == f"s3://{REDACTED}@bucket/p"
    assert (
        redact_url(f"s3://b/p?endpoint=http://u:{SECRET}@host:9")
        == f"s3://b/p?endpoint=http://{REDACTED}@host:9"
    )
    assert redact_url("file:///var/cache/kv") == "file:///var/cache/kv"


def test_redact_url_of_an_unparseable_url_drops_query_and_user_info() -> None:
    shown = redact_url(f"s3://u:{SECRET}@[bad/p?secret_access_key={SECRET}")
    assert SECRET not in shown
    assert shown.startswith("s3://")


def test_redact_options_hides_secret_names_and_urls_inside_values() -> None:
    options = {
        "secret_access_key": SECRET,
        "session_token": SECRET,
        "region": "us-east-1",
        "endpoint": f"http://user:{SECRET}@127.0.0.1:9",
        "nested": {"api_token": SECRET, "bucket": "b"},
        "max_concurrency": 4,
        "access_key_id": None,
    }
    shown = redact_options(options)
    assert SECRET not in repr(shown)
    assert shown["region"] == "us-east-1"
    assert shown["max_concurrency"] == 4
    assert shown["nested"] == {"api_token": REDACTED, "bucket": "b"}
    assert shown["access_key_id"] is None  # nothing to hide
    assert shown["endpoint"] == f"http://{REDACTED}@127.0.0.1:9"


def test_redact_text_scrubs_urls_assignments_mapping_reprs_and_known_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_SESSION_TOKEN", f"env-{SECRET}")
    text = (
        f"failed for s3://b/p?secret_access_key={SECRET}-a: config {{'password': '{SECRET}-b'}} "
        f"token={SECRET}-c raw env-{SECRET} and literal {SECRET}-d; key: not a secret"
    )
    cleaned = redact_text(text, [f"{SECRET}-d"])
    assert SECRET not in cleaned
    assert "key: not a secret" in cleaned
    assert "s3://b/p?" in cleaned


def test_environment_secrets_are_the_values_of_secret_named_variables() -> None:
    env = {
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_REGION": "eu-west-1",
        "AWS_SESSION_TOKEN": "abc",
        "HOME": "/x",
    }
    assert environment_secrets(env) == [SECRET]  # a 3-character value would mangle text: left out


def test_secret_values_come_from_user_info_query_and_options() -> None:
    found = secret_values(
        f"s3://user:{SECRET}-u@b/p?secret_access_key={SECRET}-q&region=r", {"token": f"{SECRET}-o"}
    )
    assert {f"{SECRET}-u", f"{SECRET}-q", f"{SECRET}-o"} <= set(found)
    assert "r" not in found


def test_remembered_secrets_are_scrubbed_from_any_text() -> None:
    remember_secrets([f"{SECRET}-remembered"])
    assert redact_text(f"echo {SECRET}-remembered!") == f"echo {REDACTED}!"


OF_AN_EXTRA = {"hicache.integrations.vllm": "vllm"}
"""Modules that need an optional extra (the vLLM connector runs in `.venv-vllm`): imported where the extra
is installed, and their loggers (named for the module) must be in `LOGGERS` wherever the test runs."""


def test_every_hicache_and_backend_logger_carries_the_redacting_filter() -> None:
    """A logger added later without the filter would log unredacted text: this test names it."""
    for package in (hicache, storage_backends):
        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            extra = OF_AN_EXTRA.get(module.name)
            if extra is None or importlib.util.find_spec(extra) is not None:
                importlib.import_module(module.name)
    names = [
        name
        for name, logger in logging.Logger.manager.loggerDict.items()
        if isinstance(logger, logging.Logger) and name.split(".")[0] in {"hicache", "storage_backends"}
    ]
    assert names
    for name in [*names, *OF_AN_EXTRA]:
        assert name in LOGGERS, name
        assert any(isinstance(f, RedactingFilter) for f in logging.getLogger(name).filters), name


def test_the_filter_redacts_message_arguments_and_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="storage_backends.s3")
    log = logging.getLogger("storage_backends.s3")
    try:
        raise ValueError(f"client said secret_access_key={SECRET}")
    except ValueError:
        log.exception("opening %s failed", f"s3://b/p?session_token={SECRET}")
    assert caplog.records
    assert SECRET not in caplog.text
    assert "s3://b/p?session_token=***" in caplog.text


@pytest.mark.parametrize("slash", ["/", "%2F"], ids=["slash", "percent-2F"])
def test_an_endpoint_password_with_a_slash_does_not_echo_the_access_key_id(slash: str) -> None:
    """Issue 22: `endpoint=http://KEYID:pa/ss@host` parses with the key id as the host (`/` ends the
    netloc; `%2F` is decoded by the query parser first), and the error named that host lowercased. The
    endpoint's user info is a secret of the URL, scrubbed in any case."""
    key_id = "AKIAMISUSEKEYID22"
    url = f"s3://bucket/p?endpoint=http://{key_id}:pa{slash}ss@storage.example:9000"
    assert key_id in secret_values(url)
    with pytest.raises(ValueError, match=r"^endpoint: ") as caught:
        open_backend(url, namespace_digest=bytes(16))
    assert key_id.lower() not in str(caught.value).lower()
    assert redact_text(f"got host {key_id.lower()!r}", secret_values(url)) == f"got host '{REDACTED}'"
