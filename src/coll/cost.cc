#include "coll/cost.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "coll/algorithms.h"
#include "core/json.h"
#include "core/siphash.h"
#include "smartcoll/codec.h"

namespace smartcoll::coll {

namespace {

// The profile's numeric fields, for parsing and writing them in one place. `optional` ones keep the built-in
// value when absent; `zero_ok` ones may be 0 (meaning "not measured" or "unlimited", see Profile).
struct Field {
  std::string_view name;
  double Profile::*member;
  bool optional, zero_ok;
};
constexpr Field kFields[] = {
    {"alpha_s", &Profile::alpha_s, false, false},
    {"link_Bps", &Profile::link_Bps, false, false},
    {"link_efficiency", &Profile::link_efficiency, true, false},
    {"reduce_Bps", &Profile::reduce_Bps, false, false},
    {"cores", &Profile::cores, true, false},
    {"mem_Bps", &Profile::mem_Bps, false, false},
    {"copy_Bps", &Profile::copy_Bps, false, false},
    {"switch_Bps", &Profile::switch_Bps, true, true},
    {"switch_link_Bps", &Profile::switch_link_Bps, true, true},
    {"flops", &Profile::flops, false, false},
    {"update_s_per_byte", &Profile::update_s_per_byte, false, false},
    {"wire_cpu_s_per_byte", &Profile::wire_cpu_s_per_byte, true, true},
};
constexpr std::string_view kFormat = "smartcoll-model-profile/1";
// Free-form fields a profile may carry (calibrate records how it measured); the model ignores them.
constexpr std::string_view kInformational[] = {"format", "measured", "notes"};

std::string number(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

class ProfileReader {
 public:
  explicit ProfileReader(const std::string& origin) : origin_(origin) {}

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw InvalidArgument("model profile " + origin_ + (field.empty() ? "" : ": field '" + field + "'") + ": " + what);
  }
  double positive(const std::string& field, const json::Value& v, bool zero_ok) const {
    if (v.kind != json::Value::Kind::number)
      fail(field, "expected a number, got " + std::string(v.kind_name()));
    if (!(v.number > 0 || (zero_ok && v.number == 0)) || v.number > 1e30)
      fail(field, "expected a " + std::string(zero_ok ? "non-negative" : "positive") + " number, got " +
                      number(v.number));
    return v.number;
  }
  const std::map<std::string, json::Value>& object(const std::string& field, const json::Value& v) const {
    if (v.kind != json::Value::Kind::object) fail(field, "expected an object, got " + std::string(v.kind_name()));
    return v.object;
  }

 private:
  const std::string& origin_;
};

bool known_algorithm(std::string_view name) {
  for (int c = 0; c < kCollectives; ++c)
    for (const AlgorithmInfo& info : algorithms(static_cast<Collective>(c)))
      if (algorithm_name(info.algo) == name) return true;
  return false;
}

// Bytes of the caller's buffers read and written, per byte of Query::bytes.
double memory_traffic(Collective c, int n) {
  switch (c) {
    case Collective::allreduce: return 2;
    case Collective::reduce_scatter:
    case Collective::allgather: return n + 1.0;
    case Collective::alltoall:
    case Collective::alltoallv: return 2.0 * n;
    case Collective::broadcast:
    case Collective::reduce: return 1;
    case Collective::barrier: return 0;
  }
  return 0;
}

}  // namespace

Profile Profile::builtin() {
  Profile p;
  p.alpha_s = 50e-6;
  p.link_Bps = 125e6;  // 1 Gbit/s
  p.link_efficiency = 0.94;  // TCP's goodput on a 1500-byte MTU
  p.reduce_Bps = 4e9;
  p.cores = 1;
  p.mem_Bps = 10e9;
  p.copy_Bps = 5e9;
  p.flops = 50e9;
  p.update_s_per_byte = 5.0 / p.mem_Bps;  // SGD with momentum: about 5 bytes of traffic per parameter byte
  for (const char* name : {"fp16", "bf16", "bfp16", "mxint8", "mxfp8_e4m3", "mxfp8_e5m2"})
    p.codecs[name] = {8e9, 8e9};
  // Per-algorithm steps and efficiencies chosen so that the model's picks agree with auto's size rules (which
  // come from measurements, BENCHMARKS.md) in most calls: a pipelined ring or chain step costs more than one
  // exchange; the same-host path pays all-to-all control rounds; exchanges that wait for their partner and Bruck's
  // final rotation reach about half the link.
  p.alpha_algo = {{"ring", 200e-6}, {"chain", 500e-6}, {"cma", 3e-3}, {"rhd", 50e-6}, {"rd", 20e-6},
                  {"bruck", 20e-6}, {"tree", 20e-6}, {"direct", 50e-6}, {"shm", 2e-6}};
  p.efficiency_algo = {{"rhd", 0.5}, {"rd", 0.5}, {"bruck", 0.5}};
  // The aggregation switch: a round trip through it per call, and 1408-byte payloads in 1456-byte datagrams
  // (0.91-0.98 of TCP's goodput where measured, BENCHMARKS.md). Its summing rate stays unmeasured (0), so a
  // profile's cheapest() never picks it; auto without a profile compares it with the ring (table.cc).
  p.alpha_algo["switch"] = 300e-6;
  p.efficiency_algo["switch"] = 0.9;
  return p;
}

Profile Profile::parse(std::string_view text, const std::string& origin) {
  const ProfileReader r(origin);
  json::Value doc;
  try {
    doc = json::parse(text);
  } catch (const InvalidArgument& e) {
    r.fail("", e.what());
  }
  Profile p = builtin();  // the optional fields' values; the maps are the file's alone
  p.codecs.clear();
  p.alpha_algo.clear();
  p.efficiency_algo.clear();
  p.origin = origin;
  const auto& top = r.object("", doc);
  std::string known;
  for (const Field& f : kFields) {
    known += (known.empty() ? "" : ", ") + std::string(f.name);
    const auto it = top.find(std::string(f.name));
    if (it == top.end()) {
      if (!f.optional) r.fail(std::string(f.name), "missing (smartcoll model calibrate writes every field)");
      continue;
    }
    p.*f.member = r.positive(it->first, it->second, f.zero_ok);
  }
  for (const auto& [name, value] : top) {
    if (name == "alpha_algo" || name == "efficiency_algo") {
      for (const auto& [algo, v] : r.object(name, value)) {
        const std::string field = name + "." + algo;
        if (!known_algorithm(algo)) r.fail(field, "not an algorithm of the table (smartcoll info lists them)");
        (name == "alpha_algo" ? p.alpha_algo : p.efficiency_algo)[algo] = r.positive(field, v, false);
      }
    } else if (name == "codecs") {
      for (const auto& [codec, v] : r.object(name, value)) {
        const std::string field = name + "." + codec;
        std::string canonical;
        try {
          canonical = Codec::parse(codec).name();
        } catch (const InvalidArgument& e) {
          r.fail(field, e.what());
        }
        const auto& rates = r.object(field, v);
        CodecRates c;
        for (auto [key, member] : {std::pair{"encode_Bps", &CodecRates::encode_Bps}, {"decode_Bps", &CodecRates::decode_Bps}}) {
          const auto it = rates.find(key);
          if (it == rates.end()) r.fail(field + "." + key, "missing");
          c.*member = r.positive(field + "." + key, it->second, false);
        }
        p.codecs[canonical] = c;
      }
    } else if (name == "format") {
      if (value.kind != json::Value::Kind::string || value.string != kFormat)
        r.fail(name, "expected \"" + std::string(kFormat) + "\"");
    } else if (std::find(std::begin(kInformational), std::end(kInformational), name) == std::end(kInformational) &&
               std::none_of(std::begin(kFields), std::end(kFields), [&](const Field& f) { return f.name == name; })) {
      r.fail(name, "unknown field; the fields are " + known +
                          ", alpha_algo, efficiency_algo, codecs (and format, measured, notes)");
    }
  }
  return p;
}

Profile Profile::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidArgument("model profile " + path + ": cannot be read (smartcoll model calibrate writes one)");
  std::ostringstream text;
  text << in.rdbuf();
  return parse(text.str(), path);
}

