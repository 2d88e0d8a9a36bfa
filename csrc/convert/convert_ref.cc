// CPU reference for the codec ops (convert.h).
#include <string>

#include "convert/convert_codec.h"
#include "common/ieee_denormals.h"

namespace lowbit {

Status EncodeRef(const float* x, const uint32_t* random, CodecFormat format, int64_t n,
                 uint16_t* codes) {
  const ScopedIeeeDenormals ieee;  // as the GPU (see ieee_denormals.h)
  LOWBIT_RETURN_IF_ERROR(CheckCodec(format, random != nullptr));
  for (int64_t i = 0; i < n; ++i) codes[i] = EncodeOne(x[i], random, i, format);
  return Status::Ok();
}

Status DecodeRef(const uint16_t* codes, CodecFormat format, int64_t n, float* x) {
  const ScopedIeeeDenormals ieee;  // as the GPU (see ieee_denormals.h)
  LOWBIT_RETURN_IF_ERROR(CheckCodec(format, false));
  for (int64_t i = 0; i < n; ++i) x[i] = DecodeOne(codes[i], format);
  return Status::Ok();
}

}  // namespace lowbit
