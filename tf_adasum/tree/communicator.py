"""The interface between the vector-halving tree (`tf_adasum.tree.rvh`) and a
transport: what the driver asks of one rank's communicator. The transports
(`tf_adasum.comm`) implement it; the driver (`tf_adasum.tree.rvh`) and its
exchanges (`tf_adasum.tree.exchanges`) call it. Nothing here runs.
"""

from __future__ import annotations

from typing import Protocol

import tensorflow as tf

__all__ = ["Communicator"]


class Communicator(Protocol):
    """What the vector-halving driver needs from a transport.

    Members of a pair are ordered by rank: "member 0" is the lower rank.
    Every rank must call these in the same order as its peers.
    """

    rank: int
    size: int
    device: str  # where this rank's computation is placed

    def swap_halves(self, x: tf.Tensor, partner: int) -> tuple[tf.Tensor, tf.Tensor]:
        """All-to-all with `partner`: row j of ``x`` ([2, m]) goes to member j;
        returns what member 0 and member 1 sent to this rank (``[m]`` each;
        this rank's own row may be a view of ``x``)."""

    def gather_pair(self, x: tf.Tensor, partner: int) -> tf.Tensor:
        """Concatenation of member 0's and member 1's ``x`` (1-D, same length)."""

    def sum_float64(self, x: tf.Tensor, members: tuple[int, ...]) -> tf.Tensor:
        """Elementwise sum of a small float64 tensor over `members` (sorted ranks)."""

    def send(self, x: tf.Tensor, peer: int) -> tf.Tensor:
        """Sends ``x`` to `peer`, which calls `recv` for it; returns ``x`` once sent
        (use the returned tensor so that the send is part of the computation)."""

    def recv(self, peer: int, like: tf.Tensor) -> tf.Tensor:
        """Receives from `peer` a tensor of the shape and dtype of `like`."""

    def direct(self, members: tuple[int, ...]) -> bool:
        """Whether this rank may read the tensors of `members` (sorted ranks,
        itself among them) where they lie instead of exchanging them: true
        only where every member lives in this process and the driver builds
        them all in one `allreduce` call. Every member must answer alike."""

    # Optional, for a transport that moves the bytes itself (never direct;
    # `tf_adasum.comm.socket_communicator.SocketCommunicator`):
    #
    # piece_bytes: int
    #     > 0: every level's swap goes through `swap_in_pieces` instead of
    #     `swap_halves`, in messages of about this many bytes (one where the
    #     half is smaller than two), and each level but the last combines its
    #     slice as two halves, the one sent next first.
    #
    # def swap_in_pieces(self, send, keep, partner, cuts) -> tuple[tf.Tensor, list[tf.Tensor], tf.Tensor]:
    #     Sends `send` ([m], this rank's half for `partner`) and receives the
    #     partner's half for this rank, both cut at the element offsets `cuts`;
    #     returns `keep` (the half this rank keeps) as its peers would see it
    #     had it travelled, the received pieces, each as soon as it has come,
    #     and the whole received half ([m]).
