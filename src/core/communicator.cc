#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <pthread.h>
#include <unistd.h>
#include <map>
#include <mutex>
#include <random>
#include <sstream>

#include "coll/segmented.h"
#include "coll/table.h"
#include "core/agreement.h"
#include "core/checks.h"
#include "core/config.h"
#include "core/engine.h"
#include "core/log.h"
#include "core/onesided.h"
#include "core/spin.h"
#include "nicd/client.h"
#include "store/cleanup.h"
#include "smartcoll/comm.h"
#include "switch/client.h"
#include "transport/cma.h"
#include "transport/tcp.h"

namespace smartcoll {

std::string_view collective_name(Collective c) {
  constexpr std::string_view names[] = {"allreduce", "reduce_scatter", "allgather", "broadcast",
                                        "reduce",    "alltoall",       "barrier",   "alltoallv"};
  return names[static_cast<int>(c)];
}

std::string call_name(uint8_t coll, uint64_t seq, int rank) {
  return std::string(collective_name(static_cast<Collective>(coll))) + " #" + std::to_string(seq) + " on rank " +
         std::to_string(rank);
}

std::string_view algorithm_name(Algorithm a) {
  constexpr std::string_view names[] = {"auto", "ring", "rhd",  "chain", "direct",       "local",
                                        "cma",  "tree", "rd",   "bruck", "dissemination", "hier", "switch", "pairwise", "shm",
                                        "switch_hier"};
  return names[static_cast<int>(a)];
}

Algorithm parse_algorithm(std::string_view name, Collective collective) {
  if (name == "auto") return Algorithm::automatic;
  for (const coll::AlgorithmInfo& info : coll::algorithms(collective))
    if (algorithm_name(info.algo) == name) return info.algo;
  std::string names = "auto";
  for (const coll::AlgorithmInfo& info : coll::algorithms(collective))
    names += ", " + std::string(algorithm_name(info.algo));
  throw InvalidArgument("unknown " + std::string(collective_name(collective)) + " algorithm '" + std::string(name) +
                        "'; choose " + names);
}

// The last calls' descriptors, so that a rank can say what it called when another rank reports a disagreement.
struct CallHistory {
  std::mutex mu;
  std::array<std::pair<uint64_t, Descriptor>, 256> calls{};
  void add(uint64_t seq, const Descriptor& d) {
    std::lock_guard lock(mu);
    calls[seq % calls.size()] = {seq, d};
  }
  bool find(uint64_t seq, Descriptor& d) {
    std::lock_guard lock(mu);
    const auto& [s, desc] = calls[seq % calls.size()];
    if (s != seq || desc.magic != kDescriptorMagic) return false;
    d = desc;
    return true;
  }
};

namespace {

// Counts the forks this process came out of (as a child), so that the per-call check costs a load, not a syscall.
std::atomic<uint64_t> g_forks{0};
const bool g_fork_counter = [] {
  pthread_atfork(nullptr, nullptr, [] { g_forks.fetch_add(1, std::memory_order_relaxed); });
  return true;
}();

bool forked_since(uint64_t forks) { return g_forks.load(std::memory_order_relaxed) != forks; }

// A short identifier of `text` with no spaces (hosts travel in space-separated start-up records).
std::string fingerprint(const std::string& text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) h = (h ^ c) * 0x100000001b3ull;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

std::string random_token() {
  std::random_device entropy;  // getrandom(2) on Linux
  const uint64_t bits = (static_cast<uint64_t>(entropy()) << 32) | entropy();
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(bits));
  return text;
}

// The job this rank belongs to (see the job_id knob): set by the launcher, or the scheduler's, or drawn by rank 0
// (then `drawn` is set: rank 0 deletes the key at close; every rank read it before it published its settings).
std::string resolve_job_id(const std::string& set, Store& store, int rank, std::chrono::milliseconds limit,
                           bool& drawn) {
  if (!set.empty()) return set;
  const char* run = std::getenv("TORCHELASTIC_RUN_ID");  // torchrun's --rdzv-id; "none" when not given
  if (run && *run && std::string_view(run) != "none") return std::string("torchelastic-") + run;
  if (const char* job = std::getenv("SLURM_JOB_ID"); job && *job) {
    const char* step = std::getenv("SLURM_STEP_ID");
    return std::string("slurm-") + job + "." + (step ? step : "0");
  }
  if (rank == 0) {
    std::string id = random_token();
    store.set("smartcoll/job", id);
    drawn = true;
    return id;
  }
  try {
    return store.get("smartcoll/job", limit);
  } catch (const StoreTimeout&) {  // any other failure says what went wrong itself
    throw CommError("rank " + std::to_string(rank) + " timed out waiting for rank 0 to publish the job id: is rank 0 "
                    "running, with the same MASTER_ADDR and MASTER_PORT? (SMARTCOLL_CONNECT_TIMEOUT)");
  }
}

}  // namespace

