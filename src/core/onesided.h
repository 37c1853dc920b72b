// The one-sided server and client of a communicator (docs/vectored.md, "One-sided operations").
//
// One thread per communicator, started on first use (a registration or a one-sided call), serves both roles over
// framed channels of its own (core/onesided_wire.h), apart from the collectives' unframed channels and workers:
//   - as a target, it accepts channels from initiators, reads their requests, checks every field, copies from or
//     into (or reduces into) the registered region, and answers; the application makes no call for that;
//   - as an initiator, it sends the calls posted on its channels to targets and completes their requests as the
//     answers come in. Several calls may be outstanding on a channel; a target serves one initiator's requests
//     in the order they were sent.
// All I/O is non-blocking and a message is served only once it is whole, so one slow peer never stalls the others.
// The region is touched under its lock only while copying (a get gathers into a staging buffer under it, then
// sends from there; a put or accumulate receives into staging, then scatters under it), so deregistering waits
// at most for one copy and leaves nothing that points into the buffer.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/onesided_wire.h"
#include "smartcoll/comm.h"
#include "smartcoll/onesided.h"
#include "smartcoll/store.h"
#include "transport/socket.h"

namespace smartcoll::rma {

struct Settings {
  int rank = 0, size = 1;
  std::string host;  // where to listen (the collectives' listening address)
  uint64_t job = 0;  // job_fingerprint of the job id, carried in every hello
  double timeout = 60, connect_timeout = 120;
  int sockbuf = 0;
};

class Service {
 public:
  // Listens, publishes "rma/<rank>" in the (job's) store and starts the thread.
  Service(const Settings& settings, std::shared_ptr<Store> store);
  // Fails the calls still outstanding ("the communicator was closed") and joins the thread.
  ~Service();

  uint64_t add(void* base, size_t bytes, DataType dtype);
  // Waits until no request is copying from or into the region; later requests are refused, naming it.
  void remove(uint64_t id);
  // Checks the call as the target will, connects to the peer on first use (on this thread, within
  // connect_timeout), and queues it. The local buffers must stay valid until the request completes.
  // codec: float32 only; put and accumulate encode here (on this thread) and decode at the target, get the
  // reverse.
  std::shared_ptr<Request> post(Kind kind, const RemoteRegion& region, std::span<const RemotePiece> pieces,
                                std::span<const LocalPiece> local, ReduceOp op, const std::optional<Codec>& codec);

  struct Region;
  struct Conn;
  struct Call;
  struct Accepting;

 private:
  void run();
  void connect(int peer);
  void take_inbox();
  void accept_all();
  void progress(Conn& c);
  void receive(Conn& c);
  void send(Conn& c);
  void serve(Conn& c);
  void answer(Conn& c);
  void close(Conn& c, const std::string& why);
  std::shared_ptr<Region> find(uint64_t id, std::string& why);

  Settings s_;
  uint8_t token_[16];  // what initiators must present (Hello::token)
  std::shared_ptr<Store> store_;
  net::Fd listener_, epfd_, wakefd_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> next_call_{1};

  std::mutex regions_mu_;
  std::map<uint64_t, std::shared_ptr<Region>> regions_;
  uint64_t next_region_ = 1;

  std::mutex connect_mu_;  // one caller connects to a peer at a time
  std::mutex mu_;          // the inbox, and which peers have a channel
  std::vector<std::pair<int, net::Fd>> new_conns_;
  std::vector<std::shared_ptr<Call>> new_calls_;
  std::vector<bool> connected_;          // [peer]: a channel from this rank is open or being handed over
  std::vector<std::string> last_close_;  // [peer]: why the last channel to it closed

  // The thread's own state.
  std::vector<std::unique_ptr<Conn>> conns_;
  std::vector<Conn*> to_peer_;  // [peer]: this rank's channel to it, or null
  std::vector<std::unique_ptr<Accepting>> accepting_;
};

}  // namespace smartcoll::rma
