"""A real S3-compatible server on 127.0.0.1 for tests and the demo: moto's server mode, in its own process.

``LocalS3Server`` starts ``python -m moto.server`` (installed by the project's ``test`` extras)
on a free port of ``host`` (127.0.0.1 unless a test runs it on a namespace's address), waits
until it answers, and creates a bucket. ``env`` is what a process needs to reach it through the
standard AWS configuration (no Gym YAML, no URL credentials): ``AWS_ENDPOINT_URL``, a key id
and a secret drawn at random for this server (so a test can check it never appears in any
output), and a region. It speaks the S3 REST protocol, conditional writes included
(``If-None-Match: *``), over real HTTP. Stopped by ``stop()`` (or the ``with`` block): its
process group is killed and waited for.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["LocalS3Server", "S3ServerError"]

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class S3ServerError(RuntimeError):
    """The local S3 server could not be started (moto missing, or it did not answer in time)."""


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class LocalS3Server:
    """moto's S3 server on ``host``:<free port>, with ``bucket`` created; ``env`` reaches it."""

    def __init__(
        self,
        *,
        bucket: str = "ng-checkpoint",
        host: str = "127.0.0.1",
        port: int | None = None,
        log: Path | None = None,
        popen: Any = None,
        timeout: float = 60.0,
    ) -> None:
        self.bucket = bucket
        self.host = host
        self.port = port or _free_port(host)
        self.endpoint = f"http://{host}:{self.port}"
        self.key_id = f"ngtest{secrets.token_hex(4)}"
        self.secret = secrets.token_urlsafe(30)
        self._log = log
        self._popen = popen or subprocess.Popen
        self._timeout = timeout
        self.process: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS variables pointing at this server (endpoint, credentials, region)."""
        no_proxy = ",".join(p for p in (os.environ.get("NO_PROXY"), self.host, "localhost") if p)
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": "us-east-1",
            # Requests to the local server never go through a proxy from the environment.
            "NO_PROXY": no_proxy,
            "no_proxy": no_proxy,
        }

    def url(self, *parts: str) -> str:
        """``s3://<bucket>/<parts...>``."""
        return "/".join([f"s3://{self.bucket}", *(p.strip("/") for p in parts if p)])

    def start(self) -> LocalS3Server:
        try:
            import moto  # noqa: F401 - only to say what is missing before a child fails obscurely
        except ImportError:
            raise S3ServerError("moto is not installed: pip install 'nemo-gym-checkpoint[test]'") from None
        out = open(self._log, "ab") if self._log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.process = self._popen(
                [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **self.env},
            )
        finally:
            if not isinstance(out, int):  # a file, not subprocess.DEVNULL
                out.close()
        try:
            self._wait_ready()
            self._request("PUT", f"/{self.bucket}")
        except BaseException:
            self.stop()
            raise
        return self

    def _request(self, method: str, path: str) -> int:
        request = urllib.request.Request(self.endpoint + path, method=method)
        try:
            with _DIRECT.open(request, timeout=10) as reply:
                return reply.status
        except urllib.error.HTTPError as error:
            return error.code

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._timeout
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise S3ServerError(f"the S3 server exited with status {self.process.returncode}")
            try:
                self._request("GET", "/")
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise S3ServerError(
                        f"the S3 server did not answer on {self.endpoint} in {self._timeout}s"
                    ) from None
            time.sleep(0.05)  # wait-ok: poll interval of a bounded wait on the server answering

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=30)

    def __enter__(self) -> LocalS3Server:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def apply(self, environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
        """Put ``env`` into ``os.environ`` (or ``environ``); returns what it replaced, for ``restore``."""
        target = os.environ if environ is None else environ
        saved = {key: target.get(key) for key in self.env}
        target.update(self.env)  # type: ignore[attr-defined]
        return saved

    @staticmethod
    def restore(saved: Mapping[str, str | None]) -> None:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
