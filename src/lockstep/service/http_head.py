"""A bound on the size of a request's head (request line and headers) for `lockstep serve`.

uvicorn parses HTTP with httptools when it is installed (uvicorn[standard], ~3 ms less per SDK
call than h11, BENCHMARKS.md section 8), and httptools keeps no limit: a 64 MiB header was read
into memory whole and the request served. h11 has one (`h11_max_incomplete_event_size`), and
neither uvicorn nor httptools offers one for httptools, hence this protocol: httptools', counting
the bytes it is fed while a request's head is incomplete, with a 431 past the cap (the same
setting as h11's, so either parser is bounded by one number).
"""

from __future__ import annotations

import json

MAX_HEAD_BYTES = 64 * 1024
"""A request's line and headers together (an SDK call sends well under 2 KiB)."""


def protocol():
    """The `http` argument for uvicorn: httptools' protocol with the bound, or "h11" (bounded by
    `h11_max_incomplete_event_size`) where httptools is missing."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "h11"

    class BoundedHead(HttpToolsProtocol):
        """Two counts against the cap. While a head arrives: the bytes of every read that lies wholly
        inside it (httptools buffers them until the head ends), so a huge head is refused before it
        is held. When it ends: its URL and headers as parsed, exactly. Once refused, the connection
        only closes: no callback reaches uvicorn's request handling."""

        def __init__(self, config, *args, **kw):
            super().__init__(config, *args, **kw)
            self.max_head = config.h11_max_incomplete_event_size or MAX_HEAD_BYTES
            self.head_open, self.ends, self.streamed, self.head_size, self.refused = True, 0, 0, 0, False

        def data_received(self, data: bytes) -> None:
            if self.refused:
                return
            ends = self.ends
            super().data_received(data)
            if not self.refused and self.head_open and self.ends == ends:  # (a read with no boundary in it)
                self.streamed += len(data)
                if self.streamed > self.max_head:
                    self.refuse()

        def on_message_begin(self) -> None:
            self.head_size = 0
            if not self.refused:
                super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self.head_size += len(url)
            if not self.refused:
                super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self.head_size += len(name) + len(value) + 4
            if not self.refused:
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self.head_open, self.ends = False, self.ends + 1
            if self.head_size > self.max_head and not self.refused:
                self.refuse()
            if not self.refused:
                super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self.refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            self.head_open, self.ends, self.streamed = True, self.ends + 1, 0
            if not self.refused:
                super().on_message_complete()

        def refuse(self) -> None:
            self.refused = True
            body = json.dumps({"error": f"the request's line and headers exceed {self.max_head} bytes, this server's "
                                        "cap", "category": "user"}).encode()
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return BoundedHead
