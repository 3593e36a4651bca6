"""A fault-injecting HTTP proxy on loopback, between an S3 client and the real S3 server (SeaweedFS does not
throttle or drop connections on demand). Each request is read whole (headers, then a Content-Length or chunked
body), matched against the fault rules in order, and either answered by the fault (503 SlowDown, 500, or the
connection dropped without an answer) or relayed to the server on a connection of its own, its answer relayed back.
The client signs requests for the proxy's host; SeaweedFS checks the signature against the Host header it gets,
which is relayed unchanged."""

from __future__ import annotations

import socket
import socketserver
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit

SLOW_DOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {n}\r\n\r\n",
             b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code><Message>Please reduce your "
             b"request rate.</Message></Error>")
INTERNAL = (b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/xml\r\nContent-Length: {n}\r\n\r\n",
            b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>InternalError</Code><Message>We encountered an "
            b"internal error. Please try again.</Message></Error>")


@dataclass
class Fault:
    """Answer requests whose method is `method` (None: any) and whose target contains every string of `match`
    with `action` ("503", "500" or "drop"), `times` times (None: always)."""

    action: str
    match: tuple[str, ...] = ()
    method: str | None = None
    times: int | None = 1
    hits: int = 0

    def applies(self, method: str, target: str) -> bool:
        return ((self.method is None or self.method == method) and all(m in target for m in self.match)
                and (self.times is None or self.hits < self.times))


@dataclass
class FaultyProxy:
    upstream: str
    faults: list[Fault] = field(default_factory=list)
    log: list[tuple[str, str, str]] = field(default_factory=list)  # (method, target, what happened)

    def start(self) -> "FaultyProxy":
        proxy = self
        self._lock = threading.Lock()

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                proxy._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True, name="faulty-proxy").start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _fault_for(self, method: str, target: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.applies(method, target):
                    fault.hits += 1
                    return fault
        return None

    def _serve(self, client: socket.socket) -> None:
        reader = client.makefile("rb")
        try:
            while True:
                request = _read_message(reader, is_request=True,
                                        on_expect=lambda: client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n"))
                if request is None:
                    return
                head, body = request
                method, target = head.split(b"\r\n", 1)[0].decode().split(" ")[:2]
                fault = self._fault_for(method, target)
                if fault is not None and fault.action == "drop":
                    self.log.append((method, target, "dropped"))
                    client.shutdown(socket.SHUT_RDWR)
                    return
                if fault is not None:
                    status, payload = SLOW_DOWN if fault.action == "503" else INTERNAL
                    client.sendall(status.replace(b"{n}", str(len(payload)).encode()) + payload)
                    self.log.append((method, target, fault.action))
                    continue
                client.sendall(self._relay(head, body))
                self.log.append((method, target, "relayed"))
        except (ConnectionError, OSError):
            return
        finally:
            reader.close()
            client.close()

    def _relay(self, head: bytes, body: bytes) -> bytes:
        host = urlsplit(self.upstream)
        with socket.create_connection((host.hostname, host.port)) as upstream:
            upstream.sendall(head + body)
            reader = upstream.makefile("rb")
            response = _read_message(reader, is_request=False, method_head=head.startswith(b"HEAD "))
            reader.close()
        if response is None:
            raise ConnectionError("the server closed the connection")
        return response[0] + response[1]


def _read_message(reader, is_request: bool, method_head: bool = False, on_expect=None) -> tuple[bytes, bytes] | None:
    """One HTTP/1.1 message (head, body) from `reader`; None at a clean end of the stream. A request's
    `Expect: 100-continue` is answered here (`on_expect`) and dropped from the head; a response's 1xx heads are
    skipped."""
    lines = []
    while True:
        line = reader.readline()
        if not line:
            return None if not lines else _raise("connection closed inside a message head")
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            if not is_request and lines[0].split(b" ", 2)[1].startswith(b"1"):
                lines = []  # an interim response
                continue
            break
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (h.decode("latin-1").partition(":") for h in lines[1:-1])}
    if is_request and headers.get("expect", "").lower() == "100-continue":
        lines = [h for h in lines if not h.lower().startswith(b"expect:")]
        on_expect()
    head = b"".join(lines)
    if method_head or (not is_request and head.split(b" ", 2)[1] in (b"204", b"304")):
        return head, b""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            size_line = reader.readline()
            body += size_line
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    trailer = reader.readline()
                    body += trailer
                    if trailer in (b"\r\n", b"\n", b""):
                        return head, bytes(body)
            body += reader.read(size + 2)
    length = int(headers.get("content-length", "0"))
    return head, reader.read(length) if length else b""


def _raise(message: str):
    raise ConnectionError(message)
