"""Stand-ins for what Gym's server code reads of an aiohttp reply, for in-process fakes of Gym peers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from multidict import CIMultiDict

__all__ = ["FakeReply"]


class FakeReply:
    """A 200 reply: ``status``/``ok``, ``headers`` (case-insensitive), ``cookies`` and ``read()``."""

    status = 200
    ok = True

    def __init__(
        self,
        body: Mapping[str, Any],
        headers: Mapping[str, str] | None = None,
        cookies: Mapping[str, str] | None = None,
    ) -> None:
        self._body = orjson.dumps(dict(body))
        self.headers = CIMultiDict({"content-type": "application/json", **(headers or {})})
        self.cookies = dict(cookies or {})

    async def read(self) -> bytes:
        return self._body
