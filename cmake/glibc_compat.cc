// Hidden definitions of the glibc symbols newer than 2.28 that GCC's static libstdc++ refers to,
// linked into each module only for manylinux builds against cmake/glibc_stubs.py's stubs. Each
// is private to its module, so no other library in the process sees them.
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AOTINFER_HIDDEN __attribute__((visibility("hidden")))

extern "C" {

// glibc 2.32: libstdc++ skips atomic reference counting while this is non-zero. Zero means
// "threads may exist": always atomic, always correct.
AOTINFER_HIDDEN char __libc_single_threaded = 0;

// glibc 2.33 made fstat64 a real function; before, headers routed it through __fxstat64.
AOTINFER_HIDDEN int fstat64(int fd, struct stat64* buf) {
  return static_cast<int>(syscall(SYS_fstat, fd, buf));
}

// glibc 2.36: only std::random_device("default") calls it; the kernel's generator serves it.
AOTINFER_HIDDEN uint32_t arc4random(void) {
  uint32_t value;
  for (;;) {
    const long got = syscall(SYS_getrandom, &value, sizeof(value), 0);
    if (got == static_cast<long>(sizeof(value))) return value;
    if (got < 0 && errno != EINTR) abort();
  }
}

}  // extern "C"
