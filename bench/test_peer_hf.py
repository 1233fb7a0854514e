#!/usr/bin/env python3
"""CPU check of bench/peer_hf.py, bench/peer_common.py and bench/peer_unsloth.py (not part of CI:
it needs torch, transformers and peft, which CI does not install). Runs the whole ladder on
configs/models/tiny.json, 2 steps, seq 32, on the CPU (about a minute on two cores) and checks the
JSON it writes; checks the real-data batches (chat template labels, padding, packing: a packed
row's logits equal its samples' run one by one), the bisection, the data and max-context modes on
the CPU, and, where unsloth imports (its CPU fallback), peer_unsloth.py's 16-bit rung. The Llama
3 tokenizer is read from ../shared/data/llama3-tokenizer/ (PEER_TOKENIZER overrides); without it
those tests skip.

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
import peer_common  # noqa: E402
import peer_hf  # noqa: E402

TINY = os.path.join(REPO, "configs", "models", "tiny.json")
SFT = os.path.join(REPO, "examples", "sft-tasks.jsonl")
HAVE_DEPS = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft"))
TOKENIZER = os.environ.get("PEER_TOKENIZER") or os.path.join(REPO, "..", "shared", "data", "llama3-tokenizer",
                                                             "tokenizer.json")
HAVE_TOKENIZER = os.path.isfile(TOKENIZER)


def run_peer(script, *argv, timeout=900):
    proc = subprocess.run([sys.executable, os.path.join(HERE, script), *argv], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=timeout)
    return proc


class BisectTest(unittest.TestCase):
    def test_finds_the_edge(self):
        for edge in (1024, 5120, 7168, 65536):
            seen = []

            def probe(seq):
                seen.append(seq)
                return {"seq": seq, "fits": seq <= edge}

            found, probes = peer_common.bisect_max_context(probe, 1024, 65536, 1024)
            self.assertEqual(found, edge)
            self.assertEqual([p["seq"] for p in probes], seen)
            self.assertLessEqual(len(probes), 7)  # log2(64 + 2) rounded up
            self.assertTrue(all(s % 1024 == 0 for s in seen))

    def test_nothing_fits(self):
        found, probes = peer_common.bisect_max_context(lambda s: {"fits": False}, 2048, 8192, 1024)
        self.assertIsNone(found)
        self.assertTrue(probes)


class MaxContextRunTest(unittest.TestCase):
    """run_max_context with a made-up probe: every probe runs the timed steps + 1, and the longest
    one that ran them all is the timed run (no second child at that length)."""

    def test_the_longest_fitting_probe_is_the_run(self):
        import types

        calls = []

        def probe(seq, steps):
            calls.append((seq, steps))
            fits = seq <= 5120
            return {"seq": seq, "measured": fits, "error": None if fits else "CUDA out of memory",
                    "tokens_per_second": 1000.0 + seq if fits else None, "timed_steps": steps - 1}

        args = types.SimpleNamespace(context_steps=2, context_min=1024, context_max=8192, context_unit=1024,
                                     cap_gib=24.0, out="")
        report = peer_common.run_max_context(args, {"rungs": []}, probe, types.SimpleNamespace())
        mc = report["max_context"]
        self.assertEqual(mc["max_seq"], 5120)
        self.assertEqual(mc["probe_steps"], 3)
        self.assertTrue(all(steps == 3 for _, steps in calls))
        self.assertEqual(len(calls), len(mc["probes"]))  # no extra child for the timed run
        (run,) = report["rungs"]
        self.assertEqual((run["seq"], run["tokens_per_second"]), (5120, 6120.0))
        self.assertEqual(mc["run"]["timed_steps"], 2)

    def test_nothing_fits_gives_no_run(self):
        import types

        args = types.SimpleNamespace(context_steps=0, context_min=2048, context_max=2048, context_unit=2048,
                                     cap_gib=80.0, out="")
        report = peer_common.run_max_context(args, {"rungs": []},
                                             lambda seq, steps: {"seq": seq, "measured": False,
                                                                 "error": "CUDA out of memory"},
                                             types.SimpleNamespace())
        self.assertIsNone(report["max_context"]["max_seq"])
        self.assertEqual([p["seq"] for p in report["max_context"]["probes"]], [2048])
        self.assertEqual(report["max_context"]["probe_steps"], 1)
        self.assertEqual(report["rungs"], [])


class PackTest(unittest.TestCase):
    def test_best_fit_decreasing(self):
        samples = [{"input_ids": [0] * n} for n in (5, 3, 8, 2, 6, 4)]
        rows = peer_common.pack_bfd(samples, 10)
        self.assertEqual(sorted(i for r in rows for i in r), list(range(6)))
        for r in rows:
            self.assertLessEqual(sum(len(samples[i]["input_ids"]) for i in r), 10)
        # longest first: 8 opens row 0, 6 row 1, 5 row 2; 4 fits row 1 (room 4), 3 row 2, 2 row 0
        self.assertEqual(rows, [[2, 3], [4, 5], [0, 1]])


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
            # QLoRA and the rungs after it (they keep every trick before them) need bitsandbytes.
            if "+nf4-base" in r["techniques"][0] and not have_bnb:
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


@unittest.skipUnless(HAVE_DEPS and HAVE_TOKENIZER, "needs torch, transformers, peft and the Llama 3 tokenizer")
class DataTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tok = peer_common.load_chat_tokenizer(TOKENIZER)
        cls.samples, cls.stats = peer_common.read_sft_jsonl(SFT, cls.tok, 256)

    def test_assistant_only_labels(self):
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " 2+2? "},
                    {"role": "assistant", "content": "4."}, {"role": "user", "content": "and 3+3"},
                    {"role": "assistant", "content": " 6 "}]
        ids, labels = peer_common.encode_messages(self.tok, messages)
        self.assertEqual(ids[0], self.tok.convert_tokens_to_ids("<|begin_of_text|>"))
        trained = [t for t in labels if t != -100]
        # memtune's rule (chat_template.h): each assistant content (trimmed) and its closing <|eot_id|>
        self.assertEqual(self.tok.decode(trained), "4.<|eot_id|>6<|eot_id|>")
        self.assertEqual(len(ids), len(labels))
        self.assertEqual(ids, self.tok(self.tok.apply_chat_template(messages, tokenize=False),
                                       add_special_tokens=False)["input_ids"])

    def test_file_and_repeat(self):
        self.assertEqual(self.stats["lines_used"], 360)
        samples, stats = peer_common.read_sft_jsonl(SFT, self.tok, 256, repeat=3)
        self.assertEqual(len(samples), 3 * 360)
        self.assertEqual(stats["truncated"], 0)
        short, stats = peer_common.read_sft_jsonl(SFT, self.tok, 24)
        self.assertGreater(stats["truncated"], 0)
        self.assertTrue(all(len(s["input_ids"]) <= 24 for s in short))

    def test_padded_batches(self):
        batches = peer_common.data_batches(self.samples, steps=3, accum=2, batch=4, seq=256, packing=False,
                                           pad_id=self.tok.peer_pad_id, seed=7)
        self.assertEqual((len(batches), len(batches[0])), (3, 2))
        for mb in (m for step in batches for m in step):
            ids, mask, labels = mb["input_ids"], mb["attention_mask"], mb["labels"]
            longest = int(mask.sum(1).max())
            self.assertEqual(ids.shape, (4, longest))  # padded to the longest row, not to seq
            self.assertEqual(mb["real_tokens"], int(mask.sum()))
            self.assertTrue(bool((labels[mask == 0] == -100).all()))
            self.assertTrue(bool((ids[mask == 0] == self.tok.peer_pad_id).all()))
            self.assertEqual(mb["target_tokens"], int((labels[:, 1:] != -100).sum()))
        again = peer_common.data_batches(self.samples, steps=3, accum=2, batch=4, seq=256, packing=False,
                                         pad_id=self.tok.peer_pad_id, seed=7)
        self.assertTrue(all(bool((a["input_ids"] == b["input_ids"]).all())
                            for sa, sb in zip(batches, again) for a, b in zip(sa, sb)))

    def test_packed_batches(self):
        batches = peer_common.data_batches(self.samples, steps=2, accum=1, batch=2, seq=256, packing=True,
                                           pad_id=self.tok.peer_pad_id, seed=7)
        for mb in (m for step in batches for m in step):
            self.assertNotIn("attention_mask", mb)
            self.assertLessEqual(mb["input_ids"].shape[1], 256)
            self.assertGreater(mb["real_tokens"], 0.9 * mb["tokens"])  # packed rows are nearly full
            pos, labels = mb["position_ids"], mb["labels"]
            starts = pos == 0
            self.assertTrue(bool((labels[starts] == -100).all()))  # no target crosses a sample start
        flat = peer_common.data_batches(self.samples, steps=2, accum=1, batch=2, seq=256, packing=True,
                                        pad_id=self.tok.peer_pad_id, seed=7, flatten=True)
        for a, b in zip((m for s in batches for m in s), (m for s in flat for m in s)):
            self.assertEqual(b["input_ids"].shape[0], 1)
            self.assertEqual(int(b["packed_seq_lengths"].sum()), b["input_ids"].shape[1])
            self.assertEqual(a["real_tokens"], b["real_tokens"])
            self.assertEqual(a["target_tokens"], b["target_tokens"])
            self.assertEqual(b["tokens"], b["real_tokens"])

    def test_packed_rows_do_not_attend_across_samples(self):
        import torch
        from transformers import AutoModelForCausalLM

        cfg = peer_common.load_model_config(TINY)
        cfg.vocab_size = len(self.tok)
        mb = peer_common.data_batches(self.samples[:6], steps=1, accum=1, batch=1, seq=256, packing=True,
                                      pad_id=self.tok.peer_pad_id, seed=1)[0][0]
        pos = mb["position_ids"][0].tolist()
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        self.assertGreater(len(starts), 3)
        for impl in ("eager", "sdpa"):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()
            with torch.no_grad():
                packed = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False).logits[0]
                for a, e in zip(starts[:-1], starts[1:]):
                    alone = model(input_ids=mb["input_ids"][:, a:e], use_cache=False).logits[0]
                    self.assertLess(float((alone - packed[a:e]).abs().max()), 1e-4, f"{impl} segment {a}:{e}")

    def test_cpu_data_mode(self):
        with tempfile.TemporaryDirectory() as tmp:
            for packing in ([], ["--packing"]):
                out = os.path.join(tmp, "peer.json")
                proc = run_peer("peer_hf.py", "--device", "cpu", "--config", TINY, "--vocab-size", str(len(self.tok)),
                                "--only", "flash", "--steps", "2", "--batch", "2", "--accum", "2", "--seq", "256",
                                "--data", SFT, "--tokenizer", TOKENIZER, "--repeat", "2", *packing, "--out", out)
                self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
                with open(out) as f:
                    report = json.load(f)
                r = {x["added"]: x for x in report["rungs"]}["flash"]
                self.assertTrue(r["measured"], r.get("error"))
                self.assertEqual(r["data"]["packing"], bool(packing))
                self.assertEqual(r["data"]["samples"], 720)
                self.assertLessEqual(r["target_tokens_per_second"], r["real_tokens_per_second"])
                self.assertLessEqual(r["real_tokens_per_second"], r["tokens_per_second"] + 1e-9)
                self.assertIn("num_items_in_batch", r["loss_normalisation"])
                self.assertTrue(10.5 < r["loss"] < 12.5, r["loss"])  # ~ln(128256) with random weights
                self.assertEqual(report["tool"], "transformers+peft+bnb")


@unittest.skipUnless(HAVE_DEPS, "needs torch, transformers and peft")
class CpuMaxContextTest(unittest.TestCase):
    def test_bisection_runs_children(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "ctx.json")
            proc = run_peer("peer_hf.py", "--device", "cpu", "--config", TINY, "--max-context", "--context-rung",
                            "flash", "--context-min", "32", "--context-max", "96", "--context-unit", "32",
                            "--context-steps", "1", "--out", out)
            self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
            with open(out) as f:
                report = json.load(f)
        mc = report["max_context"]
        self.assertEqual(mc["max_seq"], 96)  # nothing is capped on the CPU: the top of the range
        self.assertTrue(all(p["fits"] for p in mc["probes"]))
        self.assertEqual([p["seq"] for p in mc["probes"]], [64, 96])
        (run,) = report["rungs"]
        self.assertTrue(run["measured"], run.get("error"))
        self.assertEqual((run["seq"], run["micro_batch"], run["added"]), (96, 1, "max_context"))
        self.assertEqual(run["timed_steps"], 1)


HAVE_UNSLOTH = HAVE_DEPS and importlib.util.find_spec("unsloth") is not None


@unittest.skipUnless(HAVE_UNSLOTH, "needs unsloth (bench/install_peer_wheels.sh --prepare-unsloth, then install)")
class CpuUnslothTest(unittest.TestCase):
    def test_16bit_rung_on_unsloths_cpu_fallback(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "unsloth.json")
            proc = run_peer("peer_unsloth.py", "--device", "cpu", "--config", TINY, "--model-dir",
                            os.path.join(tmp, "model"), "--compile-dir", os.path.join(tmp, "compiled"), "--only",
                            "flash", "--steps", "2", "--seq", "64", "--batch", "2", "--accum", "1", "--out", out)
            self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
            with open(out) as f:
                report = json.load(f)
        self.assertEqual(report["tool"], "unsloth")
        self.assertIn("unsloth ", report["peer"])
        rungs = {r["added"]: r for r in report["rungs"]}
        self.assertEqual(list(rungs), [""] + peer_hf.TRICKS)
        r = rungs["flash"]
        self.assertTrue(r["measured"], r.get("error"))
        self.assertEqual(r["trainable_parameters"], 149504)
        self.assertEqual(r["settings"]["use_gradient_checkpointing"], "unsloth")
        self.assertFalse(rungs[""]["measured"])
        self.assertFalse(rungs["qlora"]["measured"])  # not in --only


if __name__ == "__main__":
    unittest.main(verbosity=2)
