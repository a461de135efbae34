"""A combiner of one's own: `combiners.register` and `combiners.serialize` end
to end, through AdasumOptimizer's tree, its config and a `.keras` file."""

import os

import keras
import numpy as np
import pytest
from conftest import mirrored
from simulation import BATCH, IN, OUT, SGD, data, simulate

import tf_adasum
from tf_adasum import combiners, reference


class Blend(combiners.Combiner):
    """``left * a + (1 - left) * b``: a pair rule with a setting, and not
    symmetric, so the tree's order and the setting both show in the result."""

    name = "blend"

    def __init__(self, left: float = 0.5):
        self.left = left

    def combine(self, a, b, segments, partials):
        return self.left * a + (1.0 - self.left) * b

    def get_config(self):
        return {"left": self.left}


def _blend_tree(left):
    """The numpy oracle: `Blend` over `reference.tree_reduce`'s tree, per tensor, in float64."""
    pair = lambda a, b: left * a + (1.0 - left) * b  # noqa: E731
    return lambda per_rank: [reference.tree_reduce(list(values), pair) for values in zip(*per_rank)]


@pytest.fixture
def registered(monkeypatch):
    """`Blend` registered for one test (the registry is restored afterwards)."""
    monkeypatch.setattr(combiners, "_BY_NAME", dict(combiners._BY_NAME))
    monkeypatch.setattr(combiners, "_BY_CLASS_NAME", dict(combiners._BY_CLASS_NAME))
    with pytest.raises(ValueError, match="Received: class_name='Blend'"):
        combiners.get({"class_name": "Blend", "config": {"left": 0.75}})
    assert combiners.register(Blend) is Blend
    return Blend


def test_a_registered_combiner_trains_and_round_trips(registered, tmp_path):
    blend = registered(left=0.75)
    assert combiners.serialize(blend) == {"class_name": "Blend", "config": {"left": 0.75}}
    assert combiners.get(combiners.serialize(blend)) == blend
    assert combiners.get("blend") == Blend()  # by its name, with the default setting

    n, steps, inner = 3, 2, SGD(momentum=0.0)
    x, y = data(steps)
    strategy = mirrored(n)[0]
    with strategy.scope():
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT)])
        initial = [w.numpy() for w in model.weights]
        optimizer = tf_adasum.AdasumOptimizer(inner.keras(), combiner=blend)
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    expected = simulate(initial, x, y, n, steps, inner, _blend_tree(0.75))
    for got, want in zip(model.weights, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)

    config = optimizer.get_config()
    assert config["combiner"] == {"class_name": "Blend", "config": {"left": 0.75}}
    assert tf_adasum.AdasumOptimizer.from_config(config).combiner == blend
    path = os.path.join(tmp_path, "blend.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer.combiner, Blend) and loaded.optimizer.combiner.left == 0.75
