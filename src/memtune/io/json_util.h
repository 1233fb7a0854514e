// Reading JSON files (config.json, tokenizer.json, index files) with errors a user can act on:
// every message names the file and, for a bad value, the key and what was found instead.
//
// `context` below is what an error message starts with: usually the file path, or the path and
// the enclosing object ("/models/x/config.json: rope_scaling").
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace memtune {

// memtune::Error naming the file, with line, column and byte offset for a syntax error.
nlohmann::json read_json_file(const std::filesystem::path& path);
// The same for text already in memory; `source_name` is used in messages.
nlohmann::json parse_json_text(std::string_view text, std::string_view source_name);

// nlohmann's message without its "[json.exception.parse_error.101] parse error at line 3,
// column 2: " prefix: the reason alone, for messages that report the position themselves.
std::string json_exception_reason(const nlohmann::json::exception& error);

// "string \"abc\"", "array", "null", ...: what a value was, for "expected X, got Y" messages.
std::string json_value_description(const nlohmann::json& value);

// Converts one value, or throws memtune::Error "<what>: expected <T>, got <value>".
// Supported T: bool, int, int64_t, double, float, std::string, std::vector<int64_t>,
// std::vector<double>, std::vector<std::string>. Integers are range-checked; a float with an
// exactly integral value (4096.0) is accepted as an integer, and integers are accepted as
// floating-point values, because JSON writers disagree about how to spell whole numbers.
template <typename T>
T json_as(const nlohmann::json& value, std::string_view what);

template <>
bool json_as<bool>(const nlohmann::json& value, std::string_view what);
template <>
int json_as<int>(const nlohmann::json& value, std::string_view what);
template <>
int64_t json_as<int64_t>(const nlohmann::json& value, std::string_view what);
template <>
double json_as<double>(const nlohmann::json& value, std::string_view what);
template <>
float json_as<float>(const nlohmann::json& value, std::string_view what);
template <>
std::string json_as<std::string>(const nlohmann::json& value, std::string_view what);
template <>
std::vector<int64_t> json_as<std::vector<int64_t>>(const nlohmann::json& value,
                                                   std::string_view what);
template <>
std::vector<double> json_as<std::vector<double>>(const nlohmann::json& value,
                                                 std::string_view what);
template <>
std::vector<std::string> json_as<std::vector<std::string>>(const nlohmann::json& value,
                                                           std::string_view what);

// memtune::Error "<context>: expected a JSON object, got ..." unless `object` is an object.
void json_require_object(const nlohmann::json& object, std::string_view context);

// The value under `key`, or nullptr when the key is absent. Requires an object.
const nlohmann::json* json_find(const nlohmann::json& object, std::string_view key,
                                std::string_view context);

// memtune::Error "<context>: missing key \"<key>\"" when absent.
const nlohmann::json& json_require(const nlohmann::json& object, std::string_view key,
                                   std::string_view context);

std::string json_key_description(std::string_view context, std::string_view key);

// A required key of type T (null is an error).
template <typename T>
T json_get(const nlohmann::json& object, std::string_view key, std::string_view context) {
  return json_as<T>(json_require(object, key, context), json_key_description(context, key));
}

// nullopt when the key is absent or null (Hugging Face configs write "rope_scaling": null).
template <typename T>
std::optional<T> json_get_optional(const nlohmann::json& object, std::string_view key,
                                   std::string_view context) {
  const nlohmann::json* value = json_find(object, key, context);
  if (value == nullptr || value->is_null()) return std::nullopt;
  return json_as<T>(*value, json_key_description(context, key));
}

// `fallback` when the key is absent or null. T is never deduced from the fallback (a literal
// 5 would make it int, "x" const char*): write it, json_get_or<int64_t>(...).
template <typename T>
T json_get_or(const nlohmann::json& object, std::string_view key, std::type_identity_t<T> fallback,
              std::string_view context) {
  std::optional<T> value = json_get_optional<T>(object, key, context);
  return value ? std::move(*value) : std::move(fallback);
}

}  // namespace memtune