Communicator::Communicator(int rank, int size, std::shared_ptr<Store> store, const Options& options,
                           const std::string& route_hint)
    : rank_(rank), size_(size), options_(options), store_(std::move(store)),
      history_(std::make_unique<CallHistory>()), pid_(static_cast<int>(::getpid())),
      forks_(g_forks.load()) {
  if (size < 1) throw InvalidArgument("world size must be at least 1, got " + std::to_string(size));
  if (rank < 0 || rank >= size)
    throw InvalidArgument("rank " + std::to_string(rank) + " is outside the world of size " + std::to_string(size));
  config_ = std::make_unique<Config>(Config::from(options_));
  log::set_level(config_->log);
  static std::once_flag unknown_once;  // once per process, not per communicator
  std::call_once(unknown_once, [rank] {
    for (const std::string& line : unknown_variables()) SC_LOG(LogLevel::warn, rank, "start") << line;
  });
  const auto limit = std::chrono::milliseconds(static_cast<int64_t>(config_->connect_timeout * 1000));
  // Every key this communicator writes lives under its job's id, and every hello carries it: ranks of another
  // job that reach the same store or ports are never joined.
  bool drawn = false;
  config_->job_id = resolve_job_id(config_->job_id, *store_, rank, limit, drawn);
  const std::string store_locator = store_->locator();  // engine=nicd: where the daemons meet
  if (drawn) drawn_in_ = store_;
  store_ = std::make_shared<PrefixStore>(std::move(store_), "job/" + config_->job_id + "/");
  // Each process claims its rank with a fresh nonce; rank 0's start-up verdict names the claim it accepted for
  // every rank, and addresses are published per claim. A second process claiming the same rank (two jobs on one
  // MASTER_PORT without job ids) fails here by name, and no rank ever connects to it.
  const std::string claim = random_token();
  auto tcp = std::make_unique<TcpTransport>(rank, size, store_, *config_, route_hint, claim);
  TcpTransport& transport = *tcp;
  transport_ = std::move(tcp);
  hosts_.assign(static_cast<size_t>(size), 0);
  if (size > 1) {
    const auto [claims, hosts] = agree_on_settings(claim);
    hosts_ = hosts;
    if (claims[static_cast<size_t>(rank)] != claim)
      throw CommError("another process also claims rank " + std::to_string(rank) + " of job '" + config_->job_id +
                      "': either this rank was started again into a job that is running (start the whole job "
                      "again), or two jobs share one rendezvous (MASTER_ADDR:MASTER_PORT; give each job its own "
                      "port, or start it with smartcoll run or torchrun, which set a job id: SMARTCOLL_JOB_ID)");
    transport.accept_claims(claims);
  }
  // Ranks that span hosts (by the layout learned at start-up, or as the launcher says) are spared the all-pairs
  // probe of the same-host path.
  host_shape_ = coll::host_layout_shape(hosts_);
  hosts_interleaved_ = coll::hosts_interleaved(hosts_);
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  const int host_count = host_shape_.first;
  const bool spans_hosts = host_count > 1 || (local && std::atoi(local) > 0 && std::atoi(local) < size);
  if (size > 1 && config_->nicd) {
    // A daemon tells its jobs apart by id, and one job may hold several communicators at once (torch's subgroups
    // share the launcher's job id): each is named after the claims its ranks made at start-up, which are its own.
    std::string claims;
    for (const std::string& c : transport.claims()) claims += c + " ";
    char digest[17];
    std::snprintf(digest, sizeof digest, "%016llx", static_cast<unsigned long long>(job_fingerprint(claims)));
    // A waiting caller reads the daemon's answers itself while it polls; the daemon's threads need a core
    // beside this host's ranks for that to pay (spin=auto).
    const Spinner spin(config_->spin, config_->spin_us, core_per_rank(hosts_, rank, 1));
    nicd_ = std::make_shared<nicd::Client>(config_->nicd_socket, nicd::Hello{rank, size, config_->timeout,
        config_->connect_timeout, config_->job_id + "." + digest, store_locator, route_hint,
        Config::must_match(options_), std::vector<int32_t>(hosts_.begin(), hosts_.end())}, spin);
  }
  if (size > 1 && config_->cma && !spans_hosts && !nicd_)
    cma_ = std::make_unique<cma::Local>(*transport_, config_->cma_shm, config_->spin_us, config_->shm_bytes);
  cma_usable_ = cma_ && cma_->usable();
  if (size == 1)
    cma_reason_ = "";
  else if (!config_->cma)
    cma_reason_ = "disabled (cma=off)";
  else if (nicd_)
    cma_reason_ = "engine=nicd (the daemon reads the buffers)";
  else if (host_count > 1)
    cma_reason_ = "ranks span " + std::to_string(host_count) + " hosts";
  else if (spans_hosts)
    cma_reason_ = "ranks span hosts (LOCAL_WORLD_SIZE=" + std::string(local) + " of " + std::to_string(size) + ")";
  else
    cma_reason_ = cma_->why_not();
  if (size > 1 && !config_->switches.empty()) join_switches();
  config_->core_per_rank = core_per_rank(hosts_, rank);
  engine_ = std::make_shared<Engine>(*transport_, *config_, rank);
  engine_->explain_failure = [this](const std::string& error) {
    switch_alive_->store(false);  // no more keepalives: the switches free the job's slots after their job timeout
    return explain_disagreement(error, *store_, rank_, size_,
                                [&](uint64_t seq, Descriptor& d) { return history_->find(seq, d); },
                                std::chrono::milliseconds(2000));
  };
  engine_->on_disagreement = [this](const Disagreement& d) {
    Descriptor mine{};
    if (history_->find(d.seq, mine)) publish_call(*store_, d.seq, rank_, &mine);
    // The peer's call of the same number, unless its message came from another call (its own report says).
    if (call_of(d.theirs, d.seq) == d.seq) publish_call(*store_, d.seq, d.peer, &d.theirs);
  };
  engine_->start();
  SC_LOG(LogLevel::info, rank_, "") << "up: " << size_ << " ranks, " << engine_->workers() << " engine workers, "
                                    << config_->streams << " streams, cma " << (cma_usable_ ? "usable" : cma_reason_);
}

