#include "memtune/experiment/sweep.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <optional>

#include "memtune/core/bytes.h"
#include "memtune/core/error.h"
#include "memtune/io/file_util.h"
#include "memtune/io/json_util.h"
#include "memtune/model/llama_config.h"
#include "memtune/plan/plan_report.h"
#include "memtune/experiment/measure.h"
#include "memtune/core/progress.h"
#include "memtune/report/output_files.h"
#include "memtune/report/svg.h"

namespace memtune {

using nlohmann::json;

std::vector<int64_t> parse_sweep_values(const std::string& text, const std::string& flag) {
  std::vector<int64_t> values;
  for (size_t start = 0; start <= text.size();) {
    const size_t end = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, end - start);
    size_t used = 0;
    int64_t value = 0;
    try {
      value = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    MT_USER_CHECK(!item.empty() && used == item.size() && value > 0,
                  "{} {}: expected a comma list of positive integers, e.g. 256,512,1024 (bad item '{}')", flag, text,
                  item);
    values.push_back(value);
    start = end + 1;
  }
  return values;
}

namespace {

std::string canonical_attention(const std::string& name) {
  if (name == "flash_attention_2" || name == "sdpa") return "flash";
  MT_USER_CHECK(name == "eager" || name == "flash", "--attn {}: expected eager or flash", name);
  return name;
}

std::string vary_option_name(const std::string& vary) {
  return vary == "seq" ? "max_seq_length" : "per_device_train_batch_size";
}

}  // namespace

json run_sweep(const SweepOptions& options) {
  MT_USER_CHECK(options.vary == "seq" || options.vary == "batch", "--vary {}: expected seq or batch", options.vary);
  MT_USER_CHECK(!options.values.empty(), "--values: give at least one value, e.g. --values 256,512,1024");
  MT_USER_CHECK(!options.attention.empty(), "--attn: give eager, flash or both");
  MT_USER_CHECK(options.steps >= 1, "--steps-per-point {}: expected at least 1", options.steps);
  std::vector<std::string> attention;
  for (const std::string& a : options.attention) {
    const std::string name = canonical_attention(a);
    if (std::find(attention.begin(), attention.end(), name) == attention.end()) attention.push_back(name);
  }
  std::vector<int64_t> values = options.values;
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
  if (options.vary == "seq")
    for (int64_t v : values) MT_USER_CHECK(v >= 2, "--values: max_seq_length {} is below 2", v);

  const ModelSource source = resolve_model(options.base.model);
  const LlamaConfig& model = source.config;
  const DeviceInfo device = probe_device(options.device);

  struct Point {
    RunConfig run;
    json rung;
  };
  std::vector<Point> points;
  for (int64_t value : values) {
    for (const std::string& attn : attention) {
      RunConfig run = options.base;
      if (options.vary == "seq") run.max_seq_length = value;
      else run.per_device_train_batch_size = value;
      run.attn_implementation = attn;
      run.validate();
      json rung = plan_rung(run, model, device, options.budget_bytes,
                            fmt::format("{}, {} {}", attn, options.vary, value), "");
      rung.erase("added");  // a sweep point adds no trick
      rung["value"] = value;
      rung["attn_implementation"] = attn;
      points.push_back({run, std::move(rung)});
    }
  }

  ProgressLine progress(stderr, !options.quiet);
  MetricsLog metrics(options.metrics);
  const auto will_measure = [&](const Point& p) { return !options.plan_only && p.rung["fits_device"].get<bool>(); };
  double total_work = 0;
  for (const Point& p : points)
    if (will_measure(p)) total_work += tokens_per_step(p.run) * static_cast<double>(options.steps);
  progress.start(total_work);
  double work_done = 0;
  for (size_t i = 0; i < points.size(); ++i) {
    Point& p = points[i];
    const std::string name = p.rung["name"].get<std::string>();
    const std::string label = fmt::format("[{}/{}] {}", i + 1, points.size(), name);
    if (will_measure(p)) {
      MeasureHooks hooks{&progress, &metrics, label,
                         {{"command", "sweep"}, {"index", i}, {"point", name}, {"value", p.rung["value"]},
                          {"attn_implementation", p.rung["attn_implementation"]}},
                         work_done};
      measure_rung(p.rung, p.run, model, device, options.steps, hooks);
      work_done += tokens_per_step(p.run) * static_cast<double>(options.steps);
      progress.set_work_done(work_done);
    } else if (!options.plan_only) {
      progress.note(fmt::format("{}: plan only ({} with context; the device takes {})", label,
                                format_bytes(p.rung["planned_with_context_bytes"].get<uint64_t>()),
                                format_bytes(device.capacity_bytes)));
    }
    json summary = {{"event", "point"}, {"command", "sweep"}, {"index", i}, {"point", name}};
    for (const char* key : {"value", "attn_implementation", "measured", "fits_device", "fits_budget",
                            "planned_peak_bytes", "attention_bytes", "engine_peak_bytes", "device_peak_bytes",
                            "step_seconds", "tokens_per_second", "loss", "mfu"})
      if (p.rung.contains(key)) summary[key] = p.rung[key];
    metrics.write(std::move(summary));
  }

  // How each implementation grows from one value to the next.
  json growth = json::array();
  for (const std::string& attn : attention) {
    const json* previous = nullptr;
    for (const Point& p : points) {
      if (p.rung["attn_implementation"] != attn) continue;
      if (previous != nullptr) {
        const auto ratio = [&](const char* key) {
          const double before = (*previous)[key].get<double>();
          return before > 0 ? json(p.rung[key].get<double>() / before) : json(nullptr);
        };
        growth.push_back({{"attn_implementation", attn}, {"from", (*previous)["value"]}, {"to", p.rung["value"]},
                          {"value_ratio", p.rung["value"].get<double>() / (*previous)["value"].get<double>()},
                          {"attention_bytes_ratio", ratio("attention_bytes")},
                          {"planned_peak_ratio", ratio("planned_peak_bytes")}});
      }
      previous = &p.rung;
    }
  }

  json sweep = {{"vary", options.vary},
                {"varied_option", vary_option_name(options.vary)},
                {"values", values},
                {"attn_implementations", attention},
                {"plan_only", options.plan_only},
                {"steps_per_point", options.steps},
                {"config", run_config_json(options.base, model)},
                {"model", model.name.empty() ? options.base.model : model.name},
                {"device", device.description},
                {"device_context_bytes", device.context_bytes},
                {"budget_bytes", options.budget_bytes},
                {"commit", options.commit},
                {"date", options.date}};
  sweep.update(mfu_context_json(device));
  json out_points = json::array();
  for (Point& p : points) out_points.push_back(std::move(p.rung));
  sweep["points"] = std::move(out_points);
  sweep["growth"] = std::move(growth);
  return sweep;
}

// ---------------------------------------------------------------------------------------------
// Rendering
// ---------------------------------------------------------------------------------------------
namespace {

struct SweepPoint {
  int64_t value = 0;
  std::string attn, name;
  uint64_t planned_peak_bytes = 0, attention_bytes = 0;
  bool measured = false, fits_device = false;
  std::optional<uint64_t> engine_peak_bytes, device_peak_bytes;
  std::optional<double> tokens_per_second, step_seconds, mfu, loss;
};

struct Sweep {
  std::string vary, varied_option, model, device;
  std::vector<std::string> attention;
  bool plan_only = false;
  std::vector<SweepPoint> points;
};

Sweep parse_sweep(const json& value) {
  const std::string context = "sweep";
  json_require_object(value, context);
  Sweep sweep;
  sweep.vary = json_get<std::string>(value, "vary", context);
  sweep.varied_option = json_get_or<std::string>(value, "varied_option", vary_option_name(sweep.vary), context);
  sweep.model = json_get_or<std::string>(value, "model", "?", context);
  sweep.device = json_get_or<std::string>(value, "device", "?", context);
  sweep.attention = json_get<std::vector<std::string>>(value, "attn_implementations", context);
  sweep.plan_only = json_get_or<bool>(value, "plan_only", false, context);
  const json& points = json_require(value, "points", context);
  MT_USER_CHECK(points.is_array(), "sweep: key \"points\": expected an array, got {}", json_value_description(points));
  for (size_t i = 0; i < points.size(); ++i) {
    const std::string point_context = fmt::format("sweep: points[{}]", i);
    const json& p = points[i];
    json_require_object(p, point_context);
    SweepPoint point;
    point.value = json_get<int64_t>(p, "value", point_context);
    point.attn = json_get<std::string>(p, "attn_implementation", point_context);
    point.name = json_get_or<std::string>(p, "name", point.attn, point_context);
    point.planned_peak_bytes = static_cast<uint64_t>(json_get<int64_t>(p, "planned_peak_bytes", point_context));
    point.attention_bytes = static_cast<uint64_t>(json_get_or<int64_t>(p, "attention_bytes", 0, point_context));
    point.measured = json_get_or<bool>(p, "measured", false, point_context);
    point.fits_device = json_get_or<bool>(p, "fits_device", point.measured, point_context);
    if (auto v = json_get_optional<int64_t>(p, "engine_peak_bytes", point_context)) point.engine_peak_bytes = *v;
    if (auto v = json_get_optional<int64_t>(p, "device_peak_bytes", point_context)) point.device_peak_bytes = *v;
    point.tokens_per_second = json_get_optional<double>(p, "tokens_per_second", point_context);
    point.step_seconds = json_get_optional<double>(p, "step_seconds", point_context);
    point.mfu = json_get_optional<double>(p, "mfu", point_context);
    point.loss = json_get_optional<double>(p, "loss", point_context);
    sweep.points.push_back(std::move(point));
  }
  return sweep;
}

struct ByteUnit {
  double bytes;
  const char* name;
};

ByteUnit byte_unit(uint64_t max_bytes) {
  if (max_bytes >= 2 * kGiB) return {static_cast<double>(kGiB), "GiB"};
  if (max_bytes >= 2 * kMiB) return {static_cast<double>(kMiB), "MiB"};
  return {static_cast<double>(kKiB), "KiB"};
}

std::string axis_label(const Sweep& sweep) {
  return sweep.vary == "seq" ? "max_seq_length (tokens)" : "per_device_train_batch_size (sequences per micro-batch)";
}

// Eager solid, flash dashed, as the other charts draw them.
std::vector<Series> series_by_attention(const Sweep& sweep, const std::string& suffix,
                                        const std::function<std::optional<double>(const SweepPoint&)>& y) {
  std::vector<Series> series;
  for (const std::string& attn : sweep.attention) {
    Series s{attn + " attention" + suffix, {}, attn == "flash"};
    for (const SweepPoint& p : sweep.points)
      if (p.attn == attn)
        if (const std::optional<double> v = y(p)) s.points.emplace_back(static_cast<double>(p.value), *v);
    std::sort(s.points.begin(), s.points.end());
    series.push_back(std::move(s));
  }
  return series;
}

std::string rate(const std::optional<double>& v) {
  if (!v) return "-";
  return *v >= 100 ? fmt::format("{:.0f}", *v) : fmt::format("{:.2f}", *v);
}

}  // namespace

std::string sweep_memory_svg(const json& value) {
  const Sweep sweep = parse_sweep(value);
  uint64_t max_bytes = 0;
  for (const SweepPoint& p : sweep.points) max_bytes = std::max(max_bytes, p.planned_peak_bytes);
  const ByteUnit unit = byte_unit(max_bytes);
  return line_chart_svg(
      fmt::format("Planned peak memory vs {}: {}", sweep.varied_option, sweep.model), axis_label(sweep),
      fmt::format("planned peak = engine peak ({})", unit.name),
      series_by_attention(sweep, "", [&](const SweepPoint& p) {
        return std::optional<double>(static_cast<double>(p.planned_peak_bytes) / unit.bytes);
      }));
}

std::string sweep_speed_svg(const json& value) {
  const Sweep sweep = parse_sweep(value);
  const bool any = std::any_of(sweep.points.begin(), sweep.points.end(),
                               [](const SweepPoint& p) { return p.tokens_per_second.has_value(); });
  return line_chart_svg(fmt::format("Training tokens/s vs {}: {} on {}{}", sweep.varied_option, sweep.model,
                                    sweep.device, any ? "" : sweep.plan_only ? " (plan only)" : " (nothing fit)"),
                        axis_label(sweep), "tokens/s (measured)",
                        series_by_attention(sweep, "", [](const SweepPoint& p) { return p.tokens_per_second; }));
}

std::string sweep_terminal_table(const json& value) {
  const Sweep sweep = parse_sweep(value);
  std::vector<std::string> headers = {sweep.vary};
  for (const std::string& attn : sweep.attention)
    for (const char* column : {"planned peak", "attention", "tokens/s", "MFU"})
      headers.push_back(attn + " " + column);
  std::map<int64_t, std::vector<std::string>> rows;
  for (const SweepPoint& p : sweep.points) {
    std::vector<std::string>& row = rows[p.value];
    if (row.empty()) {
      row.assign(headers.size(), "-");
      row[0] = std::to_string(p.value);
    }
    const size_t a = std::find(sweep.attention.begin(), sweep.attention.end(), p.attn) - sweep.attention.begin();
    if (a >= sweep.attention.size()) continue;
    row[1 + 4 * a] = format_bytes(p.planned_peak_bytes);
    row[2 + 4 * a] = format_bytes(p.attention_bytes);
    row[3 + 4 * a] = p.measured ? rate(p.tokens_per_second) : (p.fits_device ? "-" : "too big");
    row[4 + 4 * a] = p.mfu ? fmt::format("{:.1f}%", *p.mfu * 100) : "-";
  }
  std::vector<size_t> widths(headers.size());
  for (size_t c = 0; c < headers.size(); ++c) {
    widths[c] = headers[c].size();
    for (const auto& [v, row] : rows) widths[c] = std::max(widths[c], row[c].size());
  }
  const auto emit = [&](const std::vector<std::string>& cells) {
    std::string line;
    for (size_t c = 0; c < cells.size(); ++c) {
      if (c > 0) line += "  ";
      line += fmt::format("{:>{}}", cells[c], widths[c]);
    }
    return line + "\n";
  };
  std::string out = fmt::format("memtune sweep: {} over {} on {}{}\n", sweep.model, sweep.varied_option, sweep.device,
                                sweep.plan_only ? " (plan only)" : "");
  out += emit(headers);
  std::vector<std::string> rule;
  for (size_t w : widths) rule.emplace_back(w, '-');
  out += emit(rule);
  for (const auto& [v, row] : rows) out += emit(row);
  out += "attention = peak bytes of the buffers that depend on the attention implementation (eager: scores and\n"
         "probabilities, [batch, heads, seq, seq]; flash: log-sum-exp rows and backward scratch).\n";
  if (const json* growth = json_find(value, "growth", "sweep"); growth && growth->is_array()) {
    for (const std::string& attn : sweep.attention) {
      std::string line;
      for (const json& g : *growth) {
        if (!g.is_object() || g.value("attn_implementation", "") != attn || !g.contains("attention_bytes_ratio") ||
            !g["attention_bytes_ratio"].is_number())
          continue;
        line += fmt::format("{}{}->{}: x{:.2f}", line.empty() ? "" : ", ", g["from"].dump(), g["to"].dump(),
                            g["attention_bytes_ratio"].get<double>());
      }
      if (!line.empty()) out += fmt::format("{} attention bytes: {}\n", attn, line);
    }
  }
  return out;
}

std::string sweep_csv(const json& value) {
  const Sweep sweep = parse_sweep(value);
  std::vector<std::string> header = {"value", "attn_implementation", "name", "seq", "micro_batch", "grad_accum",
                                     "planned_peak_bytes", "attention_bytes", "planned_with_context_bytes",
                                     "fits_device", "fits_budget", "measured", "engine_peak_bytes",
                                     "device_peak_bytes", "step_seconds", "tokens_per_second", "loss", "mfu",
                                     "model_flops_per_token"};
  for (int c = 0; c < kNumMemCategories; ++c) header.push_back("planned_" + std::string(category_name(category_at(c))));
  const auto field = [](const json& v) -> std::string {
    if (v.is_null()) return "";
    if (v.is_string()) return v.get<std::string>();
    if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
    if (v.is_number_float()) return fmt::format("{}", v.get<double>());
    return v.dump();
  };
  const auto quoted = [](std::string text) {
    if (text.find_first_of(",\"\r\n") == std::string::npos) return text;
    std::string out = "\"";
    for (char c : text) out += c == '"' ? std::string("\"\"") : std::string(1, c);
    return out + "\"";
  };
  std::string out;
  const auto emit = [&](const std::vector<std::string>& fields) {
    for (size_t i = 0; i < fields.size(); ++i) {
      if (i > 0) out += ',';
      out += quoted(fields[i]);
    }
    out += "\r\n";
  };
  emit(header);
  for (const json& p : value.at("points")) {
    std::vector<std::string> row;
    for (size_t i = 0; i < header.size(); ++i) {
      const std::string& key = header[i];
      if (key.starts_with("planned_") && p.contains("planned") && p["planned"].contains(key.substr(8)))
        row.push_back(field(p["planned"][key.substr(8)]));
      else
        row.push_back(p.contains(key) ? field(p[key]) : "");
    }
    emit(row);
  }
  return out;
}

void write_sweep_outputs(const json& sweep, const std::filesystem::path& out_dir) {
  write_output_files(out_dir, "sweep",
                     {{"sweep.json", sweep.dump(2, ' ', false, json::error_handler_t::replace) + "\n"},
                      {"sweep.csv", sweep_csv(sweep)},
                      {"sweep_memory.svg", sweep_memory_svg(sweep)},
                      {"sweep_tokens_per_second.svg", sweep_speed_svg(sweep)}});
}

}  // namespace memtune