std::string Profile::to_json() const {
  std::string s = "{\n  \"format\": " + json::quote(kFormat);
  for (const Field& f : kFields) s += ",\n  " + json::quote(f.name) + ": " + number(this->*f.member);
  for (const auto& [name, values] : {std::pair{"alpha_algo", &alpha_algo}, {"efficiency_algo", &efficiency_algo}}) {
    s += ",\n  " + json::quote(name) + ": {";
    for (auto it = values->begin(); it != values->end(); ++it)
      s += (it == values->begin() ? "" : ", ") + json::quote(it->first) + ": " + number(it->second);
    s += "}";
  }
  s += ",\n  \"codecs\": {";
  for (auto it = codecs.begin(); it != codecs.end(); ++it)
    s += std::string(it == codecs.begin() ? "\n" : ",\n") + "    " + json::quote(it->first) +
         ": {\"encode_Bps\": " + number(it->second.encode_Bps) + ", \"decode_Bps\": " +
         number(it->second.decode_Bps) + "}";
  return s + (codecs.empty() ? "" : "\n  ") + "}\n}\n";
}

uint64_t Profile::digest() const {
  const std::string text = to_json();
  SipHasher h(SipKey{});
  h.update(text.data(), text.size());
  return h.finish();
}

namespace {
double per_algorithm(const std::map<std::string, double>& values, Algorithm a, double otherwise) {
  const auto it = values.find(std::string(algorithm_name(a)));
  return it == values.end() ? otherwise : it->second;
}
// The profile's rates for a compressing codec; throws InvalidArgument saying how to measure them when absent.
const CodecRates& rates(const Profile& p, std::string_view codec_name) {
  const std::string name = Codec::parse(codec_name).name();
  const auto it = p.codecs.find(name);
  if (it == p.codecs.end())
    throw InvalidArgument("model profile " + p.origin + " has no rates for codec '" + name +
                          "' (smartcoll model calibrate --codecs " + name + " measures them)");
  return it->second;
}
}  // namespace

