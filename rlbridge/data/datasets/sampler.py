"""Sampling: `PromptSampler` shuffles per epoch from (seed, epoch) alone, so its whole state is four integers and
a resumed run sees exactly the batches the uninterrupted one would have."""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlbridge.data.datasets.load import Prompt
from rlbridge.errors import RlbridgeError

log = logging.getLogger(__name__)


def fingerprint(prompts: Sequence[Prompt]) -> str:
    """A short hash of the prompts and answers, to refuse resuming on different data."""
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(
            p.text.encode("utf-8", "surrogatepass")
            + b"\0"
            + p.answer.encode("utf-8", "surrogatepass")
            + b"\0"
        )
    return digest.hexdigest()[:16]


class PromptSampler:
    """Endless batches of prompts, reshuffled every epoch from (seed, epoch); resumable exactly.

    A batch that runs past the end of an epoch takes the rest from the start of the next epoch's order. With
    `usable` (a source read lazily: LazyEncoded.usable_rows, asked about the rows of each batch together), a row
    it refuses is passed over as if absent: the position still moves, so the state stays the same four integers. Such a source (`fingerprint()`, millions of
    rows) is shuffled with numpy, 8 bytes per row.
    """

    def __init__(
        self,
        prompts: Sequence[Prompt],
        *,
        seed: int,
        shuffle: bool = True,
        usable: Callable[[list[int]], list[bool]] | None = None,
        fingerprint_of: Callable[[], str] | None = None,
    ) -> None:
        if not len(prompts):
            raise RlbridgeError("no prompts to sample from")
        self.prompts = prompts if usable is not None else list(prompts)
        self.seed, self.shuffle = seed, shuffle
        self.usable = usable
        self.epoch, self.index = 0, 0
        self._fingerprint = fingerprint_of() if fingerprint_of is not None else fingerprint(self.prompts)
        self._order_epoch = -1
        self._order: Sequence[int] | Any = []  # a list, or a numpy array for a lazy source

    def order(self, epoch: int) -> Sequence[int]:
        """The prompt indices of one epoch, in sampling order."""
        if epoch != self._order_epoch:
            n = len(self.prompts)
            if self.usable is not None:  # a lazy source: numpy, seeded from (seed, epoch) through sha256
                import numpy as np

                seed = int.from_bytes(hashlib.sha256(f"{self.seed}-{epoch}".encode()).digest()[:8], "little")
                self._order = np.random.default_rng(seed).permutation(n) if self.shuffle else np.arange(n)
            else:
                order = list(range(n))
                if (
                    self.shuffle
                ):  # a str seed is hashed with sha512: the same in every process and Python version
                    random.Random(f"{self.seed}-{epoch}").shuffle(order)
                self._order = order
            self._order_epoch = epoch
        return self._order

    def next_indices(self, batch_size: int) -> list[int]:
        """Positions in `prompts` of the next batch (to index parallel lists such as token ids)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        batch: list[int] = []
        passed = 0  # rows passed over since the last one taken
        while len(batch) < batch_size:
            order = self.order(self.epoch)
            take = [int(i) for i in order[self.index : self.index + batch_size - len(batch)]]
            self.index += len(take)
            if self.usable is not None:
                kept = [i for i, ok in zip(take, self.usable(take), strict=True) if ok]
                passed = 0 if kept else passed + len(take)
                if passed >= len(order):
                    raise RlbridgeError(
                        "no row of the training data is usable as a prompt (see the warnings)"
                    )
                take = kept
            batch.extend(take)
            if self.index == len(order):
                self.epoch, self.index = self.epoch + 1, 0
        return batch

    def next_batch(self, batch_size: int) -> list[Prompt]:
        """The next batch of prompts."""
        return [self.prompts[i] for i in self.next_indices(batch_size)]

    def state(self) -> dict[str, Any]:
        """JSON-able position: resume with `load_state`."""
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "index": self.index,
            "size": len(self.prompts),
            "fingerprint": self._fingerprint,
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue from `state` (from `state()`); refuses a state recorded on different data."""
        size = state.get("size")
        if size != len(self.prompts):
            raise RlbridgeError(
                f"the checkpoint's data position is for {size} prompts but the dataset now has "
                f"{len(self.prompts)}; resuming would not reproduce the data order. Restore "
                "data.train.path and data.train.limit of the original run (and data.train.loader: a .jsonl or "
                ".parquet file read whole counts only its usable prompts; set loader memory for a run started "
                "that way)"
            )
        if state.get("fingerprint", self._fingerprint) != self._fingerprint:
            raise RlbridgeError(
                "the checkpoint's data position is for different prompts (same count, different "
                "content); restore the original data.train.path file to resume"
            )
        if not (
            isinstance(state.get("epoch"), int)
            and isinstance(state.get("index"), int)
            and state["epoch"] >= 0
            and 0 <= state["index"] <= size
        ):
            raise RlbridgeError(f"invalid data position in the checkpoint: {dict(state)}")
        if (state.get("seed", self.seed), state.get("shuffle", self.shuffle)) != (self.seed, self.shuffle):
            log.warning(
                "data order follows the checkpoint (seed %s, shuffle %s), not run.seed %s / data.shuffle %s",
                state.get("seed"),
                state.get("shuffle"),
                self.seed,
                self.shuffle,
            )
        self.seed, self.shuffle = state.get("seed", self.seed), state.get("shuffle", self.shuffle)
        self.epoch, self.index = state["epoch"], state["index"]
        self._order_epoch = -1
        if self.index == size:
            self.epoch, self.index = self.epoch + 1, 0
