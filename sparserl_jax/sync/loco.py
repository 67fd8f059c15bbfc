"""PULSELoCo: DiLoCo between trainer replicas with bf16-visibility-gated sparse pseudo-gradients.

DiLoCo (Douillard et al., arXiv 2311.08105): R replicas start every round from the global fp32
weights θ, each runs H inner AdamW steps on its own data, and the round's outer gradient is the
mean pseudo-gradient

    Δ_r = θ − θ_r,        g = (1/R) Σ_r Δ_r,

applied by outer Nesterov SGD (lr 0.7, momentum 0.9); every replica then resets to the new θ.

PULSELoCo (PULSE v2, arXiv 2602.03839, reconstructed from the authors' grail "PULSE-DiLoCo" v6)
replaces the dense Δ_r by a sparse one with error feedback:

    s_r    = e_r + Δ_r                               (accumulated pseudo-gradient)
    gate_r = bits(bf16(θ)) != bits(bf16(θ − s_r))    (would the step change the bf16 forward?)
    send     s_r[gate_r] as fp32 values at their flat indices
    e_r    = s_r with the sent entries zeroed         (so sent + e_r = s_r exactly)

and g = (1/R) Σ_r scatter(sent_r): an entry sent by only some replicas is still divided by R.
Outer momentum is kept (unlike SparseLoCo). The gate compares bit patterns with the PULSESync
mask (`mask.visible_mask`), so ±0 and NaN are exact.

Payload formats (the positions of the sent entries; the values are always fp32):

  - "index": an int32 flat index per entry, 8 B per entry in all (grail sends int64, 12 B);
  - "bitmask": the gate itself packed 8 entries to a byte, ceil(P/8) B, plus 4 B per entry.

The bitmask is smaller once more than P/32 entries are sent (density above 1/32 = 3.1%); with
`payload="auto"` every round takes the smaller of the two for its padded all-gather. Both carry
the same (index, value) pairs, so the new θ is bit-identical whichever travels.

This module holds the math on flat fp32 parameter vectors (P = number of parameters) and the byte
accounting; `loco_runtime.LoCoTrainer` runs it over device groups or processes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int, UInt8

from sparserl_jax.sync.mask import pack_bits, publish_bits, unpack_bits, visible_mask

Method = Literal["diloco", "pulseloco"]
METHODS = ("diloco", "pulseloco")
PayloadFormat = Literal["index", "bitmask"]
PAYLOADS = ("auto", "index", "bitmask")
GATE_DTYPES = ("bfloat16", "float16")

# Wire sizes: a PULSELoCo payload entry is an int32 flat index and an fp32 value; each replica
# also sends its entry count (the all-gather of counts that sizes the padded payload all-gather).
INDEX_BYTES = 4
VALUE_BYTES = 4
COUNT_BYTES = 4
DENSE_BYTES = 4  # DiLoCo pseudo-gradients and DDP gradients travel as fp32
MAX_PARAMS = 2**31 - 2  # int32 indices, with P itself free as the out-of-range padding index


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoCoConfig:
    """DiLoCo / PULSELoCo outer-loop settings.

    Attributes:
      method: "diloco" all-gathers dense fp32 pseudo-gradients; "pulseloco" sends the gated
        sparse (index, fp32 value) payloads with error feedback.
      inner_steps: H, inner optimizer steps per round (grail default 10; DiLoCo paper 500).
      outer_lr: outer SGD learning rate (DiLoCo/grail: 0.7).
      outer_momentum: outer momentum (DiLoCo/grail: 0.9); 0 disables it.
      nesterov: Nesterov momentum (DiLoCo: True).
      gate: PULSELoCo only; False sends every entry of s (then the round equals DiLoCo bit for bit).
      gate_dtype: the low-precision forward dtype whose visibility gates an entry.
      pad_multiple: the payload all-gather pads every replica to the max count across replicas,
        rounded up to this multiple (larger values mean fewer distinct shapes to compile).
      payload: how the positions of the sent entries travel: "index" (int32 per entry),
        "bitmask" (the packed gate) or "auto" (the smaller of the two, chosen every round).
    """

    method: Method = "pulseloco"
    inner_steps: int = 10
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    gate: bool = True
    gate_dtype: Literal["bfloat16", "float16"] = "bfloat16"
    pad_multiple: int = 1
    payload: Literal["auto", "index", "bitmask"] = "auto"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method {self.method!r} unknown; expected one of {METHODS}")
        if not isinstance(self.inner_steps, int) or self.inner_steps < 1:
            raise ValueError(f"inner_steps must be an int >= 1, got {self.inner_steps!r}")
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.gate_dtype not in GATE_DTYPES:
            raise ValueError(
                f"gate_dtype {self.gate_dtype!r} unknown; expected one of {GATE_DTYPES}"
            )
        if not isinstance(self.pad_multiple, int) or self.pad_multiple < 1:
            raise ValueError(f"pad_multiple must be an int >= 1, got {self.pad_multiple!r}")
        if self.payload not in PAYLOADS:
            raise ValueError(f"payload {self.payload!r} unknown; expected one of {PAYLOADS}")
        if self.method == "diloco" and not self.gate:
            raise ValueError("gate=False only applies to method='pulseloco' (DiLoCo has no gate)")

    @property
    def jnp_gate_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.gate_dtype)

    def outer_optimizer(self) -> optax.GradientTransformation:
        """Outer SGD on θ: `m ← μ m + g; θ ← θ − lr (g + μ m)` (Nesterov), or plain momentum."""
        momentum = self.outer_momentum if self.outer_momentum > 0 else None
        return optax.sgd(self.outer_lr, momentum=momentum, nesterov=self.nesterov)

    def padded_count(self, max_count: int) -> int:
        """Payload length every replica pads to: max count rounded up, at least one entry."""
        n = max(int(max_count), 1)
        return -(-n // self.pad_multiple) * self.pad_multiple

    def payload_format(self, num_params: int, padded: int) -> PayloadFormat:
        """The format of a round whose payloads are padded to `padded` entries."""
        if self.payload != "auto":
            return self.payload
        index = padded_payload_bytes(1, padded, num_params, "index")
        return (
            "bitmask" if padded_payload_bytes(1, padded, num_params, "bitmask") < index else "index"
        )


def pseudo_gradient(
    global_p: Float[Array, " P"], local_p: Float[Array, " P"]
) -> Float[Array, " P"]:
    """DiLoCo's pseudo-gradient `Δ = θ_global − θ_local` (fp32, exact difference rounded once)."""
    return global_p - local_p


