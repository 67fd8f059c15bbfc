"""Paged decode attention (GQA) over page tables and lengths."""

from pallas_kernels.paged_attention.api import paged_decode_attention
from pallas_kernels.paged_attention.reference import (
    gather_pages,
    paged_attention_reference,
    paged_decode_attention_reference,
)

__all__ = [
    "gather_pages",
    "paged_attention_reference",
    "paged_decode_attention",
    "paged_decode_attention_reference",
]
