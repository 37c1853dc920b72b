// Communicator: a group of ranks and the progress engine that runs their collectives.
//
// Every collective is a task. The calling thread only checks arguments and submits; one engine thread per
// communicator (optionally pinned to a core set aside for it) runs the tasks in submission order, doing all
// transport I/O and reductions. Each call returns a Request at once; blocking calls are request.wait().
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "smartcoll/codec.h"
#include "smartcoll/knobs.h"
#include "smartcoll/store.h"
#include "smartcoll/types.h"

namespace smartcoll {

class Transport;
namespace cma {
class Local;
}
namespace algo {
struct Params;
}

enum class Collective : uint8_t { allreduce, reduce_scatter, allgather, broadcast, reduce, alltoall, barrier };
enum class Algorithm : uint8_t { automatic, ring, rhd, chain, direct, local, cma, tree };

std::string_view collective_name(Collective c);
std::string_view algorithm_name(Algorithm a);
Algorithm parse_algorithm(std::string_view name);  // "auto", "ring", "rhd", "cma"

class Request {
 public:
  // True once the task has finished (successfully or not); never blocks.
  bool test();
  // Waits up to `timeout` (nullopt: no limit). Returns false on timeout (the task goes on). Throws CommError
  // if the collective failed.
  bool wait(std::optional<std::chrono::duration<double>> timeout = std::nullopt);

 private:
  friend class Communicator;
  void finish(std::string error);
  std::mutex close_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
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
                                          std::optional<Codec> codec = std::nullopt);
  // in: sendcount elements; out: size * sendcount elements, rank i's block at i * sendcount.
  std::shared_ptr<Request> allgather(const void* in, void* out, size_t sendcount, DataType dt,
                                     std::optional<Codec> codec = std::nullopt);
  std::shared_ptr<Request> broadcast(void* buf, size_t count, DataType dt, int root);
  // out is written on root only (may be null elsewhere).
  std::shared_ptr<Request> reduce(const void* in, void* out, size_t count, DataType dt, ReduceOp op, int root);
  // in and out: size * count elements; block i of in goes to rank i, block j of out comes from rank j.
  std::shared_ptr<Request> alltoall(const void* in, void* out, size_t count, DataType dt);
  std::shared_ptr<Request> barrier();

  // Which allreduce algorithm `automatic` resolves to for this message.
  Algorithm choose_allreduce(size_t count, DataType dt, Algorithm requested, bool compressed = false) const;
  // The codec a call uses: `requested`, or the knob's where it applies; identity means raw elements.
  // op: nullopt for collectives that do not reduce (allgather).
  Codec choose_codec(DataType dt, std::optional<ReduceOp> op, const std::optional<Codec>& requested) const;

  // Empty when the same-host path (cma) is usable; otherwise why not.
  std::string cma_unusable_reason() const;

  // Finishes queued tasks, stops the engine and closes connections. Idempotent.
  void close();

 private:
  struct Call {
    Collective coll;
    DataType dt;
    ReduceOp op;
    Algorithm algo;
    int root;
    size_t count;
    Codec codec;
  };
  std::shared_ptr<Request> submit(const Call& call, std::function<void()> body);
  algo::Params params(const Codec& codec) const;
  void check_agreement(const Call& call);
  void agree_on_settings();  // at start-up: the knobs every rank must share
  void engine_loop();

  int rank_, size_;
  Options options_;
  std::shared_ptr<Store> store_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<cma::Local> cma_;
  bool cma_usable_ = false;   // fixed at construction, so callers may read it while another thread closes
  std::string cma_reason_;
  uint64_t seq_ = 0;          // engine thread only
  std::string failure_;       // engine thread only: first error; later tasks fail with it

  std::mutex close_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::thread engine_;
};

}  // namespace smartcoll
