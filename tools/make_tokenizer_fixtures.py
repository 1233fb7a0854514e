#!/usr/bin/env python3
"""Reference fixtures for memtune's tokenizer (src/memtune/data/tokenizer.cpp).

Hugging Face `tokenizers` is the reference: memtune must produce exactly the ids that
`Tokenizer.from_file(tokenizer.json).encode(text).ids` produces, for every string here.
`transformers` renders the chat template of tokenizer_config.json (apply_chat_template).

Writes, under tests/fixtures/tokenizer/:
  corpus.jsonl         {"text", "ids" (with the post-processor's bos), "decoded"}
  chat.jsonl           {"messages", "add_generation_prompt", "text", "ids"}
  tiny_tokenizer.json  a small synthetic byte-level BPE (merges as ["a","b"] pairs,
                       ignore_merges false) and tiny_corpus.jsonl encoded with it, so the
                       pair merge format and the no-ignore_merges path are checked against HF.
  ignore_merges_off.jsonl  the real vocabulary with ignore_merges switched off.

Usage: python3 tools/make_tokenizer_fixtures.py [--tokenizer-dir ../shared/data/llama3-tokenizer]
Needs: pip install tokenizers transformers jinja2 (CPU only; no torch).
"""

import argparse
import json
import random
from pathlib import Path

from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parent.parent


