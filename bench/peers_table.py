#!/usr/bin/env python3
"""Issue 21's tables from one session's device results: memtune beside Unsloth, transformers + PEFT
+ bitsandbytes + Liger and transformers + PEFT + bitsandbytes on configurations 1-4, and issue 22's
data table, in Markdown.

    python3 bench/peers_table.py RESULTS_DIR [--json]

RESULTS_DIR holds the unpacked results of scripts/device-peers.sh's calls (each results-N.tar.gz
unpacked into a folder of its own, anywhere below RESULTS_DIR). Every figure is read from the files:
  memtune   configs/<variant>.jsonl + .smi (device-check's configs part), peer-data/memtune-<mode>.jsonl
            + .smi, edge/ (fit.json, metrics.jsonl, smi.log) and longctx/ (metrics.jsonl, smi.log,
            fit-<budget>.json): tokens/s over the steps after the first two (bench/data_modes.py; edge
            and longctx, a step or two of minutes: over every step), device peak = nvidia-smi's maximum
  peers     every *.json with a "tool" and "rungs" (bench/peer_hf.py, bench/peer_unsloth.py), sorted
            into a configuration by what it ran (LoRA rank, accumulation, data, packing, --max-context)
A figure that is missing prints as "not run"; nothing is filled in from elsewhere.
"""
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data_modes import summarise  # noqa: E402

MIB = 2 ** 20
GIB = 2 ** 30


def walk(root):
    for folder, _, files in os.walk(root):
        for name in files:
            yield os.path.join(folder, name)


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def tool_label(report):
    tool = report.get("tool", "")
    if tool == "unsloth":
        return "Unsloth"
    if report.get("config", {}).get("liger"):
        return "transformers + PEFT + bnb + Liger"
    return "transformers + PEFT + bnb"


def rung_kind(rung):
    """'qlora' or '16-bit' for a ladder rung of a peer report (the rung names of bench/peer_common)."""
    name = rung.get("name", "")
    if "QLoRA" in name or rung.get("added") == "qlora":
        return "qlora"
    if "flash" in name or rung.get("added") == "flash":
        return "16-bit"
    return None


def merge_searches(old, new):
    """Two context searches of one tool under one cap (e.g. a second call narrowing the range): one
    row with every probe, both ranges, and the longer length that was found with its timed run."""
    if old is None:
        return new
    # The longest length whose timed run went through; a longer one whose timed run failed is named.
    searches = [old, new]
    timed = [f for f in searches if f.get("seq") and not f.get("run_error")]
    best = max(timed or searches, key=lambda f: f.get("seq") or 0)
    merged = dict(best)
    failed = [f["seq"] for f in searches if f.get("run_error") and (f.get("seq") or 0) > (best.get("seq") or 0)]
    failed += [old.get("longer_failed") or 0, new.get("longer_failed") or 0]
    merged["longer_failed"] = max(failed) or None
    merged["probes"] = old["probes"] + new["probes"]
    merged["ranges"] = sorted((old.get("ranges") or [old.get("range")]) + (new.get("ranges") or [new.get("range")]))
    return merged


