// nanobind bindings: the private `smartcoll._core` module. The Python package wraps it with argument checks
// and friendlier types; everything that blocks here releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>

#include "codec_bindings.h"
#include "model_bindings.h"

#include "coll/segmented.h"
#include "coll/table.h"

#include "smartcoll/comm.h"
#include "smartcoll/knobs.h"
#include "smartcoll/reduce.h"
#include "smartcoll/store.h"
#include "switch/query.h"
#include "nicd/protocol.h"
#include "nicd/server.h"
#include "switch/server.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace smartcoll {
namespace {

using Array = nb::ndarray<nb::device::cpu>;
using InArray = nb::ndarray<nb::ro, nb::device::cpu>;  // inputs: read-only arrays (np.frombuffer, mmap) welcome
using Offsets = nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

template <class A>
DataType dtype_of(const A& a) {
  const nb::dlpack::dtype d = a.dtype();
  using Code = nb::dlpack::dtype_code;
  if (d.lanes == 1) {
    if (d.code == static_cast<uint8_t>(Code::Float)) {
      if (d.bits == 32) return DataType::f32;
      if (d.bits == 64) return DataType::f64;
      if (d.bits == 16) return DataType::f16;
    } else if (d.code == static_cast<uint8_t>(Code::Bfloat) && d.bits == 16) {
      return DataType::bf16;
    } else if (d.code == static_cast<uint8_t>(Code::Int)) {
      if (d.bits == 8) return DataType::i8;
      if (d.bits == 32) return DataType::i32;
      if (d.bits == 64) return DataType::i64;
    } else if (d.code == static_cast<uint8_t>(Code::UInt) && d.bits == 8) {
      return DataType::u8;
    }
  }
  throw nb::type_error("unsupported dtype: smartcoll takes float32, float64, float16, bfloat16, int8, uint8, int32 "
                       "or int64 arrays; convert with .astype() / .to()");
}

template <class A>
void require_contiguous(const A& a) {
  if (a.size() == 0) return;  // NumPy gives empty arrays arbitrary strides
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect)
      throw nb::type_error("array is not C-contiguous: pass a contiguous copy (numpy.ascontiguousarray(x) or "
                           "x.contiguous())");
    expect *= static_cast<int64_t>(a.shape(i));
  }
}

ReduceOp parse_op(const std::string& name) {
  for (ReduceOp op : kAllReduceOps)
    if (op_name(op) == name) return op;
  throw nb::value_error(("unknown op '" + name + "'; choose sum, prod, min, max or avg").c_str());
}

DataType parse_dtype(const std::string& name) {
  for (DataType t : kAllDataTypes)
    if (dtype_name(t) == name) return t;
  throw nb::value_error(("unknown dtype '" + name + "'").c_str());
}

std::optional<Codec> parse_codec(const std::string& name) {
  if (name.empty()) return std::nullopt;
  return Codec::parse(name);
}

struct Buffer {
  void* data;
  size_t count;
  DataType dtype;
};

template <class A>
Buffer buffer(const A& a) {
  require_contiguous(a);
  return {const_cast<void*>(static_cast<const void*>(a.data())), a.size(), dtype_of(a)};
}

}  // namespace
}  // namespace smartcoll

