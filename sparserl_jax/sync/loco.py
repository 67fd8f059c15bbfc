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
    send     v_r = round(s_r[gate_r]) at their flat indices
    e_r    = s_r − scatter(v_r)                       (so sent + e_r = s_r exactly)

and g = (1/R) Σ_r scatter(v_r): an entry sent by only some replicas is still divided by R.
Outer momentum is kept (unlike SparseLoCo). The gate compares bit patterns with the PULSESync
mask (`mask.visible_mask`), so ±0 and NaN are exact.

Values (`LoCoConfig.value_dtype`): "bfloat16" (the default) sends `bf16(s)` and keeps the rounding
error `s − fp32(bf16(s))` (at most 2^-8 of |s|, exact in fp32) in e_r (`split_bf16`): nothing is
lost, only delayed until the entry fires again. "float32" sends s itself and zeroes e_r there
(grail v6; its v1 kept a bf16 *step* error in e, a different quantity).

Payload formats (`LoCoConfig.payload`):

  - "coded" (the default): one byte string per replica (`loco_codec`): the positions as gaps in
    the context order of θ's exponents and the value bits in byte planes, zstd-coded; the wire
    bytes are the measured lengths (`coded_payload_bytes`), and the bytes really travel
    (`loco_wire`). At the bench's ~7% density the positions cost about the gate's entropy
    (~0.37 bit per entry against the bitmask's 1 and int32 indices' 2.4);
  - "index": an int32 flat index per entry plus the value (8 or 6 B per entry; grail: int64, 12 B);
  - "bitmask": the gate itself packed 8 entries to a byte, ceil(P/8) B, plus the values.

The bitmask is smaller than the indices once more than P/32 entries are sent (density above
1/32 = 3.1%); `payload="auto"` takes the smaller of the two every round for its padded
all-gather. All formats carry the same (index, value) pairs, so the new θ is bit-identical
whichever travels.

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
from jax import lax
from jaxtyping import Array, Bool, Float, Int, UInt8

from sparserl_jax.sync.mask import pack_bits, publish_bits, unpack_bits, visible_mask

Method = Literal["diloco", "pulseloco"]
METHODS = ("diloco", "pulseloco")
PayloadFormat = Literal["index", "bitmask", "coded"]
PAYLOADS = ("coded", "auto", "index", "bitmask")
GATE_DTYPES = ("bfloat16", "float16")
VALUE_DTYPES = ("bfloat16", "float32")