double Profile::alpha(Algorithm a) const { return per_algorithm(alpha_algo, a, alpha_s); }
double Profile::efficiency(Algorithm a) const { return per_algorithm(efficiency_algo, a, link_efficiency); }

Cost predict(Collective c, Algorithm a, const Query& q, const Profile& p, std::string_view codec_name) {
  const AlgorithmInfo& info = find(c, a);
  Cost k;
  if (q.n <= 1) return k;
  const int n = q.n;
  const double bytes = static_cast<double>(q.bytes), cores = std::max(1.0, p.cores);
  const Codec codec = Codec::parse(codec_name.empty() ? "identity" : codec_name);
  const bool compressed = codec.kind() != CodecKind::identity;
  // Float32 bytes this rank sends on its busiest link; the codec shrinks them by its ratio on the wire.
  const double moved = info.wire(n) * bytes;
  k.steps = info.steps(n);
  k.wire_bytes = moved / (compressed ? codec.ratio() : 1.0);
  k.reduce = info.reduced(n) * bytes / (p.reduce_Bps * cores);
  k.mem = memory_traffic(c, n) * bytes / p.mem_Bps;
  if (compressed) {
    // Every hop decodes what it receives and encodes what it sends.
    const CodecRates& r = rates(p, codec_name);
    k.codec = moved * (1 / r.encode_Bps + 1 / r.decode_Bps) / cores;
  }
  const double link = p.link_Bps * p.efficiency(a);
  // This rank's own share of the bytes on the busiest link (several ranks of a host share its link) and of the
  // bytes reduced, for Cost::cpu.
  double rank_share = 1, rank_reduced = info.reduced(n) * bytes;
  double copy_alone = 0;  // the share of the host's copies that nothing overlaps (added to the bound)
  double local_latency = 0;  // steps on the host's own connections, where the algorithm's alpha is the switch's
  switch (a) {
    case Algorithm::cma:
    case Algorithm::shm:  // `wire` counts the bytes read from peers' buffers or from the segment
      k.copy = moved / p.copy_Bps;
      k.wire_bytes = 0;
      break;
    case Algorithm::hier: {
      const double h = std::max(1, q.per_host), hosts = std::max(1, q.hosts);
      if (c == Collective::allreduce) {
        // Reduce-scatter and allgather among the h ranks of a host, then a ring across the H hosts: the host's
        // link carries 2(H-1)/H of the vector whatever h is, and the phases follow one another.
        k.steps = 2 * (h - 1) + 2 * (hosts - 1);
        k.copy = 2 * (h - 1) / h * bytes / p.copy_Bps;
        k.wire_bytes = 2 * (hosts - 1) / hosts * bytes;
        rank_share = 1 / h;
        // In P pieces, the first piece's reduce-scatter and the last one's allgather alone are not overlapped.
        copy_alone = 1.0 / allreduce_hier_pieces(q.bytes);
      } else if (c == Collective::broadcast || c == Collective::reduce) {
        // Two pipelined chains, across hosts and on each host: the vector crosses each host's link once, and its
        // segments flow on through the host's own connections as they arrive (the copies overlap the link).
        k.steps = (hosts - 1) + (h - 1);
        k.copy = bytes / p.copy_Bps;
        k.wire_bytes = bytes;
        rank_share = 1 / h;
      } else {
        // allgather, reduce_scatter (bytes: one rank's block): a ring across hosts, and one ring on the host per
        // host, each moving h - 1 blocks through the host's own connections. The host's link carries the h(H-1)
        // blocks its ranks exchange with the other hosts.
        k.steps = (hosts - 1) + hosts * (h - 1);
        k.copy = hosts * (h - 1) * bytes / p.copy_Bps;
        k.wire_bytes = h * (hosts - 1) * bytes;
        rank_share = 1 / h;
        copy_alone = 1;
      }
      k.link = k.wire_bytes / link;
      break;
    }
    case Algorithm::switch_: {
      // Each rank sends its vector and receives the sum; each of the k switches takes n/k of the vector's
      // chunks from every rank and sums them. A switch that is a host has one link for all n ranks: n S / k each
      // way (the DPDK paper's 2MN/B against 2M/B in the network).
      // reduce_scatter: every rank sends all n blocks; allgather: the switch forwards, it sums nothing.
      // Several ranks per host share the host's link: it carries each one's vector (switch_hier sends one per host).
      const double switches = std::max(1, q.switches), vector = c == Collective::allreduce ? bytes : n * bytes,
                   sharing = q.hosts > 1 ? std::max(1, q.per_host) : 1;
      k.wire_bytes *= sharing;
      rank_share = 1 / sharing;
      k.link = sharing * moved / link;
      if (p.switch_link_Bps > 0) k.link = std::max(k.link, n * vector / (switches * p.switch_link_Bps));
      if (p.switch_Bps > 0 && c != Collective::allgather) k.reduce = n * vector / (switches * p.switch_Bps);
      break;
    }
    case Algorithm::switch_hier: {
      // The hierarchical ring's phases on each host around a round trip through the switches (their alpha and
      // efficiency) of each rank's 1/h of the vector among the ranks with its local index: the host's link carries
      // the vector once each way, and a switch that is a host takes it from each of the H hosts. Each rank encodes
      // and decodes its 1/h alone.
      const double h = std::max(1, q.per_host), hosts = std::max(1, q.hosts), switches = std::max(1, q.switches);
      local_latency = 2 * (h - 1) * p.alpha(Algorithm::hier);
      k.copy = 2 * (h - 1) / h * bytes / p.copy_Bps;
      k.codec /= h;
      k.reduce = (h - 1) / h * bytes / (p.reduce_Bps * cores);  // the host's reduce-scatter
      rank_reduced = (h - 1) / h * bytes;
      rank_share = 1 / h;
      k.link = k.wire_bytes / (p.link_Bps * p.efficiency(Algorithm::switch_));
      if (p.switch_link_Bps > 0) k.link = std::max(k.link, hosts * bytes / (switches * p.switch_link_Bps));
      if (p.switch_Bps > 0) k.reduce = std::max(k.reduce, hosts * bytes / (switches * p.switch_Bps));
      copy_alone = 1;
      break;
    }
    default: k.link = k.wire_bytes / link;
  }
  // This rank's own reductions (none where the switch sums), codec work, copies and share of the wire, at one
  // core's rates.
  k.cpu = rank_reduced / p.reduce_Bps + k.codec * cores + k.copy + rank_share * k.wire_bytes * p.wire_cpu_s_per_byte;
  k.latency = k.steps * p.alpha(a == Algorithm::switch_hier ? Algorithm::switch_ : a) + local_latency;
  const std::pair<double, const char*> terms[] = {
      {k.link, "link"}, {k.reduce, "reduce"}, {k.codec, "codec"}, {k.mem, "mem"}, {(1 - copy_alone) * k.copy, "copy"}};
  const auto* top = std::max_element(std::begin(terms), std::end(terms),
                                     [](const auto& x, const auto& y) { return x.first < y.first; });
  k.bound = top->first > 0 ? top->second : "latency";
  k.total = k.latency + top->first + copy_alone * k.copy;
  return k;
}

