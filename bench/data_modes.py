#!/usr/bin/env python3
"""One line for a `memtune train --metrics` file: the step records after the first SKIP (2), the
profiled one (train --profile) left out, as
tokens of samples per second, trained targets per second, token slots computed per second and
the padding share; with an nvidia-smi sample file (MiB, one per line) also the device peak.

    python3 bench/data_modes.py run.metrics.jsonl [run.smi] [--skip N] [--json]
"""
import json
import sys


def summarise(metrics_path, smi_path=None, skip=2):
    steps = []
    with open(metrics_path) as f:
        for line in f:
            record = json.loads(line)
            # A profiled step (train --profile) times every op alone: not a speed figure.
            if record.get("event") == "step" and record.get("command") == "train" and not record.get("profiled"):
                steps.append(record)
    timed = steps[skip:] if len(steps) > skip else steps
    seconds = sum(r["step_seconds"] for r in timed)
    out = {"steps_timed": len(timed), "seconds": seconds}
    for key in ("tokens", "targets", "computed_tokens"):
        total = sum(r[key] for r in timed)
        out[key] = total
        out[key + "_per_second"] = total / seconds if seconds > 0 else None
    out["padding_fraction"] = 1 - out["tokens"] / out["computed_tokens"] if out["computed_tokens"] else None
    if smi_path:
        values = []
        with open(smi_path) as f:
            for line in f:
                try:
                    values.append(int(line.strip()))
                except ValueError:
                    pass
        out["device_peak_mib"] = max(values) if values else None
    return out


def main(argv):
    args = [a for a in argv if not a.startswith("--")]
    skip = 2
    if "--skip" in argv:
        skip = int(argv[argv.index("--skip") + 1])
        args.remove(str(skip))
    s = summarise(args[0], args[1] if len(args) > 1 else None, skip)
    if "--json" in argv:
        print(json.dumps(s))
        return
    print(f"{s['tokens_per_second']:.0f} tokens/s of samples, {s['targets_per_second']:.0f} targets/s, "
          f"{s['computed_tokens_per_second']:.0f} computed slots/s, padding {100 * s['padding_fraction']:.1f}%, "
          f"device peak {s.get('device_peak_mib')} MiB ({s['steps_timed']} steps timed)")


if __name__ == "__main__":
    main(sys.argv[1:])
