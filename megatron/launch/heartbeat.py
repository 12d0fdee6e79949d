"""Peer and launcher liveness through the rendezvous store, independent of any collective.

On NCCL a dead or frozen peer leaves collectives hanging until the watchdog aborts the process
(SIGABRT, no Python exception), so the main thread cannot be the one to notice. Instead two daemon
threads on every rank, each ``interval_s``; the first talks to the store:

- beats: sets ``beat/<rank>`` to ``"<count> <iteration> <host>"`` (the loop tells it the
  iteration), so whoever notices the silence can say where and when the rank stopped;
- watches one peer, its ring successor (the next rank that has not left): the store then serves
  O(world) requests per interval, not O(world^2). Among live and lost ranks on a ring some live
  rank is always followed by a lost one, so every loss is seen by someone. A successor whose beat
  has not changed for ``grace_s`` is lost: the watcher publishes ``lost``, every rank reads it at
  its next beat, logs the same line ("lost a peer: rank N (host H) stopped responding at
  iteration I"), writes ``left/<rank>`` and exits 1 from the thread;

the second (the guard) makes no store request, since one to a frozen store host never returns:

- it watches the launcher: under torchrun the agent is the worker's parent and hosts the store,
  so a new parent pid, or no store round trip for ``grace_s``, means the launcher is gone.
  Without torchrun rank 0 hosts the store, and a store silent for ``grace_s`` means rank 0 is
  lost. Either way it logs one line and exits 1.

``blame`` serves the other path, where a collective did fail (gloo names an address, or times
out after ``parallel.timeout_minutes``): it names the peers whose beat stopped.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from megatron.logging import log
from megatron.parallel.launcher import attempt_prefix, launcher_env

PEER_FAILURE = 1  # exit code when a peer (or the launcher) died or froze
LOST = "lost"  # store key: {"rank": N, "message": line} once a watcher found a lost peer


def _when(iteration: int) -> str:
    return f"at iteration {iteration}" if iteration else "before its first iteration"


def _stopped(rank: int, beat: bytes | None) -> str:
    """How a silent rank is named, from its last beat: "rank 3 (host h) stopped responding at
    iteration 12"."""
    if beat is None:
        return f"rank {rank} stopped responding before its first heartbeat"
    _, iteration, host = beat.decode().split(" ", 2)
    return f"rank {rank} (host {host}) stopped responding {_when(int(iteration))}"


