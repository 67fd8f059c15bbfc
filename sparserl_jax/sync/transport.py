"""PULSESync transports: where published patches and anchors live between publisher and receiver.

One small interface, `Transport`: `put(version, kind, blob)`, `get(version, kind) -> bytes | None`
and `versions(kind)` (only versions that are completely written). Three implementations:

- `InProcessTransport`: a locked dict of byte strings, for a trainer and a sampler sub-mesh in one
  program (the receiver then scatters onto the sampler's devices).
- `KvStoreTransport`: any TensorStore kvstore (`file://`, `memory://`; `gs://`, `s3://` are the
  same code). The blob is written first and a `READY/<kind>-<version>` marker after it, so a
  reader never sees a half-written version (grail's READY-window convention).
- `StreamServer` / `StreamClient`: a length-prefixed TCP protocol between processes on one host
  (127.0.0.1 by default), with bounded socket timeouts. A length read from the socket is checked
  against `max_blob_bytes` and the buffer grows with the bytes that actually arrive, so a bad
  length can neither allocate nor stall beyond what the peer really sends.
"""

from __future__ import annotations

import abc
import json
import socket
import struct
import threading
from typing import Literal

Kind = Literal["patch", "anchor"]
KINDS = ("patch", "anchor")
_MISSING = 2**64 - 1
MAX_BLOB_BYTES = 1 << 40
_CHUNK = 1 << 20


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} unknown; expected one of {KINDS}")


class Transport(abc.ABC):
    """Stores published blobs by (version, kind)."""

    @abc.abstractmethod
    def put(self, version: int, kind: Kind, blob: bytes) -> None:
        """Publish `blob`; visible to `versions`/`get` only once completely stored."""

    @abc.abstractmethod
    def get(self, version: int, kind: Kind) -> bytes | None:
        """The blob, or None when that version of that kind was never (completely) published."""

    @abc.abstractmethod
    def versions(self, kind: Kind) -> list[int]:
        """Sorted versions of `kind` that are ready."""

    def close(self) -> None:  # noqa: B027 (optional hook, a no-op by default)
        """Release resources (sockets, threads)."""


class InProcessTransport(Transport):
    """Blobs held in memory by reference (no copy), shared by threads of one program."""

    def __init__(self):
        self._lock = threading.Lock()
        self._blobs: dict[tuple[str, int], bytes] = {}

    def put(self, version: int, kind: Kind, blob: bytes) -> None:
        _check_kind(kind)
        with self._lock:
            self._blobs[(kind, int(version))] = blob

    def get(self, version: int, kind: Kind) -> bytes | None:
        _check_kind(kind)
        with self._lock:
            return self._blobs.get((kind, int(version)))

    def versions(self, kind: Kind) -> list[int]:
        _check_kind(kind)
        with self._lock:
            return sorted(v for k, v in self._blobs if k == kind)

    def drop(self, version: int, kind: Kind) -> None:
        """Forget one blob (retention, or tests simulating a lost version)."""
        with self._lock:
            self._blobs.pop((kind, int(version)), None)


class KvStoreTransport(Transport):
    """TensorStore kvstore: `url` like `file:///dir/` or `memory://`, or a kvstore spec dict.

    Keys: `<kind>-<version:012d>.psyn` for the blob, then `READY/<kind>-<version:012d>` holding
    the blob's size in decimal and a newline; a reader keeps that many bytes. (TensorStore's
    file driver rewrites a dead writer's `<key>.__lock` from offset 0 without cutting it, so a
    publisher killed before its rename and restarted with a shorter blob left the dead one's
    tail, which the decoder refuses as trailing bytes. An empty marker, from before, keeps the
    whole value.)
    `context`: a `tensorstore.Context`; two `memory://` stores share data only within one context.
    """

    def __init__(self, url: str | dict, *, context=None, timeout: float = 60.0):
        import tensorstore as ts

        self._ts = ts
        self._kv = ts.KvStore.open(url, context=context).result(timeout=timeout)
        self.timeout = timeout

    @staticmethod
    def _key(version: int, kind: str) -> str:
        return f"{kind}-{int(version):012d}"

    def put(self, version: int, kind: Kind, blob: bytes) -> None:
        _check_kind(kind)
        key = self._key(version, kind)
        self._kv.write(f"{key}.psyn", blob).result(timeout=self.timeout)
        self._kv.write(f"READY/{key}", f"{len(blob)}\n".encode()).result(timeout=self.timeout)

    def get(self, version: int, kind: Kind) -> bytes | None:
        _check_kind(kind)
        key = self._key(version, kind)
        ready = self._kv.read(f"READY/{key}").result(timeout=self.timeout)
        if ready.state != "value":
            return None
        r = self._kv.read(f"{key}.psyn").result(timeout=self.timeout)
        if r.state != "value":
            return None
        size, newline, _ = bytes(ready.value).partition(b"\n")  # a marker may carry a tail too
        return bytes(r.value)[: int(size)] if newline else bytes(r.value)

    def versions(self, kind: Kind) -> list[int]:
        _check_kind(kind)
        prefix = f"READY/{kind}-".encode()
        rng = self._ts.KvStore.KeyRange(inclusive_min=prefix, exclusive_max=prefix[:-1] + b".")
        keys = self._kv.list(rng).result(timeout=self.timeout)
        return sorted(int(k[len(prefix) :]) for k in keys)

    def delete(self, version: int, kind: Kind) -> None:
        """Remove a version (marker first, so readers never see a READY without data)."""
        key = self._key(version, kind)
        self._kv.delete_range(self._ts.KvStore.KeyRange(f"READY/{key}", f"READY/{key}\0")).result(
            timeout=self.timeout
        )
        self._kv.delete_range(self._ts.KvStore.KeyRange(f"{key}.psyn", f"{key}.psyn\0")).result(
            timeout=self.timeout
        )


