"""Coded PULSELoCo payloads on the wire: encode on the host, all-gather the bytes, decode.

With `LoCoConfig(payload="coded")` the bytes that travel between replicas are the payloads of
`loco_codec`, in both topologies of `loco_runtime` (device groups of one program, or processes
joined by `jax.distributed`):

  1. every process encodes the sent entries of its own replicas (host copies of their rows),
     with the low-precision bits of the replicated global θ as the positions' context;
  2. the blob lengths are all-gathered over the replica axis, then the blobs themselves as uint8
     rows padded to a common length (`padded_length`: at most 1/8 above the longest);
  3. every process decodes all R blobs into the same `[R, N]` (int32 index, fp32 value) rows
     that the uncoded formats gather, for `loco.mean_of_payloads`.

The reported wire bytes are the blobs' real lengths (plus a 4-byte length each), measured from
what was encoded, not estimated.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparserl_jax.sync import loco, loco_codec

__all__ = ["REPLICA_AXIS", "CodedExchange", "CodedRound", "host_rows", "padded_length"]

REPLICA_AXIS = "replica"


def host_rows(x: jax.Array) -> dict[int, np.ndarray]:
    """The rows of a `[R, ...]` replica-sharded array that this process holds, by replica."""
    out = {}
    for shard in x.addressable_shards:
        r = shard.index[0].start or 0
        if r not in out:
            out[r] = np.asarray(shard.data)[0]
    return out


def padded_length(n: int) -> int:
    """`n` rounded up to one of 8 steps per power of two (few distinct all-gather shapes)."""
    if n <= 64:
        return 64
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


@dataclasses.dataclass(frozen=True)
class CodedRound:
    """One coded round, summed over all R replicas (every process sees every blob)."""

    index_rn: np.ndarray  # [R, size] int32 flat indices, padded with num_params
    value_rn: np.ndarray  # [R, size] fp32 values, padded with 0
    blob_bytes: tuple[int, ...]  # encoded length per replica
    padded_length: int  # the all-gathered row length
    position_bytes: int
    value_bytes: int
    context_entropy_bits: float  # the gates' entropy given θ's exponents (loco_codec)


class CodedExchange:
    """Encode, all-gather and decode the coded payloads of one round (module docstring)."""

    def __init__(self, mesh: Mesh, config: loco.LoCoConfig, num_params: int):
        self.mesh, self.config, self.num_params = mesh, config, num_params
        self.replicas = mesh.shape[REPLICA_AXIS]
        self._rows = NamedSharding(mesh, P(REPLICA_AXIS))
        # check_vma=False: the all-gather's result is replicated over the replica axis, which the
        # varying-axes checker cannot infer.
        self._gather = jax.jit(
            jax.shard_map(
                lambda x: lax.all_gather(x[0], REPLICA_AXIS), mesh=mesh,
                in_specs=P(REPLICA_AXIS), out_specs=P(), check_vma=False,
            )
        )  # fmt: skip

    def _all_gather(self, local: dict[int, np.ndarray], shape: tuple, dtype) -> np.ndarray:
        """Rows held by this process -> every replica's row, through the collective."""
        full = np.zeros((self.replicas, *shape), dtype)
        for r, row in local.items():
            full[r] = row
        rows = jax.make_array_from_callback(full.shape, self._rows, lambda idx: full[idx])
        return np.asarray(self._gather(rows).addressable_data(0))

    def __call__(self, theta: jax.Array, sent: jax.Array, mask: jax.Array, size: int) -> CodedRound:
        """`theta`: the replicated global θ; `sent`, `mask`: `[R, P]` replica rows; `size`: the
        padded entry count (at least the largest count)."""
        cfg, num = self.config, self.num_params
        context_dtype = cfg.jnp_gate_dtype
        context = np.asarray(theta.addressable_data(0)).astype(context_dtype).view(np.uint16)
        masks, values = host_rows(mask), host_rows(sent)
        blobs = {}
        for r, m in masks.items():
            index = np.flatnonzero(m)
            bits = values[r][index].view(np.uint32)
            if cfg.value_dtype == "bfloat16":  # the low halves are zero (loco.split_bf16)
                bits = (bits >> 16).astype(np.uint16)
            blobs[r] = loco_codec.encode_payload(
                index, bits, num_params=num, context=context,
                context_dtype=cfg.gate_dtype, zstd_level=cfg.zstd_level,
            ).blob  # fmt: skip
        lengths = self._all_gather({r: len(b) for r, b in blobs.items()}, (), np.int32)
        width = padded_length(int(lengths.max()))
        local = {r: np.frombuffer(b.ljust(width, b"\0"), np.uint8) for r, b in blobs.items()}
        gathered = self._all_gather(local, (width,), np.uint8)

        index_rn = np.full((self.replicas, size), num, np.int32)
        value_rn = np.zeros((self.replicas, size), np.float32)
        position = value = 0
        entropy = 0.0
        for r in range(self.replicas):
            dec = loco_codec.decode_payload(
                gathered[r, : lengths[r]].tobytes(), num_params=num,
                value_itemsize=cfg.value_bytes, context=context, context_dtype=cfg.gate_dtype,
            )  # fmt: skip
            n = dec.index.size
            if n > size:
                raise ValueError(f"replica {r} decoded {n} entries, more than the padded {size}")
            bits = dec.bits.astype(np.uint32)
            if cfg.value_dtype == "bfloat16":
                bits = bits << 16
            index_rn[r, :n], value_rn[r, :n] = dec.index, bits.view(np.float32)
            position, value = position + dec.position_bytes, value + dec.value_bytes
            entropy += loco_codec.context_entropy_bits(context, dec.index, cfg.gate_dtype)
        return CodedRound(
            index_rn=index_rn, value_rn=value_rn, blob_bytes=tuple(int(n) for n in lengths),
            padded_length=width, position_bytes=position, value_bytes=value,
            context_entropy_bits=entropy,
        )  # fmt: skip
