// The one place where the three ways of compiling the kernels differ:
//   CUDA  NVRTC through CuPy (or nvcc), NVIDIA GPUs;
//   HIP   hiprtc through CuPy (or hipcc), AMD GPUs;
//   host  g++ with tests/gpu/host_emulation.h, the kernels' threads run as fibers on a CPU (tests
//         only: that header is not shipped; the host build puts tests/gpu on its include path).
// Kernels include only this header, never a toolkit header: the 16-bit float types below are
// plain 16-bit storage with explicit conversions, so a CuPy wheel needs no cuda_fp16.h /
// cuda_bf16.h / hip_bf16.h on the include path at run time, and the host build needs none.
#pragma once

#if defined(MOEROUTE_HOST_EMULATION)
#define MOEROUTE_PLATFORM_HOST 1
#include "host_emulation.h"  // from tests/gpu, never seen by NVRTC, hiprtc or hipcc
#elif defined(__HIPCC_RTC__) || defined(__HIPCC__) || defined(__HIP__)
#define MOEROUTE_PLATFORM_HIP 1
#if !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>
#endif
#else
#define MOEROUTE_PLATFORM_CUDA 1
#endif

#if defined(MOEROUTE_PLATFORM_HOST)
#define MOEROUTE_DEVICE inline
#define MOEROUTE_UNROLL
#else
#define MOEROUTE_DEVICE __device__ __forceinline__
#define MOEROUTE_UNROLL _Pragma("unroll")
#endif

// CUDA's second __launch_bounds__ argument counts resident blocks per multiprocessor, HIP's
// counts waves per execution unit: AMD builds keep the thread count only.
#if defined(MOEROUTE_PLATFORM_HIP)
#define MOEROUTE_LAUNCH_BOUNDS(threads, min_blocks) __launch_bounds__(threads)
#else
#define MOEROUTE_LAUNCH_BOUNDS(threads, min_blocks) __launch_bounds__(threads, min_blocks)
#endif

// Threads per warp (NVIDIA) or wavefront (AMD: 64 on the CDNA parts gfx90a / gfx94x).
#if defined(MOEROUTE_PLATFORM_HIP)
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#define MOEROUTE_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#else
#define MOEROUTE_WARP_SIZE 64
#endif
#else
#define MOEROUTE_WARP_SIZE 32
#endif

// Dynamically sized shared memory: `extern __shared__` on the GPU, the launch's buffer on the host.
#if defined(MOEROUTE_PLATFORM_HOST)
#define MOEROUTE_DYNAMIC_SHARED(name) unsigned char* name = ::moeroute_emu::dynamic_shared_memory()
#else
#define MOEROUTE_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// The warp-level matrix path (cp.async + ldmatrix + mma.sync m16n8k16) needs sm_80 or newer.
// HIP has none of these instructions: AMD builds keep the SIMT kernels only.
#if defined(MOEROUTE_PLATFORM_HOST)
#define MOEROUTE_HAS_MMA 1
#elif defined(MOEROUTE_PLATFORM_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define MOEROUTE_HAS_MMA 1
#else
#define MOEROUTE_HAS_MMA 0
#endif

namespace moeroute {

// 16-bit storage types. Same size and alignment as __half / __nv_bfloat16 / hip_bfloat16, so
// device buffers of those types (CuPy float16, torch float16 / bfloat16) are read as they are.
struct alignas(2) float16 {
  unsigned short bits;
};
struct alignas(2) bfloat16 {
  unsigned short bits;
};

MOEROUTE_DEVICE float bits_to_float(unsigned int bits) {
#if defined(MOEROUTE_PLATFORM_HOST)
  return __builtin_bit_cast(float, bits);
#else
  return __uint_as_float(bits);
#endif
}

MOEROUTE_DEVICE unsigned int float_to_bits(float value) {
#if defined(MOEROUTE_PLATFORM_HOST)
  return __builtin_bit_cast(unsigned int, value);
#else
  return __float_as_uint(value);
#endif
}

MOEROUTE_DEVICE float to_float(float value) { return value; }

MOEROUTE_DEVICE float to_float(bfloat16 value) {
  return bits_to_float(static_cast<unsigned int>(value.bits) << 16);
}

MOEROUTE_DEVICE float to_float(float16 value) {
#if defined(MOEROUTE_PLATFORM_CUDA)
  float result;
  asm("cvt.f32.f16 %0, %1;" : "=f"(result) : "h"(value.bits));
  return result;
#else
  return static_cast<float>(__builtin_bit_cast(_Float16, value.bits));
#endif
}

template <typename T>
MOEROUTE_DEVICE T from_float(float value);

template <>
MOEROUTE_DEVICE float from_float<float>(float value) {
  return value;
}

// Round to nearest even, as torch and the hardware converters do; NaN stays a quiet NaN.
template <>
MOEROUTE_DEVICE bfloat16 from_float<bfloat16>(float value) {
  unsigned int bits = float_to_bits(value);
  bfloat16 result;
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    result.bits = static_cast<unsigned short>((bits >> 16) | 0x0040u);
    return result;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  result.bits = static_cast<unsigned short>(bits >> 16);
  return result;
}

template <>
MOEROUTE_DEVICE float16 from_float<float16>(float value) {
  float16 result;
#if defined(MOEROUTE_PLATFORM_CUDA)
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(result.bits) : "f"(value));
#else
  result.bits = __builtin_bit_cast(unsigned short, static_cast<_Float16>(value));
#endif
  return result;
}

