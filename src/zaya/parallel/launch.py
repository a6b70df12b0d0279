"""This process's place in the job, as the launcher describes it, and the start-up check that lets every
rank of a job fail together.

Under torchrun a worker learns RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (the rendezvous
store, the agent's own when TORCHELASTIC_USE_AGENT_STORE is set) and TORCHELASTIC_RESTART_COUNT. Without a
launcher the job is this one process.

Every attempt of a job gets a store of its own, empty, so that nothing the previous attempt wrote is taken
for a peer's answer. Under torchrun the workers share their agents' store, which outlives the workers and
whose keys nobody can tell apart by attempt: torchrun's restart count is kept per agent, and an agent whose
workers were healthy restarts them without counting (pytorch/pytorch#108158), so two nodes can disagree on
it. So rank 0 opens a fresh store on a free port and posts its address under one key of the agents' store,
with a random token and the attempt's number (rank 0's count of its own starts, the same on every rank).
The other ranks read that key and connect; an address left by an earlier attempt leads to a process that is
gone (torchrun stops every worker before it starts the next attempt), so they read again until the address
answers with the token. Without an agent's store rank 0 hosts the store at MASTER_PORT, new each attempt.

Start-up check: every rank first reads its config and inputs on its own. A rank that finds something wrong
posts its one-line error to the store and exits; the others, once done, wait for every rank's verdict. So
bad input (a key, a file, a mesh that does not fit) ends the whole job at once, every rank with a non-zero
exit, and rank 0 prints the line once, naming the rank it came from when that was not rank 0. A rank that
dies without a verdict is reported after `init_timeout_s`. The failing ranks exit only once rank 0 has shown
the error: torchrun stops every worker as soon as the first one exits, and rank 0 must not be stopped
before it has said why. Rank 0 in turn, which holds the attempt's store, leaves only once every rank has
posted its verdict there (or `init_timeout_s` has passed), so that none is left looking for the store.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import secrets
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch.distributed as dist

from zaya.errors import StartupFailed, ZayaError
from zaya.parallel.config import DEFAULT_INIT_TIMEOUT_S

_VERDICT = "startup/rank-{}"
_REPORTED = "startup/reported"  # rank 0 has shown the error: the other ranks may exit
_ATTEMPT_STORE = "zaya/attempt-store"  # in torchrun's agent store: where this attempt's own store is
_ATTEMPTS = "zaya/attempts"  # in torchrun's agent store: how many attempts rank 0 has started
_TOKEN, _ATTEMPT = "zaya/token", "zaya/attempt"  # in an attempt's store
_CONNECT_S = 2.0  # one try at an address read from the agent's store


@dataclass
class Launch:
    """This process's rank among `world_size`, its local rank on its node and torchrun's restart count, and where
    the job's store is (`master_addr`, `master_port`; the torchrun agent's own when `agent_store`)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    restart: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    agent_store: bool = False
    init_timeout_s: float = DEFAULT_INIT_TIMEOUT_S  # how long to wait for the other ranks to start
    _store: dist.Store | None = field(default=None, repr=False)
    _attempt: int | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Launch:
        """The launcher's description of this process, from its environment (one process when there is none)."""
        world_size = max(1, int(environ.get("WORLD_SIZE", "1")))
        return cls(rank=int(environ.get("RANK", "0")) if world_size > 1 else 0, world_size=world_size,
                   local_rank=int(environ.get("LOCAL_RANK", "0")),
                   local_world_size=int(environ.get("LOCAL_WORLD_SIZE", str(world_size))),
                   restart=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                   master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                   master_port=int(environ.get("MASTER_PORT", "0")),
                   agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def attempt(self) -> int:
        """Which attempt of the job this is, counted from 0 and the same on every rank (joins the job's store)."""
        self.store()
        assert self._attempt is not None
        return self._attempt

    def store(self) -> dist.Store:
        """This attempt's key-value store, shared by every rank of the job (made or joined on first use; see the
        module docstring). Raises `StartupFailed` if rank 0's store cannot be reached within `init_timeout_s`."""
        timeout = datetime.timedelta(seconds=self.init_timeout_s)
        if self._store is None:
            if self.world_size == 1:
                self._store, self._attempt = dist.HashStore(), self.restart
            elif not self.agent_store:
                self._store = dist.TCPStore(self.master_addr, self.master_port, self.world_size,
                                            is_master=self.rank == 0, timeout=timeout, wait_for_workers=False)
                if self.is_main:
                    self._store.set(_ATTEMPT, str(self.restart))
                self._store.wait([_ATTEMPT])
                self._attempt = int(self._store.get(_ATTEMPT))
            else:
                agents = dist.TCPStore(self.master_addr, self.master_port, self.world_size, is_master=False,
                                       timeout=timeout, wait_for_workers=False)
                self._store = self._open_attempt(agents, timeout) if self.is_main else self._join_attempt(agents)
        self._store.set_timeout(timeout)
        return self._store

    def _open_attempt(self, agents: dist.Store, timeout: datetime.timedelta) -> dist.Store:
        """Rank 0: a fresh store on a free port, posted with a token and the attempt's number."""
        self._attempt = agents.add(_ATTEMPTS, 1) - 1
        store = dist.TCPStore(self.master_addr, 0, self.world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        token = secrets.token_hex(16)
        store.set(_TOKEN, token)
        store.set(_ATTEMPT, str(self._attempt))
        agents.set(_ATTEMPT_STORE, json.dumps({"host": self.master_addr, "port": store.port, "token": token}))
        return store

    def _join_attempt(self, agents: dist.Store) -> dist.Store:
        """The other ranks: the store whose address rank 0 posted and which answers with its token."""
        deadline = time.monotonic() + self.init_timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                agents.wait([_ATTEMPT_STORE], datetime.timedelta(seconds=left))
                posted = json.loads(agents.get(_ATTEMPT_STORE))
                # a plain connection first: refused at once by a gone process's port, where a store client
                # retries and logs until its timeout
                socket.create_connection((posted["host"], posted["port"]), timeout=min(_CONNECT_S, left)).close()
                store = dist.TCPStore(posted["host"], posted["port"], self.world_size, is_master=False,
                                      timeout=datetime.timedelta(seconds=min(_CONNECT_S, left)),
                                      wait_for_workers=False)
                if store.get(_TOKEN).decode() == posted["token"]:
                    self._attempt = int(store.get(_ATTEMPT))
                    return store
            except (OSError, RuntimeError, ValueError, KeyError, TypeError):  # an earlier attempt's address, gone
                pass
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))  # rank 0 may not have posted its own yet
        raise StartupFailed(f"rank 0 did not open the job's store within {self.init_timeout_s:.0f} s (see its log)",
                            rank=self.rank)

    @contextlib.contextmanager
    def startup(self) -> Iterator[None]:
        """Run the start-up checks of this rank inside (they may set `init_timeout_s` from the config); then
        agree with every other rank (see the module docstring). Raises `StartupFailed` if any rank failed;
        re-raises this rank's own error."""
        if self.world_size == 1:
            yield
            return
        try:
            yield
        except ZayaError as exc:
            self._post(_VERDICT.format(self.rank), f"error:{exc}")
            raise self._failure(str(exc)) from None
        except BaseException as exc:
            self._post(_VERDICT.format(self.rank), "error:an internal error (its traceback is on that rank)")
            if self.is_main:
                self._release(wait=isinstance(exc, Exception))
            raise
        self._post(_VERDICT.format(self.rank), "ok")
        keys = [_VERDICT.format(rank) for rank in range(self.world_size)]
        timeout_s = self.init_timeout_s
        try:
            store = self.store()
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
            verdicts = [store.get(key).decode() for key in keys]
        except Exception:  # a timeout, or the store gone with the rank that served it
            raise self._failure(f"not every rank finished starting within {timeout_s:.0f} s (see their logs)",
                                wait=False) from None
        for rank, verdict in enumerate(verdicts):
            if verdict.startswith("error:"):
                raise self._failure(f"rank {rank}: {verdict.removeprefix('error:')}")

    def gather(self, name: str, value: str) -> list[str]:
        """Every rank's `value` for `name`, rank by rank, through the job's store (every rank calls it once; after
        the start-up check, so that every rank is alive to answer)."""
        if self.world_size == 1:
            return [value]
        store = self.store()
        keys = [f"gather/{name}/rank-{rank}" for rank in range(self.world_size)]
        store.set(keys[self.rank], value)
        store.wait(keys, datetime.timedelta(seconds=self.init_timeout_s))
        return [store.get(key).decode() for key in keys]

    def _failure(self, message: str, wait: bool = True) -> StartupFailed:
        """The error this rank leaves with: rank 0 shows it and then lets the others go; they wait for that."""
        if self.is_main:
            return StartupFailed(message, rank=0, on_reported=self._release)
        if wait:
            with contextlib.suppress(Exception):  # rank 0 gone, or too slow: leave anyway
                self.store().wait([_REPORTED], datetime.timedelta(seconds=self.init_timeout_s))
        return StartupFailed(message, rank=self.rank)

    def _release(self, wait: bool = True) -> None:
        """Rank 0, once it has shown why the job stops: let the other ranks go, and keep this attempt's store (it
        lives in this process) until every rank has come to read that, or `init_timeout_s` has passed."""
        self._post(_REPORTED, "yes")
        if wait:
            with contextlib.suppress(Exception):
                keys = [_VERDICT.format(rank) for rank in range(self.world_size)]
                self.store().wait(keys, datetime.timedelta(seconds=self.init_timeout_s))

    def _post(self, key: str, value: str) -> None:
        try:
            self.store().set(key, value)
        except Exception as exc:  # no store: rank 0 never opened it, or stopped (and the job with it)
            if value == "ok":
                if isinstance(exc, StartupFailed):
                    raise
                raise StartupFailed("the job's store is gone (its rank stopped)", rank=self.rank) from None
