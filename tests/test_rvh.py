"""The vector-halving driver (`tf_adasum.tree.rvh`), its rank groups
(`tf_adasum.tree.topology`) and its buckets (`tf_adasum.tree.buckets`): bucket
layout, rank groups, and bytes on the wire."""

import os

import numpy as np
import pytest
import tensorflow as tf
from conftest import TEST_TIMEOUT_SECONDS, TOLERANCE, relative_error
from multiprocess import TESTS, load_worker

from tf_adasum import combiners, reference
from tf_adasum.comm.collective import TFCollectiveCommunicator
from tf_adasum.engines.base import combine_with_communicators
from tf_adasum.ops import BLOCK, Segments
from tf_adasum.tree import buckets, exchanges, topology

B = BLOCK


def test_segments_of_a_slice_straddling_tensors():
    # Tensors of 3, 5 and 2 blocks; 12 blocks in all (the last tensor owns the padding).
    bucket = buckets.Bucket(tf.float32, indices=(0, 1, 2), sizes=(3 * B, 5 * B - 7, 1), total_blocks=12)
    assert bucket.blocks == (3, 5, 1)
    assert bucket.padded_length == 12 * B
    assert bucket.starts() == [0, 3 * B, 8 * B]
    assert bucket.segments(0, 12 * B) == Segments(0, (3, 5, 4), 3)
    assert bucket.segments(0, 6 * B) == Segments(0, (3, 3), 3)
    assert bucket.segments(6 * B, 12 * B) == Segments(1, (2, 4), 3)
    assert bucket.segments(3 * B, 6 * B) == Segments(1, (3,), 3)
    assert bucket.segments(9 * B, 12 * B) == Segments(2, (3,), 3)
    assert bucket.segments(10 * B, 11 * B) == Segments(2, (1,), 3)


def test_make_buckets_groups_by_dtype_and_pads_to_the_leaf_count():
    dtypes = [tf.float32, tf.float64, tf.float32, tf.float16]
    made = buckets.make_buckets(dtypes, [3, 4, 2 * B + 1, 5], num_ranks=6)  # 4 leaves
    assert [(b.dtype, b.indices, b.sizes, b.blocks, b.total_blocks) for b in made] == [
        (tf.float32, (0, 2), (3, 2 * B + 1), (1, 3), 4),
        (tf.float64, (1,), (4,), (1,), 4),
        (tf.float16, (3,), (5,), (1,), 4),
    ]


def test_make_buckets_caps_bytes_and_skips_empty_tensors():
    made = buckets.make_buckets([tf.float32] * 5, [4, 4, 0, 10, 1], num_ranks=2, bytes_per_bucket=32)
    assert [b.indices for b in made] == [(0, 1), (3,), (4,)]  # a larger tensor gets its own bucket
    assert all(b.total_blocks % 2 == 0 for b in made)


def test_pack_and_unpack_round_trip():
    tensors = [tf.reshape(tf.range(6, dtype=tf.float32), [2, 3]), tf.constant([7.0]), tf.range(B + 2, dtype=tf.float32)]
    (bucket,) = buckets.make_buckets([t.dtype for t in tensors], [6, 1, B + 2], num_ranks=4)
    flat = buckets.pack(tensors, bucket)
    assert flat.shape == [4 * B]
    np.testing.assert_array_equal(flat[:B].numpy(), np.r_[np.arange(6), np.zeros(B - 6)])
    out = buckets.unpack(flat, bucket, [t.shape for t in tensors])
    for a, b in zip(out, tensors):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_groups_power_of_two():
    assert topology.groups(4) == [(0, 1), (2, 3), (0, 2), (1, 3), (0, 1, 2, 3)]


def test_groups_with_fold():
    # N = 6: pairs (0,1), (2,3) fold; leaves are ranks 0, 2, 4, 5.
    assert topology.groups(6) == [(0, 1), (2, 3), (0, 2), (4, 5), (0, 4), (2, 5), (0, 2, 4, 5)]
    assert topology.groups(1) == []


def test_levels_and_their_representatives():
    assert [topology.num_levels(n) for n in (1, 2, 4, 6, 8)] == [0, 1, 2, 3, 3]
    assert topology.level_representatives(4) == [[0, 2], [0]]
    assert topology.level_representatives(6) == [[0, 2], [0, 4], [0]]  # the fold first
    assert topology.pair(3, 1) == topology.pair(1, 3) == (1, 3)