Communicator::~Communicator() { close(); }

StartUpVerdict Communicator::agree_on_settings(const std::string& claim) {
  // Knobs that change what goes on the wire outside a call's descriptor: a rank that skips the header, cuts
  // segments differently (they are striped over streams by index) or picks another algorithm would misframe
  // every later message. Rank 0 compares everyone's (n reads of the store, not n^2 messages) and publishes the
  // verdict that every rank reads: "ok", the claim it read of each rank and each rank's host (numbered in order
  // of first appearance), or what is wrong. Each rank publishes "<claim> <host> <settings>".
  const std::string mine = config_->start_up_settings(options_);
  std::string error;
  const std::string host = fingerprint(config_->host.empty() ? cma::host_identity(error) : config_->host);
  const auto limit = std::chrono::milliseconds(static_cast<int64_t>(config_->connect_timeout * 1000));
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%g", config_->connect_timeout);
  const std::string waiting = "rank " + std::to_string(rank_) + " timed out after " + seconds + " s waiting for ";
  const std::string hint = ": are they running, with the same WORLD_SIZE and MASTER_ADDR? (SMARTCOLL_CONNECT_TIMEOUT)";
  store_->set("settings/" + std::to_string(rank_), claim + " " + host + " " + mine);
  if (rank_ == 0) {
    std::map<std::string, std::string> groups;
    std::map<std::string, int> host_index{{host, 0}};
    std::string missing, claims = claim, hosts = " 0";
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (int p = 1; p < size_; ++p) {
      try {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                                                 std::chrono::steady_clock::now());
        std::istringstream theirs(
            store_->get("settings/" + std::to_string(p), std::max(left, std::chrono::milliseconds(1))));
        std::string their_claim, their_host, what;
        theirs >> their_claim >> their_host >> std::ws;
        std::getline(theirs, what);
        groups[what] += (groups[what].empty() ? "" : ",") + std::to_string(p);
        claims += " " + their_claim;
        const int next = static_cast<int>(host_index.size());
        hosts += " " + std::to_string(host_index.emplace(their_host, next).first->second);
      } catch (const StoreTimeout&) {
        missing += (missing.empty() ? "" : ",") + std::to_string(p);
      }
    }
    groups[mine] = groups[mine].empty() ? "0" : "0," + groups[mine];
    std::string verdict = "ok " + claims + hosts;
    if (!missing.empty()) {
      verdict = waiting + "rank(s) " + missing + " of " + std::to_string(size_) + " to start" + hint;
    } else if (groups.size() > 1) {
      verdict = "ranks disagree on settings that must match on every rank:";
      for (const auto& [what, ranks] : groups) verdict += " rank(s) " + ranks + " have " + what + ";";
      verdict += " set these SMARTCOLL_* variables (or init() options) alike everywhere";
    }
    store_->set("settings/verdict", verdict);
  }
  std::string verdict;
  try {
    // Rank 0 gives its verdict within `limit` of starting; a little more lets it arrive.
    verdict = store_->get("settings/verdict", limit + std::chrono::seconds(2));
  } catch (const StoreTimeout&) {
    throw CommError(waiting + "rank 0's start-up check" + hint);
  }
  return parse_verdict(verdict, size_);
}

