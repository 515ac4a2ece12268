"""A llama.cpp `.gguf` file, parsed once and memory-mapped: header, metadata, tensor table, tensor bytes.

Everything that reads a GGUF file (the model's config and weights in `gguf_load`, the tokenizer and its
chat template in `lmforge.tokenizer.gguf`, `--dtype auto`'s header check) asks `open_gguf(path)`, which
parses the file once and keeps the result for the next caller (keyed by path, size and mtime). The
metadata's big arrays (a vocabulary's 50k-150k tokens and merges) are read as blocks, one slice per
string, not element by element; tensors are numpy views into one read-only memory map, so nothing is
copied until a loader repacks it (a 1 GB file costs no resident memory to open).

Every read is bounds-checked: a truncated or corrupt file stops with one `GGUFError` (a ValueError)
naming the file and the fault ("truncated at byte N reading the key of metadata entry 7"), never a
numpy traceback. This module knows nothing about models, tokenizers or torch.

    from lmforge.quant.gguf_file import open_gguf
    f = open_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    f.metadata["general.architecture"], f.tensors["blk.0.attn_q.weight"].type.name
    blocks = f.tensor_data("blk.0.attn_q.weight")  # (rows, bytes a row) uint8 view of the map

Format (little-endian; https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic "GGUF",
uint32 version (2 or 3), uint64 tensor count, uint64 metadata count, the metadata (key string, uint32
value type, value), the tensor infos (name, uint32 n_dims, uint64 dims fastest-first, uint32 type,
uint64 offset), padding to `general.alignment` (32), then the tensor data.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
# fixed-size value types: struct format
SCALAR = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
          GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
          GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
          GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
NUMPY = {GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8, GGUFValueType.UINT16: np.uint16,
         GGUFValueType.INT16: np.int16, GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
         GGUFValueType.FLOAT32: np.float32, GGUFValueType.BOOL: np.bool_, GGUFValueType.UINT64: np.uint64,
         GGUFValueType.INT64: np.int64, GGUFValueType.FLOAT64: np.float64}


class GGUFError(ValueError):
    """A file that is not a readable GGUF file; the message names the file and the fault."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # as GGUF lists them: fastest-varying first (a matrix: (in, out))
    type: GGMLQuantizationType
    offset: int  # from the start of the data section
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """torch/numpy order (a matrix: (out, in))."""
        return tuple(reversed(self.dims))


