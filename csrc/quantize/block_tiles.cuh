// The block-quantize tile kernels, shared by the plain block quantizers (quantize_block.cu,
// quantize_mxfp8.cu) and the fused elementwise + block-quantize kernels (fused_block/), so
// that every block-scaled FP8 copy comes from one implementation. Numerics and layouts:
// quantize_block.h (FP8 block) and quantize_mxfp8.h (MXFP8). This umbrella header includes
// the pieces: block_tiles_common.cuh (shared tile helpers, PlainSource, staging, dbias sums),
// block_tiles_fp8.cuh (Fp8BlockTileKernel + launchers) and block_tiles_mxfp8.cuh
// (Mxfp8TileKernel + launchers); each kernel's header describes its steps.
//
// The kernels are templated on a row tiling (Rows: which rows a tile row covers) and a tile
// source. UniformRowTiles is the plain walk (tile row t = rows [t*h, t*h + h) of x); the
// grouped quantizers (quantize_grouped_block.cu) start tiles at group boundaries instead:
//   Rows::kGrouped, Rows::Cursor  per-thread lookup state
//   rows.TileRows(h)              tile rows to walk (an upper bound for grouped walks)
//   rows.Tile(t, h, blocks_per_tile, cursor) -> RowTile (block_tiles_common.cuh)
// The kernels are templated on a tile source, what a thread reads for one 16-byte chunk of
// x's row r at column c of the rows x cols matrix being quantized:
//   Src::kVec               values per chunk (16 / sizeof(input element))
//   Src::kMinBlocks, kMinBlocks2d, kMinBlocksMxfp8
//                           resident blocks per SM Fp8BlockTileKernel (1x128, 128x128) and
//                           Mxfp8TileKernel are compiled for (launch bounds: 2 leaves a thread
//                           128 registers, 3 leaves 80); 3 only where the kernel then (nearly)
//                           does not spill; the grids are twice that many blocks per SM
//   Src::Chunk              what a thread holds for a chunk between its load and its encode
//   Src::Cols               what a thread reads once per tile for its kVec columns (the
//                           same for all its rows of the tile: a norm's gamma and beta)
//   src.LoadCols(c, cols, col_state)
//   src.Load<kVectorIO>(r, c, rows, cols, col_state, chunk)
//                           kVectorIO: the chunk is one aligned 16-byte load (or its parts);
//                           else bounds-checked scalar loads. Elements outside rows x cols
//                           must come out as +0 (no amax changes).
//   Src::Value(chunk, j)    element j as fp32: the value quantized
// PlainSource is x itself (the plain quantizers: the chunk holds the input elements,
// converted when encoded). A fused source computes fp32 values in Load (fused_block/).
//
// Staged form (kStaged, both kernels: PlainSource on the plain walk with vector IO; on or off
//   per kernel by BlockTileStaging): one resident wave of blocks, each thread copying its
//   chunks of the block's next tile into its own slots of dynamic shared memory (cp.async) as
//   soon as it holds the current tile's values, so the loads of tile t+1 are in flight while
//   tile t is encoded. No thread reads another's slots, so the hand-off needs no barrier.
// dbias (both kernels, kDbias: plain walk only, compiled only into the kernels that compute
//   it, so that the others keep their registers and shared memory): after the loads, each thread
//   sums its chunk columns over its kPasses rows in pass order, the lane sums go to shared
//   memory, and one thread per column adds the tile's lanes in lane order into workspace row
//   r0 / tile height: the order of block_dbias.h (lanes S = kRowsPerPass = 32 / sizeof(x));
//   the finalize kernel (dbias_finalize.cuh) runs after the tile kernel.
// Encoding: fp8_cvt.cuh (hardware cvt where bit-identical, else the formats.h codec). Partial
// tiles and unaligned tensors take bounds-checked scalar paths: nothing outside the tensors
// is read or written.
#pragma once

#include "quantize/block_tiles_common.cuh"
#include "quantize/block_tiles_fp8.cuh"
#include "quantize/block_tiles_mxfp8.cuh"
