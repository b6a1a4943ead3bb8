"""One fsspec URL behind one-line errors, bounded time and retries: what every store call goes through.

Errors. Every public method of the store raises only ``StorageError`` (one line: what failed,
where, what to do; secrets from ``storage_options`` never appear) or, for a store that does not
answer, ``StorageUnavailable``; our own bugs (TypeError, ValueError on bad arguments) keep their
traceback. "Does not answer" is: connection refused or reset, connect/read timeouts, an attempt
exceeding its time limit, HTTP 5xx, SlowDown/throttling. Such a call is retried with tenacity
(exponential backoff with jitter, 0.2 s doubling up to 4 s, never sleeping past the deadline)
until ``retry_for_s`` seconds have passed since the public call began (one budget per
operation, shared by all its store calls); then it raises ``StorageUnavailable``. Anything else
(missing bucket, refused credentials, permission denied, disk full) is not retried.

Bounded time on s3://. Unless ``storage_options`` sets them, the S3 client gets
``config_kwargs={"connect_timeout": min(5, retry_for_s), "read_timeout": min(20, retry_for_s),
"retries": {"total_max_attempts": 1}}`` and s3fs's own retry loop is set to one attempt, so
tenacity is the only retry layer. Every attempt also has a hard limit of connect_timeout +
read_timeout seconds, plus one second per MiB it uploads (an upload slower than 1 MiB/s counts
as a store that does not answer): aiohttp waits without any timeout for the "100 Continue" of a
PUT to a server that accepted the connection but stopped answering. So an unreachable or hung
endpoint fails any operation within about retry_for_s + one attempt's limit (45 s with the
defaults; connection refused fails within retry_for_s). Payload objects are staged in a
temporary file under TMPDIR and then uploaded (``commit.py``), so a retry never re-runs a writer.

Credentials come from ``storage_options`` (``key``/``secret``/``token``, endpoint as
``endpoint_url`` or ``client_kwargs.endpoint_url``) or, as botocore reads them, from the
``AWS_*`` environment variables and config files.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import fsspec
import fsspec.asyn
import tenacity
from fsspec.implementations.local import LocalFileSystem

from elastictrain.core.config import REDACTED
from elastictrain.core.errors import ElastictrainError, StorageError, StorageUnavailable
from elastictrain.storage.store_errors import (
    CREDENTIAL_CODES,
    causes,
    is_storage_failure,
    is_unavailable,
    one_line,
    s3_error,
    s3_options_with_bounded_time,
    secret_values,
)

log = logging.getLogger("elastictrain.storage.snapshot_store")

CHECK_STORE = "check the path/credentials or set {key}"

_MIN_UPLOAD_BYTES_PER_S = 1 << 20  # slower than this, an upload attempt counts as not answering
_BACKOFF_INITIAL_S, _BACKOFF_MAX_S = 0.2, 4.0


class StoreClient:
    """Calls on one fsspec URL: each public operation one retry budget, its failures one line naming the store."""

    def __init__(
        self,
        url: str,
        storage_options: dict | None = None,
        *,
        retry_for_s: float = 20.0,
        url_key: str = "snapshot.durable.url",
    ):
        self.url = url
        self.url_key = url_key  # the config key that set the URL: messages tell the user to change that one
        self.retry_for_s = float(retry_for_s)
        self._secrets = secret_values(storage_options or {})
        self.is_s3 = url.split("://", 1)[0].lower() in ("s3", "s3a") if "://" in url else False
        options = (
            s3_options_with_bounded_time(storage_options, self.retry_for_s)
            if self.is_s3
            else dict(storage_options or {})
        )
        self.options = options  # what opened the filesystem, for readers of our own (sharded.py's DCP reader)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **options)
        except ImportError as exc:
            # fsspec names the missing package ("Install s3fs to access S3").
            raise StorageError(
                f"{url_key}={url!r} needs a filesystem package that is not installed ({self.scrub(one_line(exc))}); "
                "for s3:// run pip install 'elastictrain[s3]'"
            ) from None
        except (ValueError, TypeError) as exc:
            raise StorageError(
                f"{url_key}={url!r} cannot be opened ({self.scrub(one_line(exc))}); {CHECK_STORE.format(key=url_key)}"
            ) from None
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.is_async = isinstance(self.fs, fsspec.asyn.AsyncFileSystem)
        self.attempt_limit_s: float | None = None
        if self.is_s3:
            self.fs.retries = 1  # s3fs's own retry loop: one attempt; tenacity retries instead
            config = options["config_kwargs"]
            self.attempt_limit_s = float(config["connect_timeout"]) + float(config["read_timeout"])
            self.bucket, _, self.key_prefix = self.root.strip("/").partition("/")
        self._endpoint = self.scrub(
            str(
                options.get("endpoint_url")
                or (options.get("client_kwargs") or {}).get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL")
                or "the default AWS endpoint"
            )
        )
        self._operation_state = threading.local()  # the deadline of the public call running in this thread

    # -- paths and messages ---------------------------------------------------------------------

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def where(self, *parts: str) -> str:
        return "/".join([self.url.rstrip("/"), *parts])

    def scrub(self, text: str) -> str:
        for secret in getattr(self, "_secrets", ()):
            text = text.replace(secret, REDACTED)
        return text

    # -- calling the store: one budget per public call, retries, one-line errors ------------------

    @contextmanager
    def operation(self, failure: str, advice: str = CHECK_STORE) -> Iterator[None]:
        """The boundary of a public method: a retry budget of retry_for_s, and one-line errors out.

        ``failure`` says what went wrong in the user's words ("snapshot store X is not writable").
        Errors of the store or the network become StorageError/StorageUnavailable; anything else
        (a bug in our code or the caller's) passes unchanged. A nested public call shares the
        outer call's budget and boundary.
        """
        state = self._operation_state
        if getattr(state, "deadline", None) is not None:
            yield
            return
        state.started = time.monotonic()
        state.deadline = state.started + self.retry_for_s
        try:
            yield
        except ElastictrainError:
            raise
        except Exception as exc:
            if not is_storage_failure(exc):
                raise
            raise self._translate(
                exc, failure, advice.format(key=self.url_key), time.monotonic() - state.started
            ) from None
        finally:
            state.deadline = None

    def _translate(self, exc: BaseException, failure: str, advice: str, elapsed_s: float) -> StorageError:
        code, status = s3_error(exc)
        detail = one_line(exc)
        if is_unavailable(exc):
            message = (
                f"{failure}: the store did not answer for {elapsed_s:.1f} s (retried with backoff for up to "
                f"snapshot.durable.retry_for_s={self.retry_for_s:g} s; last error {detail}); check that {self._endpoint_words()} "
                "is up and reachable; it may come back"
            )
            return StorageUnavailable(self.scrub(message))
        if code == "NoSuchBucket":
            return StorageError(self.scrub(self._missing_bucket_message()))
        if code in CREDENTIAL_CODES:
            message = (
                f"{failure}: {self._endpoint_words()} refused the credentials ({code}); check key/secret in "
                "snapshot.durable.storage_options or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
            )
            return StorageError(self.scrub(message))
        if code in ("AccessDenied", "403") or (self.is_s3 and status == 403):
            message = (
                f"{failure}: {self._endpoint_words()} refused access ({code or status}): the credentials are wrong or "
                "lack permission on this bucket; check key/secret in snapshot.durable.storage_options or "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY and the bucket policy"
            )
            return StorageError(self.scrub(message))
        if any(type(item).__name__ in ("NoCredentialsError", "PartialCredentialsError") for item in causes(exc)):
            message = (
                f"{failure}: no S3 credentials found; set key/secret in snapshot.durable.storage_options or "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
            )
            return StorageError(self.scrub(message))
        return StorageError(self.scrub(f"{failure} ({detail}); {advice}"))

    def _endpoint_words(self) -> str:
        return f"the endpoint {self._endpoint}" if self.is_s3 else f"the filesystem of {self.url}"

    def _missing_bucket_message(self) -> str:
        return (
            f"bucket '{self.bucket}' does not exist at endpoint {self._endpoint}; create it or fix snapshot.durable.url "
            f"(now {self.url})"
        )

    def attempt(self, method: str | Callable[..., Any], *args: Any, limit_s: float | None, **kwargs: Any) -> Any:
        """One call of an fsspec method (or of a function reading a local path); on an async filesystem, cancelled
        after limit_s seconds."""
        if callable(method):
            return method(*args, **kwargs)
        if self.is_async:
            coroutine_function = getattr(self.fs, "_" + method)
            return fsspec.asyn.sync(self.fs.loop, coroutine_function, *args, timeout=limit_s, **kwargs)
        return getattr(self.fs, method)(*args, **kwargs)

    def call(self, method: str | Callable[..., Any], *args: Any, upload_bytes: int = 0, **kwargs: Any) -> Any:
        """A store call, retried with backoff while the store does not answer, until this operation's deadline."""
        deadline = getattr(self._operation_state, "deadline", None) or time.monotonic() + self.retry_for_s
        limit_s = None
        if self.attempt_limit_s is not None:
            limit_s = self.attempt_limit_s + upload_bytes / _MIN_UPLOAD_BYTES_PER_S
        backoff = tenacity.wait_exponential(multiplier=_BACKOFF_INITIAL_S, max=_BACKOFF_MAX_S) + tenacity.wait_random(
            0, _BACKOFF_INITIAL_S
        )
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_unavailable),
            stop=lambda retry_state: time.monotonic() >= deadline,
            wait=lambda retry_state: max(0.0, min(backoff(retry_state), deadline - time.monotonic())),
            before_sleep=lambda retry_state: log.debug(
                "%s on %s did not answer (attempt %d: %s); retrying",
                getattr(method, "__name__", method),
                self.url,
                retry_state.attempt_number,
                self.scrub(_failed_attempt(retry_state)),
            ),
            reraise=True,
        )
        try:
            return retrying(self.attempt, method, *args, limit_s=limit_s, **kwargs)
        except BaseException as exc:
            # The error's traceback holds tenacity's frame, which holds the attempt's outcome, which holds the error: a
            # cycle that kept every caller's frame and its locals alive until a full collection. The frames' locals go;
            # the traceback still prints every line.
            traceback.clear_frames(exc.__traceback__)
            raise

    def check_bucket(self) -> None:
        """S3 only: StorageError naming the bucket if it does not exist (s3fs would create it, SeaweedFS accepts PUTs)."""
        try:
            self.call("call_s3", "list_objects_v2", Bucket=self.bucket, Prefix=self.key_prefix, MaxKeys=1)
        except FileNotFoundError as exc:
            if s3_error(exc)[0] in ("NoSuchBucket", "404", ""):
                raise StorageError(self.scrub(self._missing_bucket_message())) from None
            raise

    def check_writable(self) -> None:
        """Write, read back and delete a probe object; StorageError if the store refuses, within bounded time."""
        probe = self.path(f".probe-{uuid.uuid4().hex}")
        payload = f"elastictrain probe {time.time()}".encode()
        with self.operation(f"snapshot store {self.url} is not writable"):
            if self.is_s3:
                self.check_bucket()  # never makedirs: on s3fs that creates a misspelt bucket
            else:
                self.call("makedirs", self.root, exist_ok=True)
            self.call("pipe_file", probe, payload)
            if self.call("cat_file", probe) != payload:
                raise StorageError(
                    f"snapshot store {self.url} is not writable: the probe object read back different bytes"
                )
            self.call("rm", probe)

    def delete_marker(self, snapshot_id: str, limit_s: float | None = None) -> None:
        """S3 only: delete the emptied prefix's "directory" marker that some stores (SeaweedFS) keep listing."""
        key = "/".join(filter(None, [self.key_prefix.strip("/"), snapshot_id])) + "/"
        try:
            if limit_s is None:
                self.call("call_s3", "delete_object", Bucket=self.bucket, Key=key)
            else:
                self.attempt("call_s3", "delete_object", Bucket=self.bucket, Key=key, limit_s=limit_s)
        except FileNotFoundError:
            pass


def _failed_attempt(retry_state: tenacity.RetryCallState) -> str:
    """The error of the attempt before a retry's sleep, in one line."""
    outcome = retry_state.outcome
    error = outcome.exception() if outcome is not None else None
    return one_line(error) if error is not None else "no error recorded"