def hand_written_corpus():
    c = []
    # Empty string, whitespace alone.
    c += ["", " ", "  ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u3000", "a", "A", "1"]
    # English prose.
    c += [
        "The quick brown fox jumps over the lazy dog.",
        "Hello, world! How are you doing today?",
        "In 1492, Columbus sailed the ocean blue; in 1969, Apollo 11 landed on the Moon.",
        "She said, \"It's fine -- really.\" Then she left (without her umbrella).",
        "Memory is a first-class quantity: it knows, before it runs, every byte a run takes.",
        "e.g. i.e. etc. Mr. Smith vs. Mrs. Jones & co.",
        "A sentence with trailing spaces.   ",
        "   Leading spaces before the words.",
        "Multiple    spaces   between    words.",
        "URL: https://example.com/path/to-page?query=1&x=y#frag and mail@example.org",
        "Price: $1,234.56 (about EUR 1.100,00) or 15% off!!!",
        "CamelCaseWordsAndsnake_case_words and kebab-case-words.",
        "ALL CAPS SHOUTING IS HERE; all lower case is here.",
        "Ellipsis... and em-dash\u2014and en\u2013dash, \u201csmart quotes\u201d and \u2018single\u2019.",
        "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.",
    ]
    # Contractions: every alternative of (?i:'s|'t|'re|'ve|'m|'ll|'d) in several cases.
    c += [
        "don't won't can't isn't",
        "DON'T WON'T CAN'T ISN'T",
        "I'll I'LL i'll I'Ll",
        "You'Re you're YOU'RE you'rE",
        "we've WE'VE We'Ve",
        "I'm I'M i'm",
        "he'd HE'D He'D",
        "'s at the start",
        "'S at the start",
        "'sa 'ss 's's ''s",
        "the dog's bone, the DOG'S BONE",
        "rock'n'roll o'clock y'all ma'am",
        "'tis 'Twas 'll 're 've 'm 'd",
        "it\u2019s curly (not matched as a contraction)",
        "x'ſ long s after an apostrophe",
        "'ſa 'ſe x'ſt",
        "'\u212a Kelvin sign",
        "''''''",
        "'",
    ]
    # Scripts.
    c += [
        "\u4eca\u5929\u5929\u6c14\u5f88\u597d\uff0c\u6211\u4eec\u53bb\u516c\u56ed\u6563\u6b65\u5427\u3002",
        "\u673a\u5668\u5b66\u4e60\u6a21\u578b\u9700\u8981\u5927\u91cf\u7684\u5185\u5b58\u548c\u8ba1\u7b97\u8d44\u6e90\u3002",
        "\u3053\u3093\u306b\u3061\u306f\u3001\u4e16\u754c\uff01\u30ab\u30bf\u30ab\u30ca\u3068\u3072\u3089\u304c\u306a\u3068\u6f22\u5b57\u3002",
        "\u6771\u4eac\u30bf\u30ef\u30fc\u306f\uff13\uff13\uff13\u30e1\u30fc\u30c8\u30eb\u3067\u3059\u3002\uff8a\uff9d\uff76\uff78\uff76\uff85",
        "\uc548\ub155\ud558\uc138\uc694, \uc138\uacc4! \ud55c\uad6d\uc5b4 \ubb38\uc7a5\uc785\ub2c8\ub2e4.",
        "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645! \u0647\u0630\u0647 \u062c\u0645\u0644\u0629 \u0639\u0631\u0628\u064a\u0629 \u0661\u0662\u0663.",
        "\u0634\u064f\u0643\u0652\u0631\u064b\u0627 \u062c\u064e\u0632\u0650\u064a\u0644\u064b\u0627",
        "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd! \u05d6\u05d5\u05d4\u05d9 \u05e2\u05d1\u05e8\u05d9\u05ea.",
        "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e! \u092f\u0939 \u0939\u093f\u0902\u0926\u0940 \u0939\u0948\u0964 \u0967\u0968\u0969",
        "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e0a\u0e32\u0e27\u0e42\u0e25\u0e01 \u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22\u0e44\u0e21\u0e48\u0e21\u0e35\u0e0a\u0e48\u0e2d\u0e07\u0e27\u0e48\u0e32\u0e07",
        "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u042d\u0442\u043e \u0440\u0443\u0441\u0441\u043a\u0438\u0439 \u0442\u0435\u043a\u0441\u0442. \u0401\u0436\u0438\u043a.",
        "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5! \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac \u03ba\u03b5\u03af\u03bc\u03b5\u03bd\u03bf.",
        "\u10d2\u10d0\u10db\u10d0\u10e0\u10ef\u10dd\u10d1\u10d0 \u0540\u0561\u0575\u0565\u0580\u0565\u0576 \u12a0\u121b\u122d\u129b",
        "Mixed: English \u4e2d\u6587 \u65e5\u672c\u8a9e \ud55c\uad6d\uc5b4 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u05e2\u05d1\u05e8\u05d9\u05ea \u0939\u093f\u0928\u094d\u0926\u0940",
        "Stra\u00dfe, na\u00efve, caf\u00e9, r\u00e9sum\u00e9, \u00c5ngstr\u00f6m, \u0141\u00f3d\u017a, \u0130stanbul",
        "Vi\u1ec7t Nam, ti\u1ebfng Vi\u1ec7t c\u00f3 d\u1ea5u",
    ]
    # Emoji: single, ZWJ sequences, skin tones, flags, keycaps, variation selectors.
    c += [
        "\U0001f600\U0001f603\U0001f604",
        "I love \u2764\ufe0f and \U0001f355!",
        "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 family",
        "\U0001f44d\U0001f3fb\U0001f44d\U0001f3fc\U0001f44d\U0001f3fd\U0001f44d\U0001f3fe\U0001f44d\U0001f3ff",
        "\U0001f1fa\U0001f1f8\U0001f1ef\U0001f1f5\U0001f1e9\U0001f1ea\U0001f1eb\U0001f1f7 flags",
        "\U0001f3f3\ufe0f\u200d\U0001f308 \U0001f3f4\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f",
        "1\ufe0f\u20e3 #\ufe0f\u20e3 *\ufe0f\u20e3",
        "\U0001f9d1\U0001f3fd\u200d\U0001f4bb coder \U0001f469\U0001f3ff\u200d\U0001f52c scientist",
        "emoji\U0001f680in\U0001f30dwords",
    ]
    # Digits: runs of 1..12 alone and mixed with letters.
    digits = "123456789012"
    for n in range(1, 13):
        c.append(digits[:n])
    c += [
        "abc123def4567ghi89012jkl",
        "x1 y22 z333 w4444 v55555",
        "3.14159265358979 2.71828",
        "version 1.2.3-rc4 build 20240101",
        "0x7fffffff 0b101010 1e-10 6.02e23",
        "\u0661\u0662\u0663\u0664\u0665 \u0967\u0968\u0969\u096a \uff11\uff12\uff13\uff14 \u2460\u2461\u2462 \u00bd\u00be",
        "1,000,000 and 1 000 000",
    ]
    # Whitespace runs, tabs, trailing spaces, newlines, CR/LF mixes.
    c += [
        "word    word",
        "word\t\tword",
        "trailing   ",
        "trailing\t \t",
        "a\n\n\nb",
        "a\n \n \nb",
        "line one\r\nline two\r\nline three\r\n",
        "old mac\rline\rends\r",
        "odd\n\rorder\n\r",
        "mixed\r\n\r\n\n\r\r\n end",
        "  \n  \n  indented after blank lines",
        "\n\n\n\n\n\n\n\n",
        "tabs\tand spaces \t mixed\t\t\n\tnext",
        "punct!\n\n",
        "punct!\r\n\r\n  next",
        "a \u00a0b\u2003c\u2009d\u202fe\u205ff\u3000g",
        "a\u0085b \u0085 c",
        "a\u1680b\u180ec \u180e d",
        "a\u2028b\u2029c",
        "a\x0bb\x0cc",
        "a\x1cb\x1dc\x1ed\x1fe",
    ]
    # Code.
    c += [
        "def add(a, b):\n    return a + b\n",
        "class Foo:\n    def __init__(self, x: int) -> None:\n        self.x = x  # store\n\n\n"
        "    def __repr__(self):\n        return f\"Foo({self.x!r})\"\n",
        "for i in range(10):\n\tif i % 2 == 0:\n\t\tprint(i, end='')\n",
        "#include <vector>\n\nint main() {\n  std::vector<int> v{1, 2, 3};\n"
        "  for (auto& x : v) x *= 2;\n  return v.size() > 2 ? 0 : 1;\n}\n",
        "template <typename T>\nconstexpr T square(T x) noexcept { return x * x; }  // 42\n",
        "{\n  \"name\": \"memtune\",\n  \"version\": 3,\n  \"tags\": [\"lora\", \"qlora\"],\n"
        "  \"nested\": {\"a\": null, \"b\": true, \"c\": -1.5e-3}\n}",
        "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%son' ORDER BY id DESC;",
        "<html><body><p class=\"x\">Hi &amp; bye</p></body></html>",
        "$ ls -la /usr/bin | grep -E '^-r.x' >> out.txt 2>&1 && echo \"done\"",
        "x+=1;y-=2;z*=3;w/=4;a%=5;b<<=6;c>>=7;d&&e||f",
        "    \n        \n    deeply    indented\n",
        "if (a != b) { /* comment */ } else if (c <= d) {} // end",
        "```python\nprint('hi')\n```",
        "!!!???...,,,;;;:::---___+++===",
        "@decorator\n@another.one(arg=1)\ndef f(): pass",
    ]
    # Special tokens written literally in the text.
    c += [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "Hello<|eot_id|>World",
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>",
        "text <|eot_id|> text",
        "<|eot_id|><|eot_id|><|eot_id|>",
        "<|reserved_special_token_0|> and <|reserved_special_token_250|>",
        "<|finetune_right_pad_id|><|eom_id|><|python_tag|>",
        "almost special <|eot_id| and <|eot_id |> and <eot_id> and <|EOT_ID|>",
        "<|<|eot_id|>|>",
        " <|eot_id|> ",
        "\n<|eot_id|>\n",
        "<|reserved_special_token_2|>x<|reserved_special_token_25|>y<|reserved_special_token_250|>z",
        "<|reserved_special_token_251|> does not exist",
    ]
    # Combining marks, zero-width characters.
    c += [
        "e\u0301 a\u0300 o\u0308 n\u0303 (combining)",
        "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034dA\u036b\u0357\u0334\u0362\u0335\u031c\u0330\u0354L\u0368\u0367\u0369\u0358\u0320G\u0311\u0357\u030e\u0305\u035b\u0341\u0334\u033b\u0348\u034d\u0354\u0339O",
        "\u0301 leading combining mark",
        "zero\u200bwidth\u200cnon\u200djoiner",
        "\ufeffBOM at the start",
        "soft\u00adhyphen and word\u2060joiner",
        "\u200e\u200fdirection marks\u202a\u202c",
        "\ud7a3\u1100\u1161\u11a8 jamo",
    ]
    # Very long words and repeated patterns (long BPE inputs).
    c += [
        "a" * 300,
        "ab" * 200,
        "Supercalifragilisticexpialidocious" * 8,
        "pneumonoultramicroscopicsilicovolcanoconiosis",
        "\u6f22" * 100,
        "\U0001f600" * 50,
        " " * 200,
        "-" * 120,
        "=" * 64 + "\n" + "-" * 64,
        "9" * 40,
        "x" * 2000,
        "Antidisestablishmentarianism" + "ism" * 50,
        # Long single-class runs: the PCRE2 JIT stack and the heap merge path.
        " " * 20000,
        "\n" * 5000 + "x",
        "a" * 5000,
        "\u4e00\u4e8c" * 1500,
    ]
    # Unusual code points.
    c += [
        "\U0010fffd private use \ue000 \U000f0000",
        "\U0001d400\U0001d401 math bold, \u2102\u211d ℕ",
        "\x00 nul \x01 ctrl \x7f del",
        "\u00ff\u0100\u017f\u0180",
        "\u0130\u0131 dotted and dotless i",
        "\u1e9e\u00df capital and small sharp s",
        "\ufb01\ufb02 ligatures \ufb00",
    ]
    return c