def collect(root):
    """Every measured figure under root, keyed by (configuration, tool label, variant)."""
    rows = {"1": {}, "2": {}, "3": {}, "4": {}, "data": {}}
    devices, commits, seen = set(), set(), set()
    for path in walk(root):
        base = os.path.basename(path)
        # The same file can be unpacked twice (a work folder reused by a later call on one machine).
        with open(path, "rb") as f:
            digest = (base, hashlib.sha256(f.read()).hexdigest())
        if digest in seen:
            continue
        seen.add(digest)
        if base == "device.txt":
            with open(path) as f:
                for line in f:
                    if line.strip() and not line.startswith("name,"):
                        devices.add(line.split(",")[0].strip())
        elif base == "commit.txt":
            with open(path) as f:
                commits.add(f.read().strip())
        elif base.endswith(".jsonl") and os.path.basename(os.path.dirname(path)) in ("configs", "peer-data"):
            name = base[:-len(".jsonl")]
            smi = path[:-len(".jsonl")] + ".smi"
            try:
                s = summarise(path, smi if os.path.exists(smi) else None)
            except (OSError, ValueError, KeyError):
                continue
            if not s["steps_timed"]:
                continue
            figure = {"tokens_per_second": s["tokens_per_second"], "targets_per_second": s["targets_per_second"],
                      "padding": s["padding_fraction"], "device_peak_bytes": (s.get("device_peak_mib") or 0) * MIB,
                      "source": path}
            folder = os.path.basename(os.path.dirname(path))
            if folder == "peer-data":
                rows["data"][("memtune", name.replace("memtune-", ""))] = figure
            elif name.startswith("qlora"):
                rows["1"][("memtune", name)] = figure
            elif name.startswith("lora16"):
                rows["3"][("memtune", name)] = figure
            elif name.startswith("data-"):
                rows["2"][("memtune", name)] = figure
        elif base == "fit.json" and os.path.basename(os.path.dirname(path)) == "edge":
            edge = os.path.dirname(path)
            fit = load_json(path) or {}
            metrics = os.path.join(edge, "metrics.jsonl")
            figure = {"seq": (fit.get("with_offload") or {}).get("seq"), "budget_bytes": fit.get("budget_bytes"),
                      "offload": True, "source": edge}
            if os.path.exists(metrics):
                try:
                    s = summarise(metrics, os.path.join(edge, "smi.log"), skip=0)
                    figure.update(tokens_per_second=s["tokens_per_second"], steps=s["steps_timed"],
                                  device_peak_bytes=(s.get("device_peak_mib") or 0) * MIB)
                    # The length trained (batch 1, no accumulation: a step's tokens), and which of
                    # fit's two lengths it was (device-check's EDGE_OFFLOAD).
                    trained = s["tokens"] // max(1, s["steps_timed"])
                    if trained and trained == (fit.get("without_offload") or {}).get("seq"):
                        figure.update(seq=trained, offload=False)
                except (OSError, ValueError, KeyError, ZeroDivisionError):
                    pass
            budget = fit.get("budget_bytes")
            rows["4"][("memtune", f"{budget / GIB:g} GiB" if budget else "edge")] = figure
        elif base == "metrics.jsonl" and os.path.basename(os.path.dirname(path)) == "longctx":
            # device-check's longctx part: `memtune train` with activation offload at a length chosen
            # by the call (LONG_SEQ) under --vram LONG_VRAM; the fit beside it (LONG_FIT_BUDGETS) gives
            # the budget where it is the only one, and the plan's longest length with offload.
            folder = os.path.dirname(path)
            fits = [load_json(os.path.join(folder, f)) or {} for f in sorted(os.listdir(folder))
                    if f.startswith("fit-") and f.endswith(".json")]
            fit = fits[0] if len(fits) == 1 else {}
            try:
                s = summarise(path, os.path.join(folder, "smi.log"), skip=0)
                steps_timed = s["steps_timed"]
                seq = s["tokens"] // max(1, steps_timed)
            except (OSError, ValueError, KeyError, ZeroDivisionError):
                continue
            if not steps_timed:
                continue
            budget = fit.get("budget_bytes")
            figure = {"seq": seq, "budget_bytes": budget, "offload": True, "longctx": True, "steps": steps_timed,
                      "plan_seq": (fit.get("with_offload") or {}).get("seq"),
                      "tokens_per_second": s["tokens_per_second"],
                      "device_peak_bytes": (s.get("device_peak_mib") or 0) * MIB, "source": folder}
            rows["4"][("memtune", f"{budget / GIB:g} GiB offload {seq}" if budget else f"offload {seq}")] = figure
        elif base.endswith(".json"):
            report = load_json(path)
            if not isinstance(report, dict) or "rungs" not in report or "tool" not in report:
                continue
            devices.add(str(report.get("device", "")))
            label, cfg = tool_label(report), report.get("config", {})
            if report.get("max_context"):
                mc = report["max_context"]
                run = mc.get("run") or {}
                key = (label, f"cap {mc.get('cap_gib'):g} GiB")
                figure = {"seq": mc.get("max_seq"), "range": mc.get("range"), "probes": mc.get("probes") or [],
                          "probe_steps": mc.get("probe_steps") or 1, "run_timed_steps": run.get("timed_steps"),
                          "run_error": None if run.get("measured") or not mc.get("max_seq") else run.get("error"),
                          "tokens_per_second": run.get("tokens_per_second") if run.get("measured") else None,
                          "device_peak_bytes": run.get("device_peak_bytes"), "source": path}
                rows["4"][key] = merge_searches(rows["4"].get(key), figure)
                continue
            for rung in report["rungs"]:
                if not rung.get("measured"):
                    continue
                figure = {"tokens_per_second": rung.get("tokens_per_second"),
                          "real_tokens_per_second": rung.get("real_tokens_per_second"),
                          "targets_per_second": rung.get("target_tokens_per_second"),
                          "device_peak_bytes": rung.get("device_peak_bytes"), "source": path}
                if cfg.get("packing") is not None:   # real data
                    shape = "2" if cfg.get("lora_r") == 32 and cfg.get("gradient_accumulation_steps") == 4 else "data"
                    rows[shape][(label, "packed" if cfg.get("packing") else "unpacked")] = figure
                elif rung_kind(rung) == "qlora":
                    rows["1"][(label, "qlora")] = figure
                elif rung_kind(rung) == "16-bit":
                    rows["3"][(label, "16-bit")] = figure
    return rows, sorted(d for d in devices if d), sorted(commits)


