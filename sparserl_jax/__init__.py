"""sparserl-jax: RL post-training of LLMs in JAX with sparse-KV rollouts, gated batch reuse and
lossless sparse weight sync.

Subpackages: `models` (the decoder, Hugging Face I/O, presets), `parallel` (meshes, sharding
rules), `kvcache` (the paged compressible cache), `rollout` (the engine), `rl` (advantages, losses,
the Sparse-RL correction, DGG, the learner), `sync` (PULSESync, PULSELoCo), `data` (tasks, rewards,
pipelines), `testing` (test doubles and oracles). `sparserl_jax.train` and
`sparserl_jax.generate` are the jobs behind the `sparserl` command (`sparserl_jax.cli`).

Axis letters, used in einsum strings, jaxtyping shapes and suffixes of array names
(`logits_btv`, `page_table_bm`):

    B  batch rows (sequences; the slots of a cache)     V  vocabulary
    T  time: query positions, new tokens                 L  page length (tokens per page)
    S  key time: cached positions (a paged slot holds    M  pages per slot (page-table width)
       S = M * L)                                        P  pages in the pool
    D  model width                                       Y  layers
    N  query heads                                       J  kept tokens (after compression)
    K  kv heads                                          W  observation window
    G  query heads per kv head (N = K * G)               R  requests (prompts x samples)
    H  head dim                                          F  MLP width
"""
