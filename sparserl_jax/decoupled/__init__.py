"""Decoupled, asynchronous training (docs/decoupled.md): a trainer job and N sampler jobs that
share nothing but an exchange (a TensorStore kvstore).

The package's `__init__` exports only what `sparserl_jax.config` and library users need without
pulling in the jobs: the config sections, the exchange and the ledger. The jobs are
`sparserl_jax.decoupled.trainer`, `.sampler_job` and `.launch` (the `sparserl trainer`,
`sparserl sampler` and `sparserl launch` commands).
"""

from sparserl_jax.decoupled.config import AsyncConfig, ExchangeConfig

__all__ = ["AsyncConfig", "ExchangeConfig"]
