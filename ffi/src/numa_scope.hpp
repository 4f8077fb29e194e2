// Puts a thread's host allocations on a CUDA device's NUMA node for a scope:
// the pinned expert store of each GPU is allocated with the memory policy
// "preferred: the host node nearest that GPU" (cudaDevAttrHostNumaId), and
// the thread's own policy is put back afterwards. Pinning touches every page as
// it allocates, so the pages stay where the policy put them. A machine with
// one node, a device without a host node, or a kernel without the mempolicy
// calls leaves the allocation where it would have been. CUDA builds only.
#pragma once

#include <cuda_runtime_api.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

namespace strata {

class NumaScope {
 public:
  explicit NumaScope(int device) {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12020 && defined(SYS_set_mempolicy)
    if (device < 0) return;
    int node = -1;
    if (cudaDeviceGetAttribute(&node, cudaDevAttrHostNumaId, device) !=
        cudaSuccess) {
      cudaGetLastError();
      return;
    }
    if (node < 0 || node >= kMaxNodes) return;
    // syscall() is variadic: every integer goes in as a long.
    if (syscall(SYS_get_mempolicy, &old_mode_, old_mask_,
                static_cast<unsigned long>(kMaxNodes), nullptr, 0UL) != 0)
      return;
    unsigned long mask[kWords] = {};
    mask[node / kBits] |= 1UL << (node % kBits);
    if (syscall(SYS_set_mempolicy, static_cast<long>(kPreferred), mask,
                static_cast<unsigned long>(kMaxNodes)) != 0)
      return;
    node_ = node;
    active_ = true;
#else
    (void)device;
#endif
  }
  ~NumaScope() {
#if defined(SYS_set_mempolicy)
    if (active_)
      syscall(SYS_set_mempolicy, static_cast<long>(old_mode_), old_mask_,
              static_cast<unsigned long>(kMaxNodes));
#endif
  }
  NumaScope(const NumaScope&) = delete;
  NumaScope& operator=(const NumaScope&) = delete;

  // The node allocations in this scope prefer, or -1 where none was set.
  int node() const { return node_; }

 private:
  static constexpr int kBits = 8 * sizeof(unsigned long);
  static constexpr int kWords = 16;
  static constexpr int kMaxNodes = kWords * kBits;
  static constexpr int kPreferred = 1;  // MPOL_PREFERRED (linux/mempolicy.h)
  int old_mode_ = 0;
  unsigned long old_mask_[kWords] = {};
  int node_ = -1;
  bool active_ = false;
};

}  // namespace strata
