"""Program order for calls that TensorFlow cannot see the peers of.

A transport whose steps are ``tf.numpy_function`` calls (MPI, sockets) must
issue them in the same order on every process: each call blocks one of
TensorFlow's threads until its peers take part, so two processes running
their calls in different orders could each wait for a call the other has not
started. `Chain` makes each such call of a graph depend on the previous one.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence

import tensorflow as tf
from tensorflow.python.ops import control_flow_util

__all__ = ["Chain"]


class Chain:
    """Orders a process's calls of one transport: per graph, each depends on the previous one.

    Keyed weakly by the graph and holding only the last call's op name (a
    tensor would keep its graph alive), so a collected graph is forgotten and
    a new graph never inherits another's last call.

    Args:
      who: what makes the calls, for the error inside XLA (e.g. "The MPI
        engine calls MPI").
    """

    def __init__(self, who: str):
        self._who = who
        self._last: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def chain(self, make: Callable[[], tf.Tensor | Sequence[tf.Tensor]]):
        """Builds ``make()`` after this graph's previous call; returns its output(s)."""
        if tf.executing_eagerly():
            return make()
        graph = tf.compat.v1.get_default_graph()
        if control_flow_util.GraphOrParentsInXlaContext(graph):
            raise ValueError(
                f"{self._who} outside XLA, which cannot compile it. Compile the model with "
                "`jit_compile=False` (Keras turns XLA on by default on a GPU without a strategy). "
                "Received: a tf_adasum transport call inside an XLA-compiled function"
            )
        with self._lock:
            last = self._last.get(graph)
            with tf.control_dependencies([] if last is None else [graph.get_operation_by_name(last)]):
                out = make()
            self._last[graph] = tf.nest.flatten(out)[0].op.name
        return out

    def call(self, fn, inputs: Sequence[tf.Tensor], dtype: tf.DType, shape) -> tf.Tensor:
        """A chained ``tf.numpy_function(fn, inputs, dtype)`` with the static `shape`."""
        out = self.chain(lambda: tf.numpy_function(fn, list(inputs), dtype, stateful=True))
        out.set_shape(shape)
        return out