void Communicator::abort(const std::string& reason) {
  if (forked_since(forks_)) return;  // a forked child's copy: the parent owns the job
  std::lock_guard closing(close_mu_);
  const std::string why = "rank " + std::to_string(rank_) + " aborted: " + reason;
  if (nicd_) nicd_->abort(why);
  // The engine first: its reason becomes the error of every call; leaving the same-host path then ends this
  // rank's own wait there and fails peers waiting on this rank at once. Those peers go on once the engine has
  // left the reason in the store (their error carries it), which may wait on the store's other requests.
  if (engine_) engine_->abort(why);
  if (cma_) cma_->leave();
  std::shared_lock rma(rma_mu_);
  if (rma_) rma_->abort(why);
}

void Communicator::join_switches() {
  sw::ClientSettings settings;
  settings.switches = sw::parse_switches(config_->switches);
  settings.window = config_->switch_slots;
  settings.packet = config_->switch_packet;
  settings.full_auth = config_->switch_full_auth;
  settings.offload = config_->switch_offload;
  settings.codec = config_->codec;
  settings.switch_timeout = config_->switch_timeout;
  settings.keepalive = config_->switch_keepalive;
  settings.job_alive = switch_alive_;
  settings.timeout = config_->timeout;
  const auto limit = std::chrono::milliseconds(static_cast<int64_t>(config_->connect_timeout * 1000));
  // The job's secret for the switches: fresh for every communicator, drawn by rank 0, shared through the
  // job's store (which the store's own secret protects, where one is set).
  std::string hex;
  if (rank_ == 0) {
    hex = random_token() + random_token();
    store_->set("switch/key", hex);
  } else {
    hex = store_->get("switch/key", limit);
  }
  if (hex.size() != 32 || hex.find_first_not_of("0123456789abcdef") != std::string::npos)
    throw CommError("the switch secret in the rendezvous store is not 32 hex digits: a corrupted store");
  uint8_t bytes[16];
  for (int i = 0; i < 16; ++i) bytes[i] = static_cast<uint8_t>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
  const SipKey key = SipKey::from_bytes(bytes);
  switch_ = std::make_unique<sw::Path>();
  switch_->fallback_ring = config_->switch_fallback_ring;
  switch_->retry = config_->switch_retry;
  switch_->store = store_;
  // Probe e joins job "<job id>/<e>": a fresh job with the same secret, whatever the old one left at the switch.
  switch_->make_client = [rank = rank_, size = size_, settings, key, id = config_->job_id](uint64_t epoch) {
    return std::make_unique<sw::Client>(rank, size, settings, key,
                                        sw::job_tag(key, epoch ? id + "/" + std::to_string(epoch) : id));
  };
  switch_->make_column = [settings, key, id = config_->job_id](uint64_t epoch, int index,
                                                                 const std::vector<int>& members, int pos) {
    const std::string tag = id + "/column" + std::to_string(index) + (epoch ? "/" + std::to_string(epoch) : "");
    sw::ClientSettings column = settings;
    column.ranks = members;
    return std::make_unique<sw::Client>(pos, static_cast<int>(members.size()), column, key, sw::job_tag(key, tag));
  };
  switch_->client = switch_->make_client(0);
  std::string why;
  try {
    switch_->client->join();
  } catch (const CommError& e) {
    why = e.what();
  }
  // Every rank must take the same path: rank 0 gathers who could join and publishes one verdict.
  store_->set("switch/joined/" + std::to_string(rank_), why.empty() ? "ok" : why);
  if (rank_ == 0) {
    std::string verdict = "ok";
    for (int p = 0; p < size_ && verdict == "ok"; ++p) {
      const std::string got = store_->get("switch/joined/" + std::to_string(p), limit);
      if (got != "ok") verdict = "rank " + std::to_string(p) + ": " + got;
    }
    store_->set("switch/verdict", verdict);
  }
  const std::string verdict = store_->get("switch/verdict", limit + std::chrono::seconds(2));
  if (verdict == "ok") return;
  if (!switch_->fallback_ring)
    throw CommError("cannot use the aggregation switch: " + verdict + " (switch_fallback=fail)");
  switch_->fall_back();
  SC_LOG(rank_ == 0 ? LogLevel::warn : LogLevel::info, rank_, "")
      << "cannot use the aggregation switch (" << verdict << "); allreduce with algo=switch uses the ring "
      << "(switch_fallback=ring)";
}

