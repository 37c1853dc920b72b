// Communicator: a group of ranks and the progress engine that runs their collectives.
//
// Every collective is a task: a schedule of sends, receives and reductions that the engine's workers progress
// (several calls at once, in the order they were made), on cores that can be set aside for them. The calling
// thread checks arguments and submits; each call returns a Request at once; blocking calls are
// request.wait(), which drives the engine itself when nothing else is running.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <shared_mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "smartcoll/codec.h"
#include "smartcoll/knobs.h"
#include "smartcoll/onesided.h"
#include "smartcoll/store.h"
#include "smartcoll/types.h"

namespace smartcoll {

class Transport;
class Engine;
struct Task;
struct Config;
struct StartUpVerdict;
struct CallHistory;
namespace cma {
class Local;
}
namespace sw {
struct Path;
}
namespace nicd {
class Client;
}
namespace rma {
class Service;
}
namespace coll {
struct Views;
struct Query;
struct Displacements;
}  // namespace coll

enum class Collective : uint8_t {
  allreduce, reduce_scatter, allgather, broadcast, reduce, alltoall, barrier, alltoallv
};
inline constexpr int kCollectives = 8;
enum class Algorithm : uint8_t {
  automatic, ring, rhd, chain, direct, local, cma, tree, rd, bruck, dissemination, hier, switch_, pairwise, shm,
  switch_hier
};
// The highest code: what range checks of algorithm codes read from the network compare against.
inline constexpr Algorithm kLastAlgorithm = Algorithm::switch_hier;

std::string_view collective_name(Collective c);
std::string_view algorithm_name(Algorithm a);
// An algorithm by name, for `collective`; throws InvalidArgument listing the ones that collective has.
Algorithm parse_algorithm(std::string_view name, Collective collective = Collective::allreduce);

class Request {
 public:
  // True once the task has finished (successfully or not); never blocks.
  bool test();
  // Waits up to `timeout` (nullopt: no limit). Returns false on timeout (the task goes on). Throws CommError
  // if the collective failed. A caller that waits on a small call while the engine is idle drives the engine
  // itself, so that no thread hand-off sits on the critical path.
  bool wait(std::optional<std::chrono::duration<double>> timeout = std::nullopt);
  // The algorithm that runs the call: the one asked for or auto's choice, or the ring where a call through the
  // aggregation switch runs the ring instead (the switch is gone, docs/switch.md); final once the call started.
  Algorithm algorithm() const { return algo_.load(); }

 private:
  friend class Engine;
  friend class Communicator;
  friend class nicd::Client;
  friend class rma::Service;
  void finish(std::string error);
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  std::string error_;
  std::atomic<Algorithm> algo_{Algorithm::automatic};
  std::weak_ptr<Engine> engine_;
  int driver_ = -1;  // the engine worker a waiting caller may drive (-1: the call spans several workers)
  std::weak_ptr<nicd::Client> nicd_;  // engine=nicd: the client whose answers a waiting caller may read itself
};

struct EngineStats {
  int workers = 0;
  double cpu_seconds = 0;           // CPU time of the engine's worker threads so far
  int open_channels = 0;            // connections this rank holds now
  int local_channels = 0;           // of those, Unix sockets to peers on this host (unix_sockets)
  uint64_t same_host_calls = 0;     // calls run on the same-host path (algo cma) so far
  uint64_t staged_bytes = 0;        // list entries' bytes copied into staging (list_stage_bytes) so far
  uint64_t direct_gets = 0;         // one-sided gets that read the target's memory directly (rma_direct) so far
  uint64_t direct_puts = 0;         // one-sided puts that wrote into the target's memory directly so far
  uint64_t direct_accumulates = 0;  // one-sided accumulates reduced into the target's memory directly so far
  uint64_t driven_answers = 0;      // engine=nicd: the daemon's answers a waiting caller read itself (spin) so far
};

class Communicator {
 public:
  // Rendezvous through `store`; route_hint (MASTER_ADDR) selects the listening address when neither the addr
  // nor the ifname option is set.
  Communicator(int rank, int size, std::shared_ptr<Store> store, const Options& options,
               const std::string& route_hint = "");
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const Options& options() const { return options_; }

