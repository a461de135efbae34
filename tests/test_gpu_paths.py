"""What tf_adasum chooses for GPU devices, checked on a machine without one
(device strings and options, nothing run on a GPU): GPUs keep TensorFlow's
collectives (NCCL where the runtime picks it) and the XLA/TF arithmetic, and
none of the CPU-only shortcuts (native CPU kernels, reading a partner's
tensor in place, the socket transport) applies to them: no silent CPU path."""

import tensorflow as tf

import tf_adasum
from tf_adasum import ops
from tf_adasum.comm import collective
from tf_adasum.engines.tf import TFEngine

GPUS_OF_ONE_PROCESS = ("/job:localhost/replica:0/task:0/device:GPU:0", "/job:localhost/replica:0/task:0/device:GPU:1")
CPUS_OF_ONE_PROCESS = ("/job:localhost/replica:0/task:0/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:1")
GPUS_OF_TWO_WORKERS = ("/job:worker/replica:0/task:0/device:GPU:0", "/job:worker/replica:0/task:1/device:GPU:0")
CPUS_OF_TWO_WORKERS = ("/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0")


def _placed(device):
    """A tensor placed on `device` in a graph (as a traced step's tensors are)."""
    graph = tf.Graph()
    with graph.as_default(), tf.device(device):
        return tf.zeros([8])


def test_arithmetic_on_a_gpu_tensor_never_takes_the_native_cpu_kernels():
    assert ops.native_for(_placed("/device:GPU:0")) is None
    assert ops.native_for(_placed("/device:CPU:0")) is ops.cpu_kernels()


def test_gpus_of_one_process_exchange_through_collectives_not_in_place():
    assert not collective.TFCollectiveCommunicator(GPUS_OF_ONE_PROCESS, 0).direct((0, 1))
    assert collective.TFCollectiveCommunicator(CPUS_OF_ONE_PROCESS, 0).direct((0, 1))


def test_gpu_workers_keep_tf_collective_ops_not_the_socket_transport(monkeypatch):
    monkeypatch.delenv("TF_ADASUM_WORKER_TRANSPORT", raising=False)  # the default: sockets between CPU workers
    gpu, cpu = TFEngine(GPUS_OF_TWO_WORKERS, [0]), TFEngine(CPUS_OF_TWO_WORKERS, [0])
    assert not gpu._over_sockets(gpu._trees("all"))
    assert cpu._over_sockets(cpu._trees("all"))


def test_plain_reductions_on_gpus_go_to_tensorflow_s_choice():
    implementation = tf.distribute.experimental.CommunicationImplementation
    cross_device_ops = tf_adasum.AdasumCrossDeviceOps()
    gpus = cross_device_ops.fallback_for(("/gpu:0", "/gpu:1"))
    assert gpus._options.implementation == implementation.AUTO  # NCCL where the runtime has it
    assert cross_device_ops.fallback_for(("/cpu:0", "/cpu:1"))._options.implementation == implementation.RING
    assert isinstance(cross_device_ops.fallback_for(("/cpu:0", "/gpu:0")), tf.distribute.ReductionToOneDevice)