def pulse_gate(
    theta_p: Float[Array, " P"], s_p: Float[Array, " P"], gate_dtype: jnp.dtype = jnp.bfloat16
) -> Bool[Array, " P"]:
    """`bits(low(θ)) != bits(low(θ − s))`: where applying s would change the low-precision forward.

    Uses PULSESync's bit-pattern mask with `low(θ)` as the "sent" state, so a ±0 flip counts and
    an unchanged NaN does not.
    """
    gate_dtype = jnp.dtype(gate_dtype)
    mask, _ = visible_mask(theta_p - s_p, publish_bits(theta_p, gate_dtype), gate_dtype)
    return mask


def error_feedback(
    theta_p: Float[Array, " P"],
    residual_p: Float[Array, " P"],
    delta_p: Float[Array, " P"],
    *,
    gate: bool = True,
    gate_dtype: jnp.dtype = jnp.bfloat16,
) -> tuple[Float[Array, " P"], Float[Array, " P"], Bool[Array, " P"]]:
    """PULSELoCo error feedback: returns `(sent, residual, mask)`.

    `s = e + Δ`; `mask = pulse_gate(θ, s)` (all True when `gate` is False); `sent = s` on the mask
    and 0 elsewhere; `residual = s` off the mask and 0 on it. Every entry of s goes to exactly one
    of the two, so `sent + residual == s` exactly (no mass is lost or invented).
    """
    s = residual_p + delta_p
    mask = pulse_gate(theta_p, s, gate_dtype) if gate else jnp.ones(s.shape, jnp.bool_)
    zeros = jnp.zeros_like(s)
    return jnp.where(mask, s, zeros), jnp.where(mask, zeros, s), mask


@functools.partial(jax.jit, static_argnames=("gate", "gate_dtype"))
def prepare_payload(
    global_p: Float[Array, " P"],
    local_p: Float[Array, " P"],
    residual_p: Float[Array, " P"],
    *,
    gate: bool = True,
    gate_dtype: jnp.dtype = jnp.bfloat16,
) -> tuple[Float[Array, " P"], Float[Array, " P"], Bool[Array, " P"], Int[Array, ""]]:
    """One replica's round: Δ, error feedback and the gate. Returns `(sent, residual, mask, n)`."""
    delta = pseudo_gradient(global_p, local_p)
    sent, residual, mask = error_feedback(
        global_p, residual_p, delta, gate=gate, gate_dtype=gate_dtype
    )
    return sent, residual, mask, jnp.sum(mask, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames=("size",))
def compact(
    mask_p: Bool[Array, " P"], values_p: Float[Array, " P"], *, size: int
) -> tuple[Int[Array, " N"], Float[Array, " N"]]:
    """The masked entries as sorted int32 flat indices and their values, padded to `size`.

    Padding uses index P (out of range, dropped by `mean_of_payloads`) and value 0.
    """
    index = mask_indices(mask_p, size)
    return index, values_p.at[index].get(mode="fill", fill_value=0)