def fmt_tps(x):
    return "not run" if x is None else f"{x:,.0f}"


def fmt_peak(b):
    return "-" if not b else f"{b / MIB:,.0f} MiB ({b / GIB:.2f} GiB)"


def ratio(a, b):
    return "-" if not a or not b else f"{a / b:.2f}x"


def table_start(title, columns, aligns):
    """A Markdown table's title and header lines."""
    return [f"### {title}", "", "| " + " | ".join(columns) + " |", "|" + "|".join(aligns) + "|"]


def memtune_first(group):
    """A table's rows: memtune's first, then the peers, each in name order."""
    return sorted(group.items(), key=lambda kv: (kv[0][0] != "memtune", kv[0]))


def speed_memory_table(title, group, unsloth_key, speed_field="tokens_per_second"):
    lines = table_start(title, ["tool", "variant", "tokens/s", "device peak", "x Unsloth (speed, peak)"],
                        ["---", "---", "---:", "---:", "---"])
    base = group.get(unsloth_key) or {}
    for (tool, variant), f in memtune_first(group):
        tps = f.get(speed_field) or f.get("tokens_per_second")
        ref = base.get(speed_field) or base.get("tokens_per_second")
        vs = "" if (tool, variant) == unsloth_key else f"{ratio(tps, ref)}, {ratio(f.get('device_peak_bytes'), base.get('device_peak_bytes'))}"
        lines.append(f"| {tool} | {variant} | {fmt_tps(tps)} | {fmt_peak(f.get('device_peak_bytes'))} | {vs} |")
    if not base:
        lines.append("")
        lines.append("(Unsloth's figure for this configuration is not in these results.)")
    return "\n".join(lines) + "\n"


