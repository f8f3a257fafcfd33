/* glibc_baseline.h - bind the interposer to symbol versions that old glibc has (<= 2.28).
 *
 * The interposer is preloaded into whatever image runs a kernel (Ubuntu 20.04 and UBI 8 ship
 * glibc 2.31 / 2.28). Built on a newer glibc, the linker binds a few symbols to the versions
 * glibc 2.34 gave them when libdl and libpthread moved into libc (dlopen@GLIBC_2.34, ...), and
 * the library then refuses to load on older systems. glibc keeps the old versions as
 * compatibility symbols, so we name them here; the build links libdl and libpthread as well
 * (--no-as-needed) because before 2.34 these symbols live there. Forced in with -include by
 * interposer/build.mk; tests/enforcement/test_glibc_baseline.py checks the result with objdump.
 */
#ifndef GPUSHARE_GLIBC_BASELINE_H
#define GPUSHARE_GLIBC_BASELINE_H

#if defined(__GLIBC__) || defined(__linux__)
#if defined(__x86_64__)
#define GS_GLIBC_BASE "GLIBC_2.2.5"
#elif defined(__aarch64__)
#define GS_GLIBC_BASE "GLIBC_2.17"
#endif
#endif

#ifdef GS_GLIBC_BASE
/* Only symbols we import: our own dlsym is a definition and must keep its plain name. */
__asm__(".symver dlopen,dlopen@" GS_GLIBC_BASE);
__asm__(".symver dlvsym,dlvsym@" GS_GLIBC_BASE);
__asm__(".symver pthread_create,pthread_create@" GS_GLIBC_BASE);
__asm__(".symver pthread_once,pthread_once@" GS_GLIBC_BASE);
#endif

#endif