std::string Communicator::cma_unusable_reason() const { return closed_ ? "the communicator is closed" : cma_reason_; }

std::string Communicator::cma_control() const { return cma_usable_ && cma_ ? cma_->control() : ""; }

void Communicator::close() {
  std::lock_guard closing(close_mu_);  // two threads closing at once must not both stop the engine
  if (closed_) return;
  closed_ = true;
  if (forked_since(forks_)) {
    // A forked child: the engine's threads were not copied, and its locks may be held by threads that do not
    // exist here. Let go without touching any of it; the child's exit closes the sockets.
    new std::shared_ptr<Engine>(std::move(engine_));
    (void)cma_.release();
    (void)switch_.release();
    new std::shared_ptr<nicd::Client>(std::move(nicd_));
    (void)rma_.release();
    (void)transport_.release();
    (void)history_.release();
    return;
  }
  {
    std::lock_guard lock(rma_mu_);  // waits for one-sided calls and deregistrations in progress
    if (rma_) unsafe_regions_ = rma_->close_directory();
    rma_.reset();  // fails its outstanding calls and stops touching the regions
  }
  if (nicd_) nicd_->close();  // waits for its calls, then says bye to the daemon (a waiting caller may hold it)
  nicd_.reset();
  if (engine_) engine_->stop();
  engine_.reset();
  switch_.reset();  // leaves the switches, which free the job's slots
  cma_.reset();
  transport_.reset();
  forget_communicator(*store_, rank_, size_);
  if (drawn_in_) forget(*drawn_in_, "smartcoll/job");
  store_.reset();
  drawn_in_.reset();
}

EngineStats Communicator::engine_stats() const {
  EngineStats s;
  if (engine_) {
    s.workers = engine_->workers();
    s.cpu_seconds = engine_->cpu_seconds();
  }
  if (transport_) {
    s.open_channels = transport_->open_channels();
    s.local_channels = transport_->local_channels();
  }
  if (cma_) s.same_host_calls = cma_->calls();
  s.staged_bytes = staged_bytes_.load(std::memory_order_relaxed);
  if (nicd_) s.driven_answers = nicd_->driven_answers();
  std::shared_lock rma(rma_mu_);
  if (rma_) s.direct_gets = rma_->direct_gets(), s.direct_puts = rma_->direct_puts(),
             s.direct_accumulates = rma_->direct_accumulates();
  return s;
}

Codec Communicator::choose_codec(Collective coll, DataType dt, std::optional<ReduceOp> op,
                                 const std::optional<Codec>& requested) const {
  const bool applies = dt == DataType::f32 && (!op || *op == ReduceOp::sum || *op == ReduceOp::avg);
  // The daemon compresses allreduce alone (nicd::check_supported): the knob leaves its other calls raw, where a
  // codec the caller passes is refused.
  if (!requested) return applies && (!nicd_ || coll == Collective::allreduce) ? config_->codec : Codec();
  if (!applies && requested->kind() != CodecKind::identity) {
    if (!op)
      throw InvalidArgument("codec '" + requested->name() + "' needs float32 data (got " +
                            std::string(dtype_name(dt)) + ")");
    throw InvalidArgument("codec '" + requested->name() + "' needs float32 data reduced with sum or avg (got " +
                          std::string(dtype_name(dt)) + ", " + std::string(op_name(*op)) + ")");
  }
  return *requested;
}

Algorithm Communicator::choose(Collective coll, size_t count, DataType dt, Algorithm requested,
                               bool compressed) const {
  if (size_ == 1) return Algorithm::local;
  if (requested == Algorithm::automatic && coll == Collective::allreduce)
    requested = parse_algorithm(config_->algo, coll);
  return coll::choose(coll, query(count * dtype_size(dt), compressed), requested, config_->rhd_max_bytes,
                      config_->profile.get());
}

