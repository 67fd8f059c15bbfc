"""Which implementation an op runs: the XLA reference or a Pallas kernel.

The target is the platform the program is lowered for, which tracing does not know: a program
traced on a CPU host may be lowered for a TPU (`jit(..., in_shardings=<on TPU topology devices>)`,
`.trace(...).lower(lowering_platforms=("tpu",))`, `jax.default_device(<TPU device>)`). So an op
traces its choice for each platform in `PLATFORMS` and `jax.lax.platform_dependent` keeps, at
lowering, the one for the platform lowered for (`by_platform`): JAX lowers no other branch, so a
TPU program holds the Mosaic call and never the interpreter, and a CPU program never a Mosaic
call. With a `mesh=` the target is its devices' platform, known when tracing. Identical choices
are traced once; an op whose choices agree everywhere (`impl="xla"`) has no branch at all.
`target_platform()` (the default device's platform) serves only reports of what runs there.

Per platform: `impl="auto"` picks the Mosaic kernel on TPU, the Triton-lowered kernels on GPU and
the XLA reference on CPU. On an H200 (JAX 0.11.2, `make device-check` of 2026-11-28,
docs/results.md) the engine at Qwen2.5-0.5B shapes decodes 1.56x (dense) and 1.49x (R-KV 512)
faster through the kernels than through XLA, which gathers each row's pages every step, and is as
faithful to the teacher-forced logprobs; before the lane-dense pool (2026-11-27) the kernels were
slower there for dense (0.88x; R-KV 1.05x) and on an H100 for both, and XLA was the GPU default.
Not yet run with the kernels as default: an H100 on the new layout, ROCm (it takes the GPU branch),
several GPUs (`on_mesh`). Pallas Triton is deprecated from JAX 0.11 (Mosaic GPU is its successor).
`impl="xla"` keeps one op on XLA (the rollout engine's cache: `rollout.kernel_impl`);
`SPARSERL_KERNEL_IMPL=xla` keeps every op there, and also turns teacher-forcing attention's "auto"
into "chunked" (`models.attention.resolve_attention`). The environment variable
`SPARSERL_KERNEL_IMPL` (xla, pallas_tpu, pallas_gpu) overrides "auto". A kernel asked for runs
compiled on its platform and in Pallas' HLO interpreter (`interpret=True`) on any other (CPU
tests): not TPU interpret mode, whose ordered host callbacks a platform-dependent branch cannot
hold (JAX threads the effect tokens of every branch into the one it lowers). Compiled, a kernel
runs only on the shapes its `unsupported_reason` accepts; any other shape goes to the XLA reference
with one log line per (op, reason) (`choose_impl`), so a program never reaches a kernel its
compiler rejects.

On a device mesh (`mesh=` of the ops), a compiled kernel runs per device under `shard_map`
(`on_mesh`): Mosaic calls cannot be partitioned by XLA. KV heads are split over the mesh when
their count divides by the mesh size (query heads follow, group by group), otherwise every device
runs the whole op on replicated operands.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
from jax.sharding import Mesh, PartitionSpec

Impl = Literal["auto", "xla", "pallas_tpu", "pallas_gpu"]
Concrete = Literal["xla", "pallas_tpu", "pallas_gpu"]
IMPLS: tuple[str, ...] = ("auto", "xla", "pallas_tpu", "pallas_gpu")
KERNEL_IMPL_ENV = "SPARSERL_KERNEL_IMPL"
KERNEL_PLATFORM = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}
# The kernel each platform runs under "auto" (any other platform: XLA).
PLATFORM_KERNEL = {on: which for which, on in KERNEL_PLATFORM.items()}
# The lowering platforms an op tells apart ("gpu": cuda or rocm; "cpu": any other).
PLATFORMS: tuple[str, ...] = ("tpu", "gpu", "cpu")

logger = logging.getLogger("pallas_kernels")
_LOGGED: set[tuple[str, str]] = set()


def platform_name(platform: str) -> str:
    """A device platform as dispatch names it: "gpu" for "cuda" and "rocm", else unchanged."""
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def target_platform() -> str:
    """ "tpu", "gpu" or "cpu": the default device's platform if set, else the default backend.

    Where eager code runs, and what reports of "what runs here" assume; a traced op decides by
    the platform its program is lowered for instead (`by_platform`).
    """
    dev = jax.config.jax_default_device
    if dev is None:
        return platform_name(jax.default_backend())
    return platform_name(dev if isinstance(dev, str) else dev.platform)


def mesh_platform(mesh: Mesh | None) -> str | None:
    """The platform of `mesh`'s devices, None without a mesh."""
    return None if mesh is None else platform_name(mesh.devices.flat[0].platform)