def random_valid_utf8(rng, count):
    """Random strings of code points drawn from assigned, long-stable blocks.

    Unassigned code points are avoided: HF's Oniguruma and PCRE2 may carry different Unicode
    versions, and a code point assigned in only one of them would make the fixture test the
    Unicode version rather than the tokenizer.
    """
    ranges = [
        (0x20, 0x7E), (0x09, 0x0D), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF),
        (0x590, 0x5FF), (0x600, 0x6FF), (0x900, 0x97F), (0xE00, 0xE5B), (0x3040, 0x30FF),
        (0x4E00, 0x9FA5), (0xAC00, 0xD7A3), (0x1F600, 0x1F64F), (0x2000, 0x206F),
        (0xFF01, 0xFF5E),
    ]
    out = []
    for _ in range(count):
        n = rng.randint(1, 40)
        chars = []
        for _ in range(n):
            lo, hi = rng.choice(ranges)
            chars.append(chr(rng.randint(lo, hi)))
        out.append("".join(chars))
    # Random bytes, kept only where they decode as UTF-8.
    while len(out) < 2 * count:
        b = bytes(rng.randint(0, 255) if rng.random() < 0.5 else rng.randint(0x20, 0x7E)
                  for _ in range(rng.randint(1, 30)))
        try:
            out.append(b.decode("utf-8"))
        except UnicodeDecodeError:
            pass
    return out


