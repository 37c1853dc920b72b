#include "model_bindings.h"

#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "coll/cost.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace smartcoll {

namespace {

using coll::Profile;

coll::Query query(int n, size_t bytes, const std::string& codec, int hosts,
                  int per_host, int switches, bool cma, bool switch_set) {
  return coll::Query{n,        bytes, !codec.empty() && codec != "identity", cma, switch_set, hosts, per_host,
                     switches};
}

nb::dict predict(const std::string& collective, const std::string& algo, int n, size_t bytes,
                 const std::string& profile, const std::string& codec, int hosts, int per_host, int switches, bool cma,
                 bool switch_set, const std::string& engine) {
  const Collective c = coll::parse_collective(collective);
  const bool offloaded = engine == "nicd";
  if (!offloaded && engine != "inprocess")
    throw nb::value_error(("engine '" + engine + "': inprocess or nicd").c_str());
  // Through the daemons the algorithm is that of their own call among the hosts (an allreduce for reductions).
  const Collective among = offloaded && (c == Collective::reduce || c == Collective::reduce_scatter)
                               ? Collective::allreduce : c;
  Algorithm a;
  try {
    a = parse_algorithm(algo, among);
  } catch (const InvalidArgument& e) {
    if (among == c) throw;
    throw InvalidArgument(std::string("engine=nicd runs ") + std::string(collective_name(c)) + " as an allreduce "
                          "among the hosts' daemons: " + e.what());
  }
  const coll::Query q = query(n, bytes, codec, hosts, per_host, switches, cma, switch_set);
  const Profile p = Profile::parse(profile, "(given)");
  std::string unsupported = offloaded ? coll::offloaded_unsupported(c, q, codec, a) : "";
  if (!offloaded && a == Algorithm::automatic) a = coll::cheapest(c, q, p);  // the model's own pick
  if (!offloaded && unsupported.empty()) unsupported = coll::find(c, a).unsupported(q);
  // In process the terms come even for a call the algorithm cannot run (the table's arithmetic); through the
  // daemons such a call has none.
  const coll::Cost k = !offloaded                ? coll::predict(c, a, q, p, codec)
                       : unsupported.empty()     ? coll::predict_offloaded(c, q, p, codec, a)
                                                 : coll::Cost{};
  nb::dict d;
  d["unsupported"] = unsupported;
  d["total"] = k.total, d["latency"] = k.latency, d["link"] = k.link, d["reduce"] = k.reduce;
  d["codec"] = k.codec, d["mem"] = k.mem, d["copy"] = k.copy, d["steps"] = k.steps;
  d["wire_bytes"] = k.wire_bytes, d["cpu"] = k.cpu, d["bound"] = k.bound;
  return d;
}

}  // namespace

