// Python bindings of the cost model (src/coll/cost.h), part of the private `smartcoll._core` module.
#pragma once

#include <nanobind/nanobind.h>

namespace smartcoll {

// Adds model_builtin_profile, model_parse_profile, model_load_profile, model_profile_digest, model_algorithms,
// model_predict, model_choose and model_iteration to `m`; python/smartcoll/tools/model/ uses them. Profiles cross as their JSON text.
void bind_model(nanobind::module_& m);

}  // namespace smartcoll