def chat_cases():
    return [
        ([{"role": "user", "content": "Hello!"}], False),
        ([{"role": "user", "content": "Hello!"}], True),
        ([{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "What is 2+2?"},
          {"role": "assistant", "content": "2 + 2 = 4."}], False),
        ([{"role": "system", "content": "  Be brief.\n\n"},
          {"role": "user", "content": "\n\tTrim me please   "},
          {"role": "assistant", "content": " Trimmed.  "},
          {"role": "user", "content": "Thanks"}], True),
        ([{"role": "user", "content": "Write code"},
          {"role": "assistant", "content": "```python\ndef f(x):\n    return x * 2\n```"},
          {"role": "user", "content": "Now in C++"},
          {"role": "assistant", "content": "int f(int x) { return x * 2; }"}], False),
        ([{"role": "system", "content": ""},
          {"role": "user", "content": "   "},
          {"role": "assistant", "content": ""}], False),
        ([{"role": "user", "content": "Unicode: \u4eca\u5929 \U0001f600 \u0645\u0631\u062d\u0628\u0627"},
          {"role": "assistant", "content": "\u00a0\u3000 spaces \u2028 around \u3000"}], False),
        ([{"role": "user", "content": "Say <|eot_id|> literally"},
          {"role": "assistant", "content": "Sure: <|eot_id|> and <|start_header_id|>"}], False),
        ([{"role": "ipython", "content": "{\"result\": 42}"},
          {"role": "assistant", "content": "The result is 42."}], True),
        ([{"role": "user", "content": "a\u0085b\u001c"},
          {"role": "assistant", "content": "\u001cx\u180e"}], False),
    ]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer-dir", default=str(REPO.parent / "shared/data/llama3-tokenizer"))
    parser.add_argument("--out", default=str(REPO / "tests/fixtures/tokenizer"))
    args = parser.parse_args()
    tok_dir = Path(args.tokenizer_dir)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    corpus = hand_written_corpus() + random_valid_utf8(random.Random(1234), 20)
    corpus = list(dict.fromkeys(corpus))  # drop repeats (e.g. "1" is also a digit run)
    with open(out / "corpus.jsonl", "w", encoding="utf-8") as f:
        for text in corpus:
            ids = tok.encode(text).ids
            decoded = tok.decode(ids, skip_special_tokens=False)
            f.write(json.dumps({"text": text, "ids": ids, "decoded": decoded},
                               ensure_ascii=True) + "\n")
    print(f"corpus.jsonl: {len(corpus)} strings")

    # The real vocabulary with ignore_merges off: BPE then runs on every word.
    spec = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    spec["model"]["ignore_merges"] = False
    tok_no_ignore = Tokenizer.from_str(json.dumps(spec))
    with open(out / "ignore_merges_off.jsonl", "w", encoding="utf-8") as f:
        differ = 0
        for text in corpus:
            ids = tok_no_ignore.encode(text).ids
            differ += ids != tok.encode(text).ids
            f.write(json.dumps({"text": text, "ids": ids}, ensure_ascii=True) + "\n")
    print(f"ignore_merges_off.jsonl: {differ} strings tokenize differently from ignore_merges on")

    write_tiny(out)
    write_chat(tok_dir, out)