  // Buffers must stay valid and untouched until the request completes. Counts are in elements.
  //
  // `codec` (allreduce, reduce_scatter, allgather) compresses float32 data on the wire; reductions stay in
  // float32. nullopt: the `codec` knob, applied where it can be (float32 with sum or avg); an explicit codec on
  // other data is an error.
  std::shared_ptr<Request> allreduce(const void* in, void* out, size_t count, DataType dt, ReduceOp op,
                                     Algorithm algo = Algorithm::automatic,
                                     std::optional<Codec> codec = std::nullopt);
  // in: size * recvcount elements; out: recvcount elements (this rank's block).
  std::shared_ptr<Request> reduce_scatter(const void* in, void* out, size_t recvcount, DataType dt, ReduceOp op,
                                          std::optional<Codec> codec = std::nullopt,
                                          Algorithm algo = Algorithm::automatic);
  // in: sendcount elements; out: size * sendcount elements, rank i's block at i * sendcount.
  std::shared_ptr<Request> allgather(const void* in, void* out, size_t sendcount, DataType dt,
                                     std::optional<Codec> codec = std::nullopt,
                                     Algorithm algo = Algorithm::automatic);
  std::shared_ptr<Request> broadcast(void* buf, size_t count, DataType dt, int root,
                                     Algorithm algo = Algorithm::automatic);
  // out is written on root only (may be null elsewhere).
  std::shared_ptr<Request> reduce(const void* in, void* out, size_t count, DataType dt, ReduceOp op, int root,
                                  Algorithm algo = Algorithm::automatic);
  // in and out: size * count elements; block i of in goes to rank i, block j of out comes from rank j.
  std::shared_ptr<Request> alltoall(const void* in, void* out, size_t count, DataType dt,
                                    Algorithm algo = Algorithm::automatic);
  std::shared_ptr<Request> barrier(Algorithm algo = Algorithm::automatic);

  // Lists of buffers (docs/vectored.md), all of dtype dt: one call, one pipeline over the whole list, each buffer
  // read and written where it is (no copy into one buffer). counts[i]: elements of list entry i. Every rank must
  // pass lists of the same counts (checked). On one host they take the same-host path (cma) where one buffer of
  // the same bytes would. Codecs as for one buffer, in codec_mode hop only (allreduce, reduce_scatter).
  std::shared_ptr<Request> allreduce(std::span<void* const> bufs, std::span<const size_t> counts, DataType dt,
                                     ReduceOp op, Algorithm algo = Algorithm::automatic,
                                     std::optional<Codec> codec = std::nullopt);  // in place
  // ins[i]: size * counts[i] elements; outs[i]: counts[i] (this rank's block of ins[i], reduced).
  std::shared_ptr<Request> reduce_scatter(std::span<const void* const> ins, std::span<void* const> outs,
                                          std::span<const size_t> counts, DataType dt, ReduceOp op,
                                          Algorithm algo = Algorithm::automatic,
                                          std::optional<Codec> codec = std::nullopt);
  // ins[i]: counts[i] elements; outs[i]: size * counts[i], rank j's block at j * counts[i].
  std::shared_ptr<Request> allgather(std::span<const void* const> ins, std::span<void* const> outs,
                                     std::span<const size_t> counts, DataType dt,
                                     Algorithm algo = Algorithm::automatic);
  std::shared_ptr<Request> broadcast(std::span<void* const> bufs, std::span<const size_t> counts, DataType dt,
                                     int root, Algorithm algo = Algorithm::automatic);
  // Block j of in (sendcounts[j] elements at sdispls[j]) goes to rank j, whose block from this rank lands at
  // rdispls[i] of its out. Rank i's sendcounts[j] must equal rank j's recvcounts[i] (checked: the call fails).
  std::shared_ptr<Request> alltoallv(const void* in, std::span<const size_t> sendcounts,
                                     std::span<const size_t> sdispls, void* out, std::span<const size_t> recvcounts,
                                     std::span<const size_t> rdispls, DataType dt);
  // The list form: ins[j] (sendcounts[j] elements) goes to rank j, and rank j's block to this rank lands in
  // outs[j] (recvcounts[j]); no buffer is copied into or out of one. No output may overlap an input or another
  // output (both forms check their blocks; InvalidArgument names the pair).
  std::shared_ptr<Request> alltoallv(std::span<const void* const> ins, std::span<const size_t> sendcounts,
                                     std::span<void* const> outs, std::span<const size_t> recvcounts, DataType dt);

