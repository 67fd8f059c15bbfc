"""Compaction: gather each slot's kept tokens into the front of its own pages."""

from pallas_kernels.compaction.api import compact_pages
from pallas_kernels.compaction.reference import compact_pages_reference

__all__ = ["compact_pages", "compact_pages_reference"]