class Heartbeat:
    """This rank's pulse in the rendezvous store and its watch over one peer and the launcher.

    ``before_exit`` runs in the thread just before it ends the process (``os._exit`` skips every
    ``finally``): it releases what the run holds, e.g. the save directory's lock. Whatever talks
    to the store (the beat thread, ``blame``, ``leave``) has a client of its own.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        grace_s: float,
        before_exit: Callable[[], None] = lambda: None,
    ):
        env = launcher_env()
        self.rank, self.world_size, self.grace_s = rank, world_size, grace_s
        # Ten beats per grace period: a beat or two lost to a busy host is never a loss.
        self.interval_s = min(1.0, grace_s / 10)
        self.iteration = 0  # set by the loop as each iteration starts; 0 until the first one
        self.host = socket.gethostname()
        self.store_host, self.store_port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        # Under torchrun its agent hosts the store the workers rendezvous through.
        self._agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self._parent = os.getppid()
        self._before_exit = before_exit
        self._watched: int | None = self._successor(rank)
        self._last_beat: bytes | None = None
        self._since = self._tick = self._contact = time.monotonic()
        self._stop = threading.Event()
        self._exiting = threading.Lock()
        self._threads = [
            threading.Thread(target=self._beat, args=(self._client(),), name="heartbeat"),
            threading.Thread(target=self._guard, name="heartbeat-guard"),
        ]
        for thread in self._threads:
            thread.daemon = True
            thread.start()

    def _client(self) -> dist.Store:
        # For connecting (a request to a frozen store host may never return: ``_guard`` covers it).
        timeout = timedelta(seconds=min(10.0, self.grace_s / 4))
        store = dist.TCPStore(self.store_host, self.store_port, is_master=False, timeout=timeout)
        # Per attempt, or a restarted one would read the old one's ``lost`` and ``left/``.
        return dist.PrefixStore(attempt_prefix("heartbeat"), store)

    def _successor(self, rank: int) -> int | None:
        after = (rank + 1) % self.world_size
        return None if after == self.rank else after

    def _beat(self, store: dist.Store) -> None:
        count = 0
        while not self._stop.is_set():
            try:
                count += 1
                store.set(f"beat/{self.rank}", f"{count} {self.iteration} {self.host}")
                if store.check([LOST]):
                    record = json.loads(store.get(LOST))
                    self._exit(record["message"], store, record["rank"])
                lost = self._watch(store)
                if lost is not None:
                    message = f"lost a peer: {lost[1]}"
                    store.set(LOST, json.dumps({"rank": lost[0], "message": message}))
                    self._exit(message, store, lost[0])
                self._contact = time.monotonic()
            except RuntimeError:  # the store's host is gone (DistStoreError is a RuntimeError)
                try:
                    store = self._client()  # a broken connection does not heal by itself
                except RuntimeError:
                    pass
            self._stop.wait(self.interval_s)

    def _guard(self) -> None:
        """The launcher and the store, watched without any store request: a request to a frozen
        store host blocks for good, whatever the client's timeout, and so would this watch."""
        tick = resumed = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            if now - tick > self.grace_s / 2:
                resumed = now  # this process was held up itself: the beat gets a fresh grace
            tick = now
            if self._agent and os.getppid() != self._parent:
                torchrun = f"torchrun (pid {self._parent})"
                self._exit(f"the launcher is gone: {torchrun} exited; stopping this worker", None)
            if now - max(self._contact, resumed) > self.grace_s:
                self._exit(self._store_lost(), None)

    def _watch(self, store: dist.Store) -> tuple[int, str] | None:
        """(rank, "rank N ... stopped responding ...") once the watched peer has been silent
        for ``grace_s``; a peer that left is passed over for the next one on the ring."""
        if self._watched is None:
            return None
        key = f"beat/{self._watched}"
        beat = store.get(key) if store.check([key]) else None  # get() waits for a missing key
        now = time.monotonic()
        if now - self._tick > self.grace_s / 2:
            # This thread was held up itself (GIL, CPU, a paused host): it saw nothing meanwhile,
            # so the silence it measured is no evidence; start measuring again.
            self._since = now
        self._tick = now
        if beat != self._last_beat:
            self._last_beat, self._since = beat, now
        elif store.check([f"left/{self._watched}"]):
            self._watched = self._successor(self._watched)
            self._last_beat, self._since = None, now
        elif now - self._since > self.grace_s:
            return self._watched, _stopped(self._watched, beat)
        return None

    def _store_lost(self) -> str:
        where = f"{self.store_host}:{self.store_port}"
        silent = f"has not answered for {self.grace_s:.0f} s"
        if self._agent:
            return (
                f"the launcher is gone: the torchrun agent's rendezvous store at {where} {silent}; "
                "stopping this worker"
            )
        return (
            f"lost a peer: rank 0 (host {self.store_host}) stopped responding "
            f"{_when(self.iteration)}: the rendezvous store it hosts at {where} {silent}"
        )

    def _exit(self, message: str, store: dist.Store | None, lost: int | None = None) -> None:
        """Log ``message``, tell the peers this rank left, and end the process with exit 1.

        The main thread may be stuck in a collective for good, so the process ends from here.
        Rank 0 hosting the store (no torchrun) first gives the others a moment to read ``lost``:
        the store dies with it. Only the first of the two threads to get here goes on.
        """
        if not self._exiting.acquire(blocking=False):
            threading.Event().wait()  # the other thread is ending the process
        log.error("%s", message)
        if store is not None:
            try:
                store.set(f"left/{self.rank}", message[:300])
                if not self._agent and self.rank == 0:
                    self._await_peers(store, lost)
            except RuntimeError:
                pass  # nobody is left to tell
        try:
            self._before_exit()
        finally:
            for handler in log.handlers + logging.getLogger().handlers:
                handler.flush()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(PEER_FAILURE)

    def _await_peers(self, store: dist.Store, lost: int | None) -> None:
        """Until every other live rank has written ``left/`` (a live one reads ``lost`` within
        an interval), or 10 s at most: a second lost rank never writes."""
        waiting = [f"left/{r}" for r in range(self.world_size) if r not in (self.rank, lost)]
        deadline = time.monotonic() + min(self.grace_s, 10.0)
        while waiting and time.monotonic() < deadline:
            waiting = [key for key in waiting if not store.check([key])]
            time.sleep(self.interval_s / 2)

    def lost_peers(self, beats: int = 5) -> tuple[list[str], list[str]]:
        """(stopped, left): the peers that stopped beating (dead or frozen), and those that left,
        each as "rank 3 (host h) stopped responding at iteration 12 (...)" or "rank 2 left (why)".

        Watches the beats for ``beats`` intervals, long enough for a live rank on a busy host
        to beat at least once. An unreachable store means its host died: rank 0 without torchrun.
        """
        others = [r for r in range(self.world_size) if r != self.rank]
        stopped, left = [], []
        try:
            store = self._client()

            def beat(r: int) -> bytes | None:
                return store.get(f"beat/{r}") if store.check([f"beat/{r}"]) else None

            before = {r: beat(r) for r in others}
            time.sleep(beats * self.interval_s)
            for r in others:
                if store.check([f"left/{r}"]):
                    left.append(f"rank {r} left ({store.get(f'left/{r}').decode()})")
                elif beat(r) == before[r]:
                    silent = beats * self.interval_s
                    stopped.append(f"{_stopped(r, before[r])} (no heartbeat for {silent:.0f} s)")
        except RuntimeError as err:
            host = "the torchrun agent" if self._agent else "rank 0"
            stopped.append(
                f"{host} stopped responding (the rendezvous store it hosts at "
                f"{self.store_host}:{self.store_port} does not answer: "
                f"{str(err).splitlines()[0]})"
            )
        return stopped, left

    def blame(self, err: Exception) -> str | None:
        """The error to report if ``err`` (from a collective) comes from a dead or frozen peer;
        None if every peer still beats or left on its own (then ``err`` speaks for itself).

        For the failure path only: it takes a few seconds (``lost_peers``).
        """
        stopped, left = self.lost_peers()
        if not stopped:
            return None
        first_line = str(err).splitlines()[0] if str(err) else ""
        return (
            f"lost a peer, exiting: {'; '.join(stopped + left)}. "
            f"The failed operation: {type(err).__name__}: {first_line}"
        )

    def leave(self, reason: str) -> None:
        """Tell the peers why this rank goes (so none reports it as dead), then stop beating."""
        try:
            self._client().set(f"left/{self.rank}", reason[:300])
        except RuntimeError:
            pass  # nobody is left to tell
        self._stop.set()
        for thread in self._threads:
            # Bounded: a request to a frozen store host never returns.
            thread.join(timeout=2 * self.interval_s + 10)
