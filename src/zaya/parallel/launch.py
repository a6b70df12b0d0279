"""This process's place in the job, as the launcher describes it, and the start-up check that lets every
rank of a job fail together.

Under torchrun a worker learns RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (the rendezvous
store, the agent's own when TORCHELASTIC_USE_AGENT_STORE is set) and TORCHELASTIC_RESTART_COUNT. Without a
launcher the job is this one process.

All keys go under `zaya/restart-N/`: after torchrun restarts the workers, the agent's store still holds
what the previous attempt wrote, and a worker must not mistake it for its peers' answers.

Start-up check: every rank first reads its config and inputs on its own. A rank that finds something wrong
posts its one-line error to the store and exits; the others, once done, wait for every rank's verdict. So
bad input (a key, a file, a mesh that does not fit) ends the whole job at once, every rank with a non-zero
exit, and rank 0 prints the line once, naming the rank it came from when that was not rank 0. A rank that
dies without a verdict is reported after `init_timeout_s`. The failing ranks exit only once rank 0 has shown
the error: torchrun stops every worker as soon as the first one exits, and rank 0 must not be stopped
before it has said why.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch.distributed as dist

from zaya.errors import StartupFailed, ZayaError
from zaya.parallel.config import DEFAULT_INIT_TIMEOUT_S

_VERDICT = "startup/rank-{}"
_REPORTED = "startup/reported"  # rank 0 has shown the error: the other ranks may exit


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

    def store(self) -> dist.Store:
        """The job's key-value store (made on first use), its keys under this attempt's prefix."""
        timeout = datetime.timedelta(seconds=self.init_timeout_s)
        if self._store is None:
            if self.world_size == 1:
                base = dist.HashStore()
            else:
                base = dist.TCPStore(self.master_addr, self.master_port, self.world_size,
                                     is_master=self.rank == 0 and not self.agent_store, timeout=timeout,
                                     wait_for_workers=False)
            self._store = dist.PrefixStore(f"zaya/restart-{self.restart}", base)
        self._store.set_timeout(timeout)
        return self._store

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
        except BaseException:
            self._post(_VERDICT.format(self.rank), "error:an internal error (its traceback is on that rank)")
            if self.is_main:
                self._post(_REPORTED, "yes")
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
            return StartupFailed(message, rank=0, on_reported=lambda: self._post(_REPORTED, "yes"))
        if wait:
            with contextlib.suppress(Exception):  # rank 0 gone, or too slow: leave anyway
                self.store().wait([_REPORTED], datetime.timedelta(seconds=self.init_timeout_s))
        return StartupFailed(message, rank=self.rank)

    def _post(self, key: str, value: str) -> None:
        try:
            self.store().set(key, value)
        except Exception:  # the store is gone: the rank that served it has stopped, and the job with it
            if value == "ok":
                raise StartupFailed("the job's store is gone (its rank stopped)", rank=self.rank) from None