coll::Query Communicator::query(size_t bytes, bool compressed) const {
  check_usable();  // before reading what close() frees (the same-host transport)
  const auto [hosts, per_host] = host_shape_;
  const int switches = 1 + static_cast<int>(std::count(config_->switches.begin(), config_->switches.end(), ','));
  return {size_,    bytes,    compressed, cma_usable_, switch_ != nullptr, hosts,
          per_host, switches, cma_usable_ ? cma_->segment_room() : 0, hosts_interleaved_};
}

void Communicator::check_usable() const {
  if (forked_since(forks_))
    throw CommError("this communicator belongs to process " + std::to_string(pid_) + "; process " +
                    std::to_string(::getpid()) + " is a fork() of it and cannot use it: create a new communicator "
                    "in the child (with its own rank and world), or start workers with the 'spawn' method");
  if (closed_) throw InvalidArgument("the communicator is closed");
}

void Communicator::check_buffers(const Call& call, const void* in, const void* out) const {
  // alltoallv's count is the world size, not its buffers' length: its own checks refuse in == out (one buffer)
  // and any input overlapping an output (lists).
  if (!in || !out || call.count == 0 || call.coll == Collective::alltoallv) return;
  const size_t block = call.count * dtype_size(call.dt), n = static_cast<size_t>(size_);
  size_t in_bytes = block, out_bytes = block;
  if (call.coll == Collective::reduce_scatter || call.coll == Collective::alltoall) in_bytes = n * block;
  if (call.coll == Collective::allgather || call.coll == Collective::alltoall) out_bytes = n * block;
  // In place: the same buffer; for reduce_scatter, the output over the input's first block (MPI_IN_PLACE's
  // layout), for allgather the input at the output's start (submit() stages either where an algorithm would
  // overwrite it before reading it).
  if (in == out) return;
  const auto* i = static_cast<const char*>(in);
  const auto* o = static_cast<const char*>(out);
  // In-place allgather (MPI_IN_PLACE, torch's all_gather_into_tensor on a view): the input is this rank's block.
  if (call.coll == Collective::allgather && i == o + static_cast<size_t>(rank_) * block) return;
  require(i + in_bytes <= o || o + out_bytes <= i, [&] {
    return std::string(collective_name(call.coll)) + ": the input and output buffers partly overlap (input " +
           std::to_string(in_bytes) + " bytes, output " + std::to_string(out_bytes) + " bytes, " +
           std::to_string(o > i ? o - i : i - o) + " bytes apart); pass the same buffer to work in place, or "
           "buffers that do not overlap";
  });
}

void Communicator::check_one_poster() {
  const auto me = std::this_thread::get_id();
  if (config_->one_poster && me != poster_) {
    if (auto last = last_posted_.lock(); last && !last->test())
      throw InvalidArgument(
          "collectives posted from two threads at once: another thread's call is still running, and two threads "
          "cannot post in the same order on every rank (same-shaped calls would mix data). Post every call of a "
          "communicator from one thread, wait for the other thread's calls first, or give each thread its own "
          "communicator (or, if the application orders its threads' posts alike on every rank, posting=ordered)");
    poster_ = me;
  }
}

