// Rendezvous stores: ranks publish and look up small values (their listening addresses) by key.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace smartcoll {

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Waits until the key exists; throws CommError naming the key after `timeout`.
  virtual std::string get(const std::string& key, std::chrono::milliseconds timeout) = 0;
};

// Puts every key under `prefix`: jobs, and communicators of one job, that share a store never see each other's
// keys.
class PrefixStore : public Store {
 public:
  PrefixStore(std::shared_ptr<Store> inner, std::string prefix) : inner_(std::move(inner)), prefix_(std::move(prefix)) {}
  void set(const std::string& key, const std::string& value) override { inner_->set(prefix_ + key, value); }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    return inner_->get(prefix_ + key, timeout);
  }

 private:
  std::shared_ptr<Store> inner_;
  std::string prefix_;
};

// In-process store, for ranks that are threads (tests).
class MemoryStore : public Store {
 public:
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;

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

 private:
  std::string path_of(const std::string& key) const;
  std::string dir_;
};

// TCP store as torchrun's env:// uses it: rank 0 serves at MASTER_ADDR:MASTER_PORT, every rank is a client.
class TcpStore : public Store {
 public:
  TcpStore(const std::string& host, uint16_t port, bool serve, std::chrono::milliseconds connect_timeout);
  ~TcpStore() override;
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;
  // The port served (when serving with port 0, the one the kernel chose) or connected to.
  uint16_t port() const { return port_; }

 private:
  class Server;
  uint16_t port_ = 0;
  std::unique_ptr<Server> server_;
  int fd_ = -1;
  std::mutex mu_;
};

}  // namespace smartcoll
