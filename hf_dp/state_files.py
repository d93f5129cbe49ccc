"""A state_dict as a file that executes nothing on load: its tensors as safetensors, the rest (nested dicts,
lists, tuples, numbers, strings) as JSON in the file's metadata, each tensor referred to by name. What a
checkpoint's noise state is written in (checkpoint.py); read back with ``safetensors.safe_open`` alone."""

from __future__ import annotations

import json
from typing import IO, Any

import numpy as np
import safetensors
import torch


def write_state(f: IO[bytes], state: Any, version: str) -> None:
    """``state`` into ``f`` (encode_state's JSON and tensors), tagged with ``version``."""
    structure, tensors = encode_state(state)
    write_safetensors(f, tensors, {"format": version, "state": json.dumps(structure)})


def read_state(path: str, version: str) -> Any:
    """The state ``write_state`` wrote at ``version``; any other file (a pickle, a truncated file, another
    version) raises."""
    with safetensors.safe_open(path, framework="pt", device="cpu") as f:
        metadata = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
    if metadata.get("format") != version:
        raise ValueError(f"format {metadata.get('format')!r} is not {version}")
    return decode_state(json.loads(metadata["state"]), tensors)


_TENSOR, _ARRAY, _TUPLE = "__tensor__", "__ndarray__", "__tuple__"  # tagged JSON objects (one key each)


def encode_state(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``state`` as JSON and the tensors it refers to: a tensor (or numpy array) becomes ``{"__tensor__":
    name}`` (``{"__ndarray__": name}``), a tuple ``{"__tuple__": [...]}``; dicts (string keys), lists, str,
    int (any size), float, bool and None stay. Anything else (an object a pickle would carry) is refused."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[tuple[str, int]] = set()

    def tensor(value: torch.Tensor, where: str) -> str:
        if value.dtype not in _SAFETENSORS_DTYPES or value.is_sparse:
            raise TypeError(
                f"hf_dp: the noise state holds a {'sparse ' if value.is_sparse else ''}{value.dtype} tensor at "
                f"{where or 'its top'!r}, which safetensors cannot store"
            )
        value = value.detach().cpu().contiguous()
        storage = (str(value.device), value.untyped_storage().data_ptr())
        if value.numel() and storage in storages:
            value = value.clone()  # each tensor its own bytes (safetensors refuses shared ones)
        storages.add(storage)
        name = where or "."
        while name in tensors or name == "__metadata__":  # a key with a "." can spell another tensor's path
            name = f"{name}#"
        tensors[name] = value
        return name

    def encode(value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            return {_TENSOR: tensor(value, where)}
        if isinstance(value, np.ndarray):
            return {_ARRAY: tensor(torch.from_numpy(np.ascontiguousarray(value)), where)}
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, (list, tuple)):
            items = [encode(v, f"{where}.{i}") for i, v in enumerate(value)]
            return {_TUPLE: items} if isinstance(value, tuple) else items
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value) or {_TENSOR, _ARRAY, _TUPLE} & set(value):
                raise TypeError(
                    f"hf_dp: the noise state at {where or 'its top'!r} has keys {sorted(map(repr, value))}: a key "
                    f"must be a string, and none of {_TENSOR}, {_ARRAY}, {_TUPLE}"
                )
            return {k: encode(v, f"{where}.{k}" if where else k) for k, v in value.items()}
        raise TypeError(
            f"hf_dp: the noise state holds a {type(value).__name__} at {where or 'its top'!r}; a mechanism's "
            "state_dict may hold tensors, numpy arrays, dicts, lists, tuples, str, int, float, bool and None "
            "(checkpoints are safetensors + JSON, never a pickle)"
        )

    return encode(state, ""), tensors


# safetensors' names of the dtypes a noise state may hold (the float8 ones where this torch has them)
_SAFETENSORS_DTYPES = {
    getattr(torch, name): code
    for name, code in [
        ("float64", "F64"),
        ("float32", "F32"),
        ("float16", "F16"),
        ("bfloat16", "BF16"),
        ("int64", "I64"),
        ("int32", "I32"),
        ("int16", "I16"),
        ("int8", "I8"),
        ("uint8", "U8"),
        ("uint16", "U16"),
        ("uint32", "U32"),
        ("uint64", "U64"),
        ("bool", "BOOL"),
        ("float8_e4m3fn", "F8_E4M3"),
        ("float8_e5m2", "F8_E5M2"),
    ]
    if hasattr(torch, name)
}


def write_safetensors(f: IO[bytes], tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """``tensors`` (contiguous, on the CPU) as a safetensors file, streamed into ``f`` one tensor at a time
    (no copy of the whole state in memory, and into atomic_write's own temporary file: safetensors' save_file
    writes a temporary file of its own, named outside hf_dp's private names). The format: the header's length
    (8 bytes, little-endian), the JSON header padded with spaces to 8 bytes, then the tensors' bytes, widest
    dtype first so that each tensor starts aligned. ``safetensors.safe_open`` reads it (load_noise_state)."""
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        t = tensors[name]
        end = offset + t.numel() * t.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    f.write(len(text).to_bytes(8, "little"))
    f.write(text)
    for name in order:
        if tensors[name].numel():
            f.write(tensors[name].reshape(-1).view(torch.uint8).numpy().data)


def decode_state(structure: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``encode_state``'s inverse; a reference to a tensor the file lacks is a KeyError."""
    if structure is None or isinstance(structure, (bool, int, float, str)):
        return structure
    if isinstance(structure, list):
        return [decode_state(v, tensors) for v in structure]
    if not isinstance(structure, dict):
        raise ValueError(f"unexpected {type(structure).__name__} in the noise state")
    if len(structure) == 1 and _TENSOR in structure:
        return tensors[structure[_TENSOR]]
    if len(structure) == 1 and _ARRAY in structure:
        return tensors[structure[_ARRAY]].numpy()
    if len(structure) == 1 and _TUPLE in structure:
        return tuple(decode_state(v, tensors) for v in structure[_TUPLE])
    return {str(k): decode_state(v, tensors) for k, v in structure.items()}
