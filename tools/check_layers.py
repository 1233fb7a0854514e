#!/usr/bin/env python3
"""The rooms of src/memtune/ may include only the rooms that docs/ARCHITECTURE.md lets them
include. Prints every include that reaches up a floor (file:line, room -> room) and exits 1 if
there is one; exits 0 with a one-line summary otherwise.

  python3 tools/check_layers.py [REPO]
"""
import os
import re
import sys

# docs/ARCHITECTURE.md's table, "may include" column: keep the two in step.
FLOORS_0_4 = {"core", "io", "quant", "ops", "model", "data", "lora"}
ALLOWED = {
    "core": set(),
    "io": {"core"},
    "quant": {"core"},
    "ops": {"core", "quant"},
    "model": {"core", "io", "quant", "ops"},
    "data": {"core", "io", "ops"},
    "lora": {"core", "io", "quant", "ops", "model"},
    "step": FLOORS_0_4,
    "train": FLOORS_0_4 | {"step", "parallel"},
    "parallel": FLOORS_0_4 | {"step", "train"},
    "plan": FLOORS_0_4 | {"step", "train", "parallel"},
    "report": {"core", "io"},
    "experiment": FLOORS_0_4 | {"step", "train", "parallel", "plan", "report"},
    "cli": None,  # everything
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"memtune/([a-z_]+)/')


def main(repo):
    root = os.path.join(repo, "src", "memtune")
    problems, files = [], 0
    for dirpath, _, names in os.walk(root):
        for name in sorted(names):
            if not name.endswith((".h", ".cpp", ".cu", ".cuh")):
                continue
            path = os.path.join(dirpath, name)
            room = os.path.relpath(path, root).split(os.sep)[0]
            if room not in ALLOWED:
                problems.append(f"{os.path.relpath(path, repo)}: room {room!r} is not in docs/ARCHITECTURE.md's table")
                continue
            files += 1
            allowed = ALLOWED[room]
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if not m or allowed is None:
                        continue
                    target = m.group(1)
                    if target != room and target not in allowed:
                        problems.append(f"{os.path.relpath(path, repo)}:{number}: {room} includes {target} "
                                        f"(it may include: {', '.join(sorted(allowed)) or 'nothing of memtune'})")
    for p in problems:
        print(p)
    print(f"check_layers: {files} files, {len(problems)} include(s) against the floors of docs/ARCHITECTURE.md")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")))
