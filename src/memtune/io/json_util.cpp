#include "memtune/io/json_util.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "memtune/core/error.h"
#include "memtune/io/file_util.h"

namespace memtune {

namespace {

std::string truncated(std::string text, size_t limit) {
  if (text.size() > limit) {
    text.resize(limit);
    text += "...";
  }
  return text;
}

[[noreturn]] void fail_at(std::string_view text, size_t offset, std::string_view source_name,
                          const std::string& reason) {
  size_t line = 1, column = 1;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  mt_fail("{}: invalid JSON at line {}, column {} (byte {}): {}", source_name, line, column, offset,
          reason);
}

}  // namespace

std::string json_exception_reason(const nlohmann::json::exception& error) {
  const std::string_view text = error.what();
  const size_t column = text.find("column ");
  if (column != std::string_view::npos) {
    const size_t colon = text.find(": ", column);
    if (colon != std::string_view::npos) return std::string(text.substr(colon + 2));
  }
  const size_t bracket = text.find("] ");
  if (bracket != std::string_view::npos) return std::string(text.substr(bracket + 2));
  return std::string(text);
}

nlohmann::json parse_json_text(std::string_view text, std::string_view source_name) {
  // nlohmann treats a NUL outside a string as the end of the input and would silently ignore
  // whatever follows it; JSON has no raw NUL anywhere.
  const size_t nul = text.find('\0');
  if (nul != std::string_view::npos) fail_at(text, nul, source_name, "NUL byte");
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::parse_error& error) {
    // error.byte counts the bytes read when the parser gave up: the offending byte, 1-based.
    const size_t offset = std::min<size_t>(error.byte == 0 ? 0 : error.byte - 1, text.size());
    fail_at(text, offset, source_name, json_exception_reason(error));
  } catch (const nlohmann::json::exception& error) {
    // A number too large for a double ("1e999") is out_of_range, which carries no position.
    mt_fail("{}: invalid JSON: {}", source_name, json_exception_reason(error));
  }
}

nlohmann::json read_json_file(const std::filesystem::path& path) {
  const std::string text = read_file(path);
  return parse_json_text(text, path.string());
}

std::string json_value_description(const nlohmann::json& value) {
  switch (value.type()) {
    case nlohmann::json::value_t::null:
      return "null";
    case nlohmann::json::value_t::boolean:
      return value.get<bool>() ? "true" : "false";
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned:
    case nlohmann::json::value_t::number_float:
      return "number " + value.dump();
    case nlohmann::json::value_t::string:
      return "string " +
             truncated(value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), 80);
    case nlohmann::json::value_t::array:
      return fmt::format("an array of {}", value.size());
    case nlohmann::json::value_t::object:
      return "an object";
    default:
      return "a binary value";
  }
}

std::string json_key_description(std::string_view context, std::string_view key) {
  return fmt::format("{}: key \"{}\"", context, key);
}

void json_require_object(const nlohmann::json& object, std::string_view context) {
  MT_USER_CHECK(object.is_object(), "{}: expected a JSON object, got {}", context,
                json_value_description(object));
}

const nlohmann::json* json_find(const nlohmann::json& object, std::string_view key,
                                std::string_view context) {
  json_require_object(object, context);
  const auto it = object.find(key);
  return it == object.end() ? nullptr : &*it;
}

const nlohmann::json& json_require(const nlohmann::json& object, std::string_view key,
                                   std::string_view context) {
  const nlohmann::json* value = json_find(object, key, context);
  MT_USER_CHECK(value != nullptr, "{}: missing key \"{}\"", context, key);
  return *value;
}

template <>
bool json_as<bool>(const nlohmann::json& value, std::string_view what) {
  MT_USER_CHECK(value.is_boolean(), "{}: expected true or false, got {}", what,
                json_value_description(value));
  return value.get<bool>();
}

template <>
int64_t json_as<int64_t>(const nlohmann::json& value, std::string_view what) {
  if (value.is_number_unsigned()) {
    const uint64_t unsigned_value = value.get<uint64_t>();
    MT_USER_CHECK(unsigned_value <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                  "{}: {} is out of range for a 64-bit integer", what, value.dump());
    return static_cast<int64_t>(unsigned_value);
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_number_float()) {
    const double float_value = value.get<double>();
    // 2^63 is exactly representable; anything at or above it does not fit.
    const bool integral = std::isfinite(float_value) && std::trunc(float_value) == float_value &&
                          float_value >= -9223372036854775808.0 &&
                          float_value < 9223372036854775808.0;
    MT_USER_CHECK(integral, "{}: expected an integer, got {}", what, json_value_description(value));
    return static_cast<int64_t>(float_value);
  }
  mt_fail("{}: expected an integer, got {}", what, json_value_description(value));
}

template <>
int json_as<int>(const nlohmann::json& value, std::string_view what) {
  const int64_t wide = json_as<int64_t>(value, what);
  MT_USER_CHECK(wide >= std::numeric_limits<int>::min() && wide <= std::numeric_limits<int>::max(),
                "{}: {} is out of range for a 32-bit integer", what, wide);
  return static_cast<int>(wide);
}

template <>
double json_as<double>(const nlohmann::json& value, std::string_view what) {
  MT_USER_CHECK(value.is_number(), "{}: expected a number, got {}", what,
                json_value_description(value));
  return value.get<double>();
}

template <>
float json_as<float>(const nlohmann::json& value, std::string_view what) {
  const double wide = json_as<double>(value, what);
  MT_USER_CHECK(std::fabs(wide) <= std::numeric_limits<float>::max(),
                "{}: {} is out of range for a 32-bit float", what, wide);
  return static_cast<float>(wide);
}

template <>
std::string json_as<std::string>(const nlohmann::json& value, std::string_view what) {
  MT_USER_CHECK(value.is_string(), "{}: expected a string, got {}", what,
                json_value_description(value));
  return value.get<std::string>();
}

namespace {

template <typename Element>
std::vector<Element> json_as_vector(const nlohmann::json& value, std::string_view what) {
  MT_USER_CHECK(value.is_array(), "{}: expected an array, got {}", what,
                json_value_description(value));
  std::vector<Element> out;
  out.reserve(value.size());
  for (size_t i = 0; i < value.size(); ++i) {
    out.push_back(json_as<Element>(value[i], fmt::format("{}[{}]", what, i)));
  }
  return out;
}

}  // namespace

template <>
std::vector<int64_t> json_as<std::vector<int64_t>>(const nlohmann::json& value,
                                                   std::string_view what) {
  return json_as_vector<int64_t>(value, what);
}

template <>
std::vector<double> json_as<std::vector<double>>(const nlohmann::json& value,
                                                 std::string_view what) {
  return json_as_vector<double>(value, what);
}

template <>
std::vector<std::string> json_as<std::vector<std::string>>(const nlohmann::json& value,
                                                           std::string_view what) {
  return json_as_vector<std::string>(value, what);
}

}  // namespace memtune
