// SIMD levels: which one this CPU supports (detected once) and which one the kernels use (see reduce.h for the
// public simd_* functions), plus what every kernel file needs to compile code for a level it was not built for.
//
// The build passes no -march flag, so the library runs on any x86-64 (or other) CPU: SIMD code is compiled per
// function with __attribute__((target)) (isa.h) and only entered after simd_active() says the CPU can run it.
#pragma once

#include "smartcoll/reduce.h"

#if defined(__x86_64__)
#define SMARTCOLL_X86 1
// GCC 12's AVX-512 intrinsics self-initialise an "undefined" operand (__Y = __Y), which the uninitialized-use
// warnings report wherever they are inlined (GCC PR105593). Silence them for the header's own lines only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#define SMARTCOLL_X86 0
#endif

#if defined(__GNUC__) && !defined(__clang__)
// Kernels pass vectors by value only between functions compiled for the same target (isa.h), so the calling
// convention difference GCC warns about never matters.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