def _recv_exact(sock: socket.socket, n: int, limit: int) -> bytes:
    """`n` bytes; refused over `limit`, and allocated as they arrive (never `n` up front)."""
    if not 0 <= n <= limit:
        raise ConnectionError(f"peer announced {n} bytes; expected 0..{limit} (max_blob_bytes)")
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), _CHUNK))
        if not chunk:
            raise ConnectionError(f"stream closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _recv_line(sock: socket.socket, limit: int = 256) -> str:
    out = bytearray()
    while not out.endswith(b"\n"):
        c = sock.recv(1)
        if not c:
            raise ConnectionError("stream closed inside a request line")
        out += c
        if len(out) > limit:
            raise ConnectionError("request line too long")
    return out[:-1].decode("ascii")


def _send_frame(sock: socket.socket, body: bytes | None) -> None:
    if body is None:
        sock.sendall(struct.pack("<Q", _MISSING))
    else:
        sock.sendall(struct.pack("<Q", len(body)))
        sock.sendall(body)


class StreamServer(Transport):
    """Serves a backing transport over TCP; also a `Transport` itself (puts go to the backing).

    Protocol, one request per line: `GET <kind> <v>`, `LIST <kind>`, `PUT <kind> <v> <n>` followed
    by n payload bytes. Each reply is a u64le length and that many bytes (`2**64-1`: missing).
    """

    def __init__(
        self,
        backing: Transport | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = 30.0,
        max_blob_bytes: int = MAX_BLOB_BYTES,
    ):
        self.backing = backing if backing is not None else InProcessTransport()
        self.timeout = timeout
        self.max_blob_bytes = max_blob_bytes
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.2)
        self.address = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(self.timeout)
        with conn:
            try:
                while not self._stop.is_set():
                    try:
                        words = _recv_line(conn).split()
                    except ConnectionError:
                        return
                    if len(words) >= 2 and words[1] not in KINDS:
                        _send_frame(conn, None)
                    elif words[0] == "GET" and len(words) == 3:
                        _send_frame(conn, self.backing.get(int(words[2]), words[1]))
                    elif words[0] == "LIST" and len(words) == 2:
                        _send_frame(conn, json.dumps(self.backing.versions(words[1])).encode())
                    elif words[0] == "PUT" and len(words) == 4:
                        blob = _recv_exact(conn, int(words[3]), self.max_blob_bytes)
                        self.backing.put(int(words[2]), words[1], blob)
                        _send_frame(conn, b"OK")
                    else:
                        _send_frame(conn, None)
            except (OSError, ValueError):  # ConnectionError included: the connection is dropped
                return

    def put(self, version: int, kind: Kind, blob: bytes) -> None:
        self.backing.put(version, kind, blob)

    def get(self, version: int, kind: Kind) -> bytes | None:
        return self.backing.get(version, kind)

    def versions(self, kind: Kind) -> list[int]:
        return self.backing.versions(kind)

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=5)


class StreamClient(Transport):
    """Client side of `StreamServer`; one connection, re-opened on error, bounded timeouts.
    A reply longer than `max_blob_bytes` is refused (`ConnectionError`) before it is read."""

    def __init__(
        self, host: str, port: int, *, timeout: float = 30.0, max_blob_bytes: int = MAX_BLOB_BYTES
    ):
        self.address = (host, int(port))
        self.timeout = timeout
        self.max_blob_bytes = max_blob_bytes
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def _request(self, line: str, payload: bytes = b"") -> bytes | None:
        with self._lock:
            if self._sock is None:
                self._sock = socket.create_connection(self.address, timeout=self.timeout)
            try:
                self._sock.sendall(line.encode("ascii") + b"\n" + payload)
                (n,) = struct.unpack("<Q", _recv_exact(self._sock, 8, 8))
                return None if n == _MISSING else _recv_exact(self._sock, n, self.max_blob_bytes)
            except (OSError, ConnectionError):
                self._sock.close()
                self._sock = None
                raise

    def put(self, version: int, kind: Kind, blob: bytes) -> None:
        _check_kind(kind)
        if self._request(f"PUT {kind} {int(version)} {len(blob)}", blob) != b"OK":
            raise ConnectionError(f"server refused PUT {kind} {version}")

    def get(self, version: int, kind: Kind) -> bytes | None:
        _check_kind(kind)
        return self._request(f"GET {kind} {int(version)}")

    def versions(self, kind: Kind) -> list[int]:
        _check_kind(kind)
        body = self._request(f"LIST {kind}")
        return [] if body is None else sorted(json.loads(body))

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
