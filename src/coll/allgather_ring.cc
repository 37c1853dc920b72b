// Ring allgather: n-1 steps; what a rank receives at step k it forwards at step k+1. With a codec, every block
// is encoded once by its owner, which also keeps the decoded values so that every rank holds the same ones.
#include "coll/algorithms.h"

namespace smartcoll::coll {

void allgather_ring(Builder& b, const Args& a) {
  const int n = b.cx.size, r = b.cx.rank;
  const Codec* codec = b.spec.wire();
  const size_t esize = dtype_size(b.spec.dtype);
  const Chunks ch = equal_blocks(a.count, n, esize, codec);
  std::vector<char*> acc = chunk_pointers(a.out, ch, esize);
  char* mine = acc[static_cast<size_t>(r)];
  const char* in = a.in;
  uint8_t* enc = nullptr;
  if (codec) {
    enc = reinterpret_cast<uint8_t*>(b.scratch(ch.wire_total()));
    uint8_t* own = enc + ch.wire_off[static_cast<size_t>(r)];
    const size_t count = a.count;
    const int32_t encoded = b.compute(0, [codec, in, mine, own, count] {
      codec->encode(reinterpret_cast<const float*>(in), count, own);
      codec->decode(own, count, reinterpret_cast<float*>(mine));
    });
    ring(b, n - 1, r, [](int) { return Step::gather; }, ch, {in, acc, enc, false, true}, 1, encoded);
    return;
  }
  if (mine != in) b.copy(0, mine, in, a.count * esize);
  acc[static_cast<size_t>(r)] = const_cast<char*>(in);  // this rank's block is sent from the input
  ring(b, n - 1, r, [](int) { return Step::gather; }, ch, {in, acc, enc, false, true});
}

}  // namespace smartcoll::coll