def resolve_impl(impl: Impl, *, platform: str | None = None) -> Concrete:
    """The implementation `impl` names on `platform` (default: `target_platform()`)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel impl {impl!r}; expected one of {IMPLS}")
    if impl != "auto":
        return impl  # type: ignore[return-value]
    env = os.environ.get(KERNEL_IMPL_ENV, "").strip()
    if env:
        if env not in IMPLS[1:]:
            raise ValueError(f"{KERNEL_IMPL_ENV}={env!r}; expected one of {IMPLS[1:]}")
        return env  # type: ignore[return-value]
    return PLATFORM_KERNEL.get(platform or target_platform(), "xla")  # type: ignore[return-value]


def interpret_needed(which: Concrete, *, platform: str | None = None) -> bool:
    """Whether kernel `which` runs in interpret mode on `platform` (default: `target_platform()`):
    the platform is not the kernel's."""
    return which != "xla" and KERNEL_PLATFORM[which] != (platform or target_platform())


def fallback_level(platform: str) -> int:
    """The log level of a "cannot run these shapes, using XLA" line for `platform`: a warning
    where the program runs (`target_platform()`); info for another platform's branch of it (a
    TPU branch traced on a CPU host, `by_platform`): nothing there to act on."""
    return logging.WARNING if platform == target_platform() else logging.INFO


def choose_impl(
    op: str,
    impl: Impl,
    unsupported: Callable[[Concrete], str | None],
    *,
    platform: str | None = None,
) -> Concrete:
    """What `op` runs on `platform` (default: `target_platform()`): `resolve_impl`, then the XLA
    path when the chosen kernel cannot compile these shapes there.

    `unsupported(which)` returns why kernel `which` cannot be compiled for the shapes at hand
    (None if it can); it is consulted only when the kernel would be compiled, not interpreted.
    """
    platform = platform or target_platform()
    which = resolve_impl(impl, platform=platform)
    if which == "xla" or interpret_needed(which, platform=platform):
        return which
    reason = unsupported(which)
    if reason is not None:
        if (op, reason) not in _LOGGED:
            _LOGGED.add((op, reason))
            logger.log(
                fallback_level(platform),
                "%s: %s cannot compile these shapes (%s); using XLA on %s",
                op,
                which,
                reason,
                platform,
            )
        return "xla"
    return which


def by_platform(
    choose: Callable[[str], Concrete],
    build: Callable[[Concrete, bool], Callable[..., Any]],
    args: Sequence[Any],
    *,
    mesh: Mesh | None = None,
) -> Any:
    """`build(which, interpret)(*args)` for the platform the program is lowered for.

    `which = choose(platform)` and `interpret = interpret_needed(which, platform=platform)`, for
    the mesh's platform when a `mesh` is given, else for each of `PLATFORMS` under
    `jax.lax.platform_dependent` ("cpu" stands for any platform but TPU and GPU). Each distinct
    (which, interpret) is built and traced once.
    """
    platforms = PLATFORMS if mesh is None else (mesh_platform(mesh),)
    built: dict[tuple[Concrete, bool], Callable[..., Any]] = {}
    branch: dict[str, Callable[..., Any]] = {}
    for platform in platforms:
        which = choose(platform)
        key = (which, interpret_needed(which, platform=platform))
        if key not in built:
            built[key] = build(*key)
        branch[platform] = built[key]
    if len(built) == 1:
        return next(iter(built.values()))(*args)
    # JAX lowers only the lowering platform's branch, yet expects the ordered-effect tokens of
    # all of them: branches must hold no ordered effects (no TPU interpret mode, see above).
    return jax.lax.platform_dependent(
        *args,
        tpu=branch["tpu"],
        cuda=branch["gpu"],
        rocm=branch["gpu"],
        default=branch["cpu"],
    )


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _free_axes(mesh: Mesh, skip: Sequence[str] = ()) -> tuple[str, ...]:
    """`mesh`'s axes of more than one device that are neither in `skip` nor manual in the
    program being traced (inside a `shard_map` over some of them, the others stay free)."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return tuple(n for n, s in mesh.shape.items() if s > 1 and n not in manual and n not in skip)


def kv_head_axes(
    mesh: Mesh | None, kv_heads: int, skip: Sequence[str] = ()
) -> tuple[str, ...] | None:
    """The mesh axes the KV heads are split over inside `on_mesh` (None: replicated): every
    free axis (`_free_axes`) when their sizes' product divides `kv_heads`."""
    if mesh is None:
        return None
    axes = _free_axes(mesh, skip)
    size = math.prod(mesh.shape[a] for a in axes)
    return axes if axes and kv_heads % size == 0 else None


