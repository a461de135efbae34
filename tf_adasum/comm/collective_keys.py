"""Collective group and instance keys, handed out in one place.

Every member of a collective must name it by the same group key and
instance key. `CollectiveKeys` derives a group's key from the set of its
devices (a hash, so every process computes the same key for the same group
whatever else it allocated before), and counts instance keys per (group,
device), so every member of a group draws the same keys as long as it issues
the same collectives in the same order. `KEYS` is the process-wide
allocator that `tf_adasum.comm.collective` and the socket transport's tags
draw from; `fallback_keys` gives TensorFlow's own allocator, for the default
all-reduce, a block of group keys of its own.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence

import tensorflow as tf
from tensorflow.python.distribute import cross_device_utils

__all__ = ["KEYS", "CollectiveKeys", "canonical_device", "device_sort_key"]

# Well above the keys TensorFlow's own CollectiveAllReduce hands out (from 1):
# our groups' keys, and the blocks of keys for each default fallback.
_GROUP_KEY_START = 0x0ADA0000
_GROUP_KEY_SPACE = 1 << 24
_FALLBACK_KEY_START = 0x0C000000
_FALLBACK_BLOCK = 64  # keys per fallback (TF's CollectiveKeys hands them out from the block's start)


def device_sort_key(device: str) -> tuple:
    """The order in which the collective runtime ranks the members of a group
    (job, replica, task, device type, device index; numerically)."""
    spec = tf.DeviceSpec.from_string(device)
    return (spec.job or "", spec.replica or 0, spec.task or 0, (spec.device_type or "").upper(), spec.device_index or 0)


def canonical_device(device: str) -> str:
    """`device` as TensorFlow spells it in full (the key of its counters and tokens)."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.to_string()


def _members(devices: Sequence[str]) -> tuple[str, ...]:
    return tuple(sorted((canonical_device(d) for d in devices), key=device_sort_key))


def _hash(members: tuple[str, ...], modulus: int, salt: str = "") -> int:
    digest = hashlib.sha256((salt + "\n".join(members)).encode()).digest()
    return int.from_bytes(digest[:8], "big") % modulus


class CollectiveKeys:
    """Hands out collective group and instance keys (process-wide).

    A group's key is derived from its member devices alone (a hash), so every
    process computes the same key for the same group whatever else it has
    allocated before (a local strategy, a fallback). Two groups whose hashes
    collide in one process raise instead of sharing a key.
    """

    def __init__(self, group_key_start: int = _GROUP_KEY_START):
        self._lock = threading.Lock()
        self._start = group_key_start
        self._group_keys: dict[tuple[str, ...], int] = {}
        self._owners: dict[int, tuple[str, ...]] = {}
        self._fallback_owners: dict[int, tuple[str, ...]] = {}
        self._fallback_keys: dict[tuple[str, ...], cross_device_utils.CollectiveKeys] = {}
        self._instance_keys: dict[tuple[int, str], int] = {}

    def group_key(self, devices: Sequence[str]) -> int:
        """The key of the group made of `devices` (in any order)."""
        members = _members(devices)
        with self._lock:
            if members not in self._group_keys:
                key = self._start + _hash(members, _GROUP_KEY_SPACE)
                _claim(self._owners, key, members)
                self._group_keys[members] = key
            return self._group_keys[members]

    def fallback_keys(self, devices: Sequence[str]) -> cross_device_utils.CollectiveKeys:
        """TensorFlow's key allocator for fallback all-reduces over `devices`:
        one per device set in the process (shared, so that its instance keys
        never repeat), handing out group keys from a block derived from the
        devices."""
        members = _members(devices)
        blocks = (1 << 24) // _FALLBACK_BLOCK
        start = _FALLBACK_KEY_START + _FALLBACK_BLOCK * _hash(members, blocks, salt="fallback\n")
        with self._lock:
            _claim(self._fallback_owners, start, members)
            if members not in self._fallback_keys:
                self._fallback_keys[members] = cross_device_utils.CollectiveKeys(group_key_start=start)
            return self._fallback_keys[members]

    def instance_key(self, group_key: int, device: str) -> int:
        """The next instance key of `device` in group `group_key`."""
        slot = (group_key, canonical_device(device))
        with self._lock:
            key = self._instance_keys.get(slot, 1)
            self._instance_keys[slot] = key + 1
            return key


def _claim(owners: dict[int, tuple[str, ...]], key: int, members: tuple[str, ...]) -> None:
    owner = owners.setdefault(key, members)
    if owner != members:
        raise RuntimeError(
            f"tf_adasum: collective group key {key} derived for devices {members} is already used by "
            f"{owner} in this process (a hash collision); please report it."
        )


#: The process-wide key allocator.
KEYS = CollectiveKeys()
