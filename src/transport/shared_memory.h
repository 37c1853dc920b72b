// Memory shared between processes of one host: a memfd that one process creates and maps, and others map through
// /proc/<pid>/fd/<fd> (the same permission as reading that process's memory: the same-host path's). Used by the
// same-host control segment (transport/cma_control.h) and the one-sided directories (core/onesided.h).
#pragma once

#include <cstddef>
#include <string>

namespace smartcoll::cma {

class SharedMemory {
 public:
  // `bytes` of zeroes in a new memfd named `name`, mapped; empty (and `error` says why) on failure.
  static SharedMemory create(const char* name, size_t bytes, std::string& error);
  // Maps process `pid`'s memfd `fd`, which must be `bytes` long; empty (and `error`, naming `what`) on failure.
  static SharedMemory open(int pid, int fd, size_t bytes, const std::string& what, std::string& error);
  SharedMemory() = default;
  SharedMemory(SharedMemory&& o) noexcept;
  SharedMemory& operator=(SharedMemory&& o) noexcept;
  ~SharedMemory();

  bool mapped() const { return base_ != nullptr; }
  void* base() const { return base_; }
  int fd() const { return fd_; }  // the creator's descriptor (-1 after close_fd, and where opened)
  void close_fd();                // once every peer has mapped it: the mappings alone keep it alive

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
  int fd_ = -1;
};

}  // namespace smartcoll::cma
