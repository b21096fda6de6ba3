"""The S3 backend's settings: an `s3://` URL's query, the numeric limits, the endpoint and credentials.

Everything here runs once, when a backend is opened, and refuses a bad value naming it; no message ever
echoes a credential value.
"""

from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import parse_qsl, urlsplit

from storage_backends.names import prefix_from_url_path, validate_bucket
from storage_backends.redact import remember_secrets

__all__ = ["StoreSettings", "check_limits", "parse_url", "store_settings"]

_INT_OPTIONS: Final = frozenset({"max_concurrency", "max_retries"})
_FLOAT_OPTIONS: Final = frozenset(
    {
        "deadline_s",
        "read_deadline_s",
        "write_deadline_s",
        "attempt_timeout_s",
        "connect_timeout_s",
        "backoff_initial_s",
        "backoff_max_s",
    }
)
_BOOL_OPTIONS: Final = frozenset({"allow_http"})
_STR_OPTIONS: Final = frozenset({"endpoint", "region", "access_key_id", "secret_access_key", "session_token"})


def parse_url(url: str) -> tuple[str, str, dict[str, Any]]:
    """The bucket, prefix and query options of `s3://bucket/prefix?endpoint=...&region=...`.

    Raises:
        TypeError: naming `url`, for a non-str.
        ValueError: for another scheme, a bucket the S3 naming rules refuse (naming `bucket`), a bad prefix
            (naming `prefix`), an unknown or repeated query parameter, or a value that does not parse.
    """
    if not isinstance(url, str):
        raise TypeError(f"url: expected str, got {type(url).__name__}")
    parts = urlsplit(url)
    if parts.scheme != "s3":
        raise ValueError(f"url: expected the s3:// scheme, got {parts.scheme!r}")
    if not parts.netloc or "@" in parts.netloc:
        raise ValueError("url: expected s3://bucket/prefix with a bucket name and no user info")
    bucket = validate_bucket(parts.netloc)
    prefix = prefix_from_url_path(parts.path)
    options: dict[str, Any] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)):
        if name in options:
            raise ValueError(f"url: query parameter {name!r} given twice")
        if name in _INT_OPTIONS:
            try:
                options[name] = int(value)
            except ValueError:
                raise ValueError(f"{name}: expected an integer, got {value!r}") from None
        elif name in _FLOAT_OPTIONS:
            try:
                options[name] = float(value)
            except ValueError:
                raise ValueError(f"{name}: expected a number, got {value!r}") from None
        elif name in _BOOL_OPTIONS:
            options[name] = _parse_bool(name, value)
        elif name in _STR_OPTIONS:
            options[name] = value
        else:
            raise ValueError(f"url: unknown query parameter {name!r}")
    return bucket, prefix, options


def check_limits(max_concurrency: int, max_retries: int, seconds: dict[str, float]) -> None:
    """Check the backend's counts and durations.

    Raises:
        ValueError: naming the argument, for a count out of range or a duration that is not a positive
            finite number of seconds.
    """
    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise ValueError(f"max_concurrency: expected an int >= 1, got {max_concurrency!r}")
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"max_retries: expected an int >= 0, got {max_retries!r}")
    for name, value in seconds.items():
        if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """What `store_settings` resolved: obstore's config, and what the backend shows or redacts."""

    config: dict[str, Any]
    endpoint: str | None
    region: str
    allow_http: bool
    secrets: tuple[str, ...]
    explicit_credentials: bool


def store_settings(
    *,
    endpoint: str | None,
    region: str | None,
    access_key_id: str | None,
    secret_access_key: str | None,
    session_token: str | None,
    allow_http: bool | None,
) -> StoreSettings:
    """Fill the endpoint, region and credentials from the standard AWS environment variables where not
    given, register the credentials for redaction (`storage_backends.redact`), and check the endpoint.

    Raises:
        ValueError: naming `endpoint`, for a URL that is not http(s)://host[:port], that carries
            credentials, or that is plain http to a non-loopback host without `allow_http=True`.
    """
    env = os.environ
    endpoint = endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None
    region = region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
    access_key_id = access_key_id or env.get("AWS_ACCESS_KEY_ID") or None
    secret_access_key = secret_access_key or env.get("AWS_SECRET_ACCESS_KEY") or None
    session_token = session_token or env.get("AWS_SESSION_TOKEN") or None
    secrets = tuple(s for s in (access_key_id, secret_access_key, session_token) if s)
    remember_secrets(secrets)

    # Single-object DELETEs: the JuiceFS (MinIO) gateway answers DeleteObjects in a shape
    # object_store rejects.
    config: dict[str, Any] = {"region": region, "disable_bulk_delete": True}
    if endpoint is not None:
        parts = urlsplit(endpoint)
        if parts.scheme not in {"http", "https"} or not parts.hostname:
            raise ValueError("endpoint: expected an http(s)://host[:port] URL")
        if parts.username is not None or parts.password is not None:
            raise ValueError(
                "endpoint: credentials in the endpoint URL are not supported; pass access_key_id"
            )
        if allow_http is None:
            allow_http = _is_loopback(parts.hostname)
        if parts.scheme == "http" and not allow_http:
            raise ValueError(
                f"endpoint: plain http is allowed only for loopback hosts unless allow_http=True, "
                f"got host {parts.hostname!r}"
            )
        config["endpoint"] = endpoint.rstrip("/")
    if access_key_id is not None:
        config["access_key_id"] = access_key_id
    if secret_access_key is not None:
        config["secret_access_key"] = secret_access_key
    if session_token is not None:
        config["session_token"] = session_token
    return StoreSettings(
        config=config,
        endpoint=config.get("endpoint"),
        region=region,
        allow_http=bool(allow_http),
        secrets=secrets,
        explicit_credentials=access_key_id is not None,
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _parse_bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"{name}: expected a boolean, got {value!r}")