@pytest.mark.parametrize("n", [2, 3, 4, 6, 8, 12])
def test_every_sum_group_is_one_of_the_groups(n):
    """`sum_group`, which the driver sums a level's partials over, names a
    group of `groups` (the MPI engine's sub-communicators) for every leaf."""
    leaves, folded = reference.tree_shape(n)
    made = set(topology.groups(n))
    bit = 1
    while bit < leaves:
        for leaf in range(leaves):
            group = topology.sum_group(leaf, bit, folded)
            assert group in made and len(group) == 2 * bit, (n, leaf, bit, group)
            assert topology.real_rank(leaf, folded) in group
        bit <<= 1


def test_pairwise_sum_adds_neighbours_first():
    """(v0 + v1) + (v2 + v3), and an odd last value added at the end: the
    order decides the bits where float64 rounds."""
    values = [tf.constant([x], tf.float64) for x in (1e16, 1.0, -1e16, 1.0)]
    assert exchanges.pairwise_sum(values).numpy()[0] == 0.0  # left to right would give 1.0
    odd = [tf.constant([x], tf.float64) for x in (1.0, 1e16, -1e16)]
    assert exchanges.pairwise_sum(odd).numpy()[0] == 0.0  # (1 + 1e16) - 1e16; 1 + (1e16 - 1e16) would give 1.0


class CountingCommunicator:
    """Wraps a communicator and counts what this rank puts on the wire."""

    def __init__(self, inner):
        self.inner = inner
        self.rank, self.size, self.device = inner.rank, inner.size, inner.device
        self.payload_bytes = 0
        self.full_sends = 0
        self.sums = []
        self.messages = 0  # sequential exchanges this rank waits on (a recursive-doubling sum: one per step)

    def swap_halves(self, x, partner):
        self.payload_bytes += x.shape[1] * x.dtype.size  # one of the two rows leaves
        self.messages += 1
        return self.inner.swap_halves(x, partner)

    def gather_pair(self, x, partner):
        self.payload_bytes += x.shape.num_elements() * x.dtype.size
        self.messages += 1
        return self.inner.gather_pair(x, partner)

    def sum_float64(self, x, members):
        self.sums.append((tuple(x.shape), x.dtype, members))
        assert len(members) & (len(members) - 1) == 0, members  # recursive doubling needs a power of two
        self.messages += len(members).bit_length() - 1  # one pairwise exchange per doubling step
        return self.inner.sum_float64(x, members)

    def send(self, x, peer):
        self.full_sends += 1
        self.messages += 1
        return self.inner.send(x, peer)

    def recv(self, peer, like):
        self.messages += 1
        return self.inner.recv(peer, like)

    def direct(self, members):
        return False  # every exchange through the wrapped transport, to be counted


def _run_counting(n, sizes, rng):
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(n)]
    per_rank = [[rng.standard_normal(s).astype(np.float32) for s in sizes] for _ in range(n)]
    comms = [CountingCommunicator(TFCollectiveCommunicator(devices, r, TEST_TIMEOUT_SECONDS)) for r in range(n)]

    @tf.function(autograph=False)
    def run():
        values = [tuple(tf.constant(per_rank[r][t]) for r in range(n)) for t in range(len(sizes))]
        outputs, _ = combine_with_communicators(values, comms, combiners.Adasum())
        return [[value[r] for value in outputs] for r in range(n)]

    out = run()
    expected = reference.adasum_tree(per_rank)
    for t in range(len(sizes)):
        assert relative_error(out[0][t].numpy(), expected[t]) <= TOLERANCE["float32"]
    return comms


