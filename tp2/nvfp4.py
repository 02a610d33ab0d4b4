"""nvfp4 (AWQ) linears cut for TP: split checks, per-rank slicing, and a quantiser writing what a ComfyUI nvfp4 file stores.

Layout of a linear [n, k] (out, in), as comfy-kitchen 0.2.31 (tensor/nvfp4.py, float_utils.py) and comfy/ops.py have it:
  weight          uint8 [roundup(n,16), roundup(k,16)/2]: two E2M1 codes a byte, the even column in the high nibble
  weight_scale    float8_e4m3fn (or uint8) [roundup(n,128), roundup(roundup(k,16)/16, 4)]: one scale per 16 input columns,
                  in cuBLAS's swizzled 128x4-tile layout (SWIZZLE_32_4_4); all padding is zero
  weight_scale_2  float32 scalar amax(|W|) / (448 * 6);  input_scale (optional) float32, the static activation scale
  pre_quant_scale [k] (optional, AWQ): multiplies the input; the stored weight is W / pre_quant_scale
  comfy_quant     uint8 JSON {"format": "nvfp4"};  W[i,j] = e2m1(weight)[i,j] * weight_scale_2 * unswizzle(weight_scale)[i,j//16]
The text encoder runs full_precision_mm (comfy/sd1_clip.py), and ComfyUI has no nvfp4 compute below sm_100: the input is only
scaled by pre_quant_scale and the weight dequantised for F.linear, so a K slice's partial product is exactly its share
(quantised inputs would need K / tp_size a multiple of 16 and an input_scale). A rank reads only its bytes: weight rows or byte
columns are a narrow; weight_scale is a row range for local rows a multiple of 128, and one run of 512-byte tiles per 128-row
band for local K / 16 a multiple of 4; else the whole (small) scale is sliced (`slice_block_scales`). Imports torch only.
"""

from __future__ import annotations

import json

import torch

BLOCK = 16  # input columns per fp8 block scale
F4_E2M1_MAX = 6.0
F8_E4M3_MAX = 448.0
# Midpoints between consecutive E2M1 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6); a value on midpoint i rounds up to
# code i + 1 only when that code is even (round half to even, as comfy-kitchen's _f32_to_floatx_unpacked does).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "comfy_quant")
COMFY_QUANT = json.dumps({"format": "nvfp4"}).encode()