def pack_mask(mask_p: Bool[Array, " P"]) -> UInt8[Array, " M"]:
    """The gate as `ceil(P/8)` bytes: bit j of byte i is entry 8i + j (numpy's little bitorder)."""
    return pack_bits(jnp.pad(mask_p, (0, -mask_p.shape[0] % 8)))


def unpack_mask(packed_m: UInt8[Array, " M"], num_params: int) -> Bool[Array, " P"]:
    """Inverse of `pack_mask`: the first `num_params` bits as booleans."""
    return unpack_bits(packed_m)[:num_params]


def mask_indices(mask_p: Bool[Array, " P"], size: int) -> Int[Array, " N"]:
    """The set positions of a mask as sorted int32 flat indices, padded with P to `size`."""
    num = mask_p.shape[0]
    if num > MAX_PARAMS:
        raise ValueError(f"{num} parameters exceed the int32 index limit {MAX_PARAMS}")
    (index,) = jnp.nonzero(mask_p, size=size, fill_value=num)
    return index.astype(jnp.int32)


def mean_of_payloads(
    index_rn: Int[Array, "R N"], value_rn: Float[Array, "R N"], num_params: int
) -> Float[Array, " P"]:
    """`fp32(1/R) · Σ_r scatter(index_r, value_r)` into P zeros, replicas added in order 0..R−1.

    The fixed order makes every process compute the same bits; out-of-range (padding) indices are
    dropped. With all P entries sent it equals `mean_of_dense` bit for bit.
    """
    acc = jnp.zeros((num_params,), value_rn.dtype)
    for r in range(index_rn.shape[0]):
        acc = acc.at[index_rn[r]].add(value_rn[r], mode="drop")
    return acc * _inverse(index_rn.shape[0], acc.dtype)


def mean_of_dense(delta_rp: Float[Array, "R P"]) -> Float[Array, " P"]:
    """`(((0 + Δ_0) + Δ_1) + ...) · fp32(1/R)`: DiLoCo's mean pseudo-gradient in a fixed order."""
    acc = jnp.zeros(delta_rp.shape[1:], delta_rp.dtype)
    for r in range(delta_rp.shape[0]):
        acc = acc + delta_rp[r]
    return acc * _inverse(delta_rp.shape[0], acc.dtype)


def _inverse(replicas: int, dtype) -> jax.Array:
    # An explicit fp32 1/R factor: XLA's simplifier turns `x / R` into `x * (1/R)` anyway, so
    # writing the product makes the result a documented formula rather than a compiler choice.
    return jnp.asarray(1.0 / replicas, dtype)


def outer_update(
    tx: optax.GradientTransformation,
    params_p: Float[Array, " P"],
    opt_state: optax.OptState,
    grad_p: Float[Array, " P"],
) -> tuple[Float[Array, " P"], optax.OptState]:
    """One outer optimizer step on the global weights with the mean pseudo-gradient."""
    updates, opt_state = tx.update(grad_p, opt_state, params_p)
    return optax.apply_updates(params_p, updates), opt_state


# --- byte accounting -------------------------------------------------------------------------


def _payload_bytes(count: int, num_params: int, fmt: PayloadFormat) -> int:
    if fmt == "index":
        return COUNT_BYTES + count * (INDEX_BYTES + VALUE_BYTES)
    if fmt == "bitmask":
        return COUNT_BYTES + -(-num_params // 8) + count * VALUE_BYTES
    raise ValueError(f"payload format {fmt!r} unknown; expected 'index' or 'bitmask'")


def payload_bytes(
    counts: list[int] | tuple[int, ...], num_params: int, fmt: PayloadFormat = "index"
) -> int:
    """Bytes all replicas need to send in one PULSELoCo round: each its entry count, then either
    (int32 index, fp32 value) per entry ("index") or the packed gate and an fp32 value per entry
    ("bitmask")."""
    return sum(_payload_bytes(n, num_params, fmt) for n in counts)


def padded_payload_bytes(
    replicas: int, padded: int, num_params: int, fmt: PayloadFormat = "index"
) -> int:
    """Bytes of the padded all-gather inputs in one round (every replica sends `padded` entries)."""
    return replicas * _payload_bytes(padded, num_params, fmt)


def diloco_bytes(num_params: int, replicas: int, rounds: int = 1) -> int:
    """Bytes all replicas send in DiLoCo: one dense fp32 pseudo-gradient each per round."""
    return rounds * replicas * num_params * DENSE_BYTES


def ddp_bytes(num_params: int, replicas: int, steps: int) -> int:
    """Bytes all replicas send in DDP: one dense fp32 gradient each per optimizer step."""
    return steps * replicas * num_params * DENSE_BYTES
