// Helpers shared by the report tests: fixtures, a CSV reader, and an XML well-formedness check.
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "report_test_util.h"
#include "memtune/io/json_util.h"
#include "../support/fixtures.h"

namespace memtune::report_test {

nlohmann::json load_fixture(std::string_view name) {
  return test::read_json_fixture("report/" + std::string(name));
}

// RFC 4180: quoted fields may hold commas, doubled quotes and line breaks; rows end in CRLF or LF.
std::vector<std::vector<std::string>> parse_csv(std::string_view text) {
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> row;
  std::string field;
  bool quoted = false, field_started = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '"' && i + 1 < text.size() && text[i + 1] == '"') {
        field += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        field += c;
      }
    } else if (c == '"' && field.empty()) {
      quoted = field_started = true;
    } else if (c == ',') {
      row.push_back(std::move(field));
      field.clear();
      field_started = true;
    } else if (c == '\r' || c == '\n') {
      if (c == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
      row.push_back(std::move(field));
      field.clear();
      rows.push_back(std::move(row));
      row.clear();
      field_started = false;
    } else {
      field += c;
      field_started = true;
    }
  }
  if (field_started || !field.empty() || !row.empty()) {
    row.push_back(std::move(field));
    rows.push_back(std::move(row));
  }
  return rows;
}

// Empty when `xml` is a well-formed document (one root, matched tags, quoted attributes without
// duplicates, only the five predefined or numeric entities, no raw '<' or '&' in text); else what
// is wrong and where. Enough of XML 1.0 for what the renderers write: no DTDs, no CDATA.
std::string xml_well_formedness_error(std::string_view xml) {
  const auto at = [&](size_t pos) { return " at byte " + std::to_string(pos); };
  const auto is_name_start = [](char c) {
    return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':' ||
           static_cast<unsigned char>(c) >= 0x80;
  };
  const auto is_name_char = [&](char c) {
    return is_name_start(c) || std::isdigit(static_cast<unsigned char>(c)) || c == '-' || c == '.';
  };
  const auto check_entities = [&](std::string_view text, size_t offset) -> std::string {
    for (size_t i = 0; i < text.size(); ++i) {
      if (text[i] == '<') return "raw '<' in text" + at(offset + i);
      if (text[i] != '&') continue;
      const size_t end = text.find(';', i);
      if (end == std::string_view::npos) return "unterminated entity" + at(offset + i);
      const std::string_view entity = text.substr(i + 1, end - i - 1);
      bool ok = entity == "amp" || entity == "lt" || entity == "gt" || entity == "quot" || entity == "apos";
      if (!ok && entity.size() >= 2 && entity[0] == '#') {
        const bool hex = entity[1] == 'x';
        const std::string_view digits = entity.substr(hex ? 2 : 1);
        ok = !digits.empty();
        for (char d : digits)
          ok = ok && (hex ? std::isxdigit(static_cast<unsigned char>(d)) : std::isdigit(static_cast<unsigned char>(d)));
      }
      if (!ok) return "unknown entity &" + std::string(entity) + ";" + at(offset + i);
      i = end;
    }
    return "";
  };

  size_t pos = 0;
  if (xml.starts_with("<?xml")) {
    pos = xml.find("?>");
    if (pos == std::string_view::npos) return "unterminated XML declaration";
    pos += 2;
  }
  std::vector<std::string> open;
  int roots = 0;
  while (pos < xml.size()) {
    const size_t lt = xml.find('<', pos);
    const std::string_view text = xml.substr(pos, (lt == std::string_view::npos ? xml.size() : lt) - pos);
    if (open.empty()) {
      for (char c : text)
        if (!std::isspace(static_cast<unsigned char>(c))) return "text outside the root element" + at(pos);
    } else if (std::string error = check_entities(text, pos); !error.empty()) {
      return error;
    }
    if (lt == std::string_view::npos) break;
    pos = lt;
    if (xml.substr(pos).starts_with("<!--")) {
      const size_t end = xml.find("-->", pos + 4);
      if (end == std::string_view::npos) return "unterminated comment" + at(pos);
      pos = end + 3;
      continue;
    }
    const bool closing = pos + 1 < xml.size() && xml[pos + 1] == '/';
    size_t i = pos + (closing ? 2 : 1);
    if (i >= xml.size() || !is_name_start(xml[i])) return "bad tag name" + at(pos);
    const size_t name_start = i;
    while (i < xml.size() && is_name_char(xml[i])) ++i;
    const std::string name(xml.substr(name_start, i - name_start));
    if (closing) {
      while (i < xml.size() && std::isspace(static_cast<unsigned char>(xml[i]))) ++i;
      if (i >= xml.size() || xml[i] != '>') return "bad closing tag </" + name + at(pos);
      if (open.empty() || open.back() != name)
        return "</" + name + "> does not close <" + (open.empty() ? std::string("nothing") : open.back()) + ">" + at(pos);
      open.pop_back();
      pos = i + 1;
      continue;
    }
    std::vector<std::string> attributes;
    bool self_closing = false;
    while (true) {
      const size_t before_space = i;
      while (i < xml.size() && std::isspace(static_cast<unsigned char>(xml[i]))) ++i;
      if (i >= xml.size()) return "unterminated tag <" + name + at(pos);
      if (xml[i] == '>') {
        ++i;
        break;
      }
      if (xml[i] == '/') {
        if (i + 1 >= xml.size() || xml[i + 1] != '>') return "stray '/' in <" + name + at(i);
        self_closing = true;
        i += 2;
        break;
      }
      if (i == before_space) return "attributes must be separated by space in <" + name + at(i);
      if (!is_name_start(xml[i])) return "bad attribute name in <" + name + at(i);
      const size_t attribute_start = i;
      while (i < xml.size() && is_name_char(xml[i])) ++i;
      const std::string attribute(xml.substr(attribute_start, i - attribute_start));
      for (const std::string& seen : attributes)
        if (seen == attribute) return "duplicate attribute " + attribute + " in <" + name + at(i);
      attributes.push_back(attribute);
      if (i >= xml.size() || xml[i] != '=') return "attribute " + attribute + " has no value" + at(i);
      ++i;
      if (i >= xml.size() || (xml[i] != '"' && xml[i] != '\'')) return "unquoted attribute " + attribute + at(i);
      const char quote = xml[i];
      const size_t value_end = xml.find(quote, i + 1);
      if (value_end == std::string_view::npos) return "unterminated attribute " + attribute + at(i);
      if (std::string error = check_entities(xml.substr(i + 1, value_end - i - 1), i + 1); !error.empty())
        return error;
      i = value_end + 1;
    }
    if (open.empty()) {
      if (++roots > 1) return "more than one root element" + at(pos);
    }
    if (!self_closing) open.push_back(name);
    pos = i;
  }
  if (!open.empty()) return "<" + open.back() + "> is never closed";
  if (roots != 1) return "no root element";
  return "";
}

// 0 when python3 parsed the file with xml.dom.minidom, 1 when it failed, -1 when there is no
// python3 with xml.dom.minidom on this machine.
int python_minidom_check(const std::filesystem::path& file) {
  if (std::system("python3 -c 'import xml.dom.minidom' >/dev/null 2>&1") != 0) return -1;
  const std::string command =
      "python3 -c 'import sys, xml.dom.minidom; xml.dom.minidom.parse(sys.argv[1])' '" + file.string() + "'";
  return std::system(command.c_str()) == 0 ? 0 : 1;
}

}  // namespace memtune::report_test
