"""How the processes walk a save of a model whose state is split over them together: the
chief leads, announcing each gather (or each value it read from a file) to the others,
and every other process follows (`ChiefLeads`).

In the script's saves (`model.save`, `save_weights` on every process) the chief walks Keras's
save and the others follow. In a checkpoint of fit the chief's callback and, at the same
step, every other process's stand-in run: a stand-in's own `save_best_only` decision can
differ from the chief's wherever their counters do (a second fit with the same checkpoint
once ran the chief's gathers against none, on PyTorch and JAX, when each fit's stand-in
started afresh). A stand-in's own walk therefore gathers nothing, and then it follows the
chief's.
"""

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


class ChiefLeads:
    """The chief's lead and the others' following, for one engine's split state.

    Args:
        collectives: the job's collectives (`broadcast_object` carries the announcements).
    """

    def __init__(self, collectives: Any) -> None:
        self.collectives = collectives
        self.leading = False  # the chief writes a save, announcing each gather to the others
        self.standing_in = False  # this process's stand-in walks the chief's checkpoint: it gathers nothing

    def announce(self, request: tuple | None) -> None:
        """Tells the followers what to take part in next (None: the save ended)."""
        self.collectives.broadcast_object(request)

    @contextlib.contextmanager
    def leading_save(self) -> Iterator[None]:
        """The chief's save of the script's: each gather announced to the others (`follow`)."""
        self.leading = True
        try:
            yield
        finally:
            self.leading = False
            self.announce(None)

    @contextlib.contextmanager
    def checkpoint_together(self) -> Iterator[None]:
        """A checkpoint of fit (or its restore) on the chief, with every other process's
        stand-in at the same step: the chief leads; a stand-in's own walk gathers and reads
        nothing, then it follows the chief's."""
        chief = self.collectives.rank == 0
        self.leading, self.standing_in = chief, not chief
        try:
            yield
        finally:
            self.leading = self.standing_in = False
            if chief:
                self.announce(None)
            else:
                self.follow()

    def follow(self) -> None:
        """Another process's part in what the chief leads, until it ends."""
        take_part = self.part_taker()
        while (request := self.collectives.broadcast_object(None)) is not None:
            take_part(*request)

    def part_taker(self) -> Callable[[str, Any], None]:
        """What a follower does for one announcement (kind, detail), for one save."""
        raise NotImplementedError
