#include "store/cleanup.h"

#include <exception>

namespace smartcoll {

void forget(Store& store, const std::string& prefix) noexcept {
  try {
    store.erase_prefix(prefix);
  } catch (const std::exception&) {
  }
}

void forget_communicator(Store& store, int rank, int size) noexcept {
  try {
    store.set("closed/" + std::to_string(rank), "");
    // From the highest rank down: ranks tend to close in order, so an early closer stops at its first look.
    for (int p = size - 1; p >= 0; --p)
      if (p != rank && !store.check("closed/" + std::to_string(p))) return;
    store.erase_prefix("");
  } catch (const std::exception&) {  // the store is gone: nothing to clean up, or nobody to do it
  }
}

}  // namespace smartcoll
