"""Hand-overs of a multipart save, point to point: the bytes a rank holds within a part another rank uploads
(`format.parts.HandOver`), sent by their holder to that uploader and to nobody else.

A plan is asked only `sent_by(rank)` and `received_by(rank)` (offset order each). A sender posts non-blocking sends
of its hand-overs (`Sends`: views of the bytes it holds, a copy only where one spans several of its ranges) before it
uploads its own parts and waits for them before its write returns; an uploader receives the hand-overs of each of
its parts straight into the part's buffer when the part is built (`Incoming.into`), so the extra host memory stays
that of the parts in flight. The messages of one pair of ranks go in offset order on both sides, on the multipart
gloo group, tagged with the file's index in the save: gloo matches a send to a receive by the pair of ranks and the
tag (its slot), in the order they were posted.

Faults: a sender that failed to produce its bytes still sends as many (zeros) and raises after its sends; a
receiver that stops early receives and drops the rest (`Incoming.drain`): nobody waits for a message that never
comes, and the save fails on every rank through `saving.conclude`. A dead peer fails the transfers pending with it
(its connections close), naming its rank; a peer that stops answering fails them after the group's timeout (torch's
default for gloo groups, 30 minutes).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence

import torch

from ... import dist
from ...format.parts import HandOver

#: (offset in the file, bytes): the ranges a rank holds of a file, in offset order.
Held = Sequence[tuple[int, memoryview]]


class Sends:
    """The non-blocking sends of one rank's hand-overs of one file, posted in offset order at construction: the
    bytes of `held`, or zeros where `held` is None (this rank failed) or does not hold them (`failure` says why)."""

    def __init__(self, hand_overs: list[HandOver], held: Held | None, group, tag: int, what: str,
                 announce: Callable[[HandOver], int] | None = None):
        """`announce`: each hand-over goes with its bounds (a header: `tag`, first byte, end byte), on the tag
        `announce(hand-over)` gives, for a receiver that cannot know its sender (`Announced`)."""
        self.what = what
        self.failure: BaseException | None = None
        self._posted: list[tuple[HandOver, torch.Tensor, object]] = []
        zeros = None
        for h in sorted(hand_overs, key=lambda h: h.start):
            if announce is not None:
                header = torch.tensor([tag, h.start, h.end], dtype=torch.int64)
                self._post(h, header, announce(h), group)
            data = None
            if held is not None and self.failure is None:
                try:
                    data = _tensor(held_bytes(held, h.start, h.end, what))
                except Exception as e:  # noqa: BLE001 - raised by the writer once its transfers are done
                    self.failure = e
            if data is None:
                if zeros is None:
                    zeros = torch.zeros(max(o.end - o.start for o in hand_overs), dtype=torch.uint8)
                data = zeros[:h.end - h.start]
            self._post(h, data, tag if announce is None else announce(h), group)

    def _post(self, h: HandOver, data: torch.Tensor, tag: int, group) -> None:
        try:
            request = dist.isend(data, h.receiver, group=group, tag=tag)
        except Exception as e:  # noqa: BLE001 - a connection known closed refuses at once; the others still go
            request = e
        self._posted.append((h, data, request))

    def wait(self) -> BaseException | None:
        """Wait for every send (its buffer is released then); the first that failed, naming its receiver, or None."""
        first = None
        for h, _, request in self._posted:
            try:
                if isinstance(request, Exception):
                    raise request
                request.wait()
            except Exception as e:  # noqa: BLE001 - every send is waited for before the buffers go
                first = first or _transfer_error(self.what, h, "sending", "to", h.receiver, e)
        self._posted.clear()
        return first


class Incoming:
    """The hand-overs one rank receives of one file (offset order), received part by part (`into`); what is left
    when the rank stops early is received and dropped (`drain`)."""

    def __init__(self, hand_overs: list[HandOver], group, tag: int, what: str):
        self._left = deque(sorted(hand_overs, key=lambda h: h.start))
        self._group, self._tag, self.what = group, tag, what
        self._posted: list[tuple[HandOver, object]] = []
        self.received = 0

    def into(self, buffer: bytearray, start: int, end: int) -> int:
        """Receive the hand-overs within bytes `[start, end)` of the file straight into `buffer` (those bytes), all
        posted at once; the bytes received."""
        got = 0
        while self._left and self._left[0].start < end:
            h = self._left.popleft()
            if h.start < start or h.end > end:
                self._left.appendleft(h)  # drained with the rest
                raise RuntimeError(f"{self.what}: bytes [{h.start}, {h.end}) handed over from rank {h.sender} lie "
                                   f"across the part [{start}, {end}); the plan's parts and hand-overs disagree.")
            view = torch.frombuffer(buffer, dtype=torch.uint8, count=h.end - h.start, offset=h.start - start)
            try:  # a connection known closed refuses at once, when the receive is posted
                self._posted.append((h, dist.irecv(view, h.sender, group=self._group, tag=self._tag)))
            except Exception as e:
                raise _transfer_error(self.what, h, "receiving", "from", h.sender, e) from e
            got += h.end - h.start
        while self._posted:
            h, request = self._posted[0]
            try:
                request.wait()
            except Exception as e:
                raise _transfer_error(self.what, h, "receiving", "from", h.sender, e) from e
            self._posted.pop(0)
        self.received += got
        return got

    def drain(self) -> None:
        """Wait for the receives already posted and receive what is left into a scratch buffer, dropping it, so that
        no sender waits for this rank; transfers that fail are skipped (and the rest from that peer). Nothing to do
        once every part was received."""
        dead = set()
        for h, request in self._posted:
            try:
                request.wait()
            except Exception:  # noqa: BLE001 - this rank is failing already
                dead.add(h.sender)
        self._posted.clear()
        scratch = None
        while self._left:
            h = self._left.popleft()
            if h.sender in dead:
                continue
            if scratch is None:
                scratch = torch.empty(max(o.end - o.start for o in [h, *self._left]), dtype=torch.uint8)
            try:
                dist.irecv(scratch[:h.end - h.start], h.sender, group=self._group, tag=self._tag).wait()
            except Exception:  # noqa: BLE001 - this rank is failing already
                dead.add(h.sender)


class Announced:
    """The bytes announced to this rank of the cells it aggregates of one file (pieces only their own rank can place,
    sent with their bounds by ranks it cannot name: `Sends(..., announce=...)`), received cell by cell (`into`);
    what is left when the rank stops early is received and dropped (`drain`), as `Incoming` does with the rest."""

    def __init__(self, cells: list[tuple[int, int, int, int]], group, file_tag: int, what: str):
        """`cells`: (first byte, end byte, bytes announced, tag) of each cell with announced bytes, in offset order."""
        self._left = deque(c for c in cells if c[2] > 0)
        self._group, self._file_tag, self.what = group, file_tag, what
        self._silent = False  # a header never came (the group's timeout): nothing more will

    def into(self, buffer, start: int, end: int) -> int:
        """Receive the bytes announced within cell `[start, end)` straight into `buffer` (those bytes): each a header
        from any rank on the cell's tag, then its bytes from that rank. The bytes received."""
        if not self._left or self._left[0][0] != start:
            return 0
        got = 0
        while self._left[0][2] > 0:
            sender, first, last = self._header()
            if not start <= first < last <= end or last - first > self._left[0][2]:
                self._silent = True  # its bytes cannot be placed, nor waited for
                raise RuntimeError(f"{self.what}: rank {sender} announced bytes [{first}, {last}) of file "
                                   f"{self._file_tag} where bytes of [{start}, {end}) were due; the plans disagree.")
            self._received(last - first)  # counted first: a transfer that fails leaves nothing to drain of them
            view = torch.frombuffer(buffer, dtype=torch.uint8, count=last - first, offset=first - start)
            try:
                dist.irecv(view, sender, group=self._group, tag=self._left[0][3]).wait()
            except Exception as e:
                raise _transfer_error(self.what, HandOver(first, last, sender, dist.rank()), "receiving", "from",
                                      sender, e) from e
            got += last - first
        self._left.popleft()
        return got

    def drain(self) -> None:
        """Receive what is still announced to this rank into a scratch buffer, dropping it, so that no live sender
        waits for this rank; a transfer that fails is skipped, and nothing more is awaited once a header did not
        come (a rank that died before announcing its bytes: gloo's receive from any rank fails only at the group's
        timeout). Nothing to do once every cell was received."""
        scratch = None
        while self._left and not self._silent:
            a, b, left, tag = self._left[0]
            if left <= 0:
                self._left.popleft()
                continue
            try:
                sender, first, last = self._header()
            except Exception:  # noqa: BLE001 - this rank is failing already
                return
            if not 0 < last - first <= left:  # plans that disagree: its bytes cannot be placed, nor waited for
                self._silent = True
                return
            if scratch is None:
                scratch = torch.empty(max(c[2] for c in self._left), dtype=torch.uint8)
            self._received(last - first)
            try:
                dist.irecv(scratch[:last - first], sender, group=self._group, tag=tag).wait()
            except Exception:  # noqa: BLE001 - this rank is failing already
                continue

    def _header(self) -> tuple[int, int, int]:
        """The next header of the first cell left: (its sender, first byte, end byte)."""
        a, b, left, tag = self._left[0]
        header = torch.empty(3, dtype=torch.int64)
        try:
            sender = dist.recv_any(header, group=self._group, tag=tag)
        except Exception as e:
            self._silent = True
            raise RuntimeError(f"{self.what}: receiving the bounds of {left} bytes of [{a}, {b}) from the ranks "
                               "holding them failed (one of them died or stopped answering; a receive from any rank "
                               f"cannot name it): {type(e).__name__}: {e}") from e
        theirs, first, last = header.tolist()
        if theirs != self._file_tag:
            self._silent = True
            raise RuntimeError(f"{self.what}: rank {sender} announced bytes [{first}, {last}) of file {theirs} where "
                               f"bytes of [{a}, {b}) of file {self._file_tag} were due; the plans disagree.")
        return sender, first, last

    def _received(self, count: int) -> None:
        a, b, left, tag = self._left[0]
        self._left[0] = (a, b, left - count, tag)


