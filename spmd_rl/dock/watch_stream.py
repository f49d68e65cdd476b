"""One etcd watch over the v3 JSON gateway whose event iterator *ends* when the watch does.

etcd3gw's ``watch`` hands its events through a queue filled by a pool thread; when the HTTP
stream ends (etcd restarted or gone, the connection reset) that thread returns and the
iterator blocks on the queue for ever. A caller that decides "the watch broke, read etcd
again" from the end of the iteration then never re-reads: after an etcd restart every dock
wait hung until its timeout (``tests/integration/test_etcd_restart.py``). Here the iterator
reads the stream itself, so it ends (or raises) exactly when the stream does:

- the connection closes or fails: the iteration ends (a ``requests``/``urllib3`` error
  propagates to the caller's loop, which treats both alike);
- etcd cancels the watch (``canceled``, e.g. its start revision was compacted): it ends;
- ``cancel()`` from any thread shuts the socket down, which wakes a blocked read; the
  iteration then ends without an error.

The gateway writes one JSON object per line; ``iter_lines(chunk_size=None)`` yields each line
as its HTTP chunk arrives and joins a line split across chunks.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import requests
from etcd3gw.utils import _decode


class WatchStream:
    """Iterate for etcd3gw-shaped event dicts (``kv`` with decoded ``key``/``value``, and
    ``type`` absent for a put); the iteration ends when the stream ends."""

    def __init__(self, response: requests.Response):
        self._response = response
        self._cancelled = False

    def __iter__(self) -> Iterator[dict]:
        try:
            for line in self._response.iter_lines(chunk_size=None):
                if not line.strip():
                    continue
                result = json.loads(line).get("result", {})
                if result.get("canceled"):
                    return
                for event in result.get("events", ()):
                    kv = event["kv"]
                    kv["key"] = _decode(kv["key"])
                    if "value" in kv:
                        kv["value"] = _decode(kv["value"])
                    yield event
        except (requests.RequestException, OSError):
            if not self._cancelled:
                raise
        finally:
            self._response.close()

    def cancel(self) -> None:
        """End the iteration from any thread: a read blocked in the socket returns at once and
        the iteration ends quietly."""
        self._cancelled = True
        try:
            fp = self._response.raw._fp  # http.client.HTTPResponse
            sock = socket.socket(fileno=fp.fileno()) if fp is not None and fp.fp is not None else None
        except (AttributeError, OSError, ValueError):
            sock = None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                sock.detach()  # the fd stays the response's own; only the shutdown was ours
        self._response.close()
