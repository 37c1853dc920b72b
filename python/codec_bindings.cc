// nanobind bindings of the wire codecs. The caller (python/smartcoll/codec.py) allocates every output array, so
// these functions only check sizes, release the GIL and run the C++ kernels.
#include "codec_bindings.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "smartcoll/codec.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace smartcoll {
namespace {

// Inputs may be read-only (np.frombuffer over bytes); outputs must be writeable.
using FloatIn = nb::ndarray<const float, nb::c_contig, nb::device::cpu>;
using ByteIn = nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>;
using FloatOut = nb::ndarray<float, nb::c_contig, nb::device::cpu>;
using ByteOut = nb::ndarray<uint8_t, nb::c_contig, nb::device::cpu>;

void require(bool ok, const std::string& message) {
  if (!ok) throw nb::value_error(message.c_str());
}

// buf must hold exactly the encoding of `count` elements: a shorter one would be read past its end, a longer one
// means the caller has the count wrong.
template <class Bytes>
void require_encoded(const Codec& c, const Bytes& buf, size_t count, const char* what) {
  const size_t want = c.encoded_size(count);
  require(buf.size() == want, std::string(what) + " holds " + std::to_string(buf.size()) + " bytes; " + c.name() +
                                  " encodes " + std::to_string(count) + " elements in " + std::to_string(want));
}

template <class Floats>
void require_count(const Floats& a, size_t count, const char* what) {
  require(a.size() == count, std::string(what) + " has " + std::to_string(a.size()) + " elements, expected " +
                                 std::to_string(count));
}

using InfoValue = std::variant<bool, int64_t, double, std::string>;

std::map<std::string, InfoValue> info(const std::string& name) {
  const Codec c = Codec::parse(name);
  const ErrorBound e = c.error_bound();
  return {
      {"name", c.name()},
      {"block_elems", static_cast<int64_t>(c.block_elems())},
      {"block_bytes", static_cast<int64_t>(c.encoded_size(c.block_elems()))},
      {"mant_bits", static_cast<int64_t>(c.mant_bits())},
      {"exp_bits", static_cast<int64_t>(c.exp_bits())},
      {"ratio", c.ratio()},
      {"error_rel", e.rel},
      {"error_abs", e.abs},
      {"error_limit", e.limit},
      {"error_per_block", e.per_block},
  };
}

}  // namespace

void bind_codec(nb::module_& m) {
  m.def("codec_formats", &Codec::names, "The preset codec names (BFP also takes 'bfp:block=B,mant=M,exp=E').");
  m.def("codec_info", &info, "name"_a, "Canonical name, block, bits, ratio and error bound of a codec.");
  m.def(
      "codec_encoded_size",
      [](const std::string& name, size_t count) { return Codec::parse(name).encoded_size(count); }, "name"_a,
      "count"_a, "Exact encoded bytes for `count` float32 elements.");
  m.def(
      "codec_encode",
      [](const std::string& name, FloatIn x, ByteOut out) {
        const Codec c = Codec::parse(name);
        require_encoded(c, out, x.size(), "out");
        nb::gil_scoped_release release;
        c.encode(x.data(), x.size(), out.data());
      },
      "name"_a, "x"_a.noconvert(), "out"_a.noconvert());
  m.def(
      "codec_decode",
      [](const std::string& name, ByteIn buf, FloatOut out) {
        const Codec c = Codec::parse(name);
        require_encoded(c, buf, out.size(), "buf");
        nb::gil_scoped_release release;
        c.decode(buf.data(), out.size(), out.data());
      },
      "name"_a, "buf"_a.noconvert(), "out"_a.noconvert());
  m.def(
      "codec_decode_add",
      [](const std::string& name, ByteIn buf, FloatIn addend, FloatOut out) {
        const Codec c = Codec::parse(name);
        require_encoded(c, buf, out.size(), "buf");
        require_count(addend, out.size(), "addend");
        nb::gil_scoped_release release;
        c.decode_add(buf.data(), out.size(), addend.data(), out.data());
      },
      "name"_a, "buf"_a.noconvert(), "addend"_a.noconvert(), "out"_a.noconvert());
  m.def(
      "codec_feedback_step",
      [](const std::string& name, FloatOut x, FloatOut residual) {
        const Codec c = Codec::parse(name);
        require_count(residual, x.size(), "residual");
        nb::gil_scoped_release release;
        c.feedback_step(x.data(), residual.data(), x.size());
      },
      "name"_a, "x"_a.noconvert(), "residual"_a.noconvert(),
      "x += residual; residual = x - decode(encode(x)), non-finite residuals stored as 0: one pass, in place.");
  m.def(
      "codec_decode_add_encode",
      [](const std::string& name, ByteIn buf, FloatIn addend, ByteOut out, std::optional<FloatOut> sum) {
        const Codec c = Codec::parse(name);
        const size_t count = addend.size();
        require_encoded(c, buf, count, "buf");
        require_encoded(c, out, count, "out");
        if (sum) require_count(*sum, count, "sum");
        float* s = sum ? sum->data() : nullptr;
        nb::gil_scoped_release release;
        c.decode_add_encode(buf.data(), count, addend.data(), out.data(), s);
      },
      "name"_a, "buf"_a.noconvert(), "addend"_a.noconvert(), "out"_a.noconvert(), "sum"_a.noconvert() = nb::none());
}

}  // namespace smartcoll
