// What a communicator leaves in the rendezvous store, and who deletes it when (docs/wire-format.md, "Which keys
// live how long"). Deleting is best effort: a store that is gone (its rank exited) or cannot delete (a server of
// release 0.1.0) leaves the keys where they are, and the caller goes on.
#pragma once

#include <string>

#include "smartcoll/store.h"

namespace smartcoll {

// Deletes every key that begins with `prefix`; never throws.
void forget(Store& store, const std::string& prefix) noexcept;

// At a communicator's close: counts rank `rank` out (key "closed/<rank>"); the rank that then finds every rank of
// `size` counted out deletes every key of the communicator (`store` is its prefixed store). Of two ranks closing
// at once at least one sees the other's mark (each sets its own before it looks, and the server answers in
// order), so the last to close cleans up; a rank that never closes (it crashed) leaves the keys to the store's
// end. Never throws.
void forget_communicator(Store& store, int rank, int size) noexcept;

}  // namespace smartcoll
