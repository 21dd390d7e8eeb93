"""HTTP/1.1 framing for both ends of the overhead measurement.

The instant backend and the load generator speak raw HTTP/1.1 over asyncio protocols (an
HTTP library's own cost would be measured too): messages with ``content-length`` bodies,
keep-alive, never chunked.
"""

from __future__ import annotations


def http_response(status: str, body: bytes, content_type: str) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def take_message(buffer: bytes) -> tuple[bytes, bytes] | None:
    """Split one whole HTTP/1.1 message (head without its blank line, plus a
    ``content-length`` body) off the front of ``buffer``: ``(head, rest)``, or None while it is
    incomplete. Both ends of the measurement frame messages this way; neither uses chunking."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = buffer[:end]
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if len(buffer) < end + 4 + length:
        return None
    return head, buffer[end + 4 + length :]
