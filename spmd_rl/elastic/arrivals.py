"""Where the members of a generation meet before each collective across replicas, so that a
slow member is waited for as long as it lives and a lost one is noticed without a timeout.

Replicas reach their collectives far apart: they generate different shares (the skew can be
minutes), and a node may pause. A gloo collective cannot tell a slow peer from a stopped one
except by its timeout, and a collective that timed out (or was abandoned) leaves the group
unusable and its worker thread blocked. So no member enters the gloo collective before every
member has arrived at it: collective ``s`` of a generation is preceded by

    arrive:  n = add("<s>", 1) on the generation's store (its first member's TCPStore);
             the member that makes n = W sets "<s>/all"
    wait:    until "<s>/all" exists (polled, backing off 0.5 ms -> 50 ms), and every
             ``CHECK_S`` ask ``check()`` for the members no longer alive (their lease lapsed,
             or their process is gone: ``quorum.gone``); any -> ``ReplicaLost``; a member that
             left the generation (a failed collective, or any ``recover``) sets "broken", and
             every waiter, and every later arrival, then raises too

and the collective itself is waited for the same way (``wait``): a member can stop (SIGSTOP, a
hung node) after it arrived, inside the collective, where gloo alone would wait out its timeout.

Invariant: a member waits at an arrival, or in the collective after it, for as long as every
member's lease holds (bounded only by ``patience_s`` at an arrival, for a member alive but hung,
and by gloo's timeout, ``elastic.replicas.timeout_s``, in the collective: the time to move the
data), and raises ``ReplicaLost`` within ``CHECK_S`` of a member's lease lapsing or its process
dying. This is torchft's liveness moved from a collective timeout to the
membership lease (its Lighthouse evicts a replica by missed heartbeats, not by a slow step).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore

CHECK_S = 1.0
"""Seconds between liveness checks while a member waits at an arrival."""

MAX_POLL_S = 0.05


class MemberLost(RuntimeError):
    """A member of the generation is gone, or another member left it (the message says which)."""


class Arrivals:
    """One member's side of its generation's arrivals (module docstring)."""

    def __init__(  # noqa: PLR0913
        self,
        address: str,
        prefix: str,
        world: int,
        check: Callable[[], list[str]],
        timeout_s: float,
        patience_s: float,
    ):
        host, _, port = address.rpartition(":")
        client = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
        self.store = PrefixStore(prefix, client)
        self.world, self.check, self.patience_s = world, check, patience_s
        self.seq = 0

    def meet(self) -> None:
        """Return once every member arrived at this member's next collective; ``MemberLost``
        when a member is no longer alive or left the generation. Store errors (the first
        member's store is gone with it) propagate as torch's ``DistError``."""
        s, self.seq = self.seq, self.seq + 1
        if self.store.check(["broken"]):
            raise MemberLost("another member left the generation")
        if self.store.add(str(s), 1) >= self.world:
            self.store.set(f"{s}/all", b"1")
            if s >= 2:  # every member returned from arrival s - 2 before it arrived at s
                self.store.delete_key(str(s - 2))
                self.store.delete_key(f"{s - 2}/all")
            return
        start = checked = time.monotonic()
        delay = 0.0005
        while not self.store.check([f"{s}/all"]):
            time.sleep(delay)
            delay = min(2 * delay, MAX_POLL_S)
            now = time.monotonic()
            if now - checked < CHECK_S:
                continue
            checked = now
            self._raise_if_lost()
            if now - start > self.patience_s:
                raise MemberLost(f"a member alive but not at collective {s} after {self.patience_s:g}s (hung)")

    def wait(self, work) -> None:
        """Until ``work`` (a gloo collective every member entered) completes, raising its error;
        ``MemberLost`` when a member is no longer alive or left the generation meanwhile,
        checked every ``CHECK_S``.
        The work is then still running: its group must be kept until it ends (``ReplicaGroup``
        does), since dropping a gloo group joins its worker thread."""
        while True:
            try:
                work.wait(timedelta(seconds=CHECK_S))
                return
            except RuntimeError:
                if work.is_completed():  # it failed, or ended as the wait timed out: its own verdict
                    work.wait()
                    return
            self._raise_if_lost()  # "broken" too: a member that left keeps its end of the group open

    def _raise_if_lost(self) -> None:
        """``MemberLost`` when another member left the generation or one is no longer alive."""
        if self.store.check(["broken"]):
            raise MemberLost("another member left the generation")
        lost = self.check()
        if lost:
            raise MemberLost(f"member(s) {lost} no longer alive (membership lease lapsed or process gone)")

    def leave(self) -> None:
        """Mark the generation broken, so members waiting at an arrival raise too."""
        try:
            self.store.set("broken", b"1")
        except RuntimeError:  # the store went with its member: the waiters fail on it too
            pass
