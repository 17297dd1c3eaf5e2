"""A trainer rank 0 in a thread of the test process, over a real gloo group: the trainer end of
the refit port's contract (``RefitTrainer``) for engines that join with the collective adapter."""

from __future__ import annotations

import threading

from rollout_fleet.core.refit import CollectiveSenderSpec, GroupJoin
from rollout_fleet.ports.contracts.refit_target import RefitTrainer
from tests.support.net import free_port


class ThreadedTrainer:
    def __init__(self, spec: CollectiveSenderSpec, timeout_s: float = 60.0) -> None:
        self.spec, self.timeout_s = spec, timeout_s
        self._group = None
        self._error: BaseException | None = None
        self._joining: threading.Thread | None = None

    def open(self, ranks: int) -> GroupJoin:
        """Rank 0 of a fresh group of 1 + ``ranks``, waiting for the engine in the background."""
        from rollout_fleet.adapters.collective import init_group

        self.close()
        port = free_port()

        def join() -> None:
            try:
                self._group = init_group("127.0.0.1", port, 0, 1 + ranks, "gloo", self.timeout_s)
            except BaseException as error:  # reported by send
                self._error = error

        self._joining = threading.Thread(target=join, name="trainer-join", daemon=True)
        self._joining.start()
        return GroupJoin(host="127.0.0.1", port=port, world_size=1 + ranks, train_world_size=1,
                         first_rank=1, ranks_per_worker=ranks, sender_spec=self.spec,
                         timeout_s=self.timeout_s, backend="gloo")

    def send(self, info, tensors) -> None:
        from rollout_fleet.adapters.collective import TorchWeightSender

        TorchWeightSender(self._joined(), self.spec).send(info, tensors)

    def send_then_die(self, info, tensors) -> None:
        """Send the header and the first half of the tensors, then leave the group."""
        from rollout_fleet.adapters.collective import TorchWeightSender

        half = len(info.tensors) // 2

        def dying():
            for index, meta in enumerate(info.tensors):
                if index == half:
                    raise RuntimeError("the trainer died")
                yield meta.name, tensors[meta.name]

        try:
            TorchWeightSender(self._joined(), self.spec).send(info, dying())
        except RuntimeError:
            pass
        self.close()

    def close(self) -> None:
        if self._joining is not None:
            self._joining.join(self.timeout_s)
        group, self._group, self._joining, self._error = self._group, None, None, None
        if group is not None:
            group.close()

    def _joined(self):
        self._joining.join(self.timeout_s)
        if self._error is not None:
            raise self._error
        assert self._group is not None, "the trainer's rank 0 never joined"
        return self._group

    def as_contract(self) -> RefitTrainer:
        return RefitTrainer(open=self.open, send=self.send, send_then_die=self.send_then_die,
                            close=self.close)
