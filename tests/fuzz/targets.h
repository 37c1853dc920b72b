// Fuzz targets: each runs one input through a component and checks that component's invariants, aborting with
// FUZZ_CHECK on a violation (sanitizers abort on memory errors and undefined behaviour). fuzz_main.cc feeds them
// seeds and mutations of the seeds; to add a target, declare its two functions here and add a row to the
// registry in fuzz_main.cc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace smartcoll::fuzz {

[[noreturn]] void check_failed(const char* expr, const char* file, int line);
#define FUZZ_CHECK(cond) ((cond) ? void(0) : ::smartcoll::fuzz::check_failed(#cond, __FILE__, __LINE__))

// Valid inputs for a target, the starting points of mutation.
using Seeds = std::vector<std::string>;

// The store server's request parser (store/protocol.h) against a direct reading of the format.
void store_request(const uint8_t* data, size_t size);
Seeds store_request_seeds();

// SHA-256 and HMAC-SHA-256 (core/mac.h): a message fed in pieces hashes as the whole.
void sha256_pieces(const uint8_t* data, size_t size);
Seeds sha256_pieces_seeds();

// A connecting rank's hello (transport/tcp.h): refused exactly when a field is out of range or foreign.
void peer_hello(const uint8_t* data, size_t size);
Seeds peer_hello_seeds();

// A call's descriptor from a peer (core/agreement.h): compared and described without trusting a byte.
void call_descriptor(const uint8_t* data, size_t size);
Seeds call_descriptor_seeds();

// Rank 0's start-up verdict from the store (core/agreement.h): parsed, or refused with a CommError.
void start_up_verdict(const uint8_t* data, size_t size);
Seeds start_up_verdict_seeds();

// An aggregation switch's datagram (switch/protocol.h, switch/aggregator.h): parsed and handled, forged or not.
void switch_packet(const uint8_t* data, size_t size);
Seeds switch_packet_seeds();

// The cost model's profile (coll/cost.h): parsed or refused with InvalidArgument; canonical JSON parses back.
void model_profile(const uint8_t* data, size_t size);
Seeds model_profile_seeds();
// A message from a rank to the offload daemon, or back (nicd/protocol.h): decoded within range, or refused.
void nicd_message(const uint8_t* data, size_t size);
Seeds nicd_message_seeds();

// A one-sided request from an initiator (core/onesided_wire.h): refused, or served inside its region alone.
void onesided_message(const uint8_t* data, size_t size);
Seeds onesided_message_seeds();

}  // namespace smartcoll::fuzz
