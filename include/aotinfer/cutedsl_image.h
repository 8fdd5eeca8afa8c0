// One kernel of a CuTeDSL module's table, as cmake/cutedsl.py embeds it in the generated
// <module>_kernels.cc (plain C++, compiled without the CUDA headers) and include/aotinfer/cutedsl.h
// loads it.
#pragma once

#include <cstddef>

namespace aotinfer::cutedsl {

struct KernelImage {
  const char* name;  // the kernel's entry
  const unsigned char* cubin;
  size_t cubin_size;
  const char* ptx;  // nullptr unless the arch was built "+PTX"
};

}  // namespace aotinfer::cutedsl