def _roundup(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def nvfp4_logical_shape(stored: tuple[int, ...]) -> tuple[int, int]:
    """An nvfp4 weight's [n, k] from its stored uint8 [n, k / 2] (two codes per byte; the pack's plan takes H3's
    linears, whose n and k are multiples of 16, so nothing is padded)."""
    return stored[0], 2 * stored[1]


def _splits(n: int, k: int, dim: int, tp_size: int) -> bool:
    if dim == 0:
        return n % tp_size == 0
    return k % tp_size == 0 and (k // tp_size) % BLOCK == 0


def _advice(n: int, k: int, dim: int) -> str:
    ok = [str(t) for t in (2, 4, 8) if _splits(n, k, dim, t)]
    if not ok:
        return "Run this layer unsplit (tp_size 1)."
    return "Use tp_size " + (ok[0] if len(ok) == 1 else ", ".join(ok[:-1]) + " or " + ok[-1]) + "."


def nvfp4_split_problem(n: int, k: int, dim: int, tp_size: int) -> str | None:
    """Why an nvfp4 weight of logical shape [n, k] cannot be cut along `dim` (0: output rows, 1: input columns) into
    tp_size equal slices, or None. Rows split anywhere (each row's blocks run along K); a K slice must hold whole
    16-column blocks, since each block scale covers 16 input columns. The swizzle imposes nothing: a local scale
    tensor is re-swizzled (and padded to 128 x 4) for its own shape."""
    if dim not in (0, 1):
        return f"dim must be 0 (output rows) or 1 (input columns), got {dim}."
    if tp_size < 1:
        return f"tp_size must be at least 1, got {tp_size}."
    if dim == 0:
        if n % tp_size:
            return f"its {n} output rows are not divisible by tp_size={tp_size}. {_advice(n, k, 0)}"
        return None
    if k % tp_size:
        return f"its input dim K={k} is not divisible by tp_size={tp_size}. {_advice(n, k, 1)}"
    if (k // tp_size) % BLOCK:
        return (
            f"the local K ({k // tp_size}) is not a multiple of {BLOCK}, so a rank's slice would cut a {BLOCK}-column "
            f"nvfp4 block (one fp8 block scale per {BLOCK} input columns). {_advice(n, k, 1)}"
        )
    return None


def swizzle_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """Row-major block scales [rows, cols] -> cuBLAS's tiled layout [roundup(rows,128), roundup(cols,4)], zero-padded.
    Tile (rb, cb) covers rows 128rb.. and scale columns 4cb..; it is stored as 32 x 16 with row r of the tile at
    (r % 32, 4 * (r // 32) + c). Tiles follow each other row band by row band (comfy-kitchen's to_blocked)."""
    rows, cols = scales.shape
    out_rows, out_cols = _roundup(rows, 128), _roundup(cols, 4)
    raw = scales.view(torch.uint8) if scales.element_size() == 1 else scales
    padded = torch.zeros((out_rows, out_cols), dtype=raw.dtype, device=raw.device)
    padded[:rows, :cols] = raw
    tiles = padded.view(out_rows // 128, 4, 32, out_cols // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(out_rows, out_cols).view(scales.dtype)


def unswizzle_block_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of `swizzle_block_scales`: the row-major [rows, cols] scales (comfy-kitchen's from_blocked)."""
    band_rows, band_cols = _roundup(rows, 128), _roundup(cols, 4)
    if swizzled.numel() != band_rows * band_cols:
        raise ValueError(
            f"nvfp4 block scales hold {swizzled.numel()} values ({list(swizzled.shape)}), but a weight with {rows} "
            f"rows and {cols} blocks per row needs {band_rows} x {band_cols} in the swizzled layout. The file is not "
            "a ComfyUI nvfp4 file (row-major scales?)."
        )
    raw = swizzled.view(torch.uint8) if swizzled.element_size() == 1 else swizzled
    tiles = raw.reshape(band_rows // 128, band_cols // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(band_rows, band_cols)[:rows, :cols].view(swizzled.dtype)


def slice_block_scales(block_scale: torch.Tensor, n: int, k: int, dim: int, start: int, end: int) -> torch.Tensor:
    """The swizzled block scales of rows (dim 0) or input columns (dim 1) [start, end) of an nvfp4 weight of logical
    shape [n, k]: exactly what quantising that slice with the same weight_scale_2 would store (blocks are
    independent of each other). Columns must be whole 16-column blocks."""
    if dim == 1 and (start % BLOCK or end % BLOCK):
        raise ValueError(f"Cannot cut nvfp4 block scales at input columns [{start}, {end}): not whole {BLOCK}-column blocks.")
    if not 0 <= start < end <= (n if dim == 0 else k):
        raise ValueError(f"[{start}, {end}) is not a slice of an nvfp4 weight [{n}, {k}] along dim {dim}.")
    stored_rows, stored_blocks = _roundup(n, 16), _roundup(k, 16) // BLOCK
    rows = unswizzle_block_scales(block_scale, stored_rows, stored_blocks)
    if dim == 0:
        mine = rows.narrow(0, start, end - start)  # the swizzle zero-pads to 128 rows, as a file's padding
    else:
        mine = rows.narrow(1, start // BLOCK, (end - start) // BLOCK)
    out = swizzle_block_scales(mine.contiguous())
    return out.reshape(-1) if block_scale.dim() == 1 else out


def _check_tensors(tensors: dict[str, torch.Tensor], n: int, k: int) -> None:
    unknown = sorted(set(tensors) - set(SUFFIXES))
    if unknown or "weight" not in tensors or "weight_scale" not in tensors:
        raise ValueError(
            f"slice_nvfp4 takes the tensors of one nvfp4 linear keyed by suffix ({', '.join(SUFFIXES)}; weight and "
            f"weight_scale required), got {sorted(tensors)}. Slice a bias like any plain tensor."
        )
    weight = tensors["weight"]
    stored = (_roundup(n, 16), _roundup(k, 16) // 2)
    if weight.dtype != torch.uint8 or tuple(weight.shape) != stored:
        raise ValueError(
            f"nvfp4 weight is {weight.dtype} {list(weight.shape)}, but a layer of logical shape [{n}, {k}] stores "
            f"uint8 {list(stored)} (two fp4 values a byte, padded to multiples of 16). Pass the module's "
            "(out_features, in_features) as shape= when they are not multiples of 16."
        )


def slice_nvfp4(
    tensors: dict[str, torch.Tensor], dim: int, tp_rank: int, tp_size: int, *, shape: tuple[int, int] | None = None
) -> dict[str, torch.Tensor]:
    """This rank's tensors of ONE nvfp4 linear, keyed by suffix: dim 0 (colwise) cuts the output rows, dim 1
    (rowwise) the input columns and pre_quant_scale; the scalars and comfy_quant stay whole. The result is what a
    ComfyUI file for the local layer would store (weight rows padded to 16, scales re-swizzled). `shape` is the
    logical [n, k]; by default the stored weight's (padding included)."""
    weight = tensors.get("weight")
    if shape is None and weight is not None:
        shape = nvfp4_logical_shape(weight.shape)
    n, k = shape or (0, 0)
    _check_tensors(tensors, n, k)
    problem = nvfp4_split_problem(n, k, dim, tp_size)
    if problem:
        raise ValueError(f"Cannot split an nvfp4 weight [{n}, {k}] along dim {dim}: {problem}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}.")
    out = dict(tensors)
    width = (n if dim == 0 else k) // tp_size
    out["weight_scale"] = slice_block_scales(tensors["weight_scale"], n, k, dim, tp_rank * width, (tp_rank + 1) * width)
    if dim == 0:
        local = n // tp_size
        mine = weight.narrow(0, tp_rank * local, local)
        out["weight"] = torch.zeros((_roundup(local, 16), weight.shape[1]), dtype=torch.uint8, device=weight.device)
        out["weight"][:local] = mine
        return out
    local = k // tp_size
    out["weight"] = weight.narrow(1, tp_rank * local // 2, local // 2).contiguous()
    if "pre_quant_scale" in tensors:
        out["pre_quant_scale"] = tensors["pre_quant_scale"].narrow(-1, tp_rank * local, local).contiguous()
    return out


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 values already in [-6, 6] -> 4-bit E2M1 codes (sign in bit 3), round half to even; -0 keeps its sign."""
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        code += (mag > mid) | ((mag == mid) & (i % 2 == 1))
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def _quantize_blocks(w: torch.Tensor, per_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """comfy-kitchen's eager quantize_nvfp4 (pad_16x): packed codes [rows, cols/2] and row-major fp8 scales."""
    rows, cols = _roundup(w.shape[0], 16), _roundup(w.shape[1], 16)
    w = torch.nn.functional.pad(w, (0, cols - w.shape[1], 0, rows - w.shape[0]))
    blocks = w.reshape(rows, cols // BLOCK, BLOCK)
    scales = torch.clamp(blocks.abs().amax(dim=-1).to(torch.float32) / F4_E2M1_MAX / per_tensor, max=F8_E4M3_MAX)
    scales_fp8 = scales.to(torch.float8_e4m3fn)
    total = per_tensor * scales_fp8.to(torch.float32)
    zero = total == 0  # all-zero blocks (padding): 0 / 0 would be NaN
    data = blocks.float() / torch.where(zero, torch.ones_like(total), total).unsqueeze(-1)
    data = torch.where(zero.unsqueeze(-1), torch.zeros_like(data), data)
    codes = _e2m1_codes(torch.clamp(data, -F4_E2M1_MAX, F4_E2M1_MAX).reshape(rows, cols))
    return (codes[:, 0::2] << 4) | codes[:, 1::2], scales_fp8


def quantize_nvfp4_awq(
    w: torch.Tensor, pre_quant_scale: torch.Tensor | None, *, input_scale: torch.Tensor | float | None = None
) -> dict[str, torch.Tensor]:
    """The tensors a ComfyUI nvfp4 file stores for the linear weight `w` [n, k], keyed by suffix. With AWQ the
    quantised weight is w / pre_quant_scale (per input column, in float32), since the layer multiplies its input by
    pre_quant_scale; that is stored as given. Bit for bit comfy-kitchen's quantize_nvfp4 with ComfyUI's
    weight_scale_2 = amax(|w|) / (448 * 6) (comfy/quant_ops.py TensorCoreNVFP4Layout.quantize)."""
    if w.dim() != 2:
        raise ValueError(f"nvfp4 quantises 2-D weights, got shape {list(w.shape)}.")
    if pre_quant_scale is not None and tuple(pre_quant_scale.shape) != (w.shape[1],):
        raise ValueError(f"pre_quant_scale has shape {list(pre_quant_scale.shape)}; the weight has K={w.shape[1]}.")
    smoothed = w if pre_quant_scale is None else w.float() / pre_quant_scale.float()
    per_tensor = (smoothed.abs().amax() / (F8_E4M3_MAX * F4_E2M1_MAX)).to(torch.float32)
    packed, scales = _quantize_blocks(smoothed, per_tensor)
    out = {
        "weight": packed,
        "weight_scale": swizzle_block_scales(scales),
        "weight_scale_2": per_tensor,
        "comfy_quant": torch.frombuffer(bytearray(COMFY_QUANT), dtype=torch.uint8),
    }
    if input_scale is not None:
        out["input_scale"] = torch.as_tensor(input_scale, dtype=torch.float32).reshape(())
    if pre_quant_scale is not None:
        out["pre_quant_scale"] = pre_quant_scale
    return out