NB_MODULE(_core, m) {
  using namespace smartcoll;
  m.doc() = "smartcoll core (C++): progress engine, transports, collective algorithms, codecs";
  bind_codec(m);
  bind_model(m);

  nb::exception<CommError>(m, "CommError", PyExc_RuntimeError);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.def("knobs", [] {
    std::vector<std::tuple<std::string, std::string, std::string, std::string, std::string>> out;
    for (const Knob& k : kKnobs)
      out.emplace_back(std::string(k.name), std::string(k.default_value), std::string(k.type),
                       knob_env_name(k.name), std::string(k.description));
    return out;
  }, "The knob table: (name, default, type, environment variable, description) per setting.");
  m.def("resolve_options", [](const std::map<std::string, std::string>& o) { return Options::resolve(o).values(); },
        "Settings after applying SMARTCOLL_* environment variables and explicit options (raises on bad ones).");
  m.def("build_info", [] {
    std::map<std::string, std::string> info{
        {"version", SMARTCOLL_VERSION},
        {"simd", std::string(simd_name(simd_active()))},
        {"simd_supported", std::string(simd_name(simd_supported()))},
        {"compiler", __VERSION__},
        {"allreduce_algorithms", [] {
           std::string all = "auto";
           for (const coll::AlgorithmInfo& a : coll::algorithms(Collective::allreduce))
             all += ", " + std::string(algorithm_name(a.algo));
           return all;
         }()},
        {"collectives", [] {  // each with its algorithms (coll/table.cc)
           std::string all;
           for (int c = 0; c < kCollectives; ++c) {
             all += (c ? "; " : "") + std::string(collective_name(static_cast<Collective>(c))) + ":";
             for (const coll::AlgorithmInfo& a : coll::algorithms(static_cast<Collective>(c)))
               all += " " + std::string(algorithm_name(a.algo));
           }
           return all;
         }()},
        {"transports", "tcp, unix (same host), cma (same host), udp (switch protocol)"},
        {"codecs", [] {
           std::string all;
           for (const auto& n : Codec::names()) all += (all.empty() ? "" : ", ") + n;
           return all;
         }()},
    };
    return info;
  });
  m.def("simd_force", [](const std::string& level) {
    for (SimdLevel l : {SimdLevel::scalar, SimdLevel::avx2, SimdLevel::avx512})
      if (simd_name(l) == level) return simd_force(l);
    throw nb::value_error("simd level must be scalar, avx2 or avx512");
  });
  m.def("reduce_arrays", [](Array dst, Array a, Array b, const std::string& op) {
    Buffer d = buffer(dst), x = buffer(a), y = buffer(b);
    if (d.count != x.count || d.count != y.count || d.dtype != x.dtype || d.dtype != y.dtype)
      throw nb::value_error("reduce_arrays needs three arrays of one dtype and size");
    nb::gil_scoped_release release;
    reduce(d.dtype, parse_op(op), d.data, x.data, y.data, d.count);
  }, "dst = a op b with the engine's kernels (for tests and benchmarks).");
  m.def("time_copy_view", [](Array base, nb::ndarray<const uint64_t, nb::ndim<1>, nb::device::cpu> offsets,
                             nb::ndarray<const uint64_t, nb::ndim<1>, nb::device::cpu> sizes, Array packed, bool gather,
                             int repeat) {
    size_t total = 0;
    bool inside = offsets.size() == sizes.size();
    for (size_t k = 0; inside && k < offsets.size(); ++k) {
      inside = offsets(k) <= base.nbytes() && sizes(k) <= base.nbytes() - offsets(k);
      total += sizes(k);
    }
    if (!inside || total > packed.nbytes())
      throw nb::value_error("time_copy_view: every piece must lie inside base and their sizes fit in packed");
    const coll::CopyTimes t = coll::time_copy_view(static_cast<char*>(base.data()), {offsets.data(), offsets.size()},
                                                   {sizes.data(), sizes.size()}, static_cast<char*>(packed.data()),
                                                   gather, repeat);
    return std::map<std::string, double>{{"segmented", t.segmented}, {"memcpy", t.memcpy}, {"read", t.read}};
  }, "Best seconds of the gather (or scatter) kernel over pieces, of one memcpy of the same bytes and of reading "
     "the pieces alone.");
  m.def("dtype_size", [](const std::string& name) { return dtype_size(parse_dtype(name)); });
  // List calls take thousands of arrays: NumPy's ndarray.ctypes.data builds a ctypes object per array (~2 us),
  // the buffer protocol answers in a tenth of that. Torch tensors have no buffer protocol: their data_ptr().
  m.def("addresses", [](nb::sequence xs) {
    std::vector<uintptr_t> out;
    out.reserve(nb::len(xs));
    for (nb::handle x : xs) {
      if (PyObject_CheckBuffer(x.ptr())) {
        Py_buffer view;
        if (PyObject_GetBuffer(x.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) throw nb::python_error();
        out.push_back(reinterpret_cast<uintptr_t>(view.buf));
        PyBuffer_Release(&view);
      } else {
        out.push_back(nb::cast<uintptr_t>(x.attr("data_ptr")()));
      }
    }
    return out;
  }, "Data addresses of C-contiguous arrays (NumPy, or anything with the buffer protocol) and CPU tensors.");

  // A list call's entries checked and described in one pass (a Python loop costs about 1 us per entry, which
  // for thousands of tiny tensors exceeds the collective). Only the plain case is decided here: every entry of
  // type `ndarray` (C-contiguous, writable where asked, all of one format) or every entry of type `tensor` (CPU,
  // contiguous, no grad where written, not a negative view, all of one dtype). Anything else returns None and the
  // Python checks, which name what is wrong, run instead.
  m.def("list_entries", [](nb::sequence xs, bool writable, nb::handle ndarray, nb::handle tensor) -> nb::object {
    const size_t n = nb::len(xs);
    std::vector<uintptr_t> addresses;
    std::vector<size_t> counts;
    addresses.reserve(n);
    counts.reserve(n);
    if (n == 0) return nb::none();
    const PyTypeObject* kind = Py_TYPE(xs[0].ptr());
    if (kind == reinterpret_cast<PyTypeObject*>(ndarray.ptr())) {
      std::string format;
      const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
      for (nb::handle x : xs) {
        Py_buffer view;
        if (Py_TYPE(x.ptr()) != kind) return nb::none();
        if (PyObject_GetBuffer(x.ptr(), &view, flags) != 0) {
          PyErr_Clear();
          return nb::none();
        }
        const bool same = format.empty() ? (format = view.format ? view.format : "B", true)
                                         : format == (view.format ? view.format : "B");
        // '>' or '!': big-endian items, which the checks of the slow path refuse by name (this host is little-endian)
        const bool ok = same && view.itemsize > 0 && format.find_first_of(">!") == std::string::npos;
        if (ok) {
          addresses.push_back(reinterpret_cast<uintptr_t>(view.buf));
          counts.push_back(static_cast<size_t>(view.len / view.itemsize));
        }
        PyBuffer_Release(&view);
        if (!ok) return nb::none();
      }
    } else if (!tensor.is_none() && kind == reinterpret_cast<PyTypeObject*>(tensor.ptr())) {
      nb::object dtype;
      for (nb::handle x : xs) {
        if (Py_TYPE(x.ptr()) != kind) return nb::none();
        if (!nb::cast<bool>(x.attr("is_cpu")) || !nb::cast<bool>(x.attr("is_contiguous")()) ||
            (writable && nb::cast<bool>(x.attr("requires_grad"))) || nb::cast<bool>(x.attr("is_neg")()))
          return nb::none();
        nb::object d = x.attr("dtype");
        if (!dtype.is_valid()) dtype = d;
        else if (!d.is(dtype)) return nb::none();
        addresses.push_back(nb::cast<uintptr_t>(x.attr("data_ptr")()));
        counts.push_back(nb::cast<size_t>(x.attr("numel")()));
      }
    } else {
      return nb::none();
    }
    return nb::make_tuple(nb::cast(addresses), nb::cast(counts));
  }, "xs"_a, "writable"_a, "ndarray"_a, "tensor"_a.none(),
     "(addresses, counts) of a list whose entries are all plain NumPy arrays or all plain tensors that pass the "
     "checks; else None.");

  nb::class_<Store>(m, "Store")
      .def("set", [](Store& s, const std::string& key, const std::string& value) {
        nb::gil_scoped_release release;
        s.set(key, value);
      }, "key"_a, "value"_a)
      .def("check", [](Store& s, const std::string& key) {
        nb::gil_scoped_release release;
        return s.check(key);
      }, "key"_a, "The value if the key exists now (None otherwise), without waiting.");
  nb::class_<TcpStore, Store>(m, "TcpStore")
      .def("__init__", [](TcpStore* self, const std::string& host, nb::int_ port, bool serve, double timeout,
                          std::string secret) {
        int p = 0;
        if (!nb::try_cast(port, p))  // beyond C++'s int; TcpStore checks the range of the others
          throw nb::value_error(("TCP store port " + std::string(nb::str(port).c_str()) + " is outside 0..65535")
                                    .c_str());
        nb::gil_scoped_release release;
        new (self) TcpStore(host, p, serve, std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000)),
                            std::move(secret));
      }, "host"_a, "port"_a, "serve"_a, "timeout"_a, "secret"_a = "")
      .def_prop_ro("port", &TcpStore::port)
      .def("close", [](TcpStore& s) {
        nb::gil_scoped_release release;  // a serving store waits for its clients, which may need this lock to leave
        s.close();
      });
  nb::class_<FileStore, Store>(m, "FileStore").def(nb::init<std::string>(), "path"_a);
  nb::class_<PrefixStore, Store>(m, "PrefixStore").def(nb::init<std::shared_ptr<Store>, std::string>(), "inner"_a,
                                                        "prefix"_a);

  // The aggregation switch (`smartcoll switch`): serves on its own threads; the CLI polls stats().
  nb::class_<sw::Switch>(m, "Switch")
      .def("__init__", [](sw::Switch* self, const std::string& host, int port, int threads, int64_t slots,
                          double job_timeout, bool full_auth, double drop, double dup, double reorder,
                          uint64_t seed, bool offload) {
        if (port < 0 || port > 65535) throw nb::value_error("port must be between 0 and 65535");
        if (slots < 1 || slots > (int64_t{1} << 30)) throw nb::value_error("slots must be between 1 and 2^30");
        for (double p : {drop, dup, reorder})
          if (!(p >= 0 && p <= 1)) throw nb::value_error("fault probabilities must be between 0 and 1");
        sw::SwitchOptions o;
        o.host = host;
        o.port = static_cast<uint16_t>(port);
        o.threads = threads;
        o.slots = static_cast<uint32_t>(slots);
        o.job_timeout = job_timeout;
        o.full_auth = full_auth;
        o.faults = {drop, dup, reorder, seed};
        o.offload = offload;
        new (self) sw::Switch(o);
      }, "host"_a, "port"_a, "threads"_a = 1, "slots"_a = 4096, "job_timeout"_a = 60.0, "full_auth"_a = false,
         "drop"_a = 0.0, "dup"_a = 0.0, "reorder"_a = 0.0, "seed"_a = 1, "offload"_a = true)
      .def_prop_ro("port", &sw::Switch::port)
      .def("start", &sw::Switch::start)
      .def("stop", [](sw::Switch& s) {
        nb::gil_scoped_release release;
        s.stop();
      })
      .def("take_expired", &sw::Switch::take_expired)
      .def("stats", [](const sw::Switch& s) {
        const sw::SwitchStats st = s.stats();
        nb::dict out;
        out["threads"] = st.threads;
        out["slots_total"] = st.slots_total;
        out["slots_free"] = st.slots_free;
        out["datagrams_in"] = st.datagrams_in;
        out["unknown_job"] = st.unknown_job;
        out["join_refused"] = st.join_refused;
        out["jobs_joined"] = st.jobs_joined;
        out["jobs_left"] = st.jobs_left;
        out["jobs_expired"] = st.jobs_expired;
        out["queries"] = st.queries;
        out["queries_refused"] = st.queries_refused;
        out["send_calls"] = st.send_calls;
        out["messages_out"] = st.messages_out;
        out["datagrams_out"] = st.datagrams_out;
        out["offload_refused"] = st.offload_refused;
        out["joined_in"] = st.joined_in;
        nb::dict malformed;
        for (int r = 1; r < sw::kRejectReasons; ++r)
          malformed[nb::str(std::string(sw::reject_name(static_cast<sw::Reject>(r))).c_str())] = st.malformed[r];
        out["malformed"] = malformed;
        auto job = [](const sw::JobStats& j) {
          nb::dict d;
          char id[17];
          std::snprintf(id, sizeof id, "%016llx", static_cast<unsigned long long>(j.job));
          d["job"] = std::string(id);
          d["world"] = j.world;
          d["window"] = j.window;
          d["busy_slots"] = j.busy_slots;
          d["full_auth"] = j.full_auth;
          d["contributions"] = j.contributions;
          d["bytes_in"] = j.bytes_in;
          d["results"] = j.results;
          d["bytes_out"] = j.bytes_out;
          d["resent"] = j.resent;
          d["duplicates"] = j.duplicates;
          d["retransmits"] = j.retransmits;
          d["idle_s"] = j.idle_s;
          nb::dict drops;
          for (size_t k = 0; k < j.drops.size(); ++k)
            drops[nb::str(std::string(sw::drop_name(static_cast<sw::Drop>(k))).c_str())] = j.drops[k];
          d["drops"] = drops;
          return d;
        };
        nb::list jobs;
        for (const sw::JobStats& j : st.jobs) jobs.append(job(j));
        out["ended"] = job(st.ended);
        out["jobs"] = jobs;
        return out;
      }, "Counters: per switch (datagrams, malformed ones by reason, unknown jobs, joins refused, slots) and per "
         "job (contributions, results, bytes, retransmissions, shadow resends, duplicates, drops by cause).");

  m.def("switch_query", [](const std::string& host, int port, double timeout) {
    if (port < 1 || port > 65535) throw nb::value_error("port must be between 1 and 65535");
    nb::gil_scoped_release release;
    return sw::query_stats(host, static_cast<uint16_t>(port), timeout);
  }, "host"_a, "port"_a, "timeout"_a = 2.0,
     "The open counters of the aggregation switch at host:port (a stats query over UDP), as JSON text.");
  // The offload daemon (`smartcoll nicd`): serves on its own threads; the CLI polls stats() and take_events().
  nb::class_<nicd::Server>(m, "Nicd")
      .def("__init__", [](nicd::Server* self, const std::string& socket, const std::vector<int>& cpus,
                          double timeout) {
        new (self) nicd::Server({socket, cpus, timeout});
      }, "socket"_a, "cpus"_a = std::vector<int>{}, "timeout"_a = 60.0)
      .def_prop_ro("path", &nicd::Server::path)
      .def("start", &nicd::Server::start)
      .def("stop", [](nicd::Server& s) {
        nb::gil_scoped_release release;
        s.stop();
      })
      .def("take_events", &nicd::Server::take_events)
      .def("stats", [](const nicd::Server& s) {
        const nicd::ServerStats st = s.stats();
        return std::map<std::string, uint64_t>{
            {"connections", st.connections}, {"refused", st.refused},       {"jobs_formed", st.jobs_formed},
            {"jobs_failed", st.jobs_failed}, {"jobs_now", st.jobs_now},     {"calls", st.calls},
            {"bytes_read", st.bytes_read},   {"bytes_written", st.bytes_written},
            {"buffer_peak", st.buffer_peak}};
      }, "Counters: connections accepted and refused, jobs formed, failed and running, calls run, bytes read from "
         "and written into the ranks' memory, and the most bytes of the ranks' data one job held for a call.");
  m.def("nicd_default_socket", &nicd::default_socket,
        "Where ranks and the daemon meet when nicd_socket is empty.");

  nb::class_<Request>(m, "Request")
      .def("test", &Request::test)
      .def_prop_ro("algorithm", [](const Request& r) { return std::string(algorithm_name(r.algorithm())); })
      .def("wait", [](Request& r, std::optional<double> timeout) {
        nb::gil_scoped_release release;
        if (timeout) return r.wait(std::chrono::duration<double>(*timeout));
        return r.wait();
      }, "timeout"_a = nb::none());

  nb::class_<Communicator>(m, "Communicator")
      .def("__init__", [](Communicator* self, int rank, int size, std::shared_ptr<Store> store,
                          const std::map<std::string, std::string>& options, const std::string& route_hint) {
        Options resolved = Options::resolve(options);
        nb::gil_scoped_release release;
        new (self) Communicator(rank, size, std::move(store), resolved, route_hint);
      }, "rank"_a, "size"_a, "store"_a, "options"_a, "route_hint"_a = "")
      .def_prop_ro("rank", &Communicator::rank)
      .def_prop_ro("size", &Communicator::size)
      .def_prop_ro("options", [](const Communicator& c) { return c.options().values(); })
      .def_prop_ro("cma_unusable_reason", &Communicator::cma_unusable_reason)
      .def_prop_ro("cma_control", &Communicator::cma_control)
      .def_prop_ro("hosts", &Communicator::hosts)
      .def("choose", [](const Communicator& c, const std::string& collective, size_t count, const std::string& dtype,
                        const std::string& algo, const std::string& op, const std::string& codec) {
        Collective coll = Collective::allreduce;
        bool known = false;
        for (int i = 0; i < kCollectives && !known; ++i)
          if (collective_name(static_cast<Collective>(i)) == collective) coll = static_cast<Collective>(i), known = true;
        if (!known) throw nb::value_error(("unknown collective '" + collective + "'").c_str());
        const DataType dt = parse_dtype(dtype);
        const bool reduces = coll == Collective::allreduce || coll == Collective::reduce_scatter ||
                             coll == Collective::reduce;
        const std::optional<ReduceOp> rop = reduces ? std::optional(parse_op(op)) : std::nullopt;
        const bool compressed = (coll == Collective::allreduce || coll == Collective::reduce_scatter ||
                                 coll == Collective::allgather) &&
                                c.choose_codec(coll, dt, rop, parse_codec(codec)).kind() != CodecKind::identity;
        return std::string(algorithm_name(c.choose(coll, count, dt, parse_algorithm(algo, coll), compressed)));
      })
      .def("engine_stats", [](const Communicator& c) {
        const EngineStats s = c.engine_stats();
        return std::map<std::string, double>{{"workers", s.workers}, {"cpu_seconds", s.cpu_seconds},
                                             {"open_channels", s.open_channels},
                                             {"local_channels", s.local_channels},
                                             {"same_host_calls", static_cast<double>(s.same_host_calls)},
                                             {"staged_bytes", static_cast<double>(s.staged_bytes)},
                                             {"direct_gets", static_cast<double>(s.direct_gets)},
                                             {"direct_puts", static_cast<double>(s.direct_puts)},
                                             {"direct_accumulates", static_cast<double>(s.direct_accumulates)},
                                             {"driven_answers", static_cast<double>(s.driven_answers)}};
      }, "Engine worker count, their CPU seconds so far, the connections this rank holds (and of those the Unix "
         "sockets to peers on this host), same-host calls run, "
         "list bytes staged, one-sided gets read, puts written and accumulates reduced directly, offload daemon answers read by the "
         "waiting caller.")
      .def("allreduce", [](Communicator& c, InArray in, Array out, const std::string& op, const std::string& algo,
                           const std::string& codec) {
        Buffer i = buffer(in), o = buffer(out);
        return c.allreduce(i.data, o.data, i.count, i.dtype, parse_op(op), parse_algorithm(algo), parse_codec(codec));
      }, "in"_a, "out"_a, "op"_a, "algo"_a, "codec"_a = "")
      .def("reduce_scatter", [](Communicator& c, InArray in, Array out, const std::string& op, const std::string& codec,
                                const std::string& algo) {
        Buffer i = buffer(in), o = buffer(out);
        return c.reduce_scatter(i.data, o.data, o.count, i.dtype, parse_op(op), parse_codec(codec),
                                parse_algorithm(algo, Collective::reduce_scatter));
      }, "in"_a, "out"_a, "op"_a, "codec"_a = "", "algo"_a = "auto")
      .def("allgather", [](Communicator& c, InArray in, Array out, const std::string& codec, const std::string& algo) {
        Buffer i = buffer(in), o = buffer(out);
        return c.allgather(i.data, o.data, i.count, i.dtype, parse_codec(codec),
                           parse_algorithm(algo, Collective::allgather));
      }, "in"_a, "out"_a, "codec"_a = "", "algo"_a = "auto")
      .def("broadcast", [](Communicator& c, Array buf, int root, const std::string& algo) {
        Buffer b = buffer(buf);
        return c.broadcast(b.data, b.count, b.dtype, root, parse_algorithm(algo, Collective::broadcast));
      }, "buf"_a, "root"_a, "algo"_a = "auto")
      .def("reduce", [](Communicator& c, InArray in, std::optional<Array> out, const std::string& op, int root,
                        const std::string& algo) {
        Buffer i = buffer(in);
        void* o = out ? buffer(*out).data : nullptr;
        return c.reduce(i.data, o, i.count, i.dtype, parse_op(op), root, parse_algorithm(algo, Collective::reduce));
      }, "in"_a, "out"_a, "op"_a, "root"_a, "algo"_a = "auto")
      .def("alltoall", [](Communicator& c, InArray in, Array out, const std::string& algo) {
        Buffer i = buffer(in), o = buffer(out);
        return c.alltoall(i.data, o.data, i.count / static_cast<size_t>(c.size()), i.dtype,
                          parse_algorithm(algo, Collective::alltoall));
      }, "in"_a, "out"_a, "algo"_a = "auto")
      .def("barrier", [](Communicator& c) { return c.barrier(); })
      // List forms and alltoallv (docs/vectored.md): addresses and counts, which smartcoll._vectored takes from
      // the arrays it checked and keeps alive.
      .def("list_call", [](Communicator& c, const std::string& collective, const std::vector<uintptr_t>& ins,
                           const std::vector<uintptr_t>& outs, const std::vector<size_t>& counts,
                           const std::string& dtype, const std::string& op, const std::string& algo, int root,
                           const std::string& codec, const std::vector<size_t>& out_counts) {
        std::vector<void*> o(outs.size());
        std::vector<const void*> i(ins.size());
        std::transform(outs.begin(), outs.end(), o.begin(), [](uintptr_t a) { return reinterpret_cast<void*>(a); });
        std::transform(ins.begin(), ins.end(), i.begin(), [](uintptr_t a) { return reinterpret_cast<void*>(a); });
        const DataType dt = parse_dtype(dtype);
        if (collective == "allreduce")
          return c.allreduce(o, counts, dt, parse_op(op), parse_algorithm(algo, Collective::allreduce),
                             parse_codec(codec));
        if (collective == "broadcast") return c.broadcast(o, counts, dt, root, parse_algorithm(algo, Collective::broadcast));
        if (collective == "reduce_scatter")
          return c.reduce_scatter(i, o, counts, dt, parse_op(op), parse_algorithm(algo, Collective::reduce_scatter),
                                  parse_codec(codec));
        if (collective == "allgather") return c.allgather(i, o, counts, dt, parse_algorithm(algo, Collective::allgather));
        if (collective == "alltoallv") return c.alltoallv(i, counts, o, out_counts, dt);
        throw nb::value_error(("no list form of '" + collective + "'").c_str());
      }, "collective"_a, "ins"_a, "outs"_a, "counts"_a, "dtype"_a, "op"_a, "algo"_a, "root"_a, "codec"_a,
         "out_counts"_a = std::vector<size_t>{})
      .def("alltoallv", [](Communicator& c, InArray in, Array out, const std::vector<size_t>& sendcounts,
                           const std::vector<size_t>& sdispls, const std::vector<size_t>& recvcounts,
                           const std::vector<size_t>& rdispls) {
        Buffer i = buffer(in), o = buffer(out);
        return c.alltoallv(i.data, sendcounts, sdispls, o.data, recvcounts, rdispls, i.dtype);
      })
      // One-sided operations (smartcoll._onesided checks the arrays and keeps them alive).
      .def("register_region", [](Communicator& c, Array buf) {
        Buffer b = buffer(buf);
        return c.register_region(b.data, b.count * dtype_size(b.dtype), b.dtype);
      })
      .def("allocate_region", [](Communicator& c, size_t bytes, const std::string& dtype) {
        AllocatedRegion r = c.allocate_region(bytes, parse_dtype(dtype));
        // The array keeps the mapping: it outlives the region's registration, never the memory.
        auto* keep = new std::shared_ptr<void>(std::move(r.memory));
        nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<std::shared_ptr<void>*>(p); });
        return nb::make_tuple(r.id, nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(r.data, {r.bytes}, owner));
      })
      .def("deregister_region", [](Communicator& c, uint64_t id) {
        nb::gil_scoped_release release;
        c.deregister_region(id);
      })
      .def("one_sided", [](Communicator& c, const std::string& kind, int rank, uint64_t id, uint64_t bytes,
                           const std::string& dtype, Offsets offsets, Offsets sizes,
                           const std::vector<uintptr_t>& addrs, const std::vector<size_t>& lens,
                           const std::string& op, const std::string& codec) {
        if (offsets.shape(0) != sizes.shape(0) || addrs.size() != lens.size())
          throw nb::value_error("one offset per size and one length per local address");
        const RemoteRegion region{rank, id, bytes, parse_dtype(dtype)};
        std::vector<RemotePiece> pieces(offsets.shape(0));
        for (size_t i = 0; i < pieces.size(); ++i) pieces[i] = {offsets(i), sizes(i)};
        std::vector<LocalPiece> local(addrs.size());
        for (size_t i = 0; i < local.size(); ++i) local[i] = {reinterpret_cast<void*>(addrs[i]), lens[i]};
        const std::optional<Codec> wire = parse_codec(codec);
        const ReduceOp rop = parse_op(op);
        nb::gil_scoped_release release;  // the first call to a peer connects to it
        if (kind == "getv") return c.getv(region, pieces, local, wire);
        if (kind == "putv") return c.putv(local, region, pieces, wire);
        return c.accumulatev(local, region, pieces, rop, wire);
      })
      .def("close", [](Communicator& c) {
        nb::gil_scoped_release release;
        c.close();
      })
      .def("abort", [](Communicator& c, const std::string& reason) {
        nb::gil_scoped_release release;
        c.abort(reason);
      }, "reason"_a);
}