def pool_dims(
    shape: Sequence[int], *, head_dim: int | None = None, kv_heads: int | None = None
) -> tuple[int, int, int, int]:
    """`(P, L, K, F)` of a page pool given as `[P, L, K, F]` or lane-dense as `[P, L, K * F]`.

    The rollout cache stores its pools lane-dense: on TPU the minor dims `(K, F)` of a
    `[P, L, K, F]` pool are tiled (and padded) together, so every op that views the pool as
    rows of `K * F` (the kernels, token-row gathers) would copy it whole into that layout. The
    lane-dense form says how to split its last dim by `head_dim` (F) or `kv_heads` (K)."""
    if len(shape) == 4:
        return tuple(shape)  # type: ignore[return-value]
    if len(shape) != 3 or (head_dim is None) == (kv_heads is None):
        raise ValueError(
            f"a pool is [P, L, K, F] or [P, L, K * F] with head_dim or kv_heads; got {shape}"
        )
    p, page_size, c = shape
    kh = c // head_dim if head_dim is not None else kv_heads
    if not kh or c % kh:
        raise ValueError(f"a lane-dense pool's last dim {c} does not split into {kh} heads")
    return p, page_size, kh, c // kh


def local_kv_heads(mesh: Mesh | None, kv_heads: int) -> int:
    """How many KV heads one device's kernel call sees under `on_mesh`."""
    axes = kv_head_axes(mesh, kv_heads)
    return kv_heads if axes is None else kv_heads // math.prod(mesh.shape[a] for a in axes)


def on_mesh(
    kernel: Callable[..., Any],
    args: Sequence[jax.Array],
    *,
    mesh: Mesh | None,
    kv_heads: int,
    in_head_dims: Sequence[int | None],
    out_head_dims: int | None | tuple[int | None, ...],
) -> Any:
    """`kernel(*args)`, per device under `shard_map` when `mesh` has more than one device.

    `in_head_dims[i]` / `out_head_dims` name the head axis of each operand / output (None: an
    operand every device needs whole, such as page tables). With `kv_head_axes` the head axes are
    split over the mesh (contiguous blocks, so query head n stays with KV head n // G); without,
    everything is replicated and each device computes the whole op. Traced inside a `shard_map`
    over some of the mesh's axes (the rollout engine's data shards), it maps over the others.
    """
    if mesh is None or mesh.size == 1:
        return kernel(*args)
    context = jax.sharding.get_abstract_mesh()
    nested = bool(context.manual_axes)
    # Nested: map over every axis not yet manual (size-1 ones too: a kernel cannot sit in
    # any automatically partitioned region).
    rest = frozenset(context.axis_names) - set(context.manual_axes) if nested else frozenset()
    if nested and not rest:  # every axis is manual already: this is one device's program
        return kernel(*args)
    axes = kv_head_axes(mesh, kv_heads)

    def spec(ndim: int, dim: int | None) -> PartitionSpec:
        if axes is None or dim is None:
            return PartitionSpec()
        parts: list[Any] = [None] * ndim
        parts[dim] = axes
        return PartitionSpec(*parts)

    in_specs = tuple(spec(x.ndim, d) for x, d in zip(args, in_head_dims, strict=True))
    out_shapes = jax.eval_shape(kernel, *args)
    if isinstance(out_head_dims, tuple):
        out_specs = tuple(spec(o.ndim, d) for o, d in zip(out_shapes, out_head_dims, strict=True))
    else:
        out_specs = spec(out_shapes.ndim, out_head_dims)
    # Pallas calls carry no varying-axes annotations; the specs above are the contract.
    fn = jax.shard_map(
        kernel,
        mesh=context if nested else mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=rest,
        check_vma=False,
    )
    return fn(*args)
