/* xxHash's x86 runtime dispatcher (native/xxhash/xxh_x86dispatch.c), compiled only where the compiler
 * targets x86: the compiler decides, not the machine that runs setup.py, so a cross build or an sdist made
 * on another architecture still gets one consistent code path. hicache_native.c routes its XXH3 calls
 * through the dispatcher under the same test; elsewhere this unit is empty and xxhash.h's own code path
 * (NEON on arm64, scalar otherwise) is the only one. */
#if defined(__x86_64__) || defined(__i386__)
#include "xxhash/xxh_x86dispatch.c"
#else
typedef int hicache_no_xxh_dispatch; /* ISO C wants a unit to declare something */
#endif