std::shared_ptr<Request> Communicator::submit(const Call& call, const void* in, void* out,
                                              std::shared_ptr<const coll::Views> views) {
  check_usable();
  check_buffers(call, in, out);
  auto req = std::make_shared<Request>();
  req->algo_ = call.algo;
  if (size_ == 1 || (call.count == 0 && call.coll != Collective::barrier)) {
    // Nothing to exchange: the result is the input. A call of no elements still takes its number, so that the
    // calls after it keep the same numbers on every rank.
    const size_t bytes = call.count * dtype_size(call.dt);
    std::lock_guard lock(submit_mu_);
    check_one_poster();
    if (in && out && in != out && bytes) std::memmove(out, in, bytes);
    if (size_ > 1) {  // a world of one has no peer to disagree with or to wait for it
      const Descriptor d = make_descriptor(call.coll, call.dt, call.op, call.algo, call.root, call.count, call.codec,
                                           config_->codec_owner, seq_);
      // Kept for the report of a disagreement: a peer that made this call with elements reports it.
      history_->add(seq_, d);
      if (cma_usable_) cma_->elsewhere(seq_, &d);  // a same-host peer whose count is not 0 must not wait for it
    }
    ++seq_;
    last_posted_ = req;
    req->finish("");
    return req;
  }
  // In place with the input at the output's start, on a rank whose block is elsewhere: the algorithms would write
  // other ranks' blocks over it before sending it (the switch's own call copies it, but the ring lanes it runs
  // after a fallback do not).
  std::shared_ptr<std::vector<char>> staged_input;
  if (call.coll == Collective::allgather && in == out && rank_ != 0 && !views) {
    const auto* from = static_cast<const char*>(in);
    staged_input = std::make_shared<std::vector<char>>(from, from + call.count * dtype_size(call.dt));
    in = staged_input->data();
  }
  if (nicd_) {
    nicd::check_supported(call.coll, call.codec);
    nicd::Post post{0, static_cast<uint8_t>(call.coll), static_cast<uint8_t>(call.dt), static_cast<uint8_t>(call.op),
                    call.root, call.count, reinterpret_cast<uintptr_t>(in), reinterpret_cast<uintptr_t>(out),
                    call.codec.name()};
    if (views) {  // the daemon maps the views' addresses through their tables of pieces, which `views` keeps
      static_assert(sizeof(coll::Piece) == 16 && offsetof(coll::Piece, bytes) == 8, "the tables' layout");
      auto table = [&](const void* at, uint64_t& addr, uint32_t& pieces) {
        // By its start: a view of no bytes (an alltoallv side with nothing to move) contains no address.
        const auto it = std::find_if(views->all.begin(), views->all.end(),
                                     [&](const auto& v) { return v->base() == static_cast<const char*>(at); });
        require(it != views->all.end(), "a list call's buffer is not one of its views");  // submit_list makes them
        const coll::Segmented* v = it->get();
        require(v->pieces().size() <= nicd::kMaxListPieces,
                std::string(collective_name(call.coll)) + ": engine=nicd takes lists of at most " +
                    std::to_string(nicd::kMaxListPieces) + " non-empty buffers per side");
        addr = reinterpret_cast<uintptr_t>(v->pieces().data());
        pieces = static_cast<uint32_t>(v->pieces().size());
      };
      table(in, post.in_table, post.in_pieces);
      table(out, post.out_table, post.out_pieces);
      post.layout = call.layout;
    }
    // What the daemon reads from this rank's memory while it runs the call: the views' tables, alltoallv's blocks.
    struct Kept {
      std::shared_ptr<const coll::Views> views;
      std::vector<uint64_t> blocks;
      std::shared_ptr<std::vector<char>> staged_input;
    };
    auto kept = std::make_shared<Kept>(Kept{views, {}, staged_input});
    if (call.displs) {
      const coll::Displacements& d = *call.displs;
      const uint64_t esize = dtype_size(call.dt);
      for (size_t j = 0; j < static_cast<size_t>(size_); ++j)
        kept->blocks.insert(kept->blocks.end(), {d.sdispls[j] * esize, d.sendcounts[j] * esize,
                                                 d.rdispls[j] * esize, d.recvcounts[j] * esize});
      post.blocks = reinterpret_cast<uintptr_t>(kept->blocks.data());
    }
    std::lock_guard lock(submit_mu_);
    check_one_poster();
    post.seq = seq_++;
    last_posted_ = req = nicd_->post(post, std::move(kept));
    req->algo_ = call.algo;
    return req;
  }
  auto task = std::make_unique<Task>();
  task->rank = rank_;
  task->desc = make_descriptor(call.coll, call.dt, call.op, call.algo, call.root, call.count, call.codec,
                               config_->codec_owner);
  if (call.layout) set_list_layout(task->desc, call.layout);
  // A barrier's messages are its descriptors: it always sends them. List calls follow the knob like every other
  // call: a descriptor that only one side sends would be read as data by the other.
  task->check = config_->check || call.coll == Collective::barrier;
  task->req = req;
  coll::Context cx{rank_, size_, config_->streams, transport_.get(), cma_.get(), switch_.get(),
                   config_->segment_size, config_->codec_owner, engine_->pool(), &hosts_};
  auto spec = std::make_shared<const coll::ReduceSpec>(coll::ReduceSpec{call.dt, call.op, size_, call.codec, views});
  coll::Builder b(*task, cx, std::move(spec));
  char* into = static_cast<char*>(out);
  if (call.coll == Collective::reduce_scatter && in == out && !views && call.algo != Algorithm::shm) {
    // In place, this rank's block is reduced into its output, the input's first block, while that block is still
    // sent (the rings, the switch's fallback lanes) or read by peers (cma): it is reduced into scratch and copied
    // into place once the call is done. shm copies every input into its segment first.
    const size_t bytes = call.count * dtype_size(call.dt);
    into = b.scratch(bytes);
    task->epilogue = [out, into, bytes] { std::memcpy(out, into, bytes); };
  }
  coll::find(call.coll, call.algo).build(b, {static_cast<const char*>(in), into, call.count, call.root, call.displs});
  if (views) {
    coll::resolve(*task, *views);
    task->epilogue = views->after;
  }
  if (staged_input) task->epilogue = [staged_input] {};  // kept until the call is done
  req->engine_ = engine_;
  // A call whose lanes all run on one worker may run on its waiting caller's thread (Engine::wait); an exclusive
  // one runs on worker 0.
  req->driver_ = task->exclusive ? engine_->worker_of(0) : -1;
  if (!task->exclusive && !task->lanes.empty()) {
    req->driver_ = engine_->worker_of(task->lanes[0].stream);
    for (const auto& lane : task->lanes)
      if (engine_->worker_of(lane.stream) != req->driver_) req->driver_ = -1;
  }
  std::lock_guard lock(submit_mu_);  // numbers and queue order agree
  check_one_poster();
  last_posted_ = req;
  task->seq = seq_++;
  task->desc.call = static_cast<uint16_t>(task->seq);
  history_->add(task->seq, task->desc);
  if (cma_usable_ && call.algo != Algorithm::cma && call.algo != Algorithm::shm)
    cma_->elsewhere(task->seq, &task->desc);
  engine_->submit(std::move(task));
  return req;
}