namespace {

// What the busiest daemon of an offloaded call does (nicd/server.cc, Job::execute).
struct DaemonWork {
  double L = 1, hosts = 1;
  double read = 0, written = 0, combined = 0;  // bytes of its ranks' memory, and bytes it adds up
  double chunk_share = 1;                      // of a rank's vector, what one chunk or part of the window holds
  Collective among = Collective::allreduce;    // the daemons' own call among the hosts
  Query among_hosts{};
};

DaemonWork daemon_work(Collective c, const Query& q) {
  DaemonWork w;
  const double n = q.n, B = std::max(1.0, static_cast<double>(q.bytes)), chunk = kOffloadChunkBytes;
  w.hosts = std::clamp(q.hosts, 1, std::max(1, q.n));
  w.L = q.per_host > 0 ? q.per_host : std::ceil(n / w.hosts);
  const double L = w.L, H = w.hosts, part = 64 * 1024;  // a part is 64 KiB at least (kMinPartBytes)
  // The reductions are one allreduce of the whole vector among the daemons; allgather and alltoall carry a host's
  // parts for every pair of ranks.
  double inter_bytes = B;
  w.read = w.written = L * B;
  w.chunk_share = std::min(1.0, chunk / B);
  w.among = c;
  switch (c) {
    case Collective::allreduce: w.combined = (L - 1) * B; break;
    case Collective::reduce: w.written = B, w.combined = (L - 1) * B, w.among = Collective::allreduce; break;
    case Collective::reduce_scatter:
      w.read = L * n * B, w.combined = (L - 1) * n * B, inter_bytes = n * B, w.among = Collective::allreduce;
      w.chunk_share = std::min(1.0, chunk / (n * B));
      break;
    case Collective::broadcast: w.read = B; break;
    case Collective::allgather:
      w.written = L * n * B, inter_bytes = L * B;
      w.chunk_share = std::min(1.0, std::max(part, chunk / ((H + 1) * L)) / B);
      break;
    case Collective::alltoall:
    case Collective::alltoallv:
      w.read = w.written = L * n * B, inter_bytes = L * L * B;
      w.chunk_share = std::min(1.0, std::max(part, chunk / (2 * H * L * L)) / B);
      break;
    case Collective::barrier: w.read = w.written = inter_bytes = 0; break;
  }
  w.among_hosts = q;
  w.among_hosts.n = static_cast<int>(H), w.among_hosts.hosts = static_cast<int>(H), w.among_hosts.per_host = 1;
  w.among_hosts.bytes = static_cast<size_t>(inter_bytes), w.among_hosts.cma_usable = false;
  w.among_hosts.switch_set = false;
  return w;
}

}  // namespace

