"""Teacher-forcing attention: causal, GQA, packed segments, one entry and four implementations.

`causal_attention(q, k, v, segment_ids, impl=...)` is what `Transformer.hidden_states` runs
(`ModelConfig.attention`). Token t attends to tokens s <= t of its own segment; queries come
pre-scaled (`Attention.project`); the softmax is fp32. Implementations:

- "dense": `layers.gqa_attention` under a `[B, T, T]` mask: the reference, `[B, K, G, T, T]`
  fp32 scores.
- "chunked": `models.flash.chunked_attention`, online softmax over key blocks in pure XLA with a
  recomputing backward; O(T) memory, runs everywhere.
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, the fused cuDNN kernel (GPU;
  bf16/fp16, head dim a multiple of 8 up to 128, or 256 from Hopper on; no packed segments).
- "splash": the Pallas TPU splash attention kernel maintained in JAX
  (`jax.experimental.pallas.ops.tpu.splash_attention`), its MQA form per KV head (the G query
  heads of a group share one K/V), with a causal mask and segment ids; T is padded to a multiple
  of 128 (padded keys follow every real query, so causality hides them).

"auto" is splash on a TPU target, cudnn on GPU, chunked elsewhere; `SPARSERL_KERNEL_IMPL=xla`
turns auto into chunked. A kernel that cannot take the shapes (`unsupported_reason`) gives way
to chunked with one log line per reason, as `pallas_kernels._dispatch.choose_impl` does. Off its
platform a kernel is refused, except splash, which runs in interpret mode (CPU tests).

The target is the platform the program is lowered for. On an accelerator host (or under an
accelerator's default device, as ahead-of-time compiles trace) that is the host's platform, and
only its choice is traced. A CPU host may lower for TPU devices: there the choice for a TPU and
the one for the CPU are both traced and `jax.lax.platform_dependent` keeps, at lowering, the
lowering platform's (a program traced on a CPU host and lowered for TPU devices holds compiled
splash, never its interpreter). Never both on an accelerator: differentiated, the switch would
carry the union of both branches' residuals (0.35 GiB more temporaries in the Qwen2.5-0.5B step
at T = 16384 on v5p). cuDNN is traced against the local library, so it exists only in a process
on a GPU.

Splash is a Mosaic call, which XLA cannot partition: inside a program traced under a mesh
(`with_attention_mesh`, `jax.set_mesh` or `jax.sharding.use_abstract_mesh`; the learner's step
and logprobs do) it runs per device under `shard_map`, rows split over the `data`/`fsdp` axes and
KV heads over `tensor` where they divide. Traced without one it runs as a single-device call.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Float, Int

from pallas_kernels import _dispatch
from sparserl_jax.models.flash import chunked_attention
from sparserl_jax.models.layers import gqa_attention

AttentionImpl = Literal["auto", "dense", "chunked", "cudnn", "splash"]
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "dense", "chunked", "cudnn", "splash")
SPLASH_LANES = 128  # splash tiles are multiples of the TPU's 128 lanes

logger = logging.getLogger("sparserl_jax.attention")
_LOGGED: set[tuple[str, str]] = set()


def dense_mask(
    t: int,
    segment_ids_bt: Int[Array, "B T"] | None,
    batch: int,
    evict_pos_bkt: Int[Array, "B K T"] | None = None,
) -> jax.Array:
    """The `[B, T, T]` mask of the reference: causal, and equal segment ids when given; with an
    eviction record, `[B, K, T, T]`: and the query before the key's eviction."""
    causal_tt = jnp.tril(jnp.ones((t, t), dtype=bool))
    if segment_ids_bt is None:
        mask = jnp.broadcast_to(causal_tt, (batch, t, t))
    else:
        mask = causal_tt[None] & (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])
    if evict_pos_bkt is None:
        return mask
    seen_bkts = jnp.arange(t, dtype=jnp.int32)[None, None, :, None] < evict_pos_bkt[:, :, None, :]
    return mask[:, None] & seen_bkts


