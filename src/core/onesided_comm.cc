// The communicator's one-sided calls (smartcoll/onesided.h): thin wrappers over its one-sided service
// (core/onesided.h), which starts on first use.
#include "core/config.h"
#include "core/onesided.h"
#include "smartcoll/comm.h"
#include "transport/cma.h"
#include "transport/tcp.h"

namespace smartcoll {

rma::Service& Communicator::one_sided(std::shared_lock<std::shared_mutex>& lock) {
  for (;;) {
    lock = std::shared_lock(rma_mu_);
    check_usable();  // under the lock: close() sets closed_, then waits for the lock to reset the service
    if (rma_) return *rma_;
    lock.unlock();
    std::lock_guard create(rma_mu_);
    check_usable();
    if (rma_) continue;
    rma::Settings s;
    s.rank = rank_;
    s.size = size_;
    const auto& tcp = static_cast<TcpTransport&>(*transport_);
    s.host = tcp.host();
    s.claims = tcp.claims();
    s.job = job_fingerprint(config_->job_id);
    s.timeout = config_->timeout;
    s.connect_timeout = config_->connect_timeout;
    s.sockbuf = config_->sockbuf;
    s.unix_sockets = config_->unix_sockets;
    if (cma_usable_ && config_->rma_direct) s.pids = cma_->pids();
    rma_ = std::make_unique<rma::Service>(s, store_);
  }
}

uint64_t Communicator::register_region(void* base, size_t bytes, DataType dtype) {
  std::shared_lock<std::shared_mutex> lock;
  return one_sided(lock).add(base, bytes, dtype);
}

AllocatedRegion Communicator::allocate_region(size_t bytes, DataType dtype) {
  std::shared_lock<std::shared_mutex> lock;
  return one_sided(lock).allocate(bytes, dtype);
}

void Communicator::deregister_region(uint64_t id) {
  // Returns only once the server touches the region no more: the caller may free it next.
  std::shared_lock lock(rma_mu_);
  if (!rma_) {  // never started, or closing stopped the server and took every region with it
    // ...but a peer stopped in the middle of a direct write into this one may still write.
    if (const auto it = unsafe_regions_.find(id); it != unsafe_regions_.end()) throw CommError(it->second);
    return;
  }
  if (!closed_) check_usable();
  rma_->remove(id);
}

std::shared_ptr<Request> Communicator::getv(const RemoteRegion& from, std::span<const RemotePiece> pieces,
                                            std::span<const LocalPiece> into, std::optional<Codec> codec) {
  std::shared_lock<std::shared_mutex> lock;
  return one_sided(lock).post(rma::Kind::get, from, pieces, into, ReduceOp::sum, codec);
}

std::shared_ptr<Request> Communicator::putv(std::span<const LocalPiece> from, const RemoteRegion& into,
                                            std::span<const RemotePiece> pieces, std::optional<Codec> codec) {
  std::shared_lock<std::shared_mutex> lock;
  return one_sided(lock).post(rma::Kind::put, into, pieces, from, ReduceOp::sum, codec);
}

std::shared_ptr<Request> Communicator::accumulatev(std::span<const LocalPiece> from, const RemoteRegion& into,
                                                   std::span<const RemotePiece> pieces, ReduceOp op,
                                                   std::optional<Codec> codec) {
  std::shared_lock<std::shared_mutex> lock;
  return one_sided(lock).post(rma::Kind::accumulate, into, pieces, from, op, codec);
}

}  // namespace smartcoll