std::string offloaded_unsupported(Collective c, const Query& q, std::string_view codec, Algorithm inter) {
  if (!codec.empty() && codec != "identity" && c != Collective::allreduce)
    return "engine=nicd compresses only allreduce between hosts";
  DaemonWork w = daemon_work(c, q);
  if (q.n <= 1 || w.hosts <= 1 || inter == Algorithm::automatic) return "";
  w.among_hosts.compressed = q.compressed || (!codec.empty() && codec != "identity");
  return find(w.among, inter).unsupported(w.among_hosts);
}

Cost predict_offloaded(Collective c, const Query& q, const Profile& p, std::string_view codec, Algorithm inter) {
  if (q.n <= 1) return {};  // a rank alone has no daemon: its calls complete on it
  const DaemonWork w = daemon_work(c, q);
  Cost k;
  if (w.hosts > 1) {
    // auto: what the daemons pick by the size rules (they get no model_profile), for one chunk or part.
    Query chunk = w.among_hosts;
    chunk.bytes = std::min<size_t>(chunk.bytes, static_cast<size_t>(kOffloadChunkBytes));
    const Algorithm a = inter == Algorithm::automatic ? choose(w.among, chunk, Algorithm::automatic, 262144) : inter;
    k = predict(w.among, a, w.among_hosts, p, codec);
  }
  const double local = (w.read + w.written) / p.copy_Bps + w.combined / p.reduce_Bps;
  const double pipeline = k.total - k.latency;  // what the chunks' copies overlap
  // With one host nothing overlaps the copies. Across hosts the first chunk's copies and the last one's trip
  // between the hosts (or the reverse, whichever side is the shorter) overlap nothing.
  const double fill = w.hosts > 1 ? w.chunk_share * std::min(pipeline, local) : 0;
  k.latency += 2 * p.alpha_s;
  k.total = k.latency + std::max(pipeline, local) + fill;
  if (local > pipeline) k.bound = "daemon";
  k.copy = local;
  k.cpu = (k.cpu + local) / w.L;
  return k;
}

