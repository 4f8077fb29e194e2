// The C API Python drives through ctypes: make, configure and destroy
// engines, read their frames and timing. Also a minimal CPython module init
// so the library is an importable extension (scikit-build-core's editable
// installs find it by module name), while its functions are reached through
// ctypes.
#include <Python.h>

#include <cstring>
#include <exception>
#include <vector>

#include "engine.hpp"

using strata::Engine;
using strata::EngineOptions;
using strata::Status;

namespace {
int Report(const Status& s, char* err, int64_t errlen) {
  if (s.empty()) return 0;
  if (err && errlen > 0) {
    std::strncpy(err, s.c_str(), static_cast<size_t>(errlen - 1));
    err[errlen - 1] = '\0';
  }
  return 1;
}
}  // namespace

extern "C" {

PyMODINIT_FUNC PyInit__native(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_native",
                            "strata_jax native library (used through ctypes)",
                            -1, nullptr};
  return PyModule_Create(&def);
}

int64_t strata_options_size() { return sizeof(EngineOptions); }

int strata_has_cuda() {
#ifdef STRATA_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

int64_t strata_engine_create(const EngineOptions* opt, char* err,
                             int64_t errlen) {
  try {
    Status s;
    if (opt->n_layers < 0) s = "negative layer count " + std::to_string(opt->n_layers);
    else if (opt->n_experts < 0)
      s = "negative expert count " + std::to_string(opt->n_experts);
    else if (opt->ring < 1)
      s = "a ring of " + std::to_string(opt->ring) +
          " slots cannot work; it needs at least one slot";
    else if (opt->blob_bytes < 1)
      s = "expert blob of " + std::to_string(opt->blob_bytes) + " bytes";
    else if (opt->publish_mode != 0 && opt->publish_mode != 1)
      s = "publish_mode " + std::to_string(opt->publish_mode) +
          " is not 0 (host callback) or 1 (polled event)";
    else if (opt->n_experts > 0 && opt->ring % opt->n_experts != 0)
      s = "a ring of " + std::to_string(opt->ring) + " slots is not a whole number of "
          "layer frames of " + std::to_string(opt->n_experts) + " experts";
    else if (opt->blob_bytes % strata::kParts != 0)
      s = "expert blob of " + std::to_string(opt->blob_bytes) +
          " bytes is not " + std::to_string(strata::kParts) +
          " equal parts (gate, up, down)";
    if (!s.empty()) return Report(s, err, errlen), 0;
    std::unique_ptr<Engine> e =
        opt->backend == 1 ? strata::MakeCudaEngine(*opt, &s)
                          : strata::MakeCpuEngine(*opt, &s);
    if (!e) return Report(s, err, errlen), 0;
    return strata::RegisterEngine(std::move(e));
  } catch (const std::exception& ex) {
    Report(std::string("engine creation failed: ") + ex.what(), err, errlen);
    return 0;
  }
}

int strata_engine_set_store(int64_t id, int32_t layer, const void* host,
                            int64_t bytes, char* err, int64_t errlen) {
  Engine* e = strata::FindEngine(id);
  if (!e) return Report("no engine " + std::to_string(id), err, errlen);
  return Report(e->SetLayerStore(layer, static_cast<const uint8_t*>(host), bytes),
                err, errlen);
}

// The stream list (layers[k], experts[k]: the walk's order) and the resident
// experts. No entry comes in staged: the CUDA engine marks every entry staged
// itself when its Prepare finds its store staged.
int strata_engine_set_plan(int64_t id, const int32_t* layers,
                           const int32_t* experts, int64_t n,
                           const int32_t* res_layers, const int32_t* res_experts,
                           int64_t n_res, char* err, int64_t errlen) {
  Engine* e = strata::FindEngine(id);
  if (!e) return Report("no engine " + std::to_string(id), err, errlen);
  try {
    std::vector<strata::StreamEntry> stream(static_cast<size_t>(n));
    for (int64_t k = 0; k < n; ++k) stream[k] = {layers[k], experts[k], false};
    int L = e->options().n_layers;
    std::vector<std::vector<int32_t>> resident(static_cast<size_t>(L));
    for (int64_t r = 0; r < n_res; ++r) {
      if (res_layers[r] < 0 || res_layers[r] >= L)
        return Report("resident entry names layer " +
                          std::to_string(res_layers[r]) + ", outside the model's " +
                          std::to_string(L) + " layers",
                      err, errlen);
      resident[res_layers[r]].push_back(res_experts[r]);
    }
    return Report(e->SetPlan(stream, resident), err, errlen);
  } catch (const std::exception& ex) {
    return Report(ex.what(), err, errlen);
  }
}

int strata_engine_prepare(int64_t id, char* err, int64_t errlen) {
  Engine* e = strata::FindEngine(id);
  if (!e) return Report("no engine " + std::to_string(id), err, errlen);
  try {
    return Report(e->Prepare(), err, errlen);
  } catch (const std::exception& ex) {
    return Report(ex.what(), err, errlen);
  }
}

int strata_engine_destroy(int64_t id) { return strata::DestroyEngine(id) ? 0 : 1; }

int strata_engine_abort(int64_t id) {
  Engine* e = strata::FindEngine(id);
  if (!e) return 1;
  e->Abort();
  return 0;
}

int strata_engine_prestart(int64_t id, int32_t mode, char* err, int64_t errlen) {
  Engine* e = strata::FindEngine(id);
  if (!e) return Report("no engine " + std::to_string(id), err, errlen);
  strata::ChunkMode m;
  if (!strata::ParseChunkMode(mode, &m))
    return Report("prestart: mode " + std::to_string(mode) +
                      " is not 0 (stream, frames), 1 (routed-only) or 2 (stream, packed)",
                  err, errlen);
  try {
    return Report(e->Prestart(m), err, errlen);
  } catch (const std::exception& ex) {
    return Report(ex.what(), err, errlen);
  }
}

int strata_engine_stage_ids(int64_t id, const int32_t* ids, int64_t n, int32_t reset,
                            char* err, int64_t errlen) {
  Engine* e = strata::FindEngine(id);
  if (!e) return Report("no engine " + std::to_string(id), err, errlen);
  try {
    return Report(e->StageIds(ids, n, reset != 0), err, errlen);
  } catch (const std::exception& ex) {  // the copy's allocation
    return Report(std::string("stage_ids: ") + ex.what(), err, errlen);
  }
}

int strata_engine_cancel(int64_t id, int32_t on) {
  Engine* e = strata::FindEngine(id);
  if (!e) return 1;
  if (on)
    e->Cancel();
  else
    e->Uncancel();
  return 0;
}

int strata_engine_walk_active(int64_t id) {
  Engine* e = strata::FindEngine(id);
  return e && e->WalkActive() ? 1 : 0;
}

int64_t strata_engine_hold(int64_t id) {
  Engine* e = strata::FindEngine(id);
  return e ? e->hold() : -1;
}

int strata_engine_inject_fault(int64_t id, int32_t layer, int32_t kind) {
  Engine* e = strata::FindEngine(id);
  if (!e) return 1;
  e->InjectFault(layer, static_cast<strata::Fault>(kind));
  return 0;
}

// A DLPack (v0.8 ABI) tensor over memory the engine owns, for a JAX array
// that views it: row-major, no strides. Its deleter frees only the structure
// (C, never Python: JAX may drop the array at interpreter exit). Null on a
// bad rank.
namespace {
struct DLDevice { int32_t device_type; int32_t device_id; };
struct DLDataType { uint8_t code; uint8_t bits; uint16_t lanes; };
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};
constexpr int kMaxDims = 8;
struct OwnedTensor {
  DLManagedTensor mt;  // first: the pointer JAX holds is this object's
  int64_t shape[kMaxDims];
};
void DeleteOwned(DLManagedTensor* t) { delete reinterpret_cast<OwnedTensor*>(t); }
}  // namespace

