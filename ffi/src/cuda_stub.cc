// Built when CUDA support is off: the CUDA engine is unavailable with a
// message that says how to get it.
#include "engine.hpp"

namespace strata {
std::unique_ptr<Engine> MakeCudaEngine(const EngineOptions&, Status* err) {
  *err =
      "strata_jax was built without CUDA support; install the CUDA toolkit "
      "(nvcc) and reinstall with `pip install --no-build-isolation -e .` "
      "(or -Ccmake.define.STRATA_CUDA=ON to make a missing toolkit an error)";
  return nullptr;
}
}  // namespace strata

namespace {
int NoCuda(char* err, int64_t errlen) {
  if (err && errlen > 0) {
    const char msg[] = "strata_jax was built without CUDA support";
    for (int64_t i = 0; i < errlen; ++i) {
      err[i] = i < static_cast<int64_t>(sizeof(msg)) ? msg[i] : '\0';
      if (!err[i]) break;
    }
  }
  return 1;
}
}  // namespace

extern "C" int strata_measure_h2d(int, int64_t, int64_t, int, int, int, double*, char* err,
                                     int64_t errlen) {
  return NoCuda(err, errlen);
}

extern "C" int strata_measure_h2d_from(int, const void*, int64_t, int, double*, char* err,
                                          int64_t errlen) {
  return NoCuda(err, errlen);
}

extern "C" void* strata_pinned_alloc(int64_t, char* err, int64_t errlen) {
  NoCuda(err, errlen);
  return nullptr;
}

extern "C" void strata_pinned_free(void*) {}
