"""The paged KV cache: page pools shared through one page table, following `DecodeCache`.

Per layer a K and a V pool of P pages of L tokens, each token a row of its K heads' keys (or
values) side by side, `[P, L, K * H]` (stacked over layers: `[Y, P, L, K * H]`). That lane-dense
layout is the one every op on the pool reads or writes: the Mosaic kernels' blocks, token-row
stores, gathers and compaction; on TPU a `[..., K, H]` pool is tiled over (K, H) instead (padded
when K is small) and each of those ops would copy the whole pool into the other layout. One page
table `[B, M]` for all layers (a page id names the same page in every layer's pool), kept-token
counts, and the next absolute position of each slot. Keys are stored after RoPE, so a kept key
stays valid however far it is compacted; a new token's RoPE position is its absolute position
(`next_pos`), never the compacted length. Only the kept count must agree between layers and KV
heads, so per-sequence, per-layer and per-KV-head selections all fit the one table.

Pages come from a jittable free stack (`allocator.py`) in `begin_step`, and go back in
`compress` (emptied pages) and `release_slots` (finished sequences).

Exhausted pool: a slot whose new tokens do not fit (no free page, or its page table is full)
stores nothing from then on (until `release_slots`) and its sticky `overflow_b` flag is set;
`check_overflow` raises a clear error on the host. Nothing is ever written to a page the slot
does not own. Callers size the pool with `CompressionConfig.pages_per_slot` and check the flag
after each chunk.

Extra state the policies need, kept only when asked for:
- `q_window`: the last w queries per layer and slot (SnapKV, R-KV), a ring indexed by
  absolute position mod w.
- `attn_mass`: the attention mass each stored key has received (H2O), paged like K/V so it is
  compacted and freed with its token.
- `evict_pos`: when each position left the cache (`kvcache.evictions`), for a learner that
  replays the sampler's attention.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels._dispatch import Concrete, Impl, by_platform, kv_head_axes
from pallas_kernels.paged_attention.api import (
    decode_impl,
    decode_kernel,
    paged_decode_attention_xla_bucketed,
)
from pallas_kernels.paged_attention.reference import layer_pages, paged_attention_reference
from sparserl_jax.kvcache import allocator, evictions
from sparserl_jax.kvcache.config import cdiv

_STATIC = {"static": True}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """A paged, compressible KV cache for `B` slots (see the module docstring)."""

    k_pages: jax.Array  # [layers, P, L, K * H] (lane-dense: the module docstring)
    v_pages: jax.Array  # [layers, P, L, K * H]
    page_table: jax.Array  # int32 [B, M]; -1 where the slot holds no page
    num_pages_b: jax.Array  # int32 [B]: pages each slot holds
    lengths_b: jax.Array  # int32 [B]: tokens kept per slot
    next_pos_b: jax.Array  # int32 [B]: absolute position of the slot's next token
    new_counts_b: jax.Array  # int32 [B]: real tokens in the step in flight (0 between steps)
    evicted_b: jax.Array  # int32 [B]: tokens evicted so far
    overflow_b: jax.Array  # bool [B]: sticky, a step of this slot found no room
    free_stack: jax.Array  # int32 [P]: stack[:free_top] are the free pages
    free_top: jax.Array  # int32 []
    steps: jax.Array  # int32 []: decode calls so far (one per `end_step`), batch-level
    peak_pages: jax.Array  # int32 []: most pages ever in use at once
    peak_tokens: jax.Array  # int32 []: most tokens ever kept at once (all slots; pages' fill)
    q_window: jax.Array | None  # [layers, B, w, N * H] (lane-dense like the pools) or None
    attn_mass: jax.Array | None  # fp32 [layers, P, L, K] or None
    evict_pos: jax.Array | None = None  # int32 [Y', B, K', T] (`kvcache.evictions`) or None
    kv_heads: int = dataclasses.field(default=1, metadata=_STATIC)  # K of the pools
    impl: Impl = dataclasses.field(default="auto", metadata=_STATIC)
    # The devices the kernels run on per device (`pallas_kernels._dispatch.on_mesh`); None: one.
    mesh: Mesh | None = dataclasses.field(default=None, metadata=_STATIC)

    @classmethod
    def create(
        cls,
        *,
        num_layers: int,
        batch: int,
        num_pages: int,
        page_size: int,
        max_pages_per_slot: int,
        num_kv_heads: int,
        head_dim: int,
        num_heads: int | None = None,
        window: int = 0,
        track_attention_mass: bool = False,
        evict_record: tuple[int, int, int] | None = None,
        dtype: jnp.dtype = jnp.float32,
        impl: Impl = "auto",
        mesh: Mesh | None = None,
    ) -> PagedKVCache:
        """An empty cache; `window > 0` (with `num_heads`) records the last `window` queries;
        `evict_record` = (Y', K', T) keeps the eviction record (`kvcache.evictions`).

        With a `mesh`, the kernels run per device (`shardings` says how the arrays are laid out).
        """
        for name, value in (
            ("num_layers", num_layers),
            ("batch", batch),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("max_pages_per_slot", max_pages_per_slot),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if window > 0 and num_heads is None:
            raise ValueError("recording a query window needs num_heads")
        pool = (num_layers, num_pages, page_size, num_kv_heads * head_dim)
        stack, top = allocator.init_free_stack(num_pages)
        zeros_b = jnp.zeros((batch,), jnp.int32)
        q_window = None
        if window > 0:
            q_window = jnp.zeros((num_layers, batch, window, num_heads * head_dim), dtype)
        attn_mass = None
        if track_attention_mass:
            attn_mass = jnp.zeros(pool[:-1] + (num_kv_heads,), jnp.float32)
        return cls(
            k_pages=jnp.zeros(pool, dtype),
            v_pages=jnp.zeros(pool, dtype),
            page_table=jnp.full((batch, max_pages_per_slot), -1, jnp.int32),
            num_pages_b=zeros_b,
            lengths_b=zeros_b,
            next_pos_b=zeros_b,
            new_counts_b=zeros_b,
            evicted_b=zeros_b,
            overflow_b=jnp.zeros((batch,), bool),
            free_stack=stack,
            free_top=top,
            steps=jnp.int32(0),
            peak_pages=jnp.int32(0),
            peak_tokens=jnp.int32(0),
            q_window=q_window,
            attn_mass=attn_mass,
            evict_pos=None if evict_record is None else evictions.empty_record(evict_record, batch),
            kv_heads=num_kv_heads,
            impl=impl,
            mesh=mesh,
        )

    def shardings(self, *, stacked: str | tuple[str, ...] | None = None) -> PagedKVCache:
        """A matching tree of `NamedSharding`s on `mesh`: pools (and the query window and the
        attention mass) split over the mesh by KV head when their count divides by its size,
        as the kernels split them (`on_mesh`); page tables, lengths and counters replicated.

        `stacked`: the shardings of a stack of such caches on a new leading axis, split over
        that mesh axis or axes (the rollout engine's data shards), the heads over the others."""
        if self.mesh is None:
            raise ValueError("PagedKVCache.shardings needs a cache created with a mesh")
        skip = (stacked,) if isinstance(stacked, str) else stacked or ()
        axes = kv_head_axes(self.mesh, self.kv_heads, skip=skip)
        lead = [stacked] if stacked else []

        def by_head(dim: int | None):
            def sharding(x):
                parts = lead + [None] * x.ndim
                if axes is not None and dim is not None:
                    parts[len(lead) + dim] = axes
                return NamedSharding(self.mesh, PartitionSpec(*parts))

            return sharding

        tree = jax.tree.map(by_head(None), self)
        heads = {"k_pages": 3, "v_pages": 3, "q_window": 3, "attn_mass": 3}
        return dataclasses.replace(
            tree,
            **{
                name: by_head(dim)(getattr(self, name))
                for name, dim in heads.items()
                if getattr(self, name) is not None
            },
        )

    # ---- sizes -------------------------------------------------------------------------------

    def split_heads(self, pool: jax.Array) -> jax.Array:
        """A pool (or a gather of its token rows) with its last dim split as `[..., K, H]`."""
        return pool.reshape(pool.shape[:-1] + (self.kv_heads, -1))

    @property
    def head_dim(self) -> int:
        return self.k_pages.shape[-1] // self.kv_heads

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[1]

    @property
    def window(self) -> int:
        return 0 if self.q_window is None else self.q_window.shape[2]

    @property
    def capacity(self) -> int:
        """S, the most tokens one slot can hold (`M * L`)."""
        return self.page_table.shape[1] * self.page_size

    @property
    def page_bytes(self) -> int:
        """Bytes one page occupies across all layers, K and V (plus H2O's mass if tracked)."""
        layers, _, pl, row = self.k_pages.shape
        nbytes = 2 * layers * pl * row * self.k_pages.dtype.itemsize
        if self.attn_mass is not None:
            nbytes += layers * pl * self.kv_heads * 4
        return nbytes

    def pages_in_use(self) -> Int[Array, ""]:
        return self.num_pages - self.free_top

    # ---- DecodeCache protocol ----------------------------------------------------------------

    def begin_step(self, token_mask_bt: Bool[Array, "B T"]) -> tuple[PagedKVCache, jax.Array]:
        """Allocate the pages the new tokens need; return their absolute RoPE positions."""
        t = token_mask_bt.shape[1]
        new_b = jnp.sum(token_mask_bt.astype(jnp.int32), axis=1)
        need_b = jnp.maximum(cdiv_arr(self.lengths_b + new_b, self.page_size) - self.num_pages_b, 0)
        # An overflowed slot stays stopped until released: no later token lands after a gap.
        need_b = jnp.where(self.overflow_b, 0, need_b)
        page_table, num_pages_b, top, ok_b = allocator.allocate(
            self.free_stack,
            self.free_top,
            self.page_table,
            self.num_pages_b,
            need_b,
            max_new=cdiv(t, self.page_size) + 1,
        )
        positions_bt = self.next_pos_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        # A slot that found no room stores nothing this step (flagged, never corrupted).
        new_counts_b = jnp.where(ok_b & ~self.overflow_b, new_b, 0)
        kept = jnp.sum(self.lengths_b + new_counts_b)
        cache = dataclasses.replace(
            self,
            page_table=page_table,
            num_pages_b=num_pages_b,
            free_top=top,
            new_counts_b=new_counts_b,
            overflow_b=self.overflow_b | ~ok_b,
            peak_pages=jnp.maximum(self.peak_pages, self.num_pages - top),
            peak_tokens=jnp.maximum(self.peak_tokens, kept),
        )
        return cache, positions_bt

    def attend(
        self,
        layer: int,
        q_btnh: Float[Array, "B T N H"],
        k_btkh: Float[Array, "B T K H"],
        v_btkh: Float[Array, "B T K H"],
    ) -> tuple[Float[Array, "B T N H"], PagedKVCache]:
        """Store the new keys/values of `layer`, then attend over the slot's kept keys."""
        b, t = q_btnh.shape[:2]
        pl, p = self.page_size, self.num_pages
        t_idx = jnp.arange(t, dtype=jnp.int32)
        idx_bt = self.lengths_b[:, None] + t_idx[None, :]
        valid_bt = t_idx[None, :] < self.new_counts_b[:, None]
        col_bt = jnp.clip(idx_bt // pl, 0, self.page_table.shape[1] - 1)
        page_bt = jnp.take_along_axis(self.page_table, col_bt, axis=1)
        flat_bt = jnp.where(valid_bt & (page_bt >= 0), page_bt * pl + idx_bt % pl, p * pl)

        # One scatter into the whole stacked pool (not slice -> scatter -> write back, which
        # XLA turns into a copy of the layer's pool every step): in place inside the decode loop.
        page_w_bt, off_w_bt = flat_bt // pl, flat_bt % pl

        def store(pool, new):  # whole token rows (K * H lanes)
            new = new.reshape(b, t, -1).astype(pool.dtype)
            return pool.at[layer, page_w_bt, off_w_bt].set(new, mode="drop")

        k_pages = store(self.k_pages, k_btkh)
        v_pages = store(self.v_pages, v_btkh)
        kv_len_b = self.lengths_b + self.new_counts_b
        want_probs = self.attn_mass is not None
        m = self.page_table.shape[1]
        if t == 1:
            # Decode per target platform (`by_platform`): the kernel when it compiles for these
            # shapes, else XLA (logged once), bounded by the longest row's pages rather than
            # the table's capacity. Both read the layer's pages through the stacked pool inside
            # their branch (`layer_pages`).
            n = q_btnh.shape[2]
            shape = (self.num_pages, pl, self.kv_heads, self.head_dim)

            def choose(platform: str) -> Concrete:
                return decode_impl(
                    shape, n, b, m, impl=self.impl, mesh=self.mesh, platform=platform
                )

            def build(which: Concrete, interpret: bool):
                if which == "xla":
                    return lambda q, kp, vp, pt, lens: paged_decode_attention_xla_bucketed(
                        q, kp, vp, layer, pt, lens, return_probs=want_probs
                    )
                kernel = decode_kernel(
                    which, interpret=interpret, return_probs=want_probs, mesh=self.mesh
                )

                def run(q, kp, vp, pt, lens):
                    # The stacked pool as one pool of Y * P pages (a free reshape of the
                    # lane-dense layout) with the table shifted to the layer's pages: a slice
                    # `kp[layer]` would be copied out of the pool for the kernel.
                    (k_flat, table), (v_flat, _) = (layer_pages(x, pt, layer) for x in (kp, vp))
                    return kernel(q, k_flat, v_flat, table, lens)

                return run

            args = (q_btnh[:, 0], k_pages, v_pages, self.page_table, kv_len_b)
            out_bnh, probs_bns = by_platform(choose, build, args, mesh=self.mesh)
            out_btnh = out_bnh[:, None]
            probs_btns = None if probs_bns is None else probs_bns[:, None]
        else:
            # Prefill (several tokens per row) runs on the XLA path; the kernels cover decode.
            (k_flat, table), (v_flat, _) = (
                layer_pages(x, self.page_table, layer) for x in (k_pages, v_pages)
            )
            out_btnh, probs_btns = paged_attention_reference(
                q_btnh,
                k_flat,
                v_flat,
                table,
                idx_bt,
                kv_len_b,
                return_probs=want_probs,
            )
        cache = dataclasses.replace(self, k_pages=k_pages, v_pages=v_pages)
        if self.q_window is not None:
            cache = cache._record_queries(layer, q_btnh, valid_bt)
        if want_probs:
            cache = cache._accumulate_mass(layer, probs_btns, valid_bt, flat_bt, kv_len_b)
        return out_btnh.astype(q_btnh.dtype), cache

    def end_step(self) -> PagedKVCache:
        return dataclasses.replace(
            self,
            lengths_b=self.lengths_b + self.new_counts_b,
            next_pos_b=self.next_pos_b + self.new_counts_b,
            new_counts_b=jnp.zeros_like(self.new_counts_b),
            steps=self.steps + 1,
        )

    # ---- policy state ------------------------------------------------------------------------

    def _record_queries(self, layer, q_btnh, valid_bt) -> PagedKVCache:
        w = self.window
        b, t = q_btnh.shape[:2]
        t_idx = jnp.arange(t, dtype=jnp.int32)
        pos_bt = self.next_pos_b[:, None] + t_idx[None, :]
        # Only the last w real tokens are written, so no two writes hit the same ring slot.
        keep_bt = valid_bt & (t_idx[None, :] >= self.new_counts_b[:, None] - w)
        ring_bt = jnp.where(keep_bt, pos_bt % w, w)
        rows_bt = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
        # One scatter into the stacked window (as `attend` stores K/V), updated in place.
        qw = self.q_window.at[layer, rows_bt, ring_bt].set(
            q_btnh.reshape(b, t, -1).astype(self.q_window.dtype), mode="drop"
        )
        return dataclasses.replace(self, q_window=qw)

    def _accumulate_mass(self, layer, probs_btns, valid_bt, flat_bt, kv_len_b) -> PagedKVCache:
        b, t, n, s = probs_btns.shape
        p, pl, kh = self.attn_mass.shape[1:]
        g = n // kh
        # H2O: each key's score is the attention it has received, summed over the query heads
        # of its KV group and over the new (real) queries.
        probs_btns = jnp.where(valid_bt[:, :, None, None], probs_btns, 0.0)
        mass_bsk = jnp.sum(probs_btns.reshape(b, t, kh, g, s), axis=(1, 3)).transpose(0, 2, 1)
        # Scatters into the stacked pool of every layer (not slice -> update -> write back,
        # which copies the layer's pool): in place. An index past the pool (page p) is dropped.
        # Recycled pages hold stale mass: the new tokens' entries start from zero.
        mass = self.attn_mass.at[layer, flat_bt // pl, flat_bt % pl].set(0.0, mode="drop")
        j = jnp.arange(s, dtype=jnp.int32)
        page_bs = jnp.take_along_axis(self.page_table, jnp.broadcast_to(j // pl, (b, s)), axis=1)
        flat_bs = jnp.where(j[None, :] < kv_len_b[:, None], page_bs * pl + j[None, :] % pl, p * pl)
        mass = mass.at[layer, flat_bs // pl, flat_bs % pl].add(mass_bsk, mode="drop")
        return dataclasses.replace(self, attn_mass=mass)

    def window_queries(self, layer: int) -> tuple[Float[Array, "B W N H"], Int[Array, " B"]]:
        """The last w queries of `layer`, oldest first, and how many of them are real."""
        w = self.window
        i_w = jnp.arange(w, dtype=jnp.int32)
        ring_bw = (self.next_pos_b[:, None] - w + i_w[None, :]) % w
        qw_bwc = jnp.take_along_axis(self.q_window[layer], ring_bw[:, :, None], axis=1)
        qw_bwnh = qw_bwc.reshape(qw_bwc.shape[:2] + (-1, self.head_dim))
        return qw_bwnh, jnp.minimum(self.next_pos_b, w)


def cdiv_arr(a: jax.Array, b: int) -> jax.Array:
    return (a + b - 1) // b


class PoolExhaustedError(RuntimeError):
    """A slot needed a page the pool (or its page table) could not give."""


def check_overflow(cache: PagedKVCache) -> None:
    """Raise `PoolExhaustedError` on the host if any slot ever ran out of pages."""
    overflow = np.asarray(jax.device_get(cache.overflow_b))
    if overflow.any():
        slots = np.flatnonzero(overflow).tolist()
        raise PoolExhaustedError(
            f"KV page pool exhausted for slots {slots}: their tokens past that point were not "
            f"stored. Pool: {cache.num_pages} pages of {cache.page_size} tokens, at most "
            f"{cache.page_table.shape[1]} pages per slot; size it with "
            "CompressionConfig.pages_per_slot or lower the batch."
        )
