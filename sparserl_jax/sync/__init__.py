"""PULSESync: lossless sparse bf16 weight patches from the trainer to sampler meshes.

`Publisher` turns master trees into versioned patches/anchors (`codec`), a `Transport` carries
them, and a `Receiver` validates and applies them bit-exactly on the sampler's devices.
"""

from sparserl_jax.sync.codec import (
    CodecConfig,
    Patch,
    TensorPatch,
    TensorSpec,
    decode,
    encode_anchor,
    encode_patch,
)
from sparserl_jax.sync.errors import (
    BaseMismatchError,
    CorruptPatchError,
    DuplicatePatchError,
    MissingVersionError,
    OutOfOrderPatchError,
    RunMismatchError,
    SyncError,
    TruncatedPatchError,
    VersionError,
)
from sparserl_jax.sync.extract import LeafChanges, extract_changes
from sparserl_jax.sync.header import new_run_id
from sparserl_jax.sync.loco import (
    LoCoConfig,
    coded_payload_bytes,
    ddp_bytes,
    diloco_bytes,
    error_feedback,
    mean_of_dense,
    mean_of_payloads,
    outer_update,
    payload_bytes,
    pseudo_gradient,
    pulse_gate,
    split_bf16,
)
from sparserl_jax.sync.loco_runtime import (
    LoCoTrainer,
    RoundStats,
    init_cpu_distributed,
    replica_mesh,
)
from sparserl_jax.sync.mask import (
    leaf_digests,
    publish_bits,
    to_bits,
    visible_bitmap,
    visible_delta,
    visible_mask,
)
from sparserl_jax.sync.publisher import Published, Publisher, SyncConfig, leaf_names
from sparserl_jax.sync.receiver import ApplyEvent, Receiver
from sparserl_jax.sync.transport import (
    InProcessTransport,
    KvStoreTransport,
    StreamClient,
    StreamServer,
    Transport,
)
from sparserl_jax.sync.values import entropy_bound

__all__ = [
    "ApplyEvent",
    "BaseMismatchError",
    "CodecConfig",
    "CorruptPatchError",
    "DuplicatePatchError",
    "InProcessTransport",
    "KvStoreTransport",
    "LeafChanges",
    "LoCoConfig",
    "LoCoTrainer",
    "MissingVersionError",
    "OutOfOrderPatchError",
    "Patch",
    "Published",
    "Publisher",
    "Receiver",
    "RunMismatchError",
    "RoundStats",
    "StreamClient",
    "StreamServer",
    "SyncConfig",
    "SyncError",
    "TensorPatch",
    "TensorSpec",
    "Transport",
    "TruncatedPatchError",
    "VersionError",
    "coded_payload_bytes",
    "ddp_bytes",
    "decode",
    "diloco_bytes",
    "encode_anchor",
    "encode_patch",
    "entropy_bound",
    "error_feedback",
    "extract_changes",
    "init_cpu_distributed",
    "leaf_digests",
    "leaf_names",
    "mean_of_dense",
    "mean_of_payloads",
    "new_run_id",
    "outer_update",
    "payload_bytes",
    "pseudo_gradient",
    "publish_bits",
    "pulse_gate",
    "replica_mesh",
    "split_bf16",
    "to_bits",
    "visible_bitmap",
    "visible_delta",
    "visible_mask",
]