def write_tiny(out):
    """A small byte-level BPE whose merges are ["a","b"] pairs and ignore_merges is false."""
    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: i for i, b in enumerate(range(256))}
    merge_pairs = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("\u0120", "w"),
                   ("o", "r"), ("\u0120w", "or"), ("\u0120wor", "l"), ("\u0120worl", "d"),
                   ("t", "h"), ("th", "e"), ("\u0120", "th"), ("\u0120th", "e"), ("a", "a"),
                   ("aa", "aa"), ("1", "2"), ("12", "3"), ("i", "n"), ("in", "g"),
                   ("\u0120", "\u0120"), ("\u0120\u0120", "\u0120\u0120")]
    for a, b in merge_pairs:
        vocab.setdefault(a + b, len(vocab))
    # A whole-word vocabulary entry that merges do not reach: with ignore_merges false it must
    # not be used.
    vocab.setdefault("xyz", len(vocab))
    n = len(vocab)
    spec = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [
            {"id": n, "content": "<|begin_of_text|>", "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True},
            {"id": n + 1, "content": "<|end_of_text|>", "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True},
            {"id": n + 2, "content": "<|eot_id|>", "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True},
            {"id": n + 3, "content": "[word]", "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": False},
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [list(p) for p in merge_pairs]},
    }
    (out / "tiny_tokenizer.json").write_text(json.dumps(spec, ensure_ascii=True, indent=1),
                                             encoding="utf-8")
    tok = Tokenizer.from_file(str(out / "tiny_tokenizer.json"))
    texts = ["hello world", "the theme", "xyz", "aaaaaaa", "1234 12 123", "helloworld",
             "    indented", "sing [word] thing<|eot_id|>", "It's the WORLD's end",
             "\u00e9t\u00e9 \u4e2d", ""]
    with open(out / "tiny_corpus.jsonl", "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text, "ids": tok.encode(text).ids},
                               ensure_ascii=True) + "\n")
    print(f"tiny_tokenizer.json: {len(vocab)} tokens, {len(merge_pairs)} merges")


def write_chat(tok_dir, out):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    with open(out / "chat.jsonl", "w", encoding="utf-8") as f:
        for messages, gen in chat_cases():
            text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
            if not isinstance(ids, list):  # transformers >= 5 returns a BatchEncoding
                ids = ids["input_ids"]
            f.write(json.dumps({"messages": messages, "add_generation_prompt": gen,
                                "text": text, "ids": list(ids)}, ensure_ascii=True) + "\n")
    print(f"chat.jsonl: {len(chat_cases())} conversations")


def bytes_to_unicode():
    """GPT-2's byte -> printable character map (openai/gpt-2 encoder.py, bytes_to_unicode)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
                 + list(range(0xAE, 0xFF + 1)))
    mapping = {}
    extra = 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


if __name__ == "__main__":
    main()