void bind_model(nb::module_& m) {
  m.def("model_builtin_profile", [] { return Profile::builtin().to_json(); },
        "The built-in profile (1 Gbit/s Ethernet, ordinary hosts) as canonical JSON.");
  m.def("model_parse_profile", [](const std::string& text, const std::string& origin) {
    return Profile::parse(text, origin).to_json();
  }, "text"_a, "origin"_a, "Checks a profile (ValueError naming origin and field) and returns its canonical JSON.");
  m.def("model_load_profile", [](const std::string& path) { return Profile::load(path).to_json(); }, "path"_a,
        "Reads and checks a profile file; returns its canonical JSON.");
  m.def("model_profile_digest", [](const std::string& text) { return Profile::parse(text, "(given)").digest(); },
        "text"_a, "The digest ranks compare for the model_profile knob.");
  m.def("model_algorithms", [](const std::string& collective) {
    std::vector<std::string> names;
    for (const coll::AlgorithmInfo& info : coll::algorithms(coll::parse_collective(collective)))
      names.emplace_back(algorithm_name(info.algo));
    return names;
  }, "collective"_a, "The collective's algorithms, in the table's order.");
  m.def("model_predict", &predict, "collective"_a, "algo"_a, "n"_a, "bytes"_a, "profile"_a, "codec"_a = "",
        "hosts"_a = 1, "per_host"_a = 0, "switches"_a = 1, "cma"_a = false, "switch"_a = false,
        "engine"_a = "inprocess",
        "Predicted seconds of one call and its terms (latency, link, reduce, codec, mem, copy), the bound, and why "
        "the algorithm cannot run the call ('' if it can). engine='nicd': through the offload daemons, one per "
        "host (algo: the daemons' own call among the hosts, auto: the cheapest).");
  m.def("model_choose", [](const std::string& collective, int n, size_t bytes, const std::string& profile,
                           const std::string& codec, int hosts, int per_host, int switches, bool cma, bool switch_set,
                           size_t small_bytes) {
    const Collective c = coll::parse_collective(collective);
    const coll::Query q = query(n, bytes, codec, hosts, per_host, switches, cma, switch_set);
    if (profile.empty()) return std::string(algorithm_name(coll::choose(c, q, Algorithm::automatic, small_bytes)));
    const Profile p = Profile::parse(profile, "(given)");
    return std::string(algorithm_name(coll::choose(c, q, Algorithm::automatic, small_bytes, &p)));
  }, "collective"_a, "n"_a, "bytes"_a, "profile"_a, "codec"_a = "", "hosts"_a = 1, "per_host"_a = 0,
     "switches"_a = 1, "cma"_a = false, "switch"_a = false, "small_bytes"_a = 262144,
     "What auto picks for the call: with a profile (its JSON) the model's cheapest, with '' the size rules "
     "(small_bytes: the rhd_max_bytes knob).");
  m.def("model_iteration", [](const std::vector<double>& elems, double batch, int n, const std::string& algo,
                              const std::string& codec, const std::string& profile, double compute_scale,
                              bool error_feedback, std::optional<std::vector<double>> measured, double cores,
                              double engine_cores, bool offloaded) {
    std::optional<coll::MeasuredCompute> phases;
    if (measured) {
      if (measured->size() != 3) throw nb::value_error("measured: (forward, backward, update) seconds");
      phases = coll::MeasuredCompute{(*measured)[0], (*measured)[1], (*measured)[2]};
    }
    const coll::IterationCost it =
        coll::iteration(elems, batch, n, parse_algorithm(algo, Collective::allreduce), codec,
                        Profile::parse(profile, "(given)"), compute_scale, error_feedback, phases ? &*phases : nullptr,
                        coll::CoreSharing{cores, engine_cores}, offloaded);
    nb::dict d;
    d["fwd"] = it.fwd, d["bwd"] = it.bwd, d["update"] = it.update, d["allreduce"] = it.allreduce;
    d["feedback"] = it.feedback;
    d["exposed"] = it.exposed, d["contention"] = it.contention, d["total"] = it.total;
    d["layer_allreduce"] = it.layer_allreduce;
    return d;
  }, "elems"_a, "batch"_a, "n"_a, "algo"_a, "codec"_a, "profile"_a, "compute_scale"_a = 1.0,
     "error_feedback"_a = false, "measured"_a = nb::none(), "cores"_a = 0.0, "engine_cores"_a = 0.0,
     "offloaded"_a = false,
     "The FPGA smart-NIC paper's training-iteration model (seconds per phase) for layers of `elems` parameters; "
     "error_feedback: the DDP hook's error feedback on the backward pass (with a compressing codec); measured: "
     "(forward, backward, update) seconds per iteration as measured, in place of the GEMM and update model; "
     "cores, engine_cores: a rank's cores and those set aside for its engine (coll::CoreSharing; 0: the paper's "
     "model, the all-reduce takes nothing from the compute); offloaded: each all-reduce through an offload daemon "
     "per host (engine=nicd).");
}

}  // namespace smartcoll