class _Cursor:
    """Reads little-endian values from a buffer, naming what it reads when the buffer ends early."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def fail(self, what: str, detail: str = "") -> GGUFError:
        return GGUFError(f"{self.path}: not a valid GGUF file: {detail or f'truncated at byte {self.pos}'} "
                         f"reading {what}")

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(what, f"{n} bytes needed at byte {self.pos} of {self.size}" if n >= 0 else "")
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, fmt: str, what: str):
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        start = self.take(n, what)
        return bytes(self.buf[start:start + n]).decode("utf-8", "replace")

    def strings(self, count: int, what: str) -> list[str]:
        """`count` length-prefixed strings, one slice each (the vocabulary: 100k strings in ~50 ms)."""
        if count * 8 > self.size - self.pos:
            raise self.fail(what, f"{count} strings cannot fit in the {self.size - self.pos} bytes left")
        out, buf, pos, size, unpack = [], self.buf, self.pos, self.size, struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail(what)
            n = unpack(buf, pos)[0]
            pos += 8
            if n > size - pos:
                self.pos = pos
                raise self.fail(what, f"a string of {n} bytes at byte {pos} runs past the end ({size})")
            out.append(bytes(buf[pos:pos + n]).decode("utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, what: str) -> Any:
        try:
            vtype = GGUFValueType(vtype)
        except ValueError:
            raise self.fail(what, f"unknown value type {vtype} at byte {self.pos}") from None
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            return self.array(what)
        v = self.scalar(SCALAR[vtype], what)
        # a float32 as the shortest decimal that reads back to it (1e-05, not 9.999999747378752e-06)
        return float(str(np.float32(v))) if vtype == GGUFValueType.FLOAT32 else v

    def array(self, what: str) -> Any:
        etype, count = self.scalar("<I", what), self.scalar("<Q", what)
        try:
            etype = GGUFValueType(etype)
        except ValueError:
            raise self.fail(what, f"unknown array element type {etype}") from None
        if etype == GGUFValueType.STRING:
            return self.strings(count, what)
        if etype == GGUFValueType.ARRAY:  # arrays of arrays: rare, read element by element
            if count > self.size - self.pos:
                raise self.fail(what, f"{count} nested arrays cannot fit in the bytes left")
            return [self.array(what) for _ in range(count)]
        dtype = np.dtype(NUMPY[etype])
        if count > (self.size - self.pos) // dtype.itemsize:
            raise self.fail(what, f"an array of {count} x {dtype.itemsize} bytes runs past the end ({self.size})")
        start = self.take(count * dtype.itemsize, what)
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).tolist()


class GGUFFile:
    """The parsed header of one GGUF file and a read-only map of its bytes (see the module docstring)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        size = self.path.stat().st_size
        if size < 24:
            raise GGUFError(f"{self.path}: not a valid GGUF file: {size} bytes, shorter than a GGUF header (24)")
        with open(self.path, "rb") as fh:
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(memoryview(self._map), self.path)
        self.version = self._header(cur)
        tensor_count, kv_count = cur.scalar("<Q", "the tensor count"), cur.scalar("<Q", "the metadata count")
        if tensor_count > size // 24 or kv_count > size // 12:  # each needs at least that many bytes
            raise cur.fail("the header", f"{tensor_count} tensors and {kv_count} metadata entries cannot fit "
                                         f"in {size} bytes")
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, tuple[GGUFValueType, ...]] = {}
        for i in range(kv_count):
            self._read_kv(cur, i)
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise cur.fail("general.alignment", f"general.alignment={alignment!r} is not a power of two")
        infos = [self._read_tensor_info(cur, i) for i in range(tensor_count)]
        self.data_offset = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for t in infos:
            end = self.data_offset + t.offset + t.nbytes
            if t.offset % alignment or end > size:
                raise cur.fail(f"tensor {t.name}", f"its data (offset {t.offset}, {t.nbytes} bytes) "
                                                   f"{'is not aligned' if t.offset % alignment else 'runs past the end'}"
                                                   f" of the file ({size} bytes)")
            if t.name in self.tensors:
                raise cur.fail(f"tensor {t.name}", "the tensor name appears twice")
            self.tensors[t.name] = t

    def _header(self, cur: _Cursor) -> int:
        start = cur.take(4, "the magic")
        magic = bytes(cur.buf[start:start + 4])
        if magic != MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (starts with {magic!r}, not {MAGIC!r})")
        version = cur.scalar("<I", "the version")
        if version not in VERSIONS:
            swapped = struct.unpack("<I", struct.pack(">I", version))[0]
            hint = " (a big-endian file: convert it on a little-endian machine)" if swapped in VERSIONS else ""
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are){hint}")
        return version

    def _read_kv(self, cur: _Cursor, i: int) -> None:
        key = cur.string(f"the key of metadata entry {i}")
        vtype = cur.scalar("<I", f"the type of {key}")
        types = (vtype,)
        if vtype == GGUFValueType.ARRAY and cur.pos + 4 <= cur.size:
            types = (vtype, struct.unpack_from("<I", cur.buf, cur.pos)[0])
        self.metadata[key] = cur.value(vtype, key)
        self.value_types[key] = tuple(GGUFValueType(t) for t in types if t in GGUFValueType._value2member_map_)

    def _read_tensor_info(self, cur: _Cursor, i: int) -> TensorInfo:
        name = cur.string(f"the name of tensor {i}")
        n_dims = cur.scalar("<I", f"the dimensions of tensor {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name}", f"{n_dims} dimensions (1 to {MAX_DIMS} are valid)")
        dims = tuple(cur.scalar("<Q", f"the shape of tensor {name}") for _ in range(n_dims))
        raw_type = cur.scalar("<I", f"the type of tensor {name}")
        offset = cur.scalar("<Q", f"the offset of tensor {name}")
        try:
            ttype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[ttype]
        except (ValueError, KeyError):
            raise cur.fail(f"tensor {name}", f"unknown tensor type {raw_type}") from None
        count = int(np.prod(dims, dtype=np.uint64)) if all(d > 0 for d in dims) else 0
        if count == 0 or count > 2**48:
            raise cur.fail(f"tensor {name}", f"shape {dims} is empty or absurd")
        if dims[0] % block:
            raise cur.fail(f"tensor {name}", f"a row of {dims[0]} is not a whole number of {ttype.name} blocks "
                                              f"of {block}")
        return TensorInfo(name, dims, ttype, offset, count // block * type_size)

    # ---- tensor data -----------------------------------------------------------------------------------

    def tensor_data(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the map, one row per output row ((rows, bytes a
        row); a vector: (1, bytes)). No copy."""
        t = self.tensors[name]
        start = self.data_offset + t.offset
        flat = np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=start)
        return flat.reshape(-1, t.nbytes // max(1, int(np.prod(t.dims[1:], dtype=np.int64))))

    def close(self) -> None:
        """Release the map (views handed out keep it alive until they are gone)."""
        try:
            self._map.close()
        except BufferError:  # a numpy view still points into it: the map closes when the view goes
            pass

    def field_type(self, key: str) -> tuple[GGUFValueType, ...]:
        return self.value_types.get(key, ())


_CACHE: dict[tuple[str, int, int], GGUFFile] = {}  # the last files opened, by (path, size, mtime)
_CACHE_SIZE = 2


def release_gguf() -> None:
    """Forget the parsed files and unmap them: a loader calls it once it holds its own copies (the map's touched
    pages otherwise stay resident, about the file's size)."""
    for f in _CACHE.values():
        f.close()
    _CACHE.clear()


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The parsed file, shared by every caller while the file is unchanged (path, size, mtime)."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such GGUF file") from None
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _CACHE:
        while len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = GGUFFile(path)
    return _CACHE[key]
