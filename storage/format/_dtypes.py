"""Tensor dtypes as they are spelled in the manifest (torch names) and safetensors headers."""

from __future__ import annotations

import torch

# manifest name -> (torch dtype, safetensors code)
_TABLE: dict[str, tuple[torch.dtype, str]] = {
    "float64": (torch.float64, "F64"),
    "float32": (torch.float32, "F32"),
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3"),
    "float8_e5m2": (torch.float8_e5m2, "F8_E5M2"),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"),
    "int16": (torch.int16, "I16"),
    "int8": (torch.int8, "I8"),
    "uint8": (torch.uint8, "U8"),
    "bool": (torch.bool, "BOOL"),
    "complex64": (torch.complex64, "C64"),
}
_BY_TORCH = {dt: name for name, (dt, _) in _TABLE.items()}
SUPPORTED = frozenset(_BY_TORCH)  # torch dtypes the format stores
BY_SAFETENSORS_CODE = {code: dt for dt, code in _TABLE.values()}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest spelling of ``dtype``; ValueError for dtypes the format does not store."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} cannot be checkpointed; supported: {sorted(_TABLE)}"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a manifest dtype name; KeyError names the unknown dtype."""
    try:
        return _TABLE[name][0]
    except KeyError:
        raise KeyError(f"unknown dtype {name!r} in manifest; known: {sorted(_TABLE)}") from None


def safetensors_code(dtype: torch.dtype) -> str:
    """The safetensors header code (``"F32"`` ...) of ``dtype``."""
    return _TABLE[dtype_name(dtype)][1]


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element."""
    return dtype.itemsize