std::shared_ptr<Request> Communicator::allreduce(const void* in, void* out, size_t count, DataType dt, ReduceOp op,
                                                 Algorithm algo, std::optional<Codec> codec) {
  check_op(dt, op);
  const Codec wire = choose_codec(Collective::allreduce, dt, op, codec);
  const Algorithm chosen = choose(Collective::allreduce, count, dt, algo, wire.kind() != CodecKind::identity);
  return submit({Collective::allreduce, dt, op, chosen, -1, count, wire}, in, out);
}

std::shared_ptr<Request> Communicator::reduce_scatter(const void* in, void* out, size_t recvcount, DataType dt,
                                                      ReduceOp op, std::optional<Codec> codec, Algorithm algo) {
  check_op(dt, op);
  const Codec wire = choose_codec(Collective::reduce_scatter, dt, op, codec);
  const Algorithm chosen = choose(Collective::reduce_scatter, recvcount, dt, algo, wire.kind() != CodecKind::identity);
  return submit({Collective::reduce_scatter, dt, op, chosen, -1, recvcount, wire}, in, out);
}

std::shared_ptr<Request> Communicator::allgather(const void* in, void* out, size_t sendcount, DataType dt,
                                                 std::optional<Codec> codec, Algorithm algo) {
  const Codec wire = choose_codec(Collective::allgather, dt, std::nullopt, codec);
  const Algorithm chosen = choose(Collective::allgather, sendcount, dt, algo, wire.kind() != CodecKind::identity);
  return submit({Collective::allgather, dt, ReduceOp::sum, chosen, -1, sendcount, wire}, in, out);
}

std::shared_ptr<Request> Communicator::broadcast(void* buf, size_t count, DataType dt, int root, Algorithm algo) {
  check_root(root, size_);
  const Algorithm chosen = choose(Collective::broadcast, count, dt, algo);
  return submit({Collective::broadcast, dt, ReduceOp::sum, chosen, root, count, {}}, buf, buf);
}

std::shared_ptr<Request> Communicator::reduce(const void* in, void* out, size_t count, DataType dt, ReduceOp op,
                                              int root, Algorithm algo) {
  check_op(dt, op);
  check_root(root, size_);
  require(rank_ != root || out != nullptr || count == 0, "reduce: the root needs an output buffer");
  const Algorithm chosen = choose(Collective::reduce, count, dt, algo);
  return submit({Collective::reduce, dt, op, chosen, root, count, {}}, in, rank_ == root ? out : nullptr);
}

std::shared_ptr<Request> Communicator::alltoall(const void* in, void* out, size_t count, DataType dt, Algorithm algo) {
  require(in != out || count == 0 || size_ == 1, "alltoall cannot run in place: pass a separate output buffer");
  const Algorithm chosen = choose(Collective::alltoall, count, dt, algo);
  return submit({Collective::alltoall, dt, ReduceOp::sum, chosen, -1, count, {}}, in, out);
}

std::shared_ptr<Request> Communicator::barrier(Algorithm algo) {
  const Algorithm chosen = choose(Collective::barrier, 0, DataType::u8, algo);
  return submit({Collective::barrier, DataType::u8, ReduceOp::sum, chosen, -1, 0, {}}, nullptr, nullptr);
}

}  // namespace smartcoll
