// Names the calling thread (at most 15 characters on Linux) so the library's
// threads are told apart from XLA's and the driver's in a debugger, `top -H`
// or /proc/<pid>/task/*/comm. A no-op where the platform has no such call.
#pragma once

#if defined(__linux__)
#include <pthread.h>
#endif

namespace strata {

inline void NameThisThread(const char* name) {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), name);
#else
  (void)name;
#endif
}

}  // namespace strata
