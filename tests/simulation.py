"""A numpy simulation of data-parallel training of one Dense layer (MSE loss):
local inner steps with per-replica optimizer state, then a combine of the
deltas (delta mode) or of the local gradients (gradient mode), in float64."""

import keras
import numpy as np

IN, OUT, BATCH = 4, 3, 12


def _learning_rate(lr, iteration):
    return lr(iteration) if callable(lr) else lr


class SGD:
    """Keras SGD: optional momentum, clipnorm (per tensor) and weight decay."""

    def __init__(self, lr=0.1, momentum=0.9, clipnorm=None, weight_decay=None, keras_lr=None):
        self.lr, self.momentum, self.clipnorm, self.weight_decay = lr, momentum, clipnorm, weight_decay
        self.keras_lr = keras_lr if keras_lr is not None else lr

    def init(self, weights):
        return [np.zeros_like(w) for w in weights]

    def delta(self, grads, state, iteration, weights):
        lr = _learning_rate(self.lr, iteration)
        if self.clipnorm is not None:
            grads = [g * self.clipnorm / max(np.linalg.norm(g), self.clipnorm) for g in grads]
        decay = [-w * self.weight_decay * lr if self.weight_decay else 0.0 for w in weights]
        state = [self.momentum * m - lr * g for m, g in zip(state, grads)]
        return [s + d for s, d in zip(state, decay)], state

    def keras(self):
        return keras.optimizers.SGD(
            self.keras_lr, momentum=self.momentum, clipnorm=self.clipnorm, weight_decay=self.weight_decay
        )


class Adam:
    """Keras Adam (AdamW when `weight_decay` is set)."""

    def __init__(self, lr=0.01, beta_1=0.9, beta_2=0.999, epsilon=1e-7, weight_decay=None):
        self.lr, self.b1, self.b2, self.eps, self.weight_decay = lr, beta_1, beta_2, epsilon, weight_decay

    def init(self, weights):
        return [(np.zeros_like(w), np.zeros_like(w)) for w in weights]

    def delta(self, grads, state, iteration, weights):
        t = iteration + 1
        alpha = self.lr * np.sqrt(1 - self.b2**t) / (1 - self.b1**t)
        new_state, deltas = [], []
        for g, (m, v), w in zip(grads, state, weights):
            decay = -w * self.weight_decay * self.lr if self.weight_decay else 0.0
            m = m + (g - m) * (1 - self.b1)
            v = v + (g * g - v) * (1 - self.b2)
            new_state.append((m, v))
            deltas.append(decay - (m * alpha) / (np.sqrt(v) + self.eps))
        return deltas, new_state

    def keras(self):
        if self.weight_decay:
            return keras.optimizers.AdamW(
                self.lr, weight_decay=self.weight_decay, beta_1=self.b1, beta_2=self.b2, epsilon=self.eps
            )
        return keras.optimizers.Adam(self.lr, beta_1=self.b1, beta_2=self.b2, epsilon=self.eps)


def _grads(weights, x, y):
    """MSE gradients of a Dense layer (mean over the shard and the outputs)."""
    kernel, bias = weights
    err = x @ kernel + bias - y
    scale = 2.0 / (len(x) * OUT)
    return [scale * x.T @ err, scale * err.sum(0)]


def simulate(weights, x, y, n, steps, inner, combine, mode="delta", k=1):
    """Weights after `steps` batches of BATCH rows, replica r taking rows r*b:(r+1)*b."""
    b = BATCH // n
    weights = [w.astype(np.float64) for w in weights]
    states = [inner.init(weights) for _ in range(n)]
    shared_state = inner.init(weights)
    iteration = 0

    def shard(step, r):
        rows = slice(step * BATCH + r * b, step * BATCH + (r + 1) * b)
        return x[rows].astype(np.float64), y[rows].astype(np.float64)

    for first in range(0, steps, k):
        if mode == "delta":
            local = [list(weights) for _ in range(n)]
            for step in range(first, first + k):
                for r in range(n):
                    deltas, states[r] = inner.delta(_grads(local[r], *shard(step, r)), states[r], iteration, local[r])
                    local[r] = [w + d for w, d in zip(local[r], deltas)]
                iteration += 1
            combined = combine([[lw - w for lw, w in zip(local[r], weights)] for r in range(n)])
            weights = [w + c for w, c in zip(weights, combined)]
        else:
            per_replica = []
            for r in range(n):
                grads = [_grads(weights, *shard(step, r)) for step in range(first, first + k)]
                per_replica.append([sum(g[i] for g in grads) / k for i in range(2)])
            deltas, shared_state = inner.delta(combine(per_replica), shared_state, iteration, weights)
            weights = [w + d for w, d in zip(weights, deltas)]
            iteration += 1
    return weights


def data(steps, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((steps * BATCH, IN)).astype(np.float32),
        rng.standard_normal((steps * BATCH, OUT)).astype(np.float32),
    )
