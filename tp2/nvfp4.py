"""nvfp4 (AWQ) linears cut for TP: a rank's block scales (scripts/make_tiny_qwen3vl.py writes such files).

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

import torch

BLOCK = 16  # input columns per fp8 block scale


def _roundup(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def nvfp4_logical_shape(stored: tuple[int, ...]) -> tuple[int, int]:
    """An nvfp4 weight's [n, k] from its stored uint8 [n, k / 2] (two codes per byte; the pack's plan takes H3's
    linears, whose n and k are multiples of 16, so nothing is padded)."""
    return stored[0], 2 * stored[1]


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
    stored_rows, stored_blocks = _roundup(n, 16), _roundup(k, 16) // BLOCK
    rows = unswizzle_block_scales(block_scale, stored_rows, stored_blocks)
    if dim == 0:
        mine = rows.narrow(0, start, end - start)  # the swizzle zero-pads to 128 rows, as a file's padding
    else:
        mine = rows.narrow(1, start // BLOCK, (end - start) // BLOCK)
    out = swizzle_block_scales(mine.contiguous())
    return out.reshape(-1) if block_scale.dim() == 1 else out
