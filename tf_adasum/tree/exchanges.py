"""How the ranks one `tf_adasum.tree.rvh.allreduce` call builds reach their
partners: `Ranks` hands each exchange to a rank's communicator (a
`tf_adasum.tree.communicator.Communicator`), or, where every member is built in this
call and the communicator allows it (`Communicator.direct`), reads the
partner's tensor where it lies; `pairwise_sum` is the fixed order in which a
sum over ranks adds their values, whichever path it takes.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tf_adasum.tree import topology
from tf_adasum.tree.communicator import Communicator

__all__ = ["Ranks", "pairwise_sum"]


class Ranks:
    """The ranks one `tf_adasum.tree.rvh.allreduce` call builds, and how each exchange reaches a
    partner: a plain reference to the partner's tensor where every member is
    built here and the communicator allows it (`Communicator.direct`), else the
    communicator's own exchange. Each method takes and returns ``{i: ...}``
    keyed by the index of the rank's communicator; a direct exchange needs
    every member's entry in the same call."""

    def __init__(self, comms: Sequence[Communicator]):
        self.comms = list(comms)
        index = {comm.rank: i for i, comm in enumerate(self.comms)}
        # Repeated ranks: one rank each of several trees (the cross-worker scope), never direct.
        self._index = index if len(index) == len(self.comms) else {}

    def _direct(self, i: int, members: tuple[int, ...]) -> bool:
        """Whether every member is built here and every member's communicator
        allows a direct exchange (so all of them take the same path)."""
        if not all(m in self._index for m in members):
            return False
        return all(self.comms[self._index[m]].direct(members) for m in members)

    def _inputs_of(self, inputs: dict, members: tuple[int, ...]) -> list:
        return [inputs[self._index[m]][0] for m in members]

    def _each(self, inputs: dict, members_of, direct, exchange) -> dict:
        """``{i: direct(i, members) or exchange(comm, x, arg)}`` over
        ``inputs = {i: (x, arg)}``, each on its rank's device; `members_of`
        gives the sorted members of rank i's exchange from (rank, arg)."""
        out = {}
        for i, (x, arg) in inputs.items():
            comm = self.comms[i]
            members = members_of(comm.rank, arg)
            with tf.device(comm.device):
                out[i] = direct(i, members) if self._direct(i, members) else exchange(comm, x, arg)
        return out

    def swap_halves(self, inputs: dict[int, tuple[tf.Tensor, int]]) -> dict[int, tuple[tf.Tensor, tf.Tensor]]:
        """Per rank ``(a, b)``: what the lower and the upper member of its pair
        send it (rows of the ``[2, m]`` inputs; views, not copies, on CPUs)."""

        def direct(i, pair):
            row = pair.index(self.comms[i].rank)
            return tuple(member_x[row] for member_x in self._inputs_of(inputs, pair))

        return self._each(inputs, topology.pair, direct, lambda comm, x, partner: comm.swap_halves(x, partner))

    def gather_pair(self, inputs: dict[int, tuple[tf.Tensor, int]]) -> dict[int, tf.Tensor]:
        """Per rank, the concatenation of its pair's ``x`` (the lower member's
        first), from ``{i: (x, partner)}``."""
        return self._each(
            inputs,
            topology.pair,
            lambda i, pair: tf.concat(self._inputs_of(inputs, pair), axis=0),
            lambda comm, x, partner: comm.gather_pair(x, partner),
        )

    def sum_float64(self, inputs: dict[int, tuple[tf.Tensor, tuple[int, ...]]]) -> dict[int, tf.Tensor]:
        """Per rank, the elementwise sum of a small float64 ``x`` over its
        `members` (sorted ranks), from ``{i: (x, members)}``: `pairwise_sum`
        where every member is built here, else the communicator's."""
        return self._each(
            inputs,
            lambda rank, members: members,
            lambda i, members: pairwise_sum(self._inputs_of(inputs, members)),
            lambda comm, x, members: comm.sum_float64(x, members),
        )

    def transfer(
        self, sends: dict[int, tuple[tf.Tensor, int]], recvs: dict[int, tuple[int, tf.Tensor]]
    ) -> tuple[dict[int, tf.Tensor], dict[int, tf.Tensor]]:
        """Each rank in `sends` sends ``x`` to its peer, each in `recvs` receives
        a tensor like ``like`` from its peer; returns (the sent tensors, once
        sent; the received ones)."""
        sent = self._each(sends, topology.pair, lambda i, pair: sends[i][0], lambda comm, x, peer: comm.send(x, peer))
        received = self._each(
            {i: (like, peer) for i, (peer, like) in recvs.items()},
            topology.pair,
            lambda i, pair: sends[self._index[recvs[i][0]]][0],  # what the peer sends
            lambda comm, like, peer: comm.recv(peer, like=like),
        )
        return sent, received


def pairwise_sum(values: list[tf.Tensor]) -> tf.Tensor:
    """The sum of `values` as recursive doubling adds them (neighbours first,
    in list order: (v0 + v1) + (v2 + v3) for four), so every rank computing
    it gets the same bits, those of `TFCollectiveCommunicator.sum_float64`
    over the same (power-of-two) members.
    Each addition of two is a `tf.reduce_sum` over a pair of rows, not an
    ``Add``: Grappler's arithmetic optimizer may merge a tree of ``Add`` ops
    into one ``AddN`` and order its inputs differently in two ranks' graphs
    (seen here for sums over the rows of one tensor: one rank of four got
    other bits)."""
    while len(values) > 1:
        values = [
            tf.reduce_sum(tf.stack(values[k : k + 2]), axis=0) if k + 1 < len(values) else values[k]
            for k in range(0, len(values), 2)
        ]
    return values[0]