def held_bytes(held: Held, start: int, end: int, what: str) -> memoryview | bytearray:
    """Bytes `[start, end)` of the file from `held`: a view where one range holds them all, else a copy."""
    i = max(0, bisect_right(held, start, key=lambda r: r[0]) - 1)
    if i < len(held):
        offset, data = held[i]
        if offset <= start and end <= offset + len(data):
            return data[start - offset:end - offset]
    out = bytearray(end - start)
    if copy_held(out, start, held) != end - start:
        raise RuntimeError(f"{what}: bytes [{start}, {end}) are not all held by this rank; the part plan and the "
                           "engine's shards disagree.")
    return out


def copy_held(buffer: bytearray, start: int, held: Held) -> int:
    """Copy what `held` holds of bytes `[start, start + len(buffer))` of the file into `buffer`; the bytes copied."""
    end, copied, target = start + len(buffer), 0, memoryview(buffer)  # a view's slice assignment is one memcpy
    for offset, data in held[max(0, bisect_right(held, start, key=lambda r: r[0]) - 1):]:
        if offset >= end:
            break
        a, b = max(start, offset), min(end, offset + len(data))
        if a < b:
            target[a - start:b - start] = data[a - offset:b - offset]
            copied += b - a
    return copied


def _tensor(data: memoryview | bytearray) -> torch.Tensor:
    """A uint8 tensor over `data` (no copy; a copy of a read-only view, e.g. the header's bytes: torch tensors
    over read-only memory are not supported)."""
    if isinstance(data, memoryview) and data.readonly:
        data = bytearray(data)
    return torch.frombuffer(data, dtype=torch.uint8)


def _transfer_error(what: str, h: HandOver, doing: str, way: str, peer: int, e: BaseException) -> RuntimeError:
    return RuntimeError(f"{what}: {doing} bytes [{h.start}, {h.end}) {way} rank {peer} failed (that rank failed, "
                        f"died or stopped answering): {type(e).__name__}: {e}")
