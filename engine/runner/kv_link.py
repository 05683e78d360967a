"""KVLink: a moved sequence's KV sent straight from the engine replica it leaves to the one
where it goes on, without Ray's object store (engine/core/sequence_kv.py says what moves).

The source keeps the exported blocks where its cache is and offers them: a `KVOffer` is plain
data (its link's address, the offer's number, what the bytes are) that travels with the
sequence's Resume. The target connects to the source's link, asks for the offer, and takes
the bytes one of two ways:
- "p2p": over a two-rank torch.distributed group between the two processes, NCCL between
  GPUs (device to device: no host copy at either end), gloo between CPU tensors. A pair's
  group is made at its first transfer and kept for the next; the target sends one transfer
  at a time on it (NCCL matches sends and receives by order alone).
- "host": the bytes on the connection itself (from a GPU, copied to the host first): where
  no p2p path exists, or p2p failed with that source (then for every later transfer from
  it). Between CPU replicas on one host Ray's object store moves KV faster than a socket
  (docs/cluster.md), so `kv_transport: auto` takes the link from GPU caches only.
An offer stands until the source withdraws it (the sequence has gone on elsewhere), so a
target that dies before importing the KV leaves it for the next one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import json
import logging
import os
import socket
import socketserver
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from engine.core.sequence_kv import SequenceKV
from engine.model.collectives import process_group

logger = logging.getLogger(__name__)

# How long either end of a transfer waits for the other before giving up on it.
TRANSFER_TIMEOUT_S = 30.0
# Socket reads and writes move this many bytes at a time at most.
_CHUNK = 1 << 22


@dataclass(frozen=True)
class KVOffer:
    """A sequence's KV held at its source's link until withdrawn."""

    host: str
    port: int
    offer_id: int
    kv: SequenceKV  # what the bytes stand for; its data is None here
    shape: tuple[int, ...]  # the bytes' shape (SequenceKV.data)
    device: str  # where the source holds them: "cuda" or "cpu"

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape))


class KVLink:
    """One process's end of the links between engine replicas: offers what it sends (a
    server thread answers the targets), fetches what it takes."""

    def __init__(self, host: str, name: str, timeout_s: float = TRANSFER_TIMEOUT_S) -> None:
        """`host`: the address other replicas reach this process at; `name`: this process's,
        unique in the cluster (its replica id)."""
        self.host = host
        self.name = name
        self.timeout_s = timeout_s
        self._offers: dict[int, torch.Tensor] = {}  # flat uint8 bytes, where the cache is
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._server: socketserver.ThreadingTCPServer | None = None
        self._store: dist.TCPStore | None = None  # the p2p groups' rendezvous, as a source
        self._sending: dict[str, Any] = {}  # p2p groups (torch backends) by name, as a source
        self._taking: dict[tuple[str, int], _Pair] = {}  # p2p groups by source, as a target
        self.num_sent = {"p2p": 0, "host": 0}
        self.num_taken = {"p2p": 0, "host": 0}
        self.num_p2p_failures = 0  # p2p transfers given up for the host way

    # The source's side.

    def offer(self, kv: SequenceKV) -> KVOffer:
        """Hold `kv`'s bytes (a torch tensor) for a target to take; its offer to send on."""
        assert isinstance(kv.data, torch.Tensor), "offer the KV where the cache holds it"
        port = self._serve()
        offer_id = next(self._ids)
        with self._lock:
            self._offers[offer_id] = kv.data.reshape(-1)
        meta = dataclasses.replace(kv, data=None)
        shape = tuple(kv.data.shape)
        return KVOffer(self.host, port, offer_id, meta, shape, kv.data.device.type)

    def withdraw(self, offer: KVOffer) -> None:
        """Free an offer's bytes: the sequence went on elsewhere (or will not)."""
        with self._lock:
            self._offers.pop(offer.offer_id, None)

    @property
    def num_offers(self) -> int:
        with self._lock:
            return len(self._offers)

    def _serve(self) -> int:
        with self._lock:
            if self._server is None:
                link = self

                class Handler(socketserver.StreamRequestHandler):
                    def handle(self) -> None:
                        link._answer(self.connection, self.rfile)

                server = socketserver.ThreadingTCPServer((self.host, 0), Handler)
                server.daemon_threads = True
                threading.Thread(target=server.serve_forever, name="kv-link", daemon=True).start()
                self._server = server
            return self._server.server_address[1]

    def _answer(self, conn: socket.socket, rfile: Any) -> None:
        """Serve one target's request on its connection."""
        conn.settimeout(self.timeout_s)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            ask = json.loads(rfile.readline())
            with self._lock:
                data = self._offers.get(ask["offer"])
            if data is None:
                _reply(conn, {"error": f"no offer {ask['offer']} here (withdrawn)"})
            elif ask["mode"] == "p2p":
                _reply(conn, {"store_port": self._rendezvous()})
                group = self._sending_group(ask["group"], data.device)
                try:
                    _p2p(lambda: group.send([data], 1, 0), data.device)
                except Exception:
                    with self._lock:
                        self._sending.pop(ask["group"], None)
                    raise
                self._count(self.num_sent, "p2p")
            else:
                host = data.cpu() if data.device.type != "cpu" else data
                _reply(conn, {"nbytes": host.numel()})
                view = memoryview(host.numpy())
                for start in range(0, len(view), _CHUNK):
                    conn.sendall(view[start : start + _CHUNK])
                self._count(self.num_sent, "host")
        except Exception as exc:
            logger.warning("a KV transfer from %s failed: %r", self.name, exc)

    def _count(self, counts: dict[str, int], way: str) -> None:
        with self._lock:  # transfers end on several threads at once
            counts[way] += 1

    def _rendezvous(self) -> int:
        with self._lock:
            if self._store is None:
                self._store = dist.TCPStore(
                    self.host,
                    0,
                    None,
                    True,
                    timeout=datetime.timedelta(seconds=self.timeout_s),
                    wait_for_workers=False,
                )
            return self._store.port

    def _sending_group(self, name: str, device: torch.device) -> Any:
        with self._lock:
            group = self._sending.get(name)
            store = self._store
        if group is None:
            assert store is not None
            group = _group(store, name, 0, device, self.timeout_s)
            with self._lock:
                self._sending[name] = group
        return group

    # The target's side.

    def fetch(self, offer: KVOffer, device: torch.device, p2p: bool | None = None) -> SequenceKV:
        """The offered KV, its bytes on `device` (the cache's) where p2p brought them, else
        on the host. `p2p`: try the p2p way first (None: where both ends are GPUs and NCCL
        is there). Raises where neither way worked (the source died, the offer is gone)."""
        if p2p is None:
            both_gpus = offer.device == device.type == "cuda"
            p2p = both_gpus and dist.is_nccl_available()
        with self._lock:
            pair = self._taking.setdefault((offer.host, offer.port), _Pair())
        if p2p and not pair.failed:
            try:
                return self._fetch_p2p(offer, device, pair)
            except LookupError:  # the offer is gone: no other way has it either
                raise
            except Exception as exc:
                pair.failed = True
                with self._lock:
                    self.num_p2p_failures += 1
                logger.warning(
                    "p2p KV transfer from %s:%d failed (%r): taking its KV through the host "
                    "from now on",
                    offer.host,
                    offer.port,
                    exc,
                )
        return self._fetch_host(offer)

    def _fetch_host(self, offer: KVOffer) -> SequenceKV:
        with self._connect(offer, "host", None) as (conn, answer):
            data = np.empty(answer["nbytes"], dtype=np.uint8)
            view, got = memoryview(data), 0
            while got < len(view):
                n = conn.recv_into(view[got:], min(len(view) - got, _CHUNK))
                if n == 0:
                    raise ConnectionError("the source closed the link mid-transfer")
                got += n
        self._count(self.num_taken, "host")
        return dataclasses.replace(offer.kv, data=data.reshape(offer.shape))

    def _fetch_p2p(self, offer: KVOffer, device: torch.device, pair: _Pair) -> SequenceKV:
        with pair.lock:  # one transfer at a time on a pair's group
            if pair.group is None:
                pair.name = f"{self.name}>{offer.host}:{offer.port}#{next(self._ids)}"
            data = torch.empty(offer.nbytes, dtype=torch.uint8, device=device)
            try:
                with self._connect(offer, "p2p", pair.name) as (_, answer):
                    if pair.group is None:
                        store = dist.TCPStore(
                            offer.host,
                            answer["store_port"],
                            None,
                            False,
                            timeout=datetime.timedelta(seconds=self.timeout_s),
                        )
                        pair.group = _group(store, pair.name, 1, device, self.timeout_s)
                    _p2p(lambda: pair.group.recv([data], 0, 0), device)
            except LookupError:  # asked for an offer withdrawn: the group is sound
                raise
            except Exception:
                pair.group = None
                raise
        self._count(self.num_taken, "p2p")
        return dataclasses.replace(offer.kv, data=data.reshape(offer.shape))

    def _connect(
        self, offer: KVOffer, mode: str, group: str | None
    ) -> contextlib.AbstractContextManager[tuple[socket.socket, dict[str, Any]]]:
        ask = {"offer": offer.offer_id, "mode": mode, "group": group}
        return _asking(offer, ask, self.timeout_s)

    def close(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            self._offers.clear()
        if server is not None:
            server.shutdown()
            server.server_close()


@dataclass
class _Pair:
    """The target's p2p group with one source."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    name: str = ""
    group: Any = None
    # A p2p transfer from this source failed (NCCL refuses two ranks on one GPU; a timeout):
    # the host way from then on, rather than a failure (and its timeout) per transfer.
    failed: bool = False


@contextlib.contextmanager
def _asking(
    offer: KVOffer, ask: dict[str, Any], timeout_s: float
) -> Iterator[tuple[socket.socket, dict[str, Any]]]:
    """A target's request to a source's link: (the connection, the source's answer)."""
    with socket.create_connection((offer.host, offer.port), timeout=timeout_s) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _reply(conn, ask)
        answer = json.loads(_read_line(conn))
        if "error" in answer:
            raise LookupError(answer["error"])
        yield conn, answer


def _reply(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _read_line(conn: socket.socket) -> bytes:
    """The answer's line, read a byte at a time: a buffered reader would take the first of
    the bytes that follow it, which go straight into the receive buffer."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = conn.recv(1)
        if not byte:
            raise ConnectionError("the source closed the link")
        line += byte
    return bytes(line)


def _group(store: dist.Store, name: str, rank: int, device: torch.device, timeout_s: float) -> Any:
    """The pair's two-rank group: NCCL for GPU tensors, gloo for CPU ones."""
    if device.type == "cuda":
        # A transfer that times out aborts the pair's communicator, never the process
        # (whose other requests go on); read where a group is made.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    prefixed = dist.PrefixStore(f"kv-link/{name}", store)
    return process_group(prefixed, rank, 2, device, datetime.timedelta(seconds=timeout_s))


def _p2p(op: Any, device: torch.device) -> None:
    """Run a send or receive to its end; on a GPU, with its bytes in place once it returns."""
    if device.type != "cuda":
        op().wait()
        return
    with torch.cuda.device(device):
        op().wait()
        torch.cuda.current_stream(device).synchronize()