@pytest.mark.parametrize("n", [2, 4, 8])
def test_bytes_sent_equal_a_ring_all_reduce(n, rng):
    sizes = [1000, 24, 3]  # each padded to whole blocks, the buffer to a multiple of n blocks
    comms = _run_counting(n, sizes, rng)
    blocks = sum(-(-size // BLOCK) for size in sizes)
    padded_bytes = (-(-blocks // n) * n) * BLOCK * 4
    levels = n.bit_length() - 1
    for comm in comms:
        assert comm.payload_bytes == 2 * (n - 1) * padded_bytes // n
        assert comm.full_sends == 0
        assert len(comm.sums) == levels
        assert all(shape == (len(sizes), 3) and dtype == tf.float64 for shape, dtype, _ in comm.sums)


def test_fold_adds_one_full_buffer_each_way(rng):
    comms = _run_counting(3, [50], rng)  # rank 1 folds into rank 0; ranks 0 and 2 form the tree
    assert comms[1].full_sends == 1 and comms[1].payload_bytes == 0 and comms[1].sums == []
    # The tree of 2 leaves: a 2-block buffer; each rank swaps 1 block and gathers 1 block.
    assert comms[0].full_sends == 1 and comms[0].payload_bytes == comms[2].payload_bytes == 2 * BLOCK * 4
    assert comms[2].full_sends == 0


@pytest.mark.parametrize("n", [2, 3, 4, 6, 8])
def test_cost_model_counts_the_messages_the_tree_sends(n, rng):
    comms = _run_counting(n, [300], rng)
    cost_model = load_worker(os.path.join(TESTS, os.pardir, "benchmarks", "cost_model.py"))
    latency, *_ = cost_model.tree_terms(n, 1.0, cores=None)
    _, folded = reference.tree_shape(n)
    # A folded rank sends its buffer and receives the result; its partner pays
    # those two messages on top of the tree's; every other rank pays the tree's.
    tree_only = latency - 2 if folded else latency
    expected = [2] * folded + [tree_only] * (n - 2 * folded) + [latency] * folded
    assert sorted(comm.messages for comm in comms) == sorted(expected)


def test_make_buckets_leaves_large_unpadded_tensors_unfused():
    large = buckets.ALONE_BYTES // 4  # float32 elements
    sizes = [3, large, 5, large + B, 2 * large]  # large + B needs padding with 4 leaves
    made = buckets.make_buckets([tf.float32] * 5, sizes, num_ranks=4)
    assert [b.indices for b in made] == [(0, 2, 3), (1,), (4,)]
    (alone,) = [b for b in made if b.indices == (1,)]
    pack = tf.function(lambda t: buckets.pack([None, t], alone))
    graph = pack.get_concrete_function(tf.TensorSpec([large], tf.float32)).graph
    assert {op.type for op in graph.get_operations()} <= {"Placeholder", "Reshape", "Const", "Identity"}  # no copy


def _devices(n):
    return [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(n)]


def _graph_op_types(fn):
    return [op.type for op in fn.get_concrete_function().graph.get_operations()]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_messages_split_into_pieces_give_the_same_bits(n, rng):
    sizes = [5000, 24, 300]
    per_rank = [[rng.standard_normal(s).astype(np.float32) for s in sizes] for _ in range(n)]

    def build(max_message_bytes):
        comms = [
            TFCollectiveCommunicator(
                _devices(n), r, TEST_TIMEOUT_SECONDS, max_message_bytes=max_message_bytes, direct=False
            )
            for r in range(n)
        ]

        @tf.function(autograph=False)
        def run():
            values = [tuple(tf.constant(per_rank[r][t]) for r in range(n)) for t in range(len(sizes))]
            outputs, _ = combine_with_communicators(values, comms, combiners.Adasum())
            return [[value[r] for value in outputs] for r in range(n)]

        return run

    whole, pieces = build(0), build(1024)
    swaps = [types.count("CollectiveAllToAllV2") for types in map(_graph_op_types, (whole, pieces))]
    gathers = [types.count("CollectiveGatherV2") for types in map(_graph_op_types, (whole, pieces))]
    assert swaps[1] > swaps[0] > 0 and gathers[1] > gathers[0] > 0
    expected = reference.adasum_tree(per_rank)
    out_whole, out_pieces = whole(), pieces()
    for t in range(len(sizes)):
        for r in range(n):
            assert out_pieces[r][t].numpy().tobytes() == out_whole[0][t].numpy().tobytes()
        assert relative_error(out_whole[0][t].numpy(), expected[t]) <= TOLERANCE["float32"]


@pytest.mark.parametrize("members", [(0, 1), (0, 1, 2, 3), (0, 2, 4, 5), (0, 1, 2)])
def test_sum_float64_over_members(members, rng):
    n = max(members) + 1
    values = rng.standard_normal((n, 7, 3)) * 10.0 ** rng.integers(-8, 8, (n, 7, 3))
    comms = {r: TFCollectiveCommunicator(_devices(n), r, TEST_TIMEOUT_SECONDS) for r in members}

    @tf.function(autograph=False)
    def run():
        return [comms[r].sum_float64(tf.constant(values[r]), members) for r in members]

    types = _graph_op_types(run)
    power_of_two = not len(members) & (len(members) - 1)
    assert ("CollectiveReduceV2" in types) != power_of_two  # recursive doubling over pairs, else a ring
    sums = [s.numpy() for s in run()]
    for s in sums:
        assert s.tobytes() == sums[0].tobytes()  # bitwise the same on every member
    np.testing.assert_allclose(sums[0], values[list(members)].sum(0), rtol=1e-14)
    if power_of_two:  # what a direct exchange computes in its place, bit for bit
        local = exchanges.pairwise_sum([tf.constant(values[r]) for r in members])
        assert local.numpy().tobytes() == sums[0].tobytes()


def _adasum_with_partials(comms, per_rank):
    """A traced Adasum combine of `per_rank` (per rank, a list of arrays) over
    `comms`, returning per rank its outputs, and the per-rank partials."""
    n, count = len(comms), len(per_rank[0])

    @tf.function(autograph=False)
    def run():
        values = [tuple(tf.constant(per_rank[r][t]) for r in range(n)) for t in range(count)]
        outputs, partials = combine_with_communicators(values, comms, combiners.Adasum())
        return [[value[r] for value in outputs] for r in range(n)], list(partials)

    return run


@pytest.mark.parametrize("n", [2, 3, 4, *(pytest.param(n, marks=pytest.mark.slow) for n in (6, 8))])
def test_direct_exchange_within_a_process_gives_the_collectives_bits(n, rng):
    sizes = [5000, 24, 300] + [7] * 12  # many tensors: many partial-sum rows
    per_rank = [[rng.standard_normal(s).astype(np.float32) for s in sizes] for _ in range(n)]

    def build(direct):
        comms = [TFCollectiveCommunicator(_devices(n), r, TEST_TIMEOUT_SECONDS, direct=direct) for r in range(n)]
        return _adasum_with_partials(comms, per_rank)

    direct, collectives = build(True), build(False)
    assert not [t for t in _graph_op_types(direct) if t.startswith("Collective")]
    assert "CollectiveAllToAllV2" in _graph_op_types(collectives)
    (out_direct, partials_direct), (out_collectives, partials_collectives) = direct(), collectives()
    expected = reference.adasum_tree(per_rank)
    for t in range(len(sizes)):
        for r in range(n):
            assert out_direct[r][t].numpy().tobytes() == out_collectives[0][t].numpy().tobytes()
        assert relative_error(out_direct[0][t].numpy(), expected[t]) <= TOLERANCE["float32"]
    for a, b in zip(partials_direct, partials_collectives):
        assert a.numpy().tobytes() == b.numpy().tobytes()  # the diagnostics' per-level partial sums too


def test_direct_only_between_cpus_of_this_process():
    devices = [
        "/job:worker/replica:0/task:0/device:CPU:0",
        "/job:worker/replica:0/task:0/device:CPU:1",
        "/job:worker/replica:0/task:1/device:CPU:0",
        "/job:worker/replica:0/task:0/device:GPU:0",
    ]
    comm = TFCollectiveCommunicator(devices, 0)
    assert comm.direct((0, 1))
    assert not comm.direct((0, 2))  # another process
    assert not comm.direct((0, 3))  # a GPU
    assert not TFCollectiveCommunicator(devices, 0, direct=False).direct((0, 1))


class DirectWithin:
    """A collective communicator that answers `direct` for members within one
    block of `block` consecutive ranks only, as a process holding `block` of
    a tree's ranks would (a mixed tree: some pairs direct, some collective)."""

    def __init__(self, inner, block):
        self.inner, self.block = inner, block
        self.rank, self.size, self.device = inner.rank, inner.size, inner.device

    def direct(self, members):
        return len({m // self.block for m in members}) == 1

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("n, block", [(4, 2), (6, 3), pytest.param(8, 4, marks=pytest.mark.slow), (5, 2)])
def test_mixed_trees_give_the_collectives_bits(n, block, rng):
    sizes = [3000, 24, 300]
    per_rank = [[rng.standard_normal(s).astype(np.float32) for s in sizes] for _ in range(n)]

    def build(wrap):
        comms = [wrap(TFCollectiveCommunicator(_devices(n), r, TEST_TIMEOUT_SECONDS, direct=False)) for r in range(n)]
        return _adasum_with_partials(comms, per_rank)

    mixed, collectives = build(lambda c: DirectWithin(c, block)), build(lambda c: c)
    graph = mixed.get_concrete_function().graph
    outputs = {t.op for t in graph.outputs}  # the function's own output Identities
    unplaced = [
        op.type
        for op in graph.get_operations()
        if not op.device and op not in outputs and op.type not in ("Const", "NoOp", "Placeholder")
    ]
    assert not unplaced  # every op of the collective on its rank's device
    (out_mixed, partials_mixed), (out_collectives, partials_collectives) = mixed(), collectives()
    for t in range(len(sizes)):
        for r in range(n):
            assert out_mixed[r][t].numpy().tobytes() == out_collectives[0][t].numpy().tobytes()
    for a, b in zip(partials_mixed, partials_collectives):
        assert a.numpy().tobytes() == b.numpy().tobytes()
