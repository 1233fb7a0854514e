#!/usr/bin/env python3
"""CPU check of bench/peers_table.py (Python only, part of CI): a made-up results folder with one
memtune configuration run, an Unsloth report, a Liger data report and a context search; the tables
must carry exactly their figures and ratios, and leave out what is not there.

    python3 bench/test_peers_table.py
"""
import json
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import peers_table  # noqa: E402

MIB = 2 ** 20


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def steps(n, seconds, tokens, targets, computed):
    return "".join(json.dumps({"event": "step", "command": "train", "step_seconds": seconds, "tokens": tokens,
                               "targets": targets, "computed_tokens": computed}) + "\n" for _ in range(n))


class PeersTableTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        root = self.tmp.name
        # memtune, configuration 1: 5 steps of 8,192 tokens in 0.5 s; the first two are not timed.
        write(f"{root}/call1/run1/configs/qlora.jsonl",
              steps(2, 9.0, 8192, 8190, 8192) + steps(3, 0.5, 8192, 8190, 8192))
        write(f"{root}/call1/run1/configs/qlora.smi", "100\n6000\n5000\n")
        write(f"{root}/call1/run1/device.txt", "name, driver_version\nNVIDIA H200, 580\n")
        # Unsloth's QLoRA rung: 8,192 tokens/s at 8,000 MiB.
        unsloth = {"tool": "unsloth", "device": "NVIDIA H200", "config": {"lora_r": 16, "packing": None},
                   "rungs": [{"name": "+ bf16", "measured": False},
                             {"name": "+ QLoRA (nf4, double quant)", "added": "qlora", "measured": True,
                              "tokens_per_second": 8192.0, "device_peak_bytes": 8000 * MIB}]}
        write(f"{root}/call2/run1/unsloth.json", json.dumps(unsloth))
        # Liger on configuration 2 (r32, accumulation 4, real data, unpacked).
        liger = {"tool": "transformers+peft+bnb+liger", "device": "NVIDIA H200",
                 "config": {"liger": True, "lora_r": 32, "gradient_accumulation_steps": 4, "packing": False},
                 "rungs": [{"name": "+ QLoRA (nf4, double quant)", "added": "qlora", "measured": True,
                            "tokens_per_second": 900.0, "real_tokens_per_second": 300.0,
                            "target_tokens_per_second": 80.0, "device_peak_bytes": 7000 * MIB}]}
        write(f"{root}/call1/run3/peer-data/peer-data.json", json.dumps(liger))
        # transformers + PEFT's context search: 16,384 fitted, 24,576 did not.
        context = {"tool": "transformers+peft+bnb", "device": "NVIDIA H200", "config": {"liger": False},
                   "rungs": [], "max_context": {"cap_gib": 24, "range": [8192, 40960], "max_seq": 16384,
                                                "probes": [{"seq": 24576, "fits": False}, {"seq": 16384, "fits": True}],
                                                "run": {"measured": True, "tokens_per_second": 3000.0,
                                                        "device_peak_bytes": 20000 * MIB}}}
        write(f"{root}/call3/run2/peer-context-24.json", json.dumps(context))
        self.rows, self.devices, _ = peers_table.collect(root)

    def tearDown(self):
        self.tmp.cleanup()

    def test_figures_land_in_their_configuration(self):
        memtune = self.rows["1"][("memtune", "qlora")]
        self.assertAlmostEqual(memtune["tokens_per_second"], 16384.0)  # the first two steps left out
        self.assertEqual(memtune["device_peak_bytes"], 6000 * MIB)
        self.assertEqual(self.rows["1"][("Unsloth", "qlora")]["tokens_per_second"], 8192.0)
        liger = self.rows["2"][("transformers + PEFT + bnb + Liger", "unpacked")]
        self.assertEqual(liger["real_tokens_per_second"], 300.0)
        self.assertEqual(self.rows["4"][("transformers + PEFT + bnb", "cap 24 GiB")]["seq"], 16384)
        self.assertEqual(self.rows["3"], {})
        self.assertIn("NVIDIA H200", self.devices)

    def test_tables_print_the_ratios_against_unsloth(self):
        table = peers_table.speed_memory_table("c1", self.rows["1"], ("Unsloth", "qlora"))
        self.assertIn("| memtune | qlora | 16,384 | 6,000 MiB (5.86 GiB) | 2.00x, 0.75x |", table)
        # No Unsloth figure: the table says so instead of a ratio against nothing.
        table2 = peers_table.speed_memory_table("c2", self.rows["2"], ("Unsloth", "unpacked"),
                                                speed_field="real_tokens_per_second")
        self.assertIn("| 300 |", table2)
        self.assertIn("not in these results", table2)
        ctx = peers_table.context_table(self.rows["4"])
        self.assertIn("| 16384 | bisection in [8192, 40960]; a step ran at 16384; out of memory at 24576 | 3,000 |", ctx)

    def test_two_searches_under_one_cap_are_one_row(self):
        # A second call searched lower: 49,152 ran its probe step, but the timed run there failed.
        second = {"tool": "transformers+peft+bnb", "device": "NVIDIA H200", "config": {"liger": False},
                  "rungs": [], "max_context": {"cap_gib": 24, "range": [32768, 49152], "max_seq": 49152,
                                               "probes": [{"seq": 49152, "fits": True}],
                                               "run": {"measured": False, "error": "CUDA out of memory"}}}
        write(f"{self.tmp.name}/call4/run1/peer-context-24.json", json.dumps(second))
        # The same file unpacked twice (a reused work folder) counts once.
        write(f"{self.tmp.name}/call4/run2/peer-context-24.json", json.dumps(second))
        rows, _, _ = peers_table.collect(self.tmp.name)
        ctx = peers_table.context_table(rows["4"])
        # The longest timed length stays the answer; the longer one whose timed run failed is named.
        self.assertIn("| 16384 (49152: its 1-step probe ran, the timed run did not) | "
                      "bisection in [8192, 40960] and [32768, 49152]; a step ran at 16384, 49152; "
                      "out of memory at 24576 | 3,000 |", ctx)

    def test_probes_that_are_the_timed_run(self):
        # The current search: each probe runs the timed steps; a one-step probe is its own timed run.
        for cap, probe_steps, timed, words in ((80, 1, 1, "a step ran (one step, timed with its warm-up)"),
                                               (79, 2, 1, "2 steps ran")):
            report = {"tool": "unsloth", "peer": "unsloth 2026.10.9", "device": "NVIDIA H100 80GB HBM3",
                      "config": {}, "rungs": [],
                      "max_context": {"cap_gib": cap, "range": [131072, 163840], "max_seq": 147456,
                                      "probe_steps": probe_steps,
                                      "probes": [{"seq": 147456, "fits": True}, {"seq": 163840, "fits": False}],
                                      "run": {"measured": True, "tokens_per_second": 1500.0, "timed_steps": timed,
                                              "device_peak_bytes": 70 * 2**30}}}
            write(f"{self.tmp.name}/call9/unsloth-context-{cap}.json", json.dumps(report))
        rows, _, _ = peers_table.collect(self.tmp.name)
        ctx = peers_table.context_table(rows["4"])
        self.assertIn("| cap 80 GiB | 147456 | bisection in [131072, 163840]; a step ran (one step, timed with its "
                      "warm-up) at 147456; out of memory at 163840 | 1,500 |", ctx)
        self.assertIn("| cap 79 GiB | 147456 | bisection in [131072, 163840]; 2 steps ran at 147456; out of memory "
                      "at 163840 | 1,500 |", ctx)

    def test_longctx_runs_and_probes_that_failed_otherwise(self):
        # device-check's longctx part: one step of 262,144 tokens with offload under a 79 GiB fit.
        folder = f"{self.tmp.name}/call5/run1/longctx"
        write(f"{folder}/metrics.jsonl", steps(1, 170.0, 262144, 262143, 262144))
        write(f"{folder}/smi.log", "0\n30000\n30603\n")
        write(f"{folder}/fit-79GiB.json", json.dumps({"budget_bytes": 79 * 2**30,
                                                      "with_offload": {"seq": 529408},
                                                      "without_offload": {"seq": 236800}}))
        # An Unsloth probe killed by a signal is not "out of memory" in the table.
        report = {"tool": "unsloth", "device": "NVIDIA H100 80GB HBM3", "config": {}, "rungs": [],
                  "max_context": {"cap_gib": 79, "range": [294912, 294912], "max_seq": None, "probe_steps": 1,
                                  "probes": [{"seq": 294912, "fits": False,
                                              "error": "process died (killed by signal 9) without a result"}],
                                  "run": {}}}
        write(f"{self.tmp.name}/call6/unsloth-context-79.json", json.dumps(report))
        rows, _, _ = peers_table.collect(self.tmp.name)
        ctx = peers_table.context_table(rows["4"])
        self.assertIn("| memtune | --vram 79 GiB | 262144 | a length chosen for the call, trained with activation "
                      "offload, 1 step (the plan's longest with it: 529408) | 1,542 | 30,603 MiB (29.89 GiB) |", ctx)
        self.assertIn("| Unsloth | cap 79 GiB | none in range | bisection in [294912, 294912]; failed at 294912 "
                      "(process died (killed by signal 9) without a result) |", ctx)


if __name__ == "__main__":
    unittest.main()