Algorithm cheapest(Collective c, const Query& q, const Profile& p, size_t small_bytes) {
  Algorithm best = algorithms(c).front().algo;
  double best_time = -1;
  for (const AlgorithmInfo& info : algorithms(c)) {
    // The switch only for allreduce, once measured: its reduce_scatter and allgather measured slower than the ring
    // (BENCHMARKS.md), as their datagrams carry every block (reduce_scatter) or wait for every rank (allgather).
    const bool switch_ok = c == Collective::allreduce && p.switch_Bps > 0;
    const bool allowed = info.automatic == AlgorithmInfo::Auto::always ||
                         (info.automatic == AlgorithmInfo::Auto::small_only && call_bytes(c, q) <= small_bytes);
    const bool through_switch = info.algo == Algorithm::switch_ || info.algo == Algorithm::switch_hier;
    if (!allowed || !info.unsupported(q).empty() || (through_switch && !switch_ok)) continue;
    const double t = predict(c, info.algo, q, p).total;
    if (best_time < 0 || t < best_time) best = info.algo, best_time = t;
  }
  return best;
}

double shared_window(double compute, double allreduce, double cpu) {
  if (cpu <= 0) return std::max(compute, allreduce);
  // Alone, the all-reduce lasts `span` and needs `need` of the cores all along. Needing at most half, it gets all
  // it needs beside the compute (which gives way by `cpu` in all); otherwise the scheduler gives each half.
  const double span = std::max(allreduce, cpu), need = cpu / span;
  if (need <= 0.5 || !std::isfinite(span + compute)) return std::max(compute + cpu, allreduce);
  // Each ends at twice its work if the other runs all along; the first to end hands its half back.
  if (compute <= cpu) return 2 * compute + span - compute * span / cpu;
  return compute + cpu;
}

