// The per-block scale rules of quantize_block.h (FP8 block) and quantize_mxfp8.h (MXFP8),
// host and device, so that the CPU references and the CUDA kernels run the same code.
#pragma once

#include <cstdint>

#include "common/formats.h"
#include "quantize/fp8_codec.h"
#include "scale/scale.h"

namespace lowbit {

// FP8 block tile: scale from the tile's amax (given as |x| bits), the current-scaling rule.
LOWBIT_HD float Fp8BlockScale(uint32_t amax_bits, float fp8_max, bool pow2) {
  return CurrentScale(BitsToFloat(amax_bits), fp8_max, pow2);
}

// MXFP8 block: the E8M0 byte of amax / fp8_max, exponent rounded up; NaN -> 0xFF.
LOWBIT_HD uint8_t Mxfp8ScaleByte(uint32_t amax_bits, float fp8_max) {
  return E8m0FromScaleRoundUp(ScaleDivRn(BitsToFloat(amax_bits), fp8_max));
}

// The factor data is multiplied by: 2^(127 - e), exact for every e <= 0xFE (2^127 down to
// the fp32 subnormal 2^-127); NaN for 0xFF.
LOWBIT_HD float Mxfp8EncodeFactor(uint8_t e) {
  return e == 0xFFu ? BitsToFloat(0x7FC00000u) : Pow2Float(127 - int32_t(e));
}

}  // namespace lowbit