#if MOEROUTE_HAS_MMA

// 16-byte global -> shared copy that does not wait; `valid == false` writes 16 zero bytes.
MOEROUTE_DEVICE void cp_async_16(void* shared_destination, const void* global_source, bool valid) {
#if defined(MOEROUTE_PLATFORM_HOST)
  ::moeroute_emu::cp_async(shared_destination, global_source, 16, valid ? 16 : 0);
#else
  const unsigned int destination = static_cast<unsigned int>(__cvta_generic_to_shared(shared_destination));
  const int source_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(destination), "l"(global_source),
               "r"(source_bytes));
#endif
}

// Closes the group of cp.async issued since the previous commit.
MOEROUTE_DEVICE void cp_async_commit() {
#if defined(MOEROUTE_PLATFORM_HOST)
  ::moeroute_emu::cp_async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most PENDING committed groups of this thread are still in flight.
template <int PENDING>
MOEROUTE_DEVICE void cp_async_wait() {
#if defined(MOEROUTE_PLATFORM_HOST)
  ::moeroute_emu::cp_async_wait(PENDING);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
#endif
}

// Four 8x8 matrices of 16-bit values from shared memory. Lanes 8i..8i+7 give the row
// addresses of matrix i; every lane receives, in fragment[i], the two values at row lane/4,
// columns 2*(lane%4) and 2*(lane%4)+1 of matrix i (lower column in the low half).
MOEROUTE_DEVICE void ldmatrix_x4(unsigned int (&fragment)[4], const void* shared_row) {
#if defined(MOEROUTE_PLATFORM_HOST)
  ::moeroute_emu::ldmatrix_x4(fragment, shared_row);
#else
  const unsigned int address = static_cast<unsigned int>(__cvta_generic_to_shared(shared_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(fragment[0]), "=r"(fragment[1]), "=r"(fragment[2]), "=r"(fragment[3])
               : "r"(address));
#endif
}

// accumulator[16x8] += A[16x16] * B[16x8], float32 accumulation, PTX fragment layouts
// (groupID g = lane/4, t = lane%4): A regs (g, 2t) (g+8, 2t) (g, 2t+8) (g+8, 2t+8);
// B regs (k=2t, n=g) (k=2t+8, n=g); accumulator (g, 2t..2t+1) (g+8, 2t..2t+1).
template <typename T>
MOEROUTE_DEVICE void mma_m16n8k16(float (&accumulator)[4], const unsigned int (&a)[4], unsigned int b0,
                                  unsigned int b1);

template <>
MOEROUTE_DEVICE void mma_m16n8k16<bfloat16>(float (&accumulator)[4], const unsigned int (&a)[4],
                                            unsigned int b0, unsigned int b1) {
#if defined(MOEROUTE_PLATFORM_HOST)
  ::moeroute_emu::mma_m16n8k16(accumulator, a, b0, b1, ::moeroute_emu::kBfloat16);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(accumulator[0]), "+f"(accumulator[1]), "+f"(accumulator[2]), "+f"(accumulator[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

template <>
MOEROUTE_DEVICE void mma_m16n8k16<float16>(float (&accumulator)[4], const unsigned int (&a)[4],
                                           unsigned int b0, unsigned int b1) {
#if defined(MOEROUTE_PLATFORM_HOST)
  ::moeroute_emu::mma_m16n8k16(accumulator, a, b0, b1, ::moeroute_emu::kFloat16);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(accumulator[0]), "+f"(accumulator[1]), "+f"(accumulator[2]), "+f"(accumulator[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

#endif  // MOEROUTE_HAS_MMA

}  // namespace moeroute