  // One-sided operations on registered regions (smartcoll/onesided.h, docs/vectored.md). A region is any
  // writable buffer; its id (1, 2, ... in this rank's order of registration) names it to peers, whose calls this
  // rank's one-sided server thread serves with no call of its own. Offsets and sizes in bytes; the local buffers,
  // taken one after the other, hold the pieces in order. Every field is checked here and again by the target.
  // `codec` (float32 regions, whole elements): each piece travels encoded; accumulate then takes sum only.
  uint64_t register_region(void* base, size_t bytes, DataType dtype);
  // Allocates `bytes` (> 0) of shared memory and registers it (AllocatedRegion). CommError where the memory
  // cannot be had.
  AllocatedRegion allocate_region(size_t bytes, DataType dtype);
  // Waits for a copy in progress from or into the region, a peer's direct write on this host included; later
  // calls on it fail ("region N was deregistered"). CommError where a peer's direct write did not finish within
  // the timeout knob (a stopped process), also after close(): the buffer must then stay allocated.
  void deregister_region(uint64_t id);
  std::shared_ptr<Request> getv(const RemoteRegion& from, std::span<const RemotePiece> pieces,
                                std::span<const LocalPiece> into, std::optional<Codec> codec = std::nullopt);
  std::shared_ptr<Request> putv(std::span<const LocalPiece> from, const RemoteRegion& into,
                                std::span<const RemotePiece> pieces, std::optional<Codec> codec = std::nullopt);
  // Reduces (op: sum, prod, min, max) element-wise into the region, in its dtype; a target applies one rank's
  // calls in the order they were made.
  std::shared_ptr<Request> accumulatev(std::span<const LocalPiece> from, const RemoteRegion& into,
                                       std::span<const RemotePiece> pieces, ReduceOp op = ReduceOp::sum,
                                       std::optional<Codec> codec = std::nullopt);

  // The codec a call uses: `requested`, or the knob's where it applies; identity means raw elements.
  // op: nullopt for collectives that do not reduce (allgather).
  Codec choose_codec(Collective coll, DataType dt, std::optional<ReduceOp> op,
                     const std::optional<Codec>& requested) const;

  // Empty when the same-host path (cma) is usable; otherwise why not.
  std::string cma_unusable_reason() const;
  // Where the same-host path's control messages go: "shm" (a shared segment), "tcp", or "" when it is unusable.
  std::string cma_control() const;

  // Finishes queued tasks, stops the engine and closes connections. Idempotent. In a child made by fork() it only
  // lets go of the parent's engine (whose threads do not exist there).
  void close();
  // Fails every pending and later call of this communicator on this rank with `reason`, and the peers' calls
  // within moments (they read the reason from the store); any thread may call it, e.g. on Ctrl-C.
  void abort(const std::string& reason);

  // Which algorithm `automatic` resolves to for this call (count in elements, as the collective takes it).
  Algorithm choose(Collective coll, size_t count, DataType dt, Algorithm requested = Algorithm::automatic,
                   bool compressed = false) const;
  EngineStats engine_stats() const;
  // The host of every rank (numbered from 0 in order of first appearance), as ranks learned it at start-up.
  const std::vector<int>& hosts() const { return hosts_; }