def unsupported_reason(
    which: str, dtype, head_dim: int, *, segmented: bool, platform: str
) -> str | None:
    """Why kernel `which` ("cudnn", "splash") cannot run these operands here (None: it can)."""
    dtype = jnp.dtype(dtype)
    if which == "cudnn":
        if platform != "gpu":
            return f"cuDNN needs a GPU target, not {platform}"
        if dtype not in (jnp.bfloat16, jnp.float16):
            return f"cuDNN flash attention takes bf16/fp16, not {dtype.name}"
        hopper = any(
            float(getattr(d, "compute_capability", "0") or 0) >= 9.0 for d in jax.devices()[:1]
        )
        h_max = 256 if hopper else 128
        if head_dim % 8 or head_dim > h_max:
            return f"cuDNN needs a head dim that is a multiple of 8 up to {h_max}, not {head_dim}"
        if segmented:
            return "packed segment ids (cuDNN's packed layout is not wired in)"
        return None
    if which == "splash":
        if dtype not in (jnp.bfloat16, jnp.float32):
            return f"splash attention takes bf16/fp32, not {dtype.name}"
        if head_dim % 8:
            return f"head dim {head_dim} is not a multiple of 8"
        return None
    raise ValueError(f"unknown attention kernel {which!r}")


def resolve_attention(
    impl: AttentionImpl,
    dtype,
    head_dim: int,
    *,
    segmented: bool,
    platform: str | None = None,
) -> str:
    """The implementation `causal_attention` runs: "dense", "chunked", "cudnn" or "splash"."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {ATTENTION_IMPLS}")
    platform = platform or _dispatch.target_platform()
    which = impl
    if impl == "auto":
        if os.environ.get(_dispatch.KERNEL_IMPL_ENV, "").strip() == "xla":
            return "chunked"
        which = {"tpu": "splash", "gpu": "cudnn"}.get(platform, "chunked")
    if which in ("dense", "chunked"):
        return which
    if which == "splash" and platform != "tpu":
        return which  # interpret mode
    reason = unsupported_reason(which, dtype, head_dim, segmented=segmented, platform=platform)
    if reason is None:
        return which
    if (which, reason) not in _LOGGED:
        _LOGGED.add((which, reason))
        logger.log(
            _dispatch.fallback_level(platform),
            "attention: %s cannot run these operands (%s); using chunked",
            which,
            reason,
        )
    return "chunked"


def _cudnn(q_btnh, k_btkh, v_btkh):
    return jax.nn.dot_product_attention(
        q_btnh, k_btkh, v_btkh, scale=1.0, is_causal=True, implementation="cudnn"
    )


def _splash_block(t: int, block: int) -> int:
    """The largest multiple of 128 that divides `t` (a multiple of 128) and is <= `block`."""
    best = SPLASH_LANES
    for cand in range(SPLASH_LANES, max(block, SPLASH_LANES) + 1, SPLASH_LANES):
        if t % cand == 0:
            best = cand
    return best


def _splash(
    q_btnh,
    k_btkh,
    v_btkh,
    segment_ids_bt,
    *,
    block_q: int,
    block_kv: int,
    mesh,
    interpret: bool,
    switched: bool = False,
):
    b, t, n, h = q_btnh.shape
    kh = k_btkh.shape[2]
    g = n // kh
    tp = -(-t // SPLASH_LANES) * SPLASH_LANES
    bq, bk = _splash_block(tp, block_q), _splash_block(tp, block_kv)
    sizes = splash.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        block_q_dq=bq,
        block_kv_dq=bk,
    )
    make_kernel = functools.partial(
        splash.make_splash_mqa_single_device,
        splash.MultiHeadMask([splash.CausalMask((tp, tp))] * g),
        block_sizes=sizes,
        interpret=interpret,
    )
    # The kernel holds its mask tables as arrays. Built once here, every row and KV head shares
    # them; built inside the rows' function, each call site holds its own copy (0.32 GiB more
    # temporaries in the Qwen2.5-0.5B step at T = 16384 on v5p). In a `platform_dependent`
    # branch they must belong to the trace that uses them (the custom VJP's backward is traced
    # after the branch's trace has ended), so there they are built where the kernel is called.
    shared = None if switched else make_kernel()

    def kernel_here():
        return shared if shared is not None else make_kernel()

    pad = ((0, 0), (0, tp - t), (0, 0), (0, 0))
    dt = q_btnh.dtype
    q_bkgth = jnp.pad(q_btnh, pad).reshape(b, tp, kh, g, h).transpose(0, 2, 3, 1, 4)
    k_bkth = jnp.pad(k_btkh.astype(dt), pad).transpose(0, 2, 1, 3)
    v_bkth = jnp.pad(v_btkh.astype(dt), pad).transpose(0, 2, 1, 3)

    if segment_ids_bt is None:

        def per_row(q_kgth, k_kth, v_kth):
            return jax.vmap(kernel_here())(q_kgth, k_kth, v_kth)

        args = (q_bkgth, k_bkth, v_bkth)
    else:

        def per_row(q_kgth, k_kth, v_kth, seg_t):
            ids = splash.SegmentIds(q=seg_t, kv=seg_t)
            kernel = kernel_here()
            return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=ids))(q_kgth, k_kth, v_kth)

        seg = jnp.pad(segment_ids_bt.astype(jnp.int32), ((0, 0), (0, tp - t)))
        args = (q_bkgth, k_bkth, v_bkth, seg)

    run = jax.vmap(per_row)
    if mesh is not None and mesh.size > 1:
        run = _per_device(run, args, mesh, b, kh)
    if dt != jnp.float32:
        run = _default_precision(run)
    out_bkgth = run(*args)
    return out_bkgth.transpose(0, 3, 1, 2, 4).reshape(b, tp, n, h)[:, :t]


def _default_precision(fn: Callable) -> Callable:
    """`fn` traced at the default matmul precision, forward and backward. Mosaic rejects the
    fp32 contract precision that `jax_default_matmul_precision="highest"` asks of bf16 matmuls
    (it changes nothing there: bf16 products are exact in the fp32 accumulator)."""

    @jax.custom_vjp
    def run(*args):
        with jax.default_matmul_precision("default"):
            return fn(*args)

    def fwd(*args):
        with jax.default_matmul_precision("default"):
            return jax.vjp(fn, *args)

    def bwd(vjp, ct):
        with jax.default_matmul_precision("default"):
            return vjp(ct)

    run.defvjp(fwd, bwd)
    return run


def _per_device(fn, args, mesh, batch: int, kv_heads: int):
    """`fn` under `shard_map`: rows over data x fsdp, KV heads over tensor, where they divide."""
    rows = tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)
    if batch % math.prod(mesh.shape[a] for a in rows):
        rows = ()
    heads = "tensor" if mesh.shape.get("tensor", 1) > 1 else None
    if heads and kv_heads % mesh.shape["tensor"]:
        heads = None
    row_spec = rows or None
    specs = [PartitionSpec(row_spec, heads, *([None] * (x.ndim - 2))) for x in args[:3]]
    if len(args) == 4:
        specs.append(PartitionSpec(row_spec, None))
    out_spec = PartitionSpec(row_spec, heads, None, None, None)
    # Pallas calls carry no varying-axes annotations; the specs above are the contract.
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(specs), out_specs=out_spec, check_vma=False)


def with_attention_mesh(mesh: Mesh | None, fn: Callable) -> Callable:
    """`fn` traced under `mesh`'s abstract mesh (unchanged without a mesh), so that splash runs
    per device under `shard_map` there and the model pins its activations' layout on it
    (`parallel.constrain`: rows over data x fsdp): jit what this returns for a program over
    `mesh` (its operands or `in_shardings` on `mesh`, so that XLA compiles it for the mesh's
    devices)."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced


def causal_attention(
    q_btnh: Float[Array, "B T N H"],
    k_btkh: Float[Array, "B T K H"],
    v_btkh: Float[Array, "B T K H"],
    segment_ids_bt: Int[Array, "B T"] | None = None,
    *,
    impl: AttentionImpl = "auto",
    block_q: int = 512,
    block_kv: int = 512,
    evict_pos_bkt: Int[Array, "B K T"] | None = None,
) -> Float[Array, "B T N H"]:
    """Causal GQA self-attention of pre-scaled queries within segments, in q's dtype.

    Query head n uses KV head n // G. Token t attends to s <= t with equal `segment_ids` (None:
    one segment). `evict_pos_bkt` (`[B, K or 1, T]`): replay a sparse sampler's evictions, t
    attends s only while `t < evict_pos[s]` (`kvcache.evictions`); dense and chunked only: "auto"
    runs chunked, an explicit "splash" or "cudnn" is a ValueError. `block_q`/`block_kv` tile
    the chunked path and splash (for splash rounded to a multiple of 128 that divides the
    padded length). The mesh splash runs per device on is the
    abstract mesh of the tracing context (see the module docstring).
    """
    h = q_btnh.shape[3]
    here = _dispatch.target_platform()
    # On an accelerator (or under one's default device, as ahead-of-time compiles trace) the
    # program is lowered for it: one branch. Only a CPU host traces both TPU and CPU, chosen at
    # lowering; there a differentiated `platform_dependent` carries the union of its branches'
    # residuals (zeros for the branch not taken), which would cost the TPU step memory.
    platforms = (here,) if here != "cpu" else ("tpu", "cpu")
    segmented = segment_ids_bt is not None
    if evict_pos_bkt is not None:
        if impl in ("splash", "cudnn"):
            raise ValueError(
                f"attention {impl!r} cannot replay evictions (learner.attention_mask=replay); "
                "use attention 'chunked', 'dense' or 'auto'"
            )
        if impl == "auto":
            impl = "chunked"
    keys = {}  # platform -> (implementation, interpreted)
    for p in platforms:
        which = resolve_attention(impl, q_btnh.dtype, h, segmented=segmented, platform=p)
        keys[p] = (which, which == "splash" and p != "tpu")
    built = {
        key: functools.partial(
            _attend,
            which=key[0],
            interpret=key[1],
            switched=len(set(keys.values())) > 1,
            block_q=block_q,
            block_kv=block_kv,
            evict_pos_bkt=evict_pos_bkt,
        )
        for key in dict.fromkeys(keys.values())
    }
    branch = {p: built[key] for p, key in keys.items()}
    args = (q_btnh, k_btkh, v_btkh, segment_ids_bt)
    if len(built) == 1:
        return next(iter(built.values()))(*args)
    # The branch of the platform the program is lowered for, chosen at lowering (see the module
    # docstring): a TPU program holds compiled splash and never the interpreter.
    return jax.lax.platform_dependent(*args, tpu=branch["tpu"], default=branch["cpu"])


