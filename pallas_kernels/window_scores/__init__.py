"""Window scoring: attention of the last w queries to every kept key (SnapKV / R-KV)."""

from pallas_kernels.window_scores.api import window_scores
from pallas_kernels.window_scores.reference import window_scores_reference

__all__ = ["window_scores", "window_scores_reference"]
