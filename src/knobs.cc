#include "smartcoll/knobs.h"

#include <cctype>
#include <cstdlib>

#include "smartcoll/types.h"

namespace smartcoll {

namespace {

void validate(const Knob& knob, const std::string& value) {
  const std::string_view type = knob.type;
  auto fail = [&](std::string_view expected) {
    throw InvalidArgument("option '" + std::string(knob.name) + "' (" + knob_env_name(knob.name) + ") = '" +
                          value + "': expected " + std::string(expected));
  };
  if (type == "int") {
    char* end = nullptr;
    std::strtoll(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0') fail("an integer");
  } else if (type == "float") {
    char* end = nullptr;
    std::strtod(value.c_str(), &end);
    if (value.empty() || *end != '\0') fail("a number");
  } else if (type.starts_with("choice:")) {
    std::string_view choices = type.substr(7);
    size_t pos = 0;
    while (pos <= choices.size()) {
      size_t bar = choices.find('|', pos);
      if (bar == std::string_view::npos) bar = choices.size();
      if (choices.substr(pos, bar - pos) == value) return;
      pos = bar + 1;
    }
    fail("one of " + std::string(choices));
  }
}

}  // namespace

std::string knob_env_name(std::string_view name) {
  std::string env = "SMARTCOLL_";
  for (char c : name) env += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return env;
}

const Knob& find_knob(std::string_view name) {
  for (const Knob& k : kKnobs)
    if (k.name == name) return k;
  std::string valid;
  for (const Knob& k : kKnobs) valid += (valid.empty() ? "" : ", ") + std::string(k.name);
  throw InvalidArgument("unknown option '" + std::string(name) + "'; valid options: " + valid);
}

Options Options::resolve(const std::map<std::string, std::string>& explicit_options) {
  Options o;
  for (const Knob& k : kKnobs) {
    std::string value(k.default_value);
    if (const char* env = std::getenv(knob_env_name(k.name).c_str())) value = env;
    o.values_[std::string(k.name)] = value;
  }
  for (const auto& [name, value] : explicit_options) o.values_[std::string(find_knob(name).name)] = value;
  for (const Knob& k : kKnobs) validate(k, o.values_[std::string(k.name)]);
  return o;
}

const std::string& Options::str(std::string_view name) const {
  return values_.at(std::string(find_knob(name).name));
}

int64_t Options::integer(std::string_view name) const { return std::strtoll(str(name).c_str(), nullptr, 10); }

double Options::real(std::string_view name) const { return std::strtod(str(name).c_str(), nullptr); }

}  // namespace smartcoll
