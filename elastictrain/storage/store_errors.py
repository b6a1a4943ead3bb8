"""Telling a store that does not answer from one that refuses, and keeping secrets out of messages.

``is_unavailable`` is the retry policy's question: connection refused or reset, timeouts, an
attempt over its time limit, HTTP 5xx and throttling mean "may come back"; everything else
(a missing bucket, refused credentials, permission denied, a full disk) does not. The S3 client
defaults that bound the time of every attempt live here too.
"""

from __future__ import annotations

import copy
import errno
import os
from collections.abc import Iterator
from typing import Any

from elastictrain.core import errors
from elastictrain.core.config import REDACTED, redact_secrets

S3_CONNECT_TIMEOUT_S = 5.0
S3_READ_TIMEOUT_S = 20.0

# Error codes of an S3 response that mean "the store is overloaded or briefly broken".
_UNAVAILABLE_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequestsException",
    "RequestTimeout",
    "ServiceUnavailable",
    "InternalError",
    "503",
    "500",
    "502",
    "504",
}
CREDENTIAL_CODES = {
    "SignatureDoesNotMatch",
    "InvalidAccessKeyId",
    "InvalidToken",
    "ExpiredToken",
    "InvalidSecurity",
    "InvalidClientTokenId",
    "UnrecognizedClientException",
    "AuthorizationHeaderMalformed",
}
_UNAVAILABLE_ERRNOS = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.EPIPE,
}
_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# Exception types by module: the network stack's own errors that mean "no answer".
_UNAVAILABLE_TYPES = {
    ("botocore.exceptions", "EndpointConnectionError"),
    ("botocore.exceptions", "ConnectTimeoutError"),
    ("botocore.exceptions", "ReadTimeoutError"),
    ("botocore.exceptions", "ConnectionClosedError"),
    ("botocore.exceptions", "HTTPClientError"),
    ("botocore.exceptions", "ResponseStreamingError"),
    ("fsspec.exceptions", "FSTimeoutError"),
}
_NETWORK_MODULES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "urllib3", "fsspec", "gcsfs", "adlfs", "requests")


def one_line(exc: BaseException) -> str:
    """A store's exception in one line, led by its class name (fsspec's timeout has no message of its own)."""
    if type(exc).__name__ == "FSTimeoutError" and not str(exc).strip():
        return "FSTimeoutError: an attempt got no answer within its time limit"
    return errors.one_line(exc, kind=True)


def causes(exc: BaseException) -> Iterator[BaseException]:
    """exc and what led to it: explicit causes (s3fs raises an OSError whose __cause__ is botocore's
    ClientError) and the exception being handled when it was raised (torch.save hitting ENOSPC
    raises a RuntimeError "unexpected pos" while closing its zip writer, in the OSError's context)."""
    seen = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or link.__context__


def s3_error(exc: BaseException) -> tuple[str, int]:
    """(error code, HTTP status) of the S3 response behind exc, or ("", 0) if there was none."""
    for item in causes(exc):
        response = getattr(item, "response", None)
        if isinstance(response, dict) and "Error" in response:
            code = str(response["Error"].get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or (int(code) if code.isdigit() else 0)
            return code, int(status)
    return "", 0


def is_type(exc: BaseException, pairs: set[tuple[str, str]]) -> bool:
    return any((klass.__module__, klass.__name__) in pairs for klass in type(exc).__mro__)


def is_unavailable(exc: BaseException) -> bool:
    """True if exc means the store did not answer (worth retrying), False for any definite answer."""
    code, status = s3_error(exc)
    if code or status:
        return code in _UNAVAILABLE_CODES or status >= 500 or status == 429
    for item in causes(exc):
        if is_type(item, _UNAVAILABLE_TYPES) or isinstance(item, (TimeoutError, ConnectionError)):
            return True
        if type(item).__module__.startswith("aiohttp") and type(item).__name__ in (
            "ClientConnectionError",
            "ClientConnectorError",
            "ServerDisconnectedError",
            "ClientOSError",
            "ServerTimeoutError",
            "ClientPayloadError",
            "ConnectionTimeoutError",
            "SocketTimeoutError",
        ):
            return True
        if isinstance(item, OSError) and item.errno in _UNAVAILABLE_ERRNOS:
            return True
    return False


def is_storage_failure(exc: BaseException) -> bool:
    """An error the store or the network stack raised (as opposed to a bug in our own code)."""
    if isinstance(exc, OSError):
        return True
    return any(type(item).__module__.split(".")[0] in _NETWORK_MODULES for item in causes(exc))


def is_disk_full(exc: BaseException) -> bool:
    return any(isinstance(item, OSError) and item.errno in _DISK_FULL_ERRNOS for item in causes(exc))


def secret_values(options: Any) -> list[str]:
    """Every string in options that redact_secrets hides (to scrub it from error text)."""
    found: list[str] = []

    def walk(original: Any, redacted: Any) -> None:
        if isinstance(original, dict):
            for name, value in original.items():
                walk(value, redacted.get(name))
        elif isinstance(original, list):
            for value, hidden in zip(original, redacted):
                walk(value, hidden)
        elif redacted == REDACTED and original not in (None, "", REDACTED):
            found.append(str(original))

    walk(options, redact_secrets(options))
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        if os.environ.get(name):
            found.append(os.environ[name])
    return sorted(set(found), key=len, reverse=True)


def s3_options_with_bounded_time(storage_options: dict | None, retry_for_s: float) -> dict:
    """storage_options for s3:// with bounded timeouts and no client-level retries, unless the user set them."""
    options = copy.deepcopy(storage_options or {})
    config_kwargs = dict(options.get("config_kwargs") or {})
    config_kwargs.setdefault("connect_timeout", min(S3_CONNECT_TIMEOUT_S, retry_for_s))
    config_kwargs.setdefault("read_timeout", min(S3_READ_TIMEOUT_S, retry_for_s))
    config_kwargs.setdefault("retries", {"total_max_attempts": 1})  # tenacity is the one retry layer
    options["config_kwargs"] = config_kwargs
    options.setdefault("skip_instance_cache", True)  # the s3fs retry setting below is ours alone
    return options
