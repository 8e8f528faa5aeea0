"""Zero-copy views of pinned host memory as CUDA tensors (unified virtual addressing).

With UVA (every 64-bit CUDA platform), a pinned host allocation has one address that both the
CPU and the GPU can use, so a CUDA kernel can read it directly over PCIe/NVLink without a copy.
PyTorch has no public call for such a view, but it builds a CUDA tensor from any object that
exports `__cuda_array_interface__`, and it accepts a pointer that CUDA reports as registered
host memory. The view keeps its pinned base tensor alive.
"""

from __future__ import annotations

import torch

__all__ = ["uva_view"]

_TYPESTR = {
    torch.int64: "<i8",
    torch.int32: "<i4",
    torch.float64: "<f8",
    torch.float32: "<f4",
    torch.float16: "<f2",
    torch.uint8: "|u1",
    torch.int8: "|i1",
    torch.bool: "|b1",
}


class _PinnedArray:
    """Exports a pinned, contiguous host tensor through `__cuda_array_interface__`."""

    def __init__(self, base: torch.Tensor) -> None:
        self.base = base  # keeps the host memory alive as long as the view
        self.__cuda_array_interface__ = {
            "shape": tuple(base.shape),
            "typestr": _TYPESTR[base.dtype],
            "data": (base.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


def uva_view(host: torch.Tensor, device: torch.device | str = "cuda") -> torch.Tensor:
    """A CUDA tensor aliasing the pinned host tensor `host`: kernels read host memory."""
    if not host.is_pinned():
        raise ValueError("uva_view: the tensor must be in pinned host memory")
    if not host.is_contiguous():  # a contiguous copy would be pageable memory
        raise ValueError("uva_view: the pinned tensor must be contiguous")
    if host.dtype not in _TYPESTR:
        raise ValueError(f"uva_view: unsupported dtype {host.dtype}")
    if host.numel() == 0:
        return torch.empty(host.shape, dtype=host.dtype, device=device)
    return torch.as_tensor(_PinnedArray(host), device=device)