def _attend(
    q_btnh,
    k_btkh,
    v_btkh,
    segment_ids_bt,
    *,
    which,
    interpret,
    switched,
    block_q,
    block_kv,
    evict_pos_bkt,
):
    """`causal_attention` on implementation `which` (splash interpreted if `interpret`; a
    branch of a `platform_dependent` if `switched`)."""
    b, t = q_btnh.shape[:2]
    if which == "dense":
        mask = dense_mask(t, segment_ids_bt, b, evict_pos_bkt)
        out = gqa_attention(q_btnh, k_btkh, v_btkh, mask)
    elif which == "chunked":
        out = chunked_attention(
            q_btnh,
            k_btkh,
            v_btkh,
            segment_ids_bt,
            block_q=block_q,
            block_kv=block_kv,
            evict_pos_bkt=evict_pos_bkt,
        )
    elif which == "cudnn":
        out = _cudnn(q_btnh, k_btkh, v_btkh)
    else:
        mesh = jax.sharding.get_abstract_mesh()
        out = _splash(
            q_btnh,
            k_btkh,
            v_btkh,
            segment_ids_bt,
            block_q=block_q,
            block_kv=block_kv,
            mesh=None if mesh.empty else mesh,
            interpret=interpret,
            switched=switched,
        )
    return out.astype(q_btnh.dtype)
