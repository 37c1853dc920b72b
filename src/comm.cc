#include "smartcoll/comm.h"

#include <pthread.h>
#include <sched.h>

#include <cstring>
#include <iomanip>
#include <sstream>
#include <map>
#include <vector>

#include "algorithms.h"
#include "cma.h"
#include "smartcoll/reduce.h"
#include "transport.h"

namespace smartcoll {

std::string_view collective_name(Collective c) {
  constexpr std::string_view names[] = {"allreduce", "reduce_scatter", "allgather", "broadcast",
                                        "reduce",    "alltoall",       "barrier"};
  return names[static_cast<int>(c)];
}

std::string_view algorithm_name(Algorithm a) {
  constexpr std::string_view names[] = {"auto", "ring", "rhd", "chain", "direct", "local", "cma", "tree"};
  return names[static_cast<int>(a)];
}

Algorithm parse_algorithm(std::string_view name) {
  if (name == "auto") return Algorithm::automatic;
  if (name == "ring") return Algorithm::ring;
  if (name == "rhd") return Algorithm::rhd;
  if (name == "cma") return Algorithm::cma;
  throw InvalidArgument("unknown allreduce algorithm '" + std::string(name) + "'; choose auto, ring, rhd or cma");
}

bool Request::test() {
  std::lock_guard lock(mu_);
  return done_;
}

bool Request::wait(std::optional<std::chrono::duration<double>> timeout) {
  std::unique_lock lock(mu_);
  if (timeout) {
    if (!cv_.wait_for(lock, *timeout, [&] { return done_; })) return false;
  } else {
    cv_.wait(lock, [&] { return done_; });
  }
  if (!error_.empty()) throw CommError(error_);
  return true;
}

void Request::finish(std::string error) {
  {
    std::lock_guard lock(mu_);
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

namespace {

// Range checks for numeric knobs, so that a typo fails at start-up with the knob's name rather than as an
// overflow deep inside (a timeout of 1e300 s, a negative socket buffer).
void check_ranges(const Options& o) {
  struct Range {
    std::string_view knob;
    double lo, hi;
  };
  constexpr Range ranges[] = {{"segment_size", 64, 1 << 30},  {"streams", 1, 64},
                              {"timeout", 0.001, 1e6},         {"connect_timeout", 0.001, 1e6},
                              {"sockbuf", 0, 1 << 30},         {"rhd_max_bytes", 0, 1e15},
                              {"engine_cpu", -1, 1 << 20}};
  auto show = [](double x) {
    std::ostringstream s;
    s << std::setprecision(15) << x;
    return s.str();
  };
  for (const Range& r : ranges) {
    const double v = o.real(r.knob);
    if (v < r.lo || v > r.hi)
      throw InvalidArgument("option '" + std::string(r.knob) + "' (" + knob_env_name(r.knob) + ") = " +
                            o.str(r.knob) + " is outside [" + show(r.lo) + ", " + show(r.hi) + "]");
  }
}

}  // namespace

Communicator::Communicator(int rank, int size, std::shared_ptr<Store> store, const Options& options,
                           const std::string& route_hint)
    : rank_(rank), size_(size), options_(options), store_(std::move(store)) {
  if (size < 1) throw InvalidArgument("world size must be at least 1, got " + std::to_string(size));
  if (rank < 0 || rank >= size)
    throw InvalidArgument("rank " + std::to_string(rank) + " is outside the world of size " + std::to_string(size));
  check_ranges(options_);
  Codec::parse(options_.str("codec"));  // a bad SMARTCOLL_CODEC fails here, not at the first collective
  transport_ = std::make_unique<Transport>(rank, size, *store_, options_, route_hint);
  if (size > 1) agree_on_settings();
  if (size > 1 && options_.str("cma") == "auto") cma_ = std::make_unique<cma::Local>(*transport_);
  cma_usable_ = cma_ && cma_->usable();
  cma_reason_ = size == 1 ? "" : !cma_ ? "disabled (cma=off)" : cma_->why_not();
  engine_ = std::thread([this] { engine_loop(); });
  if (int cpu = static_cast<int>(options_.integer("engine_cpu")); cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (pthread_setaffinity_np(engine_.native_handle(), sizeof set, &set) != 0) {
      close();
      throw InvalidArgument("cannot pin the engine thread to CPU " + std::to_string(cpu) +
                            " (SMARTCOLL_ENGINE_CPU): no such CPU or not allowed for this process");
    }
  }
}

Communicator::~Communicator() { close(); }

void Communicator::agree_on_settings() {
  // Knobs that change what goes on the wire outside of a call's descriptor: a rank that skips the argument
  // check or the same-host probe, cuts segments differently (they are striped over streams by index) or picks
  // another algorithm would misframe every later message.
  constexpr std::string_view kMustMatch[] = {"check", "cma", "streams", "segment_size", "algo", "rhd_max_bytes"};
  std::string mine;
  for (std::string_view k : kMustMatch) mine += std::string(k) + "=" + options_.str(k) + " ";
  mine.resize(160, ' ');
  std::vector<std::string> all(size_, std::string(160, ' '));
  all[rank_] = mine;
  std::vector<Transport::Op> ops;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    ops.push_back({p, true, mine.data(), mine.size()});
    ops.push_back({p, false, all[p].data(), all[p].size()});
  }
  transport_->context = "start-up settings check on rank " + std::to_string(rank_);
  transport_->run(ops);
  std::string msg;
  for (int p = 0; p < size_; ++p) {
    if (all[p] == mine) continue;
    auto trim = [](std::string s) { return s.substr(0, s.find_last_not_of(' ') + 1); };
    msg += " rank " + std::to_string(p) + " has " + trim(all[p]) + ";";
    if (msg.find("rank " + std::to_string(rank_) + " has") == std::string::npos)
      msg = " rank " + std::to_string(rank_) + " has " + trim(mine) + ";" + msg;
  }
  if (!msg.empty()) {
    transport_->abort();
    throw CommError("ranks disagree on settings that must match on every rank:" + msg +
                    " set these SMARTCOLL_* variables (or init() options) alike everywhere");
  }
}

std::string Communicator::cma_unusable_reason() const { return cma_reason_; }

void Communicator::close() {
  std::lock_guard closing(close_mu_);  // two threads closing at once must not both join the engine
  {
    std::lock_guard lock(mu_);
    if (stopping_ && !engine_.joinable()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (engine_.joinable()) engine_.join();
  cma_.reset();
  transport_.reset();
  store_.reset();
}

void Communicator::engine_loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and every submitted task has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

std::shared_ptr<Request> Communicator::submit(const Call& call, std::function<void()> body) {
  auto req = std::make_shared<Request>();
  auto task = [this, call, body = std::move(body), req] {
    const uint64_t seq = seq_++;
    if (!failure_.empty()) {
      req->finish(std::string(collective_name(call.coll)) + ": the communicator failed earlier (" + failure_ +
                  "); create a new one");
      return;
    }
    try {
      transport_->context = std::string(collective_name(call.coll)) + " #" + std::to_string(seq) + " on rank " +
                            std::to_string(rank_);
      if (size_ > 1 && (options_.integer("check") != 0 || call.coll == Collective::barrier)) check_agreement(call);
      body();
      req->finish("");
    } catch (const std::exception& e) {
      failure_ = e.what();
      transport_->abort();
      req->finish(e.what());
    }
  };
  {
    std::lock_guard lock(mu_);
    if (stopping_) throw InvalidArgument("the communicator is closed");
    queue_.push_back(std::move(task));
  }
  cv_.notify_all();
  return req;
}

namespace {

struct Descriptor {
  uint32_t magic;
  uint8_t coll, dtype, op, algo;
  uint8_t codec, codec_mant, codec_exp, codec_owner;
  uint32_t codec_block;
  int64_t root;
  uint64_t count;
  bool operator==(const Descriptor&) const = default;
};
static_assert(sizeof(Descriptor) == 32, "the descriptor is a wire format: no padding");

std::string describe(const Descriptor& d) {
  auto coll = static_cast<Collective>(d.coll);
  std::string s = std::string(collective_name(coll)) + "(count=" + std::to_string(d.count) + ", " +
                  std::string(dtype_name(static_cast<DataType>(d.dtype)));
  if (coll == Collective::allreduce || coll == Collective::reduce_scatter || coll == Collective::reduce)
    s += ", op=" + std::string(op_name(static_cast<ReduceOp>(d.op)));
  if (coll == Collective::allreduce) s += ", algo=" + std::string(algorithm_name(static_cast<Algorithm>(d.algo)));
  if (const auto kind = static_cast<CodecKind>(d.codec); kind != CodecKind::identity) {
    std::string name = "kind " + std::to_string(d.codec);
    for (const std::string& preset : Codec::names())
      if (Codec::parse(preset).kind() == kind) name = preset;
    if (kind == CodecKind::bfp)
      name = "bfp:block=" + std::to_string(d.codec_block) + ",mant=" + std::to_string(d.codec_mant) +
             ",exp=" + std::to_string(d.codec_exp);
    s += ", codec=" + name;
    if (coll == Collective::allreduce || coll == Collective::reduce_scatter)
      s += std::string(", codec_mode=") + (d.codec_owner ? "owner" : "hop");
  }
  if (coll == Collective::broadcast || coll == Collective::reduce) s += ", root=" + std::to_string(d.root);
  return s + ")";
}

}  // namespace

void Communicator::check_agreement(const Call& call) {
  // Every rank sends its call's descriptor to every other rank, so each one can name all disagreeing ranks;
  // this is also what makes barrier a barrier.
  const Codec& c = call.codec;
  const bool compressed = c.kind() != CodecKind::identity;
  Descriptor mine{0x53434432,
                  static_cast<uint8_t>(call.coll),
                  static_cast<uint8_t>(call.dt),
                  static_cast<uint8_t>(call.op),
                  static_cast<uint8_t>(call.algo),
                  static_cast<uint8_t>(c.kind()),
                  static_cast<uint8_t>(compressed ? c.mant_bits() : 0),
                  static_cast<uint8_t>(compressed ? c.exp_bits() : 0),
                  // codec_mode changes allreduce and reduce_scatter, not allgather
                  static_cast<uint8_t>(compressed && call.coll != Collective::allgather &&
                                       options_.str("codec_mode") == "owner"),
                  static_cast<uint32_t>(compressed ? c.block() : 0),
                  call.root,
                  call.count};
  std::vector<Descriptor> all(size_);
  all[rank_] = mine;
  std::vector<Transport::Op> ops;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    ops.push_back({p, true, reinterpret_cast<char*>(&mine), sizeof mine});
    ops.push_back({p, false, reinterpret_cast<char*>(&all[p]), sizeof(Descriptor)});
  }
  transport_->run(ops);
  bool agree = true;
  for (const auto& d : all) agree &= d == mine;
  if (agree) return;
  std::map<std::string, std::string> groups;  // call -> ranks that made it
  for (int p = 0; p < size_; ++p) {
    std::string what = all[p].magic == mine.magic ? describe(all[p]) : "a corrupted or foreign message";
    groups[what] += (groups[what].empty() ? "" : ",") + std::to_string(p);
  }
  std::string msg = "ranks disagree on the collective call:";
  for (const auto& [what, ranks] : groups) msg += " rank(s) " + ranks + " called " + what + ";";
  throw CommError(msg + " every rank must make the same calls in the same order with the same arguments and "
                        "settings (count, dtype, op, root, algo, codec, codec_mode)");
}

Algorithm Communicator::choose_allreduce(size_t count, DataType dt, Algorithm requested, bool compressed) const {
  if (size_ == 1) return Algorithm::local;
  if (requested == Algorithm::automatic) requested = parse_algorithm(options_.str("algo"));
  if (compressed) {
    if (requested == Algorithm::rhd)
      throw InvalidArgument("allreduce: algo 'rhd' does not support codecs; use 'ring' or 'auto'");
    return Algorithm::ring;
  }
  const bool cma_usable = cma_usable_;
  if (requested == Algorithm::cma && !cma_usable)
    throw InvalidArgument("allreduce: algo 'cma' is not usable here: " + cma_unusable_reason());
  if (requested != Algorithm::automatic) return requested;
  const auto small = static_cast<size_t>(options_.integer("rhd_max_bytes"));
  if (count * dtype_size(dt) <= small) return Algorithm::rhd;
  return cma_usable ? Algorithm::cma : Algorithm::ring;
}

namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw InvalidArgument(message);
}

void check_op(DataType dt, ReduceOp op) {
  require(op != ReduceOp::avg || is_floating(dt),
          "op 'avg' needs a floating-point dtype, got " + std::string(dtype_name(dt)) + "; use 'sum' and divide");
}

void check_root(int root, int size) {
  require(root >= 0 && root < size,
          "root " + std::to_string(root) + " is outside the world of size " + std::to_string(size));
}

}  // namespace

Codec Communicator::choose_codec(DataType dt, std::optional<ReduceOp> op,
                                 const std::optional<Codec>& requested) const {
  const bool applies = dt == DataType::f32 && (!op || *op == ReduceOp::sum || *op == ReduceOp::avg);
  if (!requested) return applies ? Codec::parse(options_.str("codec")) : Codec();
  if (!applies && requested->kind() != CodecKind::identity) {
    if (!op)
      throw InvalidArgument("codec '" + requested->name() + "' needs float32 data (got " +
                            std::string(dtype_name(dt)) + ")");
    throw InvalidArgument("codec '" + requested->name() + "' needs float32 data reduced with sum or avg (got " +
                          std::string(dtype_name(dt)) + ", " + std::string(op_name(*op)) + ")");
  }
  return *requested;
}

// The codec of collectives that never compress (Params keeps a pointer to it, so it must outlive the call).
const Codec kRaw;

algo::Params Communicator::params(const Codec& codec) const {
  return {static_cast<size_t>(options_.integer("segment_size")), &codec, options_.str("codec_mode") == "owner"};
}

std::shared_ptr<Request> Communicator::allreduce(const void* in, void* out, size_t count, DataType dt, ReduceOp op,
                                                 Algorithm algo, std::optional<Codec> codec) {
  check_op(dt, op);
  const Codec wire = choose_codec(dt, op, codec);
  const Algorithm chosen = choose_allreduce(count, dt, algo, wire.kind() != CodecKind::identity);
  return submit({Collective::allreduce, dt, op, chosen, -1, count, wire}, [=, this] {
    const algo::Params params = this->params(wire);
    auto src = static_cast<const char*>(in);
    auto dst = static_cast<char*>(out);
    if (chosen == Algorithm::local) {
      if (dst != src) std::memcpy(dst, src, count * dtype_size(dt));
    } else if (chosen == Algorithm::rhd) {
      algo::allreduce_rhd(*transport_, src, dst, count, dt, op);
    } else if (chosen == Algorithm::cma) {
      cma_->allreduce(*transport_, src, dst, count, dt, op);
    } else {
      algo::allreduce_ring(*transport_, src, dst, count, dt, op, params);
    }
  });
}

std::shared_ptr<Request> Communicator::reduce_scatter(const void* in, void* out, size_t recvcount, DataType dt,
                                                      ReduceOp op, std::optional<Codec> codec) {
  check_op(dt, op);
  const Codec wire = choose_codec(dt, op, codec);
  return submit({Collective::reduce_scatter, dt, op, Algorithm::ring, -1, recvcount, wire}, [=, this] {
    const algo::Params params = this->params(wire);
    if (size_ == 1)
      std::memmove(out, in, recvcount * dtype_size(dt));
    else
      algo::reduce_scatter_ring(*transport_, static_cast<const char*>(in), static_cast<char*>(out), recvcount, dt,
                                op, params);
  });
}

std::shared_ptr<Request> Communicator::allgather(const void* in, void* out, size_t sendcount, DataType dt,
                                                 std::optional<Codec> codec) {
  const Codec wire = choose_codec(dt, std::nullopt, codec);
  return submit({Collective::allgather, dt, ReduceOp::sum, Algorithm::ring, -1, sendcount, wire}, [=, this] {
    const algo::Params params = this->params(wire);
    if (size_ == 1)
      std::memmove(out, in, sendcount * dtype_size(dt));
    else
      algo::allgather_ring(*transport_, static_cast<const char*>(in), static_cast<char*>(out), sendcount, dt,
                           params);
  });
}

std::shared_ptr<Request> Communicator::broadcast(void* buf, size_t count, DataType dt, int root) {
  check_root(root, size_);
  // Small messages are latency-bound: a binomial tree takes log2(n) steps where the chain takes n-1.
  const bool small = count * dtype_size(dt) <= static_cast<size_t>(options_.integer("rhd_max_bytes"));
  const Algorithm chosen = small ? Algorithm::tree : Algorithm::chain;
  return submit({Collective::broadcast, dt, ReduceOp::sum, chosen, root, count, {}}, [=, this] {
    auto* data = static_cast<char*>(buf);
    if (size_ == 1) return;
    if (chosen == Algorithm::tree)
      algo::broadcast_tree(*transport_, data, count, dt, root);
    else
      algo::broadcast_chain(*transport_, data, count, dt, root, this->params(kRaw));
  });
}

std::shared_ptr<Request> Communicator::reduce(const void* in, void* out, size_t count, DataType dt, ReduceOp op,
                                              int root) {
  check_op(dt, op);
  check_root(root, size_);
  require(rank_ != root || out != nullptr || count == 0, "reduce: the root needs an output buffer");
  return submit({Collective::reduce, dt, op, Algorithm::chain, root, count, {}}, [=, this] {
    const algo::Params params = this->params(kRaw);
    if (size_ == 1 && count > 0)
      std::memmove(out, in, count * dtype_size(dt));
    else if (size_ > 1)
      algo::reduce_chain(*transport_, static_cast<const char*>(in), static_cast<char*>(out), count, dt, op, root,
                         params);
  });
}

std::shared_ptr<Request> Communicator::alltoall(const void* in, void* out, size_t count, DataType dt) {
  require(in != out || count == 0 || size_ == 1, "alltoall cannot run in place: pass a separate output buffer");
  return submit({Collective::alltoall, dt, ReduceOp::sum, Algorithm::direct, -1, count, {}}, [=, this] {
    if (size_ == 1)
      std::memmove(out, in, count * dtype_size(dt));
    else
      algo::alltoall_direct(*transport_, static_cast<const char*>(in), static_cast<char*>(out), count, dt);
  });
}

std::shared_ptr<Request> Communicator::barrier() {
  return submit({Collective::barrier, DataType::u8, ReduceOp::sum, Algorithm::direct, -1, 0, {}}, [] {});
}

}  // namespace smartcoll