void* strata_dlpack_tensor(void* data, int32_t ndim, const int64_t* shape,
                           int32_t code, int32_t bits, int32_t device_type,
                           int32_t device_id) {
  if (ndim < 0 || ndim > kMaxDims) return nullptr;
  auto* t = new OwnedTensor{};
  for (int i = 0; i < ndim; ++i) t->shape[i] = shape[i];
  t->mt.dl_tensor = DLTensor{data, DLDevice{device_type, device_id}, ndim,
                             DLDataType{static_cast<uint8_t>(code),
                                        static_cast<uint8_t>(bits), 1},
                             t->shape, nullptr, 0};
  t->mt.manager_ctx = nullptr;
  t->mt.deleter = &DeleteOwned;
  return &t->mt;
}

// planes: void*[3], the ring's gate, up and down planes ([ring, part] each,
// frame f at row f * n_experts); frames: how many frames. 0 on success.
int strata_engine_frames(int64_t id, void** planes, int64_t* frames) {
  Engine* e = strata::FindEngine(id);
  if (!e) return 1;
  const strata::Rows r = e->FramePlanes();
  for (int p = 0; p < strata::kParts; ++p) planes[p] = r.part[p];
  *frames = e->frames();
  return 0;
}

// The ring frame `layer` reads its experts from (-1: none, or no engine).
int64_t strata_engine_frame_of(int64_t id, int32_t layer) {
  Engine* e = strata::FindEngine(id);
  return e ? e->frame_of(layer) : -1;
}

int strata_engine_depth(int64_t id) {
  Engine* e = strata::FindEngine(id);
  return e ? e->depth() : -1;
}

// out: double[2], host seconds of the last chunk's begin and end handlers.
int strata_engine_host_times(int64_t id, double* out) {
  Engine* e = strata::FindEngine(id);
  if (!e) return 1;
  e->HostTimes(out);
  return 0;
}

// out: double[4] (see Engine::Timing); 0 on success.
int strata_engine_timing(int64_t id, double* out, char* err, int64_t errlen) {
  Engine* e = strata::FindEngine(id);
  if (!e) return Report("no engine " + std::to_string(id), err, errlen);
  return Report(e->Timing(out), err, errlen);
}

}  // extern "C"
