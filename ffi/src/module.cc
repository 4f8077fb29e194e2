// The Python module strata_jax._native (nanobind): the streaming engine's
// handle (Streamer), pinned host memory for the expert store, DLPack tensors
// over the engine's memory, the link probe, and the XLA FFI handlers as
// capsules for jax.ffi.register_ffi_target (`registrations()`).
//
// Engine errors come back as Python exceptions carrying the engine's message:
// ValueError for an argument the module refuses, RuntimeError for the rest.
// Every call that may wait (on the engine's threads, on the device, on a
// CUDA allocation) runs with the GIL released, so none can deadlock with a
// thread that needs the GIL to make progress (a JAX host callback on XLA's
// stream, a thread of the caller's).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <unistd.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine.hpp"
#include "handlers.hpp"
#include "link_probe.hpp"

namespace nb = nanobind;

namespace strata {
namespace {

// strata_jax/native.py refuses a module of another version: a stale build.
constexpr int kApiVersion = 6;

using HostBytes = nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>;
using Int32s = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// "strata engine: <what>: <status>" as a RuntimeError, when `s` is an error.
void Check(const Status& s, const std::string& what) {
  if (!s.empty()) throw std::runtime_error("strata engine: " + what + ": " + s);
}

// Refuses options no engine can work with (ValueError).
void CheckOptions(const EngineOptions& opt) {
  std::string s;
  if (opt.n_layers < 0) s = "negative layer count " + std::to_string(opt.n_layers);
  else if (opt.n_experts < 0)
    s = "negative expert count " + std::to_string(opt.n_experts);
  else if (opt.ring < 1)
    s = "a ring of " + std::to_string(opt.ring) +
        " slots cannot work; it needs at least one slot";
  else if (opt.blob_bytes < 1)
    s = "expert blob of " + std::to_string(opt.blob_bytes) + " bytes";
  else if (opt.backend != 0 && opt.backend != 1)
    s = "backend " + std::to_string(opt.backend) + " is not 0 (cpu) or 1 (cuda)";
  else if (opt.publish_mode != 0 && opt.publish_mode != 1)
    s = "publish_mode " + std::to_string(opt.publish_mode) +
        " is not 0 (host callback) or 1 (polled event)";
  else if (opt.n_experts > 0 && opt.ring % opt.n_experts != 0)
    s = "a ring of " + std::to_string(opt.ring) + " slots is not a whole number of "
        "layer frames of " + std::to_string(opt.n_experts) + " experts";
  else
    s = ValidatePlanes(opt);
  if (!s.empty()) throw std::invalid_argument("strata engine: " + s);
}

// One engine, registered under `id()` (the id the FFI calls carry), destroyed
// by close() or with this object. It holds the host stores the engine reads,
// so their memory outlives the engine.
class Streamer {
 public:
  explicit Streamer(const EngineOptions& opt) {
    CheckOptions(opt);
    Status s;
    std::unique_ptr<Engine> e;
    try {
      e = opt.backend == 1 ? MakeCudaEngine(opt, &s) : MakeCpuEngine(opt, &s);
    } catch (const std::exception& ex) {
      throw std::runtime_error(std::string("strata engine: engine creation failed: ") +
                               ex.what());
    }
    if (!e) throw std::runtime_error("strata engine: " + s);
    id_ = RegisterEngine(std::move(e));
  }
  ~Streamer() { Close(); }
  Streamer(const Streamer&) = delete;
  Streamer& operator=(const Streamer&) = delete;

  int64_t id() const { return id_; }
  bool closed() const { return closed_; }

  // The engine, or null (closed, or made in the process this one forked from).
  Engine* Find() const { return closed_ ? nullptr : FindEngine(id_); }
  // The engine, or a RuntimeError naming `what`.
  Engine& Get(const std::string& what) const {
    Engine* e = Find();
    if (!e) Check("no engine " + std::to_string(id_), what);
    return *e;
  }

  // The engine reads `store` until it is destroyed: the reference is kept
  // until then. With the GIL held.
  void SetStore(int32_t layer, const HostBytes& store) {
    Engine& e = Get("host store of layer " + std::to_string(layer));
    Status s;
    {
      nb::gil_scoped_release unlocked;
      s = e.SetLayerStore(layer, static_cast<const uint8_t*>(store.data()),
                          static_cast<int64_t>(store.size()));
    }
    Check(s, "host store of layer " + std::to_string(layer));
    stores_.push_back(store);
  }