 private:
  struct Call {
    Collective coll;
    DataType dt;
    ReduceOp op;
    Algorithm algo;
    int root;
    size_t count;
    Codec codec;
    uint32_t layout = 0;  // list calls: a digest of the list's counts, compared across ranks with the call
    const coll::Displacements* displs = nullptr;  // alltoallv
  };
  // views: the segmented views (list calls) that in and out point into.
  std::shared_ptr<Request> submit(const Call& call, const void* in, void* out,
                                  std::shared_ptr<const coll::Views> views = nullptr);
  // A list call: in and out as views of these buffers (docs/vectored.md).
  std::shared_ptr<Request> submit_list(Call call, const std::vector<std::pair<const void*, size_t>>& in,
                                       const std::vector<std::pair<const void*, size_t>>& out);
  void check_usable() const;                     // not closed, not a forked child's copy
  void check_buffers(const Call& call, const void* in, const void* out) const;
  // A call of `bytes` (the vector, or one rank's block) as algorithm selection sees it.
  coll::Query query(size_t bytes, bool compressed) const;
  void check_one_poster();  // submit_mu_ held
  // Started on first use; `lock` (shared) holds it open for the call: close() takes it exclusively.
  rma::Service& one_sided(std::shared_lock<std::shared_mutex>& lock);
  // At start-up, through the store: the knobs every rank must share; the claim rank 0 accepted and the host of
  // every rank.
  StartUpVerdict agree_on_settings(const std::string& claim);
  // Joins the job to the switches of the switch knob; every rank learns whether all could (through the store).
  void join_switches();

  int rank_, size_;
  Options options_;
  std::unique_ptr<Config> config_;
  std::shared_ptr<Store> store_;
  std::shared_ptr<Store> drawn_in_;  // rank 0, where it drew the job id: it deletes that key at close
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<cma::Local> cma_;
  std::unique_ptr<sw::Path> switch_;  // the aggregation switches (switch knob), joined at start-up
  // Cleared at the first failure: the switch clients stop their keepalives (sw::ClientSettings::job_alive).
  std::shared_ptr<std::atomic<bool>> switch_alive_ = std::make_shared<std::atomic<bool>>(true);
  std::shared_ptr<nicd::Client> nicd_;  // engine=nicd: the host's offload daemon runs every call
  mutable std::shared_mutex rma_mu_;
  std::unique_ptr<rma::Service> rma_;  // one-sided operations
  // Regions that a peer was still writing into directly when close() gave up waiting: why, by id.
  std::map<uint64_t, std::string> unsafe_regions_;
  bool cma_usable_ = false;  // fixed at construction, so callers may read it while another thread closes
  std::string cma_reason_;
  std::shared_ptr<Engine> engine_;
  std::vector<int> hosts_;  // [rank]: its host, numbered in order of first appearance (0: rank 0's)
  // What every call's algorithm choice reads of hosts_, worked out once (coll::host_layout_shape and
  // coll::hosts_interleaved).
  std::pair<int, int> host_shape_{1, 0};
  bool hosts_interleaved_ = false;
  std::unique_ptr<CallHistory> history_;
  std::mutex submit_mu_;  // calls are numbered and queued in one order
  uint64_t seq_ = 0;
  int pid_ = 0;         // the process that made this communicator: a forked child has a copy it cannot use
  uint64_t forks_ = 0;  // how many forks this process had come out of when it made it
  // The thread that posted the last call, and that call: another thread may post only once it has finished
  // (two threads posting at once would number their calls in different orders on different ranks).
  std::thread::id poster_;
  std::weak_ptr<Request> last_posted_;
  std::mutex close_mu_;
  std::atomic<bool> closed_{false};
  std::atomic<uint64_t> staged_bytes_{0};
};

}  // namespace smartcoll
