#!/usr/bin/env python3
"""CPU check of bench/peer_hf.py (not part of CI: it needs torch, transformers and peft, which CI
does not install). Runs the whole ladder on configs/models/tiny.json, 2 steps, seq 32, on the CPU
(about a minute on two cores) and checks the JSON it writes.

    python3 bench/test_peer_hf.py          # or: python3 -m pytest bench/test_peer_hf.py
"""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import peer_hf  # noqa: E402

TINY = os.path.join(REPO, "configs", "models", "tiny.json")
HAVE_DEPS = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft"))


class PlanTest(unittest.TestCase):
    def test_default_order_matches_memtune(self):
        args = peer_hf.parse_args(["--batch", "2", "--accum", "8", "--seq", "2048"])
        rungs = peer_hf.plan_rungs(args)
        self.assertEqual([r["added"] for r in rungs], [""] + peer_hf.TRICKS)
        self.assertEqual(rungs[0]["name"], "fp16 baseline")
        last = rungs[-1]
        self.assertEqual((last["batch"], last["accum"], last["seq"]), (1, 16, 1024))
        self.assertEqual(last["precision"], "bf16")
        self.assertTrue(last["qlora"] and last["checkpointing"])
        self.assertEqual(last["attention"], "flash")
        # The peer has no chunked loss: only that rung says chunked, the later ones compute the full loss.
        self.assertEqual([r["loss"] for r in rungs].count("chunked"), 1)
        self.assertEqual(peer_hf.techniques_of(last),
                         ["bf16+nf4-base", "flash", "checkpointing", "full-loss", "batch 1 x accumulation 16",
                          "seq 1024"])

    def test_custom_order(self):
        args = peer_hf.parse_args(["--order", "micro_batch,qlora", "--batch", "4", "--accum", "2"])
        rungs = peer_hf.plan_rungs(args)
        self.assertEqual([r["added"] for r in rungs], ["", "micro_batch", "qlora"])
        self.assertEqual((rungs[1]["batch"], rungs[1]["accum"]), (1, 8))
        self.assertEqual(rungs[2]["precision"], "fp16")  # qlora keeps the rung's precision, as memtune does

    def test_unknown_trick_is_refused(self):
        with self.assertRaises(SystemExit):
            peer_hf.parse_args(["--order", "bf16,nope"])


@unittest.skipUnless(HAVE_DEPS, "needs torch, transformers and peft")
class CpuLadderTest(unittest.TestCase):
    def test_cpu_ladder(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "peer.json")
            cmd = [sys.executable, os.path.join(HERE, "peer_hf.py"), "--device", "cpu", "--config", TINY,
                   "--steps", "2", "--seq", "32", "--accum", "1", "--out", out]
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=900)
            self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
            self.assertIn("fp16 baseline", proc.stdout)
            with open(out) as f:
                report = json.load(f)
        for key in ("peer", "device", "date", "config", "rungs"):
            self.assertIn(key, report)
        self.assertEqual(report["device"], "cpu")
        self.assertIn("transformers ", report["peer"])
        rungs = {r["added"]: r for r in report["rungs"]}
        self.assertEqual(list(rungs), [""] + peer_hf.TRICKS)
        have_bnb = importlib.util.find_spec("bitsandbytes") is not None
        for key, r in rungs.items():
            for field in ("name", "added", "techniques", "measured", "micro_batch", "grad_accum", "seq"):
                self.assertIn(field, r, key)
            if key == "chunked_loss":
                self.assertFalse(r["measured"])
                self.assertEqual(r["error"], "no equivalent in transformers")
                continue
            if key == "qlora" and not have_bnb:
                self.assertFalse(r["measured"])
                self.assertEqual(r["error"], "bitsandbytes not installed")
                continue
            self.assertTrue(r["measured"], f"{key}: {r.get('error')}")
            self.assertGreater(r["tokens_per_second"], 0)
            self.assertGreater(r["step_seconds"], 0)
            self.assertTrue(5.0 < r["loss"] < 7.5, r["loss"])  # ~ln(512) on random tokens
            self.assertEqual(r["trainable_parameters"], 149504)  # r16 on the 7 projections of tiny
        self.assertEqual(rungs[""]["loss_scaler"]["skipped_steps"], 0)
        self.assertEqual(rungs[""]["loss_scaler"]["final_scale"], 65536.0)
        self.assertEqual(rungs["micro_batch"]["grad_accum"], 2)
        self.assertEqual(rungs["seq_halved"]["seq"], 16)
        if have_bnb:
            self.assertEqual(rungs["qlora"]["settings"]["quantized_linears"], 4 * 7)


if __name__ == "__main__":
    unittest.main(verbosity=2)