  // Stops the engine's threads and frees it, then lets go of the stores. With
  // the GIL held (released while the engine is destroyed). Idempotent.
  void Close() {
    if (!closed_) {
      closed_ = true;
      nb::gil_scoped_release unlocked;
      DestroyEngine(id_);
    }
    stores_.clear();
  }

 private:
  int64_t id_ = 0;
  bool closed_ = false;
  std::vector<HostBytes> stores_;
};

// The stream list (layers[k], experts[k]: the walk's order) and the resident
// experts. No entry comes in staged: the CUDA engine marks every entry staged
// itself when its Prepare finds its store staged.
void SetPlan(Streamer& self, const Int32s& layers, const Int32s& experts,
             const Int32s& res_layers, const Int32s& res_experts) {
  if (layers.shape(0) != experts.shape(0) || res_layers.shape(0) != res_experts.shape(0))
    throw std::invalid_argument(
        "strata engine: stream plan: " + std::to_string(layers.shape(0)) + " layers for " +
        std::to_string(experts.shape(0)) + " experts, " +
        std::to_string(res_layers.shape(0)) + " resident layers for " +
        std::to_string(res_experts.shape(0)) + " resident experts");
  Engine& e = self.Get("stream plan");
  const int32_t* l = layers.data();
  const int32_t* x = experts.data();
  const int32_t* rl = res_layers.data();
  const int32_t* rx = res_experts.data();
  const int64_t n = static_cast<int64_t>(layers.shape(0));
  const int64_t n_res = static_cast<int64_t>(res_layers.shape(0));
  nb::gil_scoped_release unlocked;
  Status s;
  try {
    std::vector<StreamEntry> stream(static_cast<size_t>(n));
    for (int64_t k = 0; k < n; ++k) stream[k] = {l[k], x[k], false};
    const int L = e.options().n_layers;
    std::vector<std::vector<int32_t>> resident(static_cast<size_t>(L));
    for (int64_t r = 0; r < n_res && s.empty(); ++r) {
      if (rl[r] < 0 || rl[r] >= L)
        s = "resident entry names layer " + std::to_string(rl[r]) +
            ", outside the model's " + std::to_string(L) + " layers";
      else
        resident[rl[r]].push_back(rx[r]);
    }
    if (s.empty()) s = e.SetPlan(stream, resident);
  } catch (const std::exception& ex) {
    s = ex.what();
  }
  Check(s, "stream plan");
}

void Prestart(Streamer& self, int32_t mode) {
  ChunkMode m;
  if (!ParseChunkMode(mode, &m))
    throw std::invalid_argument(
        "strata engine: prestart: prestart: mode " + std::to_string(mode) +
        " is not 0 (stream, frames), 1 (routed-only) or 2 (stream, packed)");
  Engine& e = self.Get("prestart");
  Status s;
  try {
    s = e.Prestart(m);
  } catch (const std::exception& ex) {
    s = ex.what();
  }
  Check(s, "prestart");
}

void StageIds(Streamer& self, const Int32s& ids, bool reset) {
  Engine& e = self.Get("stage_ids");
  Status s;
  try {
    s = e.StageIds(ids.data(), static_cast<int64_t>(ids.shape(0)), reset);
  } catch (const std::exception& ex) {  // the copy's allocation
    s = std::string("stage_ids: ") + ex.what();
  }
  Check(s, "stage_ids");
}

// Pinned host memory (PinnedAlloc) for the expert store, freed when this
// object goes, which the arrays over it (`array()`) keep alive. With a CUDA
// device ordinal, allocated on that GPU's host NUMA node where it has one.
class PinnedBuffer {
 public:
  explicit PinnedBuffer(int64_t nbytes, int device = -1)
      : nbytes_(nbytes), pid_(getpid()) {
    if (nbytes < 1)
      throw std::invalid_argument("pinned buffer of " + std::to_string(nbytes) +
                                  " bytes: needs at least one byte");
    const Status s = PinnedAlloc(nbytes, &data_, device, &numa_node_);
    if (!s.empty()) throw std::runtime_error(s);
  }
  ~PinnedBuffer() {
    // A forked child's copy: the memory is the parent's, and CUDA is not for
    // the child to call.
    if (!data_ || getpid() != pid_) return;
    nb::gil_scoped_release unlocked;  // unpinning gigabytes takes a while
    PinnedFree(data_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  void* data() const { return data_; }
  int64_t nbytes() const { return nbytes_; }
  int numa_node() const { return numa_node_; }

 private:
  void* data_ = nullptr;
  int64_t nbytes_;
  int numa_node_ = -1;
  pid_t pid_;
};

// A DLPack (v0.8 ABI) tensor over memory the engine owns, for a JAX array
// that views it: row-major, no strides. Its deleter frees only the structure
// (C, never Python: JAX may drop the array at interpreter exit).
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

// A capsule JAX never took (its name is still "dltensor") frees its tensor.
void DeleteUnusedCapsule(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, "dltensor"))
    DeleteOwned(static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor")));
}

nb::object DlpackTensor(uintptr_t data, const std::vector<int64_t>& shape, int32_t code,
                        int32_t bits, int32_t device_type, int32_t device_id) {
  if (shape.size() > static_cast<size_t>(kMaxDims))
    throw std::invalid_argument("no DLPack view of rank " + std::to_string(shape.size()) +
                                " (at most " + std::to_string(kMaxDims) + " dimensions)");
  auto t = std::make_unique<OwnedTensor>();
  const int32_t ndim = static_cast<int32_t>(shape.size());
  for (int32_t i = 0; i < ndim; ++i) t->shape[i] = shape[i];
  t->mt.dl_tensor = DLTensor{reinterpret_cast<void*>(data), DLDevice{device_type, device_id},
                             ndim,
                             DLDataType{static_cast<uint8_t>(code),
                                        static_cast<uint8_t>(bits), 1},
                             t->shape, nullptr, 0};
  t->mt.manager_ctx = nullptr;
  t->mt.deleter = &DeleteOwned;
  PyObject* capsule = PyCapsule_New(&t->mt, "dltensor", &DeleteUnusedCapsule);
  if (!capsule) throw nb::python_error();
  t.release();  // the capsule's now
  return nb::steal(capsule);
}

// The link probe's host memory kinds, as native.py names them.
ProbeHost ParseProbeHost(int32_t mode) {
  if (mode < 0 || mode > 2)
    throw std::invalid_argument("host_mode " + std::to_string(mode) +
                                " is not 0 (pageable), 1 (alloc) or 2 (register)");
  return static_cast<ProbeHost>(mode);
}

double MeasureLink(int32_t device, int64_t nbytes, int64_t block, int32_t reps,
                   int32_t host_mode, bool events) {
  if (nbytes <= 0 || reps < 1)
    throw std::invalid_argument("bad probe arguments: bytes " + std::to_string(nbytes) +
                                ", reps " + std::to_string(reps));
  const ProbeHost host = ParseProbeHost(host_mode);
  double gbps = 0.0;
  Status s;
  {
    nb::gil_scoped_release unlocked;
    s = MeasureH2D(device, nbytes, block, reps, host, events, &gbps);
  }
  if (!s.empty()) throw std::runtime_error("link probe failed: " + s);
  return gbps;
}

double MeasureLinkFrom(int32_t device, uintptr_t address, int64_t nbytes, int32_t reps) {
  if (!address || nbytes <= 0 || reps < 1)
    throw std::invalid_argument("bad probe arguments: host " + std::to_string(address) +
                                ", bytes " + std::to_string(nbytes) + ", reps " +
                                std::to_string(reps));
  double gbps = 0.0;
  Status s;
  {
    nb::gil_scoped_release unlocked;
    s = MeasureH2DFrom(device, reinterpret_cast<const void*>(address), nbytes, reps, &gbps);
  }
  if (!s.empty()) throw std::runtime_error("link probe failed: " + s);
  return gbps;
}

// An engine group over the engines `ids` (Streamer.id), engine i serving
// device ordinal `ordinals[i]` (engine.hpp, RegisterGroup): its id, which the
// FFI calls of a program run on every device carry.
int64_t RegisterGroupPy(const std::vector<int64_t>& ids, const std::vector<int32_t>& ordinals) {
  std::string err;
  int64_t id = 0;
  {
    nb::gil_scoped_release unlocked;
    id = RegisterGroup(ids, ordinals, &err);
  }
  if (!id) throw std::invalid_argument("strata engine group: " + err);
  return id;
}

// {platform: {target: capsule}}: "cpu", and "CUDA" in a CUDA build.
nb::dict Registrations() {
  auto table = [](const handlers::Registrations& regs) {
    nb::dict d;
    for (const handlers::Registration& r : regs)
      d[r.target] = nb::capsule(reinterpret_cast<void*>(r.handler));
    return d;
  };
  nb::dict out;
  out["cpu"] = table(handlers::CpuRegistrations());
#ifdef STRATA_WITH_CUDA
  out["CUDA"] = table(handlers::CudaRegistrations());
#endif
  return out;
}

constexpr bool kHasCuda =
#ifdef STRATA_WITH_CUDA
    true;
#else
    false;
#endif

}  // namespace
}  // namespace strata

NB_MODULE(_native, m) {
  using strata::EngineOptions;
  using strata::Streamer;
  using Release = nb::call_guard<nb::gil_scoped_release>;
  m.doc() = "strata_jax's native library: the streaming engine and its XLA FFI handlers";
  // Python decides when a handle goes (an engine kept in a global lives to
  // the interpreter's exit, where its finalizer has destroyed it already).
  nb::set_leak_warnings(false);
  m.attr("api_version") = strata::kApiVersion;
  m.def("has_cuda", [] { return strata::kHasCuda; },
        "Whether the library was built with the CUDA backend.");
  m.def("registrations", &strata::Registrations,
        "The FFI handlers as capsules, {platform: {target: capsule}}.");

  // The engine's configuration, the C++ struct itself (engine.hpp): each field read and
  // written by name, its default the struct's. Streamer() checks it (CheckOptions).
  nb::class_<EngineOptions>(
      m, "EngineOptions",
      "The streaming engine's options (ffi/src/engine.hpp EngineOptions), field for field; "
      "a new object holds the engine's defaults. Streamer(options) checks and copies it.")
      .def(nb::init<>())
      .def_rw("backend", &EngineOptions::backend, "0: CPU (simulated link), 1: CUDA.")
      .def_rw("n_layers", &EngineOptions::n_layers, "Model layers (dense ones included).")
      .def_rw("n_experts", &EngineOptions::n_experts, "Routed experts per MoE layer.")
      .def_prop_rw(
          "routed", [](const EngineOptions& o) { return o.routed != 0; },
          [](EngineOptions& o, bool on) { o.routed = on ? 1 : 0; },
          "The routed switch: skip ring entries whose layer's routing landed before they were "
          "issued and whose expert no token routes to, with at most `depth` copies queued.")
      .def_rw("blob_bytes", &EngineOptions::blob_bytes, "Bytes of one expert (one ring slot).")
      .def_rw("ring", &EngineOptions::ring,
              "Ring slots: a whole number of layer frames of n_experts slots.")
      .def_rw("depth", &EngineOptions::depth,
              "Copies queued ahead of the link with the routed switch on.")
      .def_prop_rw(
          "trace", [](const EngineOptions& o) { return o.trace != 0; },
          [](EngineOptions& o, bool on) { o.trace = on ? 1 : 0; },
          "Print per-chunk copied/skipped lines on stderr.")
      .def_rw("sim_bandwidth", &EngineOptions::sim_bandwidth,
              "CPU backend: the simulated link's bytes/s (0: unlimited).")
      .def_rw("sim_latency", &EngineOptions::sim_latency,
              "CPU backend: the simulated link's seconds per copy.")
      .def_rw("sim_jitter", &EngineOptions::sim_jitter,
              "CPU backend: up to this many extra seconds per copy, uniform.")
      .def_rw("seed", &EngineOptions::seed, "CPU backend: the simulated jitter's seed.")
      .def_rw("pin_mode", &EngineOptions::pin_mode,
              "CUDA backend: 1 reads the host store pinned (falling back to staging), 2 "
              "stages it through pinned bounce buffers from the start.")
      .def_rw("device", &EngineOptions::device, "CUDA backend: the device ordinal.")
      .def_rw("publish_mode", &EngineOptions::publish_mode,
              "CUDA backend: how a layer's routing reaches the gate: 0 a host callback, 1 an "
              "event the issuer polls.")
      .def_rw("plane_offsets", &EngineOptions::plane_offsets,
              "The plane table: each plane's byte offset in an expert's blob, in blob order.")
      .def_rw("plane_bytes", &EngineOptions::plane_bytes,
              "The plane table: each plane's bytes, in blob order.")
      .def("__repr__", [](const EngineOptions& o) {
        auto list = [](const std::vector<int64_t>& v) {
          std::ostringstream s;
          s << "[";
          for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
          s << "]";
          return s.str();
        };
        std::ostringstream s;
        s << "EngineOptions(backend=" << o.backend << ", n_layers=" << o.n_layers
          << ", n_experts=" << o.n_experts << ", routed=" << (o.routed ? "True" : "False")
          << ", blob_bytes=" << o.blob_bytes << ", ring=" << o.ring << ", depth=" << o.depth
          << ", trace=" << (o.trace ? "True" : "False") << ", sim_bandwidth=" << o.sim_bandwidth
          << ", sim_latency=" << o.sim_latency << ", sim_jitter=" << o.sim_jitter
          << ", seed=" << o.seed << ", pin_mode=" << o.pin_mode << ", device=" << o.device
          << ", publish_mode=" << o.publish_mode << ", plane_offsets=" << list(o.plane_offsets)
          << ", plane_bytes=" << list(o.plane_bytes) << ")";
        return s.str();
      });

  nb::class_<Streamer>(m, "Streamer",
                       "One streaming engine (ffi/src/engine.hpp), destroyed by close().")
      .def(nb::init<const EngineOptions&>(), nb::arg("options"), Release(),
           "Makes the engine `options` (an EngineOptions, checked here) describe.")
      .def_prop_ro("id", &Streamer::id, "The engine's id, which the FFI calls carry.")
      .def_prop_ro("closed", &Streamer::closed)
      .def("set_store", &Streamer::SetStore, nb::arg("layer"), nb::arg("store").noconvert(),
           "Sets a layer's host store (uint8, C-contiguous [E, blob]), kept until close().")
      .def("set_plan", &strata::SetPlan, nb::arg("layers"), nb::arg("experts"),
           nb::arg("res_layers"), nb::arg("res_experts"))
      .def(
          "prepare",
          [](Streamer& self) {
            strata::Engine& e = self.Get("prepare");
            strata::Status s;
            try {
              s = e.Prepare();
            } catch (const std::exception& ex) {
              s = ex.what();
            }
            strata::Check(s, "prepare");
          },
          Release())
      .def("prestart", &strata::Prestart, nb::arg("mode"), Release())
      .def("stage_ids", &strata::StageIds, nb::arg("ids"), nb::arg("reset"), Release())
      .def(
          "abort",
          [](Streamer& self) {
            if (strata::Engine* e = self.Find()) {
              e->Abort();
              e->ClearPeerStops();
            }
          },
          Release())
      .def(
          "cancel",
          [](Streamer& self, bool on) {
            strata::Engine* e = self.Find();
            if (!e) return;
            if (on)
              e->Cancel();
            else
              e->Uncancel();
          },
          nb::arg("on"), Release())
      .def("close", &Streamer::Close)
      .def("walk_active",
           [](const Streamer& self) {
             const strata::Engine* e = self.Find();
             return e && e->WalkActive();
           })
      .def("hold",
           [](const Streamer& self) -> int64_t {
             const strata::Engine* e = self.Find();
             return e ? e->hold() : -1;
           })
      .def("depth",
           [](const Streamer& self) -> int {
             const strata::Engine* e = self.Find();
             return e ? e->depth() : -1;
           })
      .def(
          "frame_of",
          [](const Streamer& self, int32_t layer) -> int64_t {
            const strata::Engine* e = self.Find();
            return e ? e->frame_of(layer) : -1;
          },
          nb::arg("layer"), "The ring frame `layer` reads its experts from (-1: none).")
      .def(
          "frames",
          [](const Streamer& self) {
            const strata::Engine* e = self.Find();
            if (!e)
              throw std::runtime_error("strata engine " + std::to_string(self.id()) +
                                       ": no ring frames (engine closed?)");
            const strata::Rows r = e->FramePlanes();
            nb::list planes;
            for (int p = 0; p < e->n_planes(); ++p)
              planes.append(reinterpret_cast<uintptr_t>(r.plane[p]));
            return nb::make_tuple(planes, e->frames());
          },
          "([plane addresses], frames): the address of each plane's region of the ring "
          "([ring, plane bytes] each, frame f at row f * n_experts) and its frame count.")
      .def(
          "inject_fault",
          [](const Streamer& self, int32_t layer, int32_t kind) {
            if (kind < 0 || kind > 2)
              throw std::invalid_argument("fault kind " + std::to_string(kind) +
                                          " is not 0 (none), 1 (error) or 2 (stop)");
            if (strata::Engine* e = self.Find())
              e->InjectFault(layer, static_cast<strata::Fault>(kind));
          },
          nb::arg("layer"), nb::arg("kind"))
      .def(
          "last_error",
          [](const Streamer& self) -> std::string {
            strata::Engine* e = self.Find();
            return e ? e->last_error() : std::string();
          },
          "The error this engine's last chunk ended with, as a group member (its "
          "end_chunk's; empty: none, or not in a group).")
      .def(
          "host_times",
          [](const Streamer& self) {
            double out[2] = {0.0, 0.0};
            if (const strata::Engine* e = self.Find()) e->HostTimes(out);
            return nb::make_tuple(out[0], out[1]);
          },
          "Host seconds (time.monotonic) of the last chunk's begin and end.")
      .def(
          "timing",
          [](const Streamer& self) -> nb::object {
            double out[4] = {0.0, 0.0, 0.0, 0.0};
            strata::Status s = "no engine";
            if (const strata::Engine* e = self.Find()) {
              nb::gil_scoped_release unlocked;
              s = e->Timing(out);
            }
            if (!s.empty()) return nb::none();
            return nb::make_tuple(out[0], out[1], out[2], out[3]);
          },
          "Device timing of the last chunk in ms (Engine::Timing), or None.");

  nb::class_<strata::PinnedBuffer>(m, "PinnedBuffer",
                                   "Pinned host memory, freed when the last reference goes.")
      .def(nb::init<int64_t, int>(), nb::arg("nbytes"), nb::arg("device") = -1, Release())
      .def_prop_ro("numa_node", &strata::PinnedBuffer::numa_node,
                   "The host NUMA node the memory was allocated on (the device's), or -1.")
      .def_prop_ro("address",
                   [](const strata::PinnedBuffer& b) {
                     return reinterpret_cast<uintptr_t>(b.data());
                   })
      .def_prop_ro("nbytes", &strata::PinnedBuffer::nbytes)
      .def(
          "array",
          [](strata::PinnedBuffer& b) {
            return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(
                b.data(), {static_cast<size_t>(b.nbytes())}, nb::find(&b));
          },
          "The memory as a uint8 numpy array, which keeps this buffer alive.");

  m.def("register_group", &strata::RegisterGroupPy, nb::arg("ids"), nb::arg("ordinals"),
        "Groups engines, one per device ordinal: the group's id, which the FFI calls carry "
        "(each call reaches the member of the device it runs on).");
  m.def(
      "destroy_group", [](int64_t id) { return strata::DestroyGroup(id); }, nb::arg("id"),
      Release(), "Ends a group (its engines stay); False when there was none.");
  m.def("dlpack_tensor", &strata::DlpackTensor, nb::arg("data"), nb::arg("shape"),
        nb::arg("code"), nb::arg("bits"), nb::arg("device_type"), nb::arg("device_id"),
        "A 'dltensor' capsule over `data` (row-major `shape`), for jax.dlpack.from_dlpack.");
  m.def("measure_h2d", &strata::MeasureLink, nb::arg("device"), nb::arg("nbytes"),
        nb::arg("block"), nb::arg("reps"), nb::arg("host_mode"), nb::arg("events"));
  m.def("measure_h2d_from", &strata::MeasureLinkFrom, nb::arg("device"), nb::arg("address"),
        nb::arg("nbytes"), nb::arg("reps"));
}
