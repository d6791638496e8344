// Host emulation of the CUDA execution model, so that the kernels of moeroute/gpu/kernels run on a
// CPU in tests (compat.cuh includes this when MOEROUTE_HOST_EMULATION is defined; g++ builds it
// with this directory on its include path, see gpu_host_emulator.py). Not shipped in the package.
//
// Blocks run one after another. Inside a block every CUDA thread is a fiber (ucontext) on the
// calling OS thread, switched at __syncthreads() and at warp-collective operations, so a block
// behaves like the GPU's: `__shared__` variables are shared by its threads, a barrier holds a
// thread until all of them arrive, ldmatrix / mma.sync exchange registers across the 32 lanes of
// a warp exactly as the PTX fragment layouts say, and cp.async copies land only when the issuing
// thread waits for their group (so a read before the wait sees stale data, as it may on a GPU).
// Detected and reported as errors: a thread leaving the kernel while others wait at a barrier,
// a block where every thread waits forever, and writes past the dynamic shared memory size.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

struct dim3 {
  unsigned int x, y, z;
  dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
// One instance per kernel instantiation, seen by every fiber: blocks run one at a time.
#define __shared__ static

namespace moeroute_emu {

constexpr unsigned int kWarpSize = 32;              // an NVIDIA warp: the fragment layouts assume 32 lanes
constexpr std::size_t kFiberStackBytes = 256 << 10;  // a kernel's local arrays plus the emulation's frames
constexpr unsigned int kSharedCanaryBytes = 64;      // guard after the dynamic shared memory
constexpr unsigned char kSharedCanary = 0xA5;
constexpr unsigned char kUninitializedShared = 0xFF;
constexpr std::size_t kSharedAlignment = 16;         // cp.async and ldmatrix need 16-byte aligned rows
constexpr int kBfloat16 = 0;
constexpr int kFloat16 = 1;

struct AsyncCopy {
  void* destination;
  const void* source;
  unsigned int bytes;
  unsigned int source_bytes;
  long group;
};

struct Barrier {
  unsigned int arrived = 0;
  unsigned long generation = 0;
};

struct Fiber {
  ucontext_t context;
  std::unique_ptr<unsigned char[]> stack;
  dim3 thread_idx;
  unsigned int linear = 0;
  bool finished = false;
  unsigned long collectives = 0;  // warp collectives done so far: picks the exchange buffer
  std::vector<AsyncCopy> async_copies;
  long committed_groups = 0;
  const Barrier* waiting = nullptr;  // the barrier this thread waits at, if any
  unsigned long waiting_generation = 0;
};

struct LaneSlot {
  const void* address;
  unsigned int words[8];
};

struct Warp {
  Barrier barrier;
  unsigned int lanes = 0;
  LaneSlot slots[2][kWarpSize];  // double buffered: one barrier per collective is enough
};

struct Launch {
  dim3 grid, block, block_idx;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  Barrier block_barrier;
  std::vector<unsigned char> shared_storage;
  unsigned char* dynamic_shared = nullptr;
  std::size_t dynamic_shared_bytes = 0;
  ucontext_t scheduler;
  Fiber* current = nullptr;
  unsigned int alive = 0;
  int schedule = 0;
  bool aborted = false;
  bool eager_async_copies = false;
  std::string error;
  void (*body)(void*) = nullptr;
  void* body_state = nullptr;
};

// Order in which runnable threads of a block are resumed. Round robin keeps warps in step;
// lowest / highest first run one warp as far as it can get ahead of the others, which exposes a
// missing __syncthreads() (together with cp.async landing at the wait).
enum Schedule { kRoundRobin = 0, kLowestFirst = 1, kHighestFirst = 2 };

// The launch in progress: one at a time, on one OS thread.
inline Launch* current_launch = nullptr;
inline int schedule = kRoundRobin;
// Test switch: land cp.async at issue (exposes a stage overwritten while other warps still read
// it) instead of at the wait (exposes a read before the wait).
inline bool eager_async_copies = false;

inline unsigned char* dynamic_shared_memory() { return current_launch->dynamic_shared; }

inline void fail(const std::string& message) {
  Launch& launch = *current_launch;
  if (!launch.aborted) {
    launch.aborted = true;
    launch.error = message + " (block " + std::to_string(launch.block_idx.x) + "," +
                   std::to_string(launch.block_idx.y) + "," + std::to_string(launch.block_idx.z) + ", thread " +
                   std::to_string(launch.current ? launch.current->linear : 0) + ")";
  }
}

inline void yield_to_scheduler() {
  Launch& launch = *current_launch;
  swapcontext(&launch.current->context, &launch.scheduler);
}

inline void barrier_wait(Barrier& barrier, unsigned int participants) {
  Fiber& fiber = *current_launch->current;
  const unsigned long generation = barrier.generation;
  if (++barrier.arrived == participants) {
    barrier.arrived = 0;
    ++barrier.generation;
    return;
  }
  fiber.waiting = &barrier;
  fiber.waiting_generation = generation;
  while (barrier.generation == generation) yield_to_scheduler();
  fiber.waiting = nullptr;
}

inline void sync_block() {
  Launch& launch = *current_launch;
  barrier_wait(launch.block_barrier, launch.block.x * launch.block.y * launch.block.z);
}

inline Warp& current_warp() {
  Launch& launch = *current_launch;
  Warp& warp = launch.warps[launch.current->linear / kWarpSize];
  if (warp.lanes != kWarpSize) fail("warp-collective operation in a partial warp");
  return warp;
}

inline unsigned int current_lane() { return current_launch->current->linear % kWarpSize; }

// Publishes this lane's slot, waits for the whole warp, returns the warp's slots.
inline LaneSlot* exchange(const LaneSlot& mine) {
  Fiber& fiber = *current_launch->current;
  Warp& warp = current_warp();
  LaneSlot* slots = warp.slots[fiber.collectives++ & 1];
  slots[current_lane()] = mine;
  barrier_wait(warp.barrier, kWarpSize);
  return slots;
}

inline void ldmatrix_x4(unsigned int (&fragment)[4], const void* shared_row) {
  LaneSlot mine{};
  mine.address = shared_row;
  const LaneSlot* slots = exchange(mine);
  const unsigned int lane = current_lane();
  for (unsigned int matrix = 0; matrix < 4; ++matrix) {
    const auto* row = static_cast<const unsigned char*>(slots[8 * matrix + lane / 4].address);
    std::memcpy(&fragment[matrix], row + 4 * (lane % 4), 4);
  }
}

inline float half_to_float(unsigned short bits, int kind) {
  if (kind == kBfloat16) return __builtin_bit_cast(float, static_cast<unsigned int>(bits) << 16);
  return static_cast<float>(__builtin_bit_cast(_Float16, bits));
}

inline float fragment_value(const LaneSlot* slots, unsigned int lane, unsigned int word, unsigned int half,
                            int kind) {
  const unsigned int packed = slots[lane].words[word];
  return half_to_float(static_cast<unsigned short>(half ? packed >> 16 : packed & 0xffffu), kind);
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: built from the PTX fragment tables, not
// from the kernels' use of them.
inline void mma_m16n8k16(float (&accumulator)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1,
                         int kind) {
  LaneSlot mine{};
  for (int i = 0; i < 4; ++i) mine.words[i] = a[i];
  mine.words[4] = b0;
  mine.words[5] = b1;
  const LaneSlot* slots = exchange(mine);
  const unsigned int lane = current_lane();
  const unsigned int group = lane / 4, thread_in_group = lane % 4;
  float result[4];
  for (unsigned int i = 0; i < 4; ++i) {
    const unsigned int row = group + 8 * (i / 2), col = 2 * thread_in_group + (i % 2);
    float sum = 0.0f;
    for (unsigned int k = 0; k < 16; ++k) {
      // A (row-major 16x16): register (row/8) + 2*(k/8) of lane (row%8)*4 + (k%8)/2.
      const float a_value = fragment_value(slots, (row % 8) * 4 + (k % 8) / 2, row / 8 + 2 * (k / 8), k % 2, kind);
      // B (16x8, column-major): register k/8 (words 4, 5) of lane col*4 + (k%8)/2.
      const float b_value = fragment_value(slots, col * 4 + (k % 8) / 2, 4 + k / 8, k % 2, kind);
      sum += a_value * b_value;
    }
    result[i] = accumulator[i] + sum;
  }
  for (int i = 0; i < 4; ++i) accumulator[i] = result[i];
}

inline void land(const AsyncCopy& copy) {
  std::memset(copy.destination, 0, copy.bytes);
  std::memcpy(copy.destination, copy.source, copy.source_bytes);
}

inline void cp_async(void* destination, const void* source, unsigned int bytes, unsigned int source_bytes) {
  Launch& launch = *current_launch;
  Fiber& fiber = *launch.current;
  const AsyncCopy copy{destination, source, bytes, source_bytes, fiber.committed_groups};
  if (launch.eager_async_copies) {
    land(copy);
  } else {
    fiber.async_copies.push_back(copy);
  }
}

inline void cp_async_commit() { ++current_launch->current->committed_groups; }

inline void cp_async_wait(int pending) {
  Fiber& fiber = *current_launch->current;
  const long complete_below = fiber.committed_groups - pending;
  std::vector<AsyncCopy> still_pending;
  for (const AsyncCopy& copy : fiber.async_copies) {
    if (copy.group < complete_below) {
      land(copy);
    } else {
      still_pending.push_back(copy);
    }
  }
  fiber.async_copies.swap(still_pending);
}

inline void fiber_entry() {
  Launch& launch = *current_launch;
  launch.body(launch.body_state);
  Fiber& fiber = *launch.current;
  fiber.finished = true;
  --launch.alive;
  Warp& warp = launch.warps[fiber.linear / kWarpSize];
  if (launch.block_barrier.arrived > 0 || warp.barrier.arrived > 0)
    fail("a thread left the kernel while others wait at a barrier");
  // returning resumes the scheduler through uc_link
}

inline void run_block(Launch& launch) {
  const unsigned int threads = launch.block.x * launch.block.y * launch.block.z;
  launch.block_barrier = Barrier{};
  for (unsigned int w = 0; w < launch.warps.size(); ++w) {
    launch.warps[w].barrier = Barrier{};
    launch.warps[w].lanes = (threads - w * kWarpSize) < kWarpSize ? threads - w * kWarpSize : kWarpSize;
  }
  for (unsigned int t = 0; t < threads; ++t) {
    Fiber& fiber = launch.fibers[t];
    fiber.linear = t;
    fiber.thread_idx = dim3(t % launch.block.x, (t / launch.block.x) % launch.block.y,
                            t / (launch.block.x * launch.block.y));
    fiber.finished = false;
    fiber.collectives = 0;
    fiber.async_copies.clear();
    fiber.committed_groups = 0;
    fiber.waiting = nullptr;
    getcontext(&fiber.context);
    fiber.context.uc_stack.ss_sp = fiber.stack.get();
    fiber.context.uc_stack.ss_size = kFiberStackBytes;
    fiber.context.uc_link = &launch.scheduler;
    makecontext(&fiber.context, fiber_entry, 0);
  }
  launch.alive = threads;
  auto runnable = [](const Fiber& fiber) {
    return !fiber.finished && (fiber.waiting == nullptr || fiber.waiting->generation != fiber.waiting_generation);
  };
  auto resume = [&launch](Fiber& fiber) {
    launch.current = &fiber;
    swapcontext(&launch.scheduler, &fiber.context);
  };
  while (launch.alive > 0 && !launch.aborted) {
    bool resumed = false;
    if (launch.schedule == kRoundRobin) {
      for (unsigned int t = 0; t < threads && !launch.aborted; ++t) {
        if (!runnable(launch.fibers[t])) continue;
        resumed = true;
        resume(launch.fibers[t]);
      }
    } else {
      for (unsigned int i = 0; i < threads; ++i) {
        const unsigned int t = launch.schedule == kLowestFirst ? i : threads - 1 - i;
        if (!runnable(launch.fibers[t])) continue;
        resumed = true;
        resume(launch.fibers[t]);
        break;
      }
    }
    if (launch.alive > 0 && !resumed) {
      launch.current = nullptr;
      fail("every remaining thread waits at a barrier that cannot complete");
    }
  }
}

// Runs body(state) as every thread of every block. Returns "" or the first error.
inline std::string run_grid(dim3 grid, dim3 block, std::size_t dynamic_shared_bytes, void (*body)(void*),
                            void* state) {
  Launch launch;
  launch.grid = grid;
  launch.block = block;
  launch.body = body;
  launch.body_state = state;
  launch.eager_async_copies = eager_async_copies;
  launch.schedule = schedule;
  const unsigned int threads = block.x * block.y * block.z;
  if (threads == 0 || threads > 1024) return "block of " + std::to_string(threads) + " threads";
  launch.fibers = std::vector<Fiber>(threads);
  for (Fiber& fiber : launch.fibers) fiber.stack.reset(new unsigned char[kFiberStackBytes]);
  launch.warps = std::vector<Warp>((threads + kWarpSize - 1) / kWarpSize);
  launch.shared_storage.assign(dynamic_shared_bytes + kSharedCanaryBytes + kSharedAlignment, 0);
  auto base = reinterpret_cast<std::size_t>(launch.shared_storage.data());
  launch.dynamic_shared = launch.shared_storage.data() + (kSharedAlignment - base % kSharedAlignment) % kSharedAlignment;
  launch.dynamic_shared_bytes = dynamic_shared_bytes;
  Launch* previous = current_launch;
  current_launch = &launch;
  for (unsigned int z = 0; z < grid.z && !launch.aborted; ++z)
    for (unsigned int y = 0; y < grid.y && !launch.aborted; ++y)
      for (unsigned int x = 0; x < grid.x && !launch.aborted; ++x) {
        launch.block_idx = dim3(x, y, z);
        // Shared memory starts as garbage on a GPU: all-ones bytes read as NaN in every float type.
        std::memset(launch.dynamic_shared, kUninitializedShared, dynamic_shared_bytes);
        std::memset(launch.dynamic_shared + dynamic_shared_bytes, kSharedCanary, kSharedCanaryBytes);
        run_block(launch);
        for (unsigned int i = 0; i < kSharedCanaryBytes && !launch.aborted; ++i)
          if (launch.dynamic_shared[dynamic_shared_bytes + i] != kSharedCanary)
            fail("write past the dynamic shared memory size");
      }
  current_launch = previous;
  return launch.error;
}

template <typename... Args, std::size_t... I>
void unpack_params(std::tuple<Args...>& values, void** params, std::index_sequence<I...>) {
  ((std::get<I>(values) = *static_cast<Args*>(params[I])), ...);
}

// Launches `kernel` the way cuLaunchKernel does: params[i] points at the value of argument i.
template <typename... Args>
std::string launch_kernel(void (*kernel)(Args...), dim3 grid, dim3 block, std::size_t dynamic_shared_bytes,
                          void** params) {
  struct State {
    void (*kernel)(Args...);
    std::tuple<Args...> values;
  };
  State state{kernel, {}};
  unpack_params(state.values, params, std::index_sequence_for<Args...>{});
  auto body = [](void* raw) {
    auto* s = static_cast<State*>(raw);
    std::apply(s->kernel, s->values);
  };
  return run_grid(grid, block, dynamic_shared_bytes, body, &state);
}

}  // namespace moeroute_emu

#define threadIdx (::moeroute_emu::current_launch->current->thread_idx)
#define blockIdx (::moeroute_emu::current_launch->block_idx)
#define blockDim (::moeroute_emu::current_launch->block)
#define gridDim (::moeroute_emu::current_launch->grid)
#define __syncthreads() ::moeroute_emu::sync_block()
