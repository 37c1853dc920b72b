// The communicator's one-sided calls (smartcoll/onesided.h): thin wrappers over its one-sided service
// (core/onesided.h), which starts on first use.
#include "core/config.h"
#include "core/onesided.h"
#include "smartcoll/comm.h"
#include "transport/tcp.h"

namespace smartcoll {

rma::Service& Communicator::one_sided() {
  check_usable();
  std::lock_guard lock(rma_mu_);
  if (!rma_) {
    rma::Settings s;
    s.rank = rank_;
    s.size = size_;
    s.host = static_cast<TcpTransport&>(*transport_).host();
    s.job = job_fingerprint(config_->job_id);
    s.timeout = config_->timeout;
    s.connect_timeout = config_->connect_timeout;
    s.sockbuf = config_->sockbuf;
    rma_ = std::make_unique<rma::Service>(s, store_);
  }
  return *rma_;
}

uint64_t Communicator::register_region(void* base, size_t bytes, DataType dtype) {
  return one_sided().add(base, bytes, dtype);
}

void Communicator::deregister_region(uint64_t id) {
  if (closed_) return;  // closing took every region with it
  one_sided().remove(id);
}

std::shared_ptr<Request> Communicator::getv(const RemoteRegion& from, std::span<const RemotePiece> pieces,
                                            std::span<const LocalPiece> into, std::optional<Codec> codec) {
  return one_sided().post(rma::Kind::get, from, pieces, into, ReduceOp::sum, codec);
}

std::shared_ptr<Request> Communicator::putv(std::span<const LocalPiece> from, const RemoteRegion& into,
                                            std::span<const RemotePiece> pieces, std::optional<Codec> codec) {
  return one_sided().post(rma::Kind::put, into, pieces, from, ReduceOp::sum, codec);
}

std::shared_ptr<Request> Communicator::accumulatev(std::span<const LocalPiece> from, const RemoteRegion& into,
                                                   std::span<const RemotePiece> pieces, ReduceOp op,
                                                   std::optional<Codec> codec) {
  return one_sided().post(rma::Kind::accumulate, into, pieces, from, op, codec);
}

}  // namespace smartcoll