# Wire sizes: an uncoded PULSELoCo payload entry is an int32 flat index and a value (4 B fp32 or
# 2 B bf16); each replica also sends its entry count (coded: its byte count), the all-gather of
# counts that sizes the padded payload all-gather.
INDEX_BYTES = 4
COUNT_BYTES = 4
DENSE_BYTES = 4  # DiLoCo pseudo-gradients and DDP gradients travel as fp32
MAX_PARAMS = 2**31 - 2  # int32 indices, with P itself free as the out-of-range padding index
# Below this magnitude the bf16 rounding error of an fp32 value can be subnormal, which XLA:CPU
# flushes to zero: such entries are held back in the residual whole (see `split_bf16`).
BF16_SPLIT_MIN = 2.0**-103


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
      payload: how the sent entries travel: "coded" (one entropy-coded byte string per replica,
        `loco_codec`), or padded arrays of values with their positions as "index" (int32 per
        entry), "bitmask" (the packed gate) or "auto" (the smaller of the two, every round).
      value_dtype: the dtype of the sent values: "bfloat16" (the rounding error of each sent
        entry stays in the residual, `split_bf16`) or "float32" (s itself, grail v6).
      zstd_level: the zstd level of the coded payload's streams.
    """

    method: Method = "pulseloco"
    inner_steps: int = 10
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    gate: bool = True
    gate_dtype: Literal["bfloat16", "float16"] = "bfloat16"
    pad_multiple: int = 1
    payload: Literal["coded", "auto", "index", "bitmask"] = "coded"
    value_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    zstd_level: int = 1

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
        if self.value_dtype not in VALUE_DTYPES:
            raise ValueError(
                f"value_dtype {self.value_dtype!r} unknown; expected one of {VALUE_DTYPES}"
            )
        if not isinstance(self.zstd_level, int) or not 1 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level must be an int in 1..22, got {self.zstd_level!r}")
        if self.method == "diloco" and not self.gate:
            raise ValueError("gate=False only applies to method='pulseloco' (DiLoCo has no gate)")

    @property
    def jnp_gate_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.gate_dtype)

    @property
    def value_bytes(self) -> int:
        return jnp.dtype(self.value_dtype).itemsize

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
        size = functools.partial(padded_payload_bytes, 1, padded, num_params)
        v = self.value_bytes
        return "bitmask" if size("bitmask", v) < size("index", v) else "index"


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


def split_bf16(
    s_p: Float[Array, " P"],
) -> tuple[Float[Array, " P"], Float[Array, " P"], Bool[Array, " P"]]:
    """`s = hi + lo` with `hi` a bf16 value (as fp32) and `lo` its rounding error, exactly.

    Returns `(hi, lo, exact)`. `hi` is `bf16(s)` (round to nearest even), or s truncated toward
    zero where rounding would overflow to ±inf; `lo = s - hi` is exact in fp32 (hi keeps the top
    8 significant bits of s, so lo is s's remaining 16 bits at s's own scale). `exact` is False
    where that error could be subnormal (|s| < 2^-103 with nonzero low bits, subnormal s
    included): XLA:CPU flushes subnormal results to zero, so such an entry must not be split.
    Non-finite s: `hi = s` (NaN quieted), `lo = 0`. The casts are bit operations, so no compiler
    may treat the fp32 -> bf16 -> fp32 round trip as the identity (excess precision).
    """
    bits = lax.bitcast_convert_type(s_p, jnp.uint32)
    hi16 = lax.bitcast_convert_type(s_p.astype(jnp.bfloat16), jnp.uint16)
    finite = jnp.isfinite(s_p)
    overflow = finite & ((hi16 & 0x7FFF) == 0x7F80)
    hi16 = jnp.where(overflow, (bits >> 16).astype(jnp.uint16), hi16)
    hi = lax.bitcast_convert_type(hi16.astype(jnp.uint32) << 16, jnp.float32)
    lo = jnp.where(finite, s_p - hi, jnp.zeros_like(s_p))
    exact = ~finite | (jnp.abs(s_p) >= BF16_SPLIT_MIN) | ((bits & 0xFFFF) == 0)
    return hi, lo, exact


def error_feedback(
    theta_p: Float[Array, " P"],
    residual_p: Float[Array, " P"],
    delta_p: Float[Array, " P"],
    *,
    gate: bool = True,
    gate_dtype: jnp.dtype = jnp.bfloat16,
    value_dtype: str = "float32",
) -> tuple[Float[Array, " P"], Float[Array, " P"], Bool[Array, " P"]]:
    """PULSELoCo error feedback: returns `(sent, residual, mask)`.

    `s = e + Δ`; `mask = pulse_gate(θ, s)` (all True when `gate` is False); off the mask
    `sent = 0` and `residual = s`. On it, with fp32 values, `sent = s` and `residual = 0`; with
    bf16 values `(sent, residual) = split_bf16(s)`, the rounding error staying in the residual
    (entries that cannot be split exactly are held back whole). Either way `sent + residual == s`
    exactly (no mass is lost or invented) and `sent` is exactly representable in `value_dtype`.
    """
    s = residual_p + delta_p
    mask = pulse_gate(theta_p, s, gate_dtype) if gate else jnp.ones(s.shape, jnp.bool_)
    zeros = jnp.zeros_like(s)
    if value_dtype == "float32":
        return jnp.where(mask, s, zeros), jnp.where(mask, zeros, s), mask
    if value_dtype != "bfloat16":
        raise ValueError(f"value_dtype {value_dtype!r} unknown; expected one of {VALUE_DTYPES}")
    hi, lo, exact = split_bf16(s)
    mask = mask & exact
    return jnp.where(mask, hi, zeros), jnp.where(mask, lo, s), mask


@functools.partial(jax.jit, static_argnames=("gate", "gate_dtype", "value_dtype"))
def prepare_payload(
    global_p: Float[Array, " P"],
    local_p: Float[Array, " P"],
    residual_p: Float[Array, " P"],
    *,
    gate: bool = True,
    gate_dtype: jnp.dtype = jnp.bfloat16,
    value_dtype: str = "float32",
) -> tuple[Float[Array, " P"], Float[Array, " P"], Bool[Array, " P"], Int[Array, ""]]:
    """One replica's round: Δ, error feedback and the gate. Returns `(sent, residual, mask, n)`."""
    delta = pseudo_gradient(global_p, local_p)
    sent, residual, mask = error_feedback(
        global_p, residual_p, delta, gate=gate, gate_dtype=gate_dtype, value_dtype=value_dtype
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


def _payload_bytes(count: int, num_params: int, fmt: PayloadFormat, value_bytes: int) -> int:
    if fmt == "index":
        return COUNT_BYTES + count * (INDEX_BYTES + value_bytes)
    if fmt == "bitmask":
        return COUNT_BYTES + -(-num_params // 8) + count * value_bytes
    raise ValueError(f"payload format {fmt!r} unknown; expected 'index' or 'bitmask'")


def payload_bytes(
    counts: list[int] | tuple[int, ...],
    num_params: int,
    fmt: PayloadFormat = "index",
    value_bytes: int = 4,
) -> int:
    """Bytes all replicas need to send in one uncoded PULSELoCo round: each its entry count,
    then (int32 index, value) per entry ("index") or the packed gate and a value per entry
    ("bitmask"); values of `value_bytes` (4: fp32, 2: bf16). Coded payloads are measured, not
    computed: `coded_payload_bytes`."""
    return sum(_payload_bytes(n, num_params, fmt, value_bytes) for n in counts)


def padded_payload_bytes(
    replicas: int, padded: int, num_params: int, fmt: PayloadFormat = "index", value_bytes: int = 4
) -> int:
    """Bytes of the padded all-gather inputs in one round (every replica sends `padded` entries)."""
    return replicas * _payload_bytes(padded, num_params, fmt, value_bytes)


def coded_payload_bytes(blob_sizes: list[int] | tuple[int, ...]) -> int:
    """Bytes all replicas send in one coded round: each its byte count, then its encoded blob."""
    return sum(COUNT_BYTES + n for n in blob_sizes)


def diloco_bytes(num_params: int, replicas: int, rounds: int = 1) -> int:
    """Bytes all replicas send in DiLoCo: one dense fp32 pseudo-gradient each per round."""
    return rounds * replicas * num_params * DENSE_BYTES


def ddp_bytes(num_params: int, replicas: int, steps: int) -> int:
    """Bytes all replicas send in DDP: one dense fp32 gradient each per optimizer step."""
    return steps * replicas * num_params * DENSE_BYTES
