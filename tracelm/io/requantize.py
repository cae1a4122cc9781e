"""A GGUF file copied with its tensors of one quantized type requantized to another, by gguf-py alone: each
such tensor dequantized (`gguf.quants.dequantize`) and quantized again (`gguf.quants.quantize`), every other
tensor and all metadata copied as they are (`general.file_type` set, or added, as the new type's), written with
`gguf.GGUFWriter` one tensor at a time.

The registry uses it for files no package carries: SmolLM2 in Q4_0 (llama.cpp's repacked path) from the Q4_1
file (its generic one). The new blocks round the old blocks' values, not the original weights: a second
rounding, so the model is a little further from the original than a Q4_0 made from f16 weights would be; its
speed is the same.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from tracelm.state.errors import TracelmError

# the file type GGUF metadata names when every large matrix is of that type (gguf.LlamaFileType)
FILE_TYPE = {QType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, QType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
             QType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0, QType.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0,
             QType.Q5_1: gguf.LlamaFileType.MOSTLY_Q5_1}


def _requantized(data: np.ndarray, old: QType, new: QType) -> np.ndarray:
    """A tensor's raw blocks (uint8 rows, as gguf's reader gives them) in the new type."""
    values = gguf.quants.dequantize(data, old).astype(np.float32)
    return np.ascontiguousarray(gguf.quants.quantize(values, new)).view(np.uint8)


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, new: QType) -> None:
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        if field.name == gguf.Keys.General.FILE_TYPE:
            continue  # the new type's, below
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
    writer.add_file_type(int(FILE_TYPE[new]))


def requantize_gguf(src: str | os.PathLike, dst: str | os.PathLike, old: QType, new: QType) -> int:
    """Write `dst`: the GGUF `src` with every `old` tensor requantized to `new`; returns how many were."""
    if new not in FILE_TYPE:
        raise TracelmError(f"requantize: no GGUF file type for {new.name} (known: "
                           f"{', '.join(t.name for t in FILE_TYPE)})")
    try:
        reader = gguf.GGUFReader(str(src))
    except (OSError, ValueError) as e:
        raise TracelmError(f"{src}: cannot read as GGUF: {e}") from None
    if not any(t.tensor_type == old for t in reader.tensors):
        raise TracelmError(f"{src}: has no {old.name} tensor to requantize")
    arch = str(reader.get_field(gguf.Keys.General.ARCHITECTURE).contents())
    if reader.endianess != gguf.GGUFEndian.LITTLE:  # (write_tensor_data's byte order differs across gguf versions)
        raise TracelmError(f"{src}: a big-endian GGUF; requantize writes little-endian files from little-endian ones")
    writer = gguf.GGUFWriter(str(dst), arch=arch)
    _copy_metadata(reader, writer, new)
    block, type_size = gguf.GGML_QUANT_SIZES[new]
    for t in reader.tensors:
        if t.tensor_type == old:
            rows, cols = int(np.prod(t.data.shape[:-1])), int(t.shape[0])  # t.shape is GGUF's ne: columns first
            shape = (*t.data.shape[:-1], cols // block * type_size)
            writer.add_tensor_info(t.name, shape, np.dtype(np.uint8), rows * shape[-1], raw_dtype=new)
        else:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    done = 0
    for t in reader.tensors:
        if t.tensor_type == old:
            writer.write_tensor_data(_requantized(t.data, old, new))
            done += 1
        else:
            writer.write_tensor_data(t.data)
    writer.close()
    return done
