// Identity of the built library, read by lowbit/_ffi.py to detect a stale build: the ABI
// version must equal lowbit._ffi.ABI_VERSION. Compiled into both libraries.
#include "ffi/build_info.h"

extern "C" {

__attribute__((visibility("default"))) int LowbitAbiVersion() { return LOWBIT_ABI_VERSION; }

__attribute__((visibility("default"))) const char* LowbitBuildInfo() {
  return "lowbit " LOWBIT_VERSION_STRING " abi=" LOWBIT_ABI_STR " " LOWBIT_BUILD_FLAVOR;
}

}  // extern "C"