IterationCost iteration(const std::vector<double>& elems, double batch, int n, Algorithm algo, std::string_view codec,
                        const Profile& p, double compute_scale, bool error_feedback, const MeasuredCompute* measured,
                        const CoreSharing& sharing, bool offloaded) {
  IterationCost it;
  const size_t L = elems.size();
  if (L == 0) return it;
  if (sharing.cores < 0 || sharing.engine_cores < 0 || (sharing.engine_cores > 0 && sharing.engine_cores >= sharing.cores))
    throw InvalidArgument("iteration: a rank's cores (" + number(sharing.cores) + ") must exceed the engine's (" +
                          number(sharing.engine_cores) + "), both non-negative");
  // The compute's cores: all the rank's, or those the engine leaves (measured phases already ran on them).
  const double aside = sharing.engine_cores > 0 && !measured ? sharing.cores / (sharing.cores - sharing.engine_cores) : 1;
  const bool contended = sharing.cores > 0 && sharing.engine_cores == 0;
  double all = 0;
  for (const double e : elems) all += e;
  std::vector<double> F(L + 1), B(L + 1), U(L + 1), AR(L + 1), CPU(L + 1);  // 1-based, as in the paper
  for (size_t l = 1; l <= L; ++l) {
    const double e = elems[l - 1];
    if (measured) {
      const double share = all > 0 ? e / all : 1.0 / static_cast<double>(L);
      F[l] = measured->fwd * share, B[l] = measured->bwd * share, U[l] = measured->update * share;
    } else {
      F[l] = aside * compute_scale * 2 * e * batch / p.flops;
      B[l] = aside * compute_scale * 4 * e * batch / p.flops;
      U[l] = aside * p.update_s_per_byte * 4 * e;
    }
    const bool compressed = codec != "" && codec != "identity";
    const Query q{n, static_cast<size_t>(4 * e), compressed, false, false, offloaded ? n : 1, offloaded ? 1 : 0};
    const Cost k = offloaded ? predict_offloaded(Collective::allreduce, q, p, codec, algo)
                             : predict(Collective::allreduce, algo, q, p, codec);
    // On cores set aside the all-reduce takes at least its CPU time over them; on shared ones it stretches the
    // compute instead.
    AR[l] = sharing.engine_cores > 0 ? std::max(k.total, k.cpu / sharing.engine_cores) : k.total;
    CPU[l] = contended ? k.cpu / sharing.cores : 0;
    if (!measured && error_feedback && compressed && n > 1) {
      const CodecRates& r = rates(p, codec);
      const double ef = compute_scale * 4 * e * (1 / r.encode_Bps + 1 / r.decode_Bps + kFeedbackPasses / p.mem_Bps);
      B[l] += ef;
      it.feedback += ef;
    }
    it.fwd += F[l], it.bwd += B[l], it.update += U[l], it.allreduce += AR[l];
    it.layer_allreduce.push_back(AR[l]);
  }
  // A window where compute overlaps layer l's all-reduce (CPU[l] is 0 unless they share the cores).
  auto window = [&](double compute, size_t l) {
    const double w = shared_window(compute, AR[l], CPU[l]);
    it.contention += w - std::max(compute, AR[l]);
    return w;
  };
  double t = it.fwd + B[L];
  if (L == 1) {
    t += AR[1] + U[1];
  } else {
    t += window(B[L - 1], L);
    for (size_t l = L - 1; l >= 2; --l) t += window(U[l + 1] + B[l - 1], l);
    t += window(U[2], 1) + U[1];
  }
  it.total = t;
  it.exposed = t - it.fwd - it.bwd - it.update;
  return it;
}

}  // namespace smartcoll::coll