def context_table(group):
    lines = table_start("Configuration 4: the longest trainable context at batch 1",
                        ["tool", "cap", "longest length", "searched", "tokens/s there", "device peak there"],
                        ["---", "---", "---:", "---", "---:", "---:"])
    for (tool, variant), f in memtune_first(group):
        if tool == "memtune":
            cap = f"--vram {f['budget_bytes'] / GIB:g} GiB" if f.get("budget_bytes") else "--vram"
            if f.get("longctx"):
                plan = f" (the plan's longest with it: {f['plan_seq']})" if f.get("plan_seq") else ""
                searched = (f"a length chosen for the call, trained with activation offload, "
                            f"{f['steps']} step{'s' if f['steps'] != 1 else ''}{plan}")
            else:
                searched = (f"the plan (`fit --max-context`, activation offload {'on' if f.get('offload') else 'off'}), "
                            "trained at it")
        else:
            cap = variant
            ranges = f.get("ranges") or [f.get("range") or ["?", "?"]]
            probes = f.get("probes") or []
            fits = sorted(p["seq"] for p in probes if p.get("fits"))
            # A probe that failed for another reason than the device's memory says so.
            def out_of_memory(p):
                return not p.get("error") or "out of memory" in str(p["error"]).lower()
            fails = sorted(p["seq"] for p in probes if not p.get("fits") and out_of_memory(p))
            others = sorted((p["seq"], p["error"]) for p in probes if not p.get("fits") and not out_of_memory(p))
            # A one-step probe that is also the timed run: its figure holds its warm-up, and one step
            # says less than the steady state (the optimizer's state is allocated in that step).
            steps = f.get("probe_steps") or 1
            ran = ("a step ran (one step, timed with its warm-up)" if steps == 1 and f.get("run_timed_steps") == 1
                   else "a step ran" if steps == 1 else f"{steps} steps ran")
            searched = ("bisection in " + " and ".join(f"[{r[0]}, {r[1]}]" for r in ranges)
                        + (f"; {ran} at {', '.join(map(str, fits))}" if fits else "")
                        + (f"; out of memory at {', '.join(map(str, fails))}" if fails else "")
                        + "".join(f"; failed at {q} ({error})" for q, error in others))
        seq = f.get("seq")
        if not seq:
            seq = "none in range"
        elif f.get("run_error"):
            seq = f"{seq}: its 1-step probe ran, the timed run did not ({f['run_error']})"
        if f.get("longer_failed"):
            seq = f"{seq} ({f['longer_failed']}: its 1-step probe ran, the timed run did not)"
        lines.append(f"| {tool} | {cap} | {seq} | {searched} | "
                     f"{fmt_tps(f.get('tokens_per_second'))} | {fmt_peak(f.get('device_peak_bytes'))} |")
    return "\n".join(lines) + "\n"


def data_table(group):
    lines = table_start("Issue 22: real data (sft-tasks.jsonl x 30, Llama 3 tokenizer, QLoRA full stack, 2 x 2048, "
                        "accumulation 2)",
                        ["tool", "mode", "tokens of samples / s", "trained targets / s", "padding computed", "device peak"],
                        ["---", "---", "---:", "---:", "---:", "---:"])
    for (tool, mode), f in memtune_first(group):
        real = f.get("real_tokens_per_second") or f.get("tokens_per_second")
        pad = f.get("padding")
        lines.append(f"| {tool} | {mode} | {fmt_tps(real)} | {fmt_tps(f.get('targets_per_second'))} | "
                     f"{'-' if pad is None else f'{100 * pad:.1f}%'} | {fmt_peak(f.get('device_peak_bytes'))} |")
    return "\n".join(lines) + "\n"


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    rows, devices, commits = collect(argv[0])
    if "--json" in argv:
        print(json.dumps({k: {" / ".join(key): v for key, v in g.items()} for k, g in rows.items()}, indent=1))
        return 0
    print(f"devices: {'; '.join(devices) or 'unknown'}")
    print(f"memtune binaries: {', '.join(commits) or 'unknown'}\n")
    print(speed_memory_table("Configuration 1: QLoRA, 2 x 2048, accumulation 2, r16, random ids", rows["1"],
                             ("Unsloth", "qlora")))
    print(speed_memory_table("Configuration 2: QLoRA, 2 x 2048, accumulation 4, r32, sft-tasks.jsonl x 30 "
                             "(tokens of samples / s)", rows["2"], ("Unsloth", "unpacked"),
                             speed_field="real_tokens_per_second"))
    print(speed_memory_table("Configuration 3: 16-bit LoRA, 2 x 2048, accumulation 2, r16, random ids", rows["3"],
                             ("Unsloth", "16-bit")))
    print(context_table(rows["4"]))
    print(data_table(rows["data"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
