"""The receiver's first apply (commit a8f3eae: unpadded scatters), kept as the measured baseline.

`tools/bench_sync.py` applies every patch with this and with today's `Receiver` side by side.
Before: each sparse leaf is one scatter padded to the next power of two of its change count (a
new program whenever a count crosses one), with the XOR mode static and the multi-index built on
the host, then every leaf's digest is recomputed on device. Not for use outside the benchmark.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Sharding

from sparserl_jax.sync import codec
from sparserl_jax.sync.errors import CorruptPatchError
from sparserl_jax.sync.mask import _leaf_digest, from_bits, to_bits
from sparserl_jax.sync.receiver import Receiver, _replicated


@jax.jit
def _digest(arr):
    """The leaf digest as the receiver computed it then: one `jnp.sum` per lane (the sharded path
    of `mask.lane_sums`; today's receiver fuses both lanes on a single device), so the baseline's
    figures do not move with the receiver's digest."""
    return _leaf_digest(to_bits(arr, None), local=False)


@functools.partial(jax.jit, static_argnames=("xor", "sharding"))
def _scatter_v1(arr, idx_nm, vals, *, xor: bool, sharding: Sharding):
    bits = to_bits(arr, None)
    idx = tuple(idx_nm[i] for i in range(arr.ndim))
    if xor:
        vals = vals ^ bits.at[idx].get(mode="fill", fill_value=0)
    bits = bits.at[idx].set(vals, mode="drop", indices_are_sorted=True)
    return lax.with_sharding_constraint(from_bits(bits, arr.dtype), sharding)


def _pad_size(n: int) -> int:
    return max(8, 1 << (n - 1).bit_length())


class ReceiverV1(Receiver):
    """`Receiver` with the first apply (verify="all" only)."""

    def apply(self, blob: bytes) -> int:
        self._check_order(codec.read_header(blob, max_header_bytes=self.max_header_bytes))
        patch = codec.decode(
            blob,
            expect=self.specs,
            base=lambda name: np.asarray(self.arrays[name]),
            max_header_bytes=self.max_header_bytes,
        )
        specs = [t.spec for t in patch.tensors.values()]
        arrays = dict(self.arrays)
        for name, t in patch.tensors.items():
            if t.encoding == "unchanged":
                continue
            shape = t.spec.shape
            sharding = self.sharding_of(name, shape)
            dtype = jnp.dtype(t.spec.dtype)
            if t.encoding == "dense":
                host = t.bits.view(np.bool_ if dtype == jnp.bool_ else dtype)
                arrays[name] = jax.device_put(host, sharding)
                continue
            n = t.index.size
            m = _pad_size(n)
            idx_nm = np.zeros((len(shape), m), np.int32)
            idx_nm[0, n:] = shape[0]
            idx_nm[:, :n] = np.stack(np.unravel_index(t.index, shape)).astype(np.int32)
            vals = np.zeros((m,), t.bits.dtype)
            vals[:n] = t.bits
            rep = _replicated(sharding)
            arrays[name] = _scatter_v1(
                arrays[name],
                jax.device_put(idx_nm, rep),
                jax.device_put(vals, rep),
                xor=t.xor,
                sharding=sharding,
            )
        names = [s.name for s in specs]
        pending = {name: _digest(arrays[name]) for name in names}
        computed = {k: np.asarray(v, np.uint32) for k, v in pending.items()}
        bad = [n for n in names if not np.array_equal(computed[n], patch.leaf_digests[n])]
        if bad or codec.state_digest(specs, computed) != patch.state_digest:
            raise CorruptPatchError(f"version {patch.new_version}: digest mismatch in {bad[:5]}")
        self.arrays, self.digests, self.specs = arrays, computed, specs
        self.version, self.state_digest = patch.new_version, patch.state_digest
        self.run_id = self.run_id or patch.run_id
        return patch.new_version
