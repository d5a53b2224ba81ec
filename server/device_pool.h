// Memory one batcher lane reuses from batch to batch: a host staging region where requests are
// packed, and, for device engines, a device region of the same size plus a CUDA stream.
//
// Both regions grow geometrically to the largest batch seen, never past the limit, and are
// never freed between batches: no allocation per request. With CUDA the staging region is
// pinned (cudaHostAlloc) so that the copies are truly asynchronous on the lane's stream; two
// lanes on one device each own a pool and a stream, so one batch's copies overlap the other
// lane's compute. Host engines use the staging region directly and copies are no-ops.
//
// Next (sessions over a paged KV cache): a second, page-granular pool per device that keeps a
// sequence's K/V resident across requests; a batch would then stage only Q here and pass the
// page table to the engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attn/engine.h"

namespace attnserve {

// How a lane thread waits for its batch on the GPU (Synchronize). The server's default is
// kYield: on the H200 machine it answered as fast as spinning at one request in flight and served
// ~8% more batched small requests at 64, since a spinning lane holds a core for the whole GPU
// round trip while gRPC's threads wait for one. kBlock added ~35 us per batch (the interrupt
// wake-up). docs/server-performance.md has the runs.
enum class DeviceWait {
  kSpin,   // cudaStreamSynchronize: the runtime polls (one context, many cores: it spins)
  kYield,  // poll an event, sched_yield between polls: runnable threads on the core go first
  kBlock,  // a blocking-sync event: the thread sleeps until the GPU's interrupt wakes it
};
// "spin", "yield" or "block"; INVALID_ARGUMENT naming the flag otherwise.
absl::StatusOr<DeviceWait> ParseDeviceWait(absl::string_view name);

class DevicePool {
 public:
  // `device` is the CUDA ordinal (ignored for host memory). `limit_bytes` caps each region.
  // `wait` says how Synchronize waits (device pools only).
  static absl::StatusOr<std::unique_ptr<DevicePool>> Create(attn::MemorySpace space, int device,
                                                            int64_t limit_bytes,
                                                            DeviceWait wait = DeviceWait::kSpin);
  ~DevicePool();

  // Total memory of CUDA device `device`, or of the host for kHost; 0 when unknown.
  static int64_t TotalMemoryBytes(attn::MemorySpace space, int device);
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  // Makes both regions at least `bytes` long. RESOURCE_EXHAUSTED past the limit or when the
  // allocation fails; the old regions stay valid then.
  absl::Status Reserve(int64_t bytes);

  std::byte* host() { return host_; }
  // The engine's view of the same offsets: device memory, or host() for host engines.
  std::byte* device() { return space_ == attn::MemorySpace::kDevice ? device_ : host_; }
  // cudaStream_t as void*, null for host engines.
  void* stream() { return stream_; }
  int64_t capacity() const { return capacity_; }
  attn::MemorySpace space() const { return space_; }
  // The metrics' device label: "cuda:N" for device pools, "cpu" for host pools.
  std::string label() const;

  // Brackets an engine call to time it: CUDA events recorded on stream() for device pools, the
  // host clock for host pools (host engines are synchronous). ComputeTime is valid after
  // Synchronize().
  absl::Status StartComputeTimer();
  absl::Status StopComputeTimer();
  absl::StatusOr<absl::Duration> ComputeTime() const;

  // The device's used (total - free) and total memory (cudaMemGetInfo); device pools only, with
  // the pool's device current (Activate).
  absl::Status DeviceMemory(int64_t* used_bytes, int64_t* total_bytes) const;

  // Makes the pool's device current on the calling thread (lane threads call it per batch).
  absl::Status Activate();

  // Asynchronous on stream(); no-ops for host engines.
  absl::Status CopyToDevice(int64_t offset, int64_t bytes);
  absl::Status CopyToHost(int64_t offset, int64_t bytes);
  // Copies between the device region and host memory outside the staging region, which must be
  // page-locked (PinHostMemory) for them to be asynchronous; independent of each other (no two
  // write the same bytes). A batch of small requests has dozens: many small copies go as one
  // kernel that reads or writes the mapped host memory (UseCopyKernel), the others in one
  // driver call where the runtime has one (cudaMemcpyBatchAsync). Device pools only.
  struct HostCopy {
    void* host;      // page-locked; read from (to device) or written to (to host)
    int64_t offset;  // into the device region
    int64_t bytes;
  };
  absl::Status CopyManyToDevice(const std::vector<HostCopy>& copies);
  absl::Status CopyManyToHost(const std::vector<HostCopy>& copies);
  // Copies from the pool's region (an offset, as the engine sees it) to memory of the same space
  // outside it (KV pages): one kernel for all of them on a device pool, memcpy on a host pool.
  // Asynchronous on stream(); destinations must not overlap.
  struct RegionCopy {
    int64_t offset;  // into the region (device() for device pools, host() for host pools)
    void* dst;
    int64_t bytes;
  };
  absl::Status CopyFromRegion(const std::vector<RegionCopy>& copies);
  // Whether CopyMany moves `copies` with a kernel rather than the copy engines: many copies, on
  // average small, and a device that addresses registered host memory by its host pointers.
  bool UseCopyKernel(const std::vector<HostCopy>& copies) const;

  // Page-locks host memory for every device (cudaHostRegister, portable and mapped), so that
  // copies to and from it need no staging copy; shared-memory regions use it. UNAVAILABLE without
  // CUDA. Unpin before unmapping.
  static absl::Status PinHostMemory(void* p, int64_t bytes);
  static void UnpinHostMemory(void* p);
  // Waits until everything issued on stream() has run, the way `wait` says.
  absl::Status Synchronize();

 private:
  absl::Status CopyMany(const std::vector<HostCopy>& copies, bool to_device);
  DevicePool(attn::MemorySpace space, int device, int64_t limit_bytes, DeviceWait wait)
      : space_(space), device_ordinal_(device), limit_(limit_bytes), wait_(wait) {}
  void Release();

  attn::MemorySpace space_;
  int device_ordinal_;
  int64_t limit_;
  DeviceWait wait_;
  int64_t capacity_ = 0;
  bool kernel_reads_host_pointers_ = false;  // cudaDevAttrCanUseHostPointerForRegisteredMem
  std::byte* host_ = nullptr;
  std::byte* device_ = nullptr;
  void* stream_ = nullptr;
  void* compute_start_ = nullptr;  // cudaEvent_t, device pools only
  void* compute_stop_ = nullptr;
  void* done_ = nullptr;  // recorded by Synchronize unless spinning
  absl::Time host_start_;
  absl::Time host_stop_;
};

}  // namespace attnserve
