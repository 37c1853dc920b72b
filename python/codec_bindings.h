// Python bindings of the wire codecs (include/smartcoll/codec.h), part of the private `smartcoll._core` module.
#pragma once

#include <nanobind/nanobind.h>

namespace smartcoll {

// Adds codec_formats, codec_info, codec_encoded_size, codec_encode, codec_decode, codec_decode_add and
// codec_decode_add_encode to `m`; python/smartcoll/codec.py wraps them.
void bind_codec(nanobind::module_& m);

}  // namespace smartcoll
