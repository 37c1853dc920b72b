// Rendezvous stores: ranks publish and look up small values (their listening addresses) by key.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "smartcoll/types.h"

namespace smartcoll {

// A get that waited out its time without the key appearing (any other failure is a plain CommError: a store
// that went away, or answered nonsense).
class StoreTimeout : public CommError {
 public:
  using CommError::CommError;
};

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Waits until the key exists; throws CommError naming the key after `timeout`.
  virtual std::string get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // The value if the key exists now, without waiting (nullopt otherwise); never drops a connection. Throws
  // CommError only when the store cannot be reached.
  virtual std::optional<std::string> check(const std::string& key);
  // check(), except that it never waits behind another thread's request (a get that waits for its key): nullopt
  // then, as for a key that does not exist. For looks made by threads that must not stall (the engine's).
  virtual std::optional<std::string> peek(const std::string& key) { return check(key); }
  // Deletes every key that begins with `prefix` (a whole key, where no other key extends it); returns how many.
  // Throws CommError when the store cannot be reached, or (a TCP store's server of release 0.1.0) cannot delete.
  virtual size_t erase_prefix(const std::string& prefix) = 0;
  // How another process can reach this store ("tcp IP PORT SECRET", "file DIR"; open_store() reads it), for the
  // offload daemon (engine=nicd); empty for stores only this process can reach.
  virtual std::string locator() const { return ""; }
};

// The store a locator names, as a client; throws InvalidArgument for a locator it cannot read.
std::shared_ptr<Store> open_store(const std::string& locator, std::chrono::milliseconds connect_timeout);

// Puts every key under `prefix`: jobs, and communicators of one job, that share a store never see each other's
// keys.
class PrefixStore : public Store {
 public:
  PrefixStore(std::shared_ptr<Store> inner, std::string prefix) : inner_(std::move(inner)), prefix_(std::move(prefix)) {}
  void set(const std::string& key, const std::string& value) override { inner_->set(prefix_ + key, value); }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    return inner_->get(prefix_ + key, timeout);
  }
  std::optional<std::string> check(const std::string& key) override { return inner_->check(prefix_ + key); }
  std::optional<std::string> peek(const std::string& key) override { return inner_->peek(prefix_ + key); }
  size_t erase_prefix(const std::string& prefix) override { return inner_->erase_prefix(prefix_ + prefix); }

 private:
  std::shared_ptr<Store> inner_;
  std::string prefix_;
};

// In-process store, for ranks that are threads (tests).
class MemoryStore : public Store {
 public:
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;
  size_t erase_prefix(const std::string& prefix) override;
  size_t size();  // keys held now (tests)

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> values_;
};

// A directory shared by all ranks (a local or network file system); one file per key, written atomically.
// Use a fresh directory per job: keys left by an earlier job would be read as this job's.
class FileStore : public Store {
 public:
  explicit FileStore(std::string dir);
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;
  size_t erase_prefix(const std::string& prefix) override;
  std::string locator() const override { return "file " + dir_; }

 private:
  std::string path_of(const std::string& key) const;
  std::string dir_;
};

// What the TCP store's server lets clients make it hold (docs/wire-format.md, "Rendezvous store"). A client that
// goes over a limit is dropped and the drop logged; clients check the key and value limits before sending.
struct StoreLimits {
  size_t max_key = 4096;
  size_t max_value = size_t{16} << 20;
  size_t max_clients = 4096;
  // Input and output buffered for all clients together (requests not yet complete, replies not yet sent).
  size_t max_buffered = size_t{256} << 20;
  // A client that has sent and received nothing for this long is dropped, unless it waits for a key; clients
  // reconnect on their next request. One that has not passed the secret handshake this long after connecting too.
  std::chrono::milliseconds idle_timeout = std::chrono::minutes(10);
  std::chrono::milliseconds handshake_timeout = std::chrono::seconds(10);
};

// Counters of a TCP store's server, for tests and diagnostics.
struct StoreServerStats {
  uint64_t loop_iterations = 0;  // wake-ups of the server's event loop
  uint64_t accepted = 0;         // connections accepted
  uint64_t clients = 0;          // connected now
  uint64_t bad_requests = 0;     // clients dropped for a malformed request or one over a size limit
  uint64_t refused = 0;          // clients dropped for a wrong proof of the shared secret
  uint64_t timed_out = 0;        // clients dropped for idling or for not finishing the handshake in time
  uint64_t over_buffer = 0;      // clients dropped because the server's buffers were full (max_buffered)
  uint64_t accept_backoffs = 0;  // pauses of accept() because the process or system ran out of descriptors
  uint64_t keys = 0;             // keys held now
};

namespace store {
class Server;
}

// TCP store as torchrun's env:// uses it: rank 0 serves at MASTER_ADDR:MASTER_PORT, every rank is a client.
class TcpStore : public Store {
 public:
  // A non-empty `secret` must be the same on every rank: the server then admits only clients that prove they
  // know it, and a client refuses a server that does not ask. `limits` bound the server (when serving) and what
  // this client sends and accepts. Throws InvalidArgument for a port outside 0..65535, CommError when the store
  // cannot be reached within connect_timeout or refuses this client.
  TcpStore(const std::string& host, int port, bool serve, std::chrono::milliseconds connect_timeout,
           std::string secret = "", const StoreLimits& limits = {});
  ~TcpStore() override;
  // Leaves the store now: drops this client's connection and, when serving, stops the server (which goes on
  // answering the other ranks for up to a few seconds while they are connected). Later calls throw CommError.
  // The destructor does the same; a binding calls this first so that the wait happens without its interpreter lock.
  void close();
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;
  std::optional<std::string> check(const std::string& key) override;
  std::optional<std::string> peek(const std::string& key) override;
  size_t erase_prefix(const std::string& prefix) override;
  std::string locator() const override { return "tcp " + ip_ + " " + std::to_string(port_) + " " + secret_; }
  // The port served (when serving with port 0, the one the kernel chose) or connected to.
  uint16_t port() const { return port_; }
  // The server's counters; all zero when this store only connects.
  StoreServerStats server_stats() const;

 private:
  int connect_and_greet(std::chrono::steady_clock::time_point deadline) const;
  int connection(std::chrono::steady_clock::time_point deadline);
  void disconnect();
  std::string where() const;
  // Sends a get (wait) or a check and reads its reply (nullopt: the key does not exist, for a check); mu_ held.
  std::optional<std::string> ask(bool wait, const std::string& key, std::chrono::milliseconds timeout);
  uint16_t port_ = 0;  // first: checked before the host is resolved
  std::string ip_;
  std::string secret_;
  StoreLimits limits_;
  std::unique_ptr<store::Server> server_;
  int fd_ = -1;
  bool closed_ = false;
  std::mutex mu_;
};

}  // namespace smartcoll
