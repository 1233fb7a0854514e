#!/usr/bin/env python3
"""Write examples/sft-tasks.jsonl: a small supervised fine-tuning set written for memtune.

    python3 examples/make_sft_data.py            # writes examples/sft-tasks.jsonl
    python3 examples/make_sft_data.py --count 1000 --out /tmp/more.jsonl

Every line is {"messages": [{"role": ..., "content": ...}, ...]}: an optional system message, one
user instruction and the assistant's answer. The tasks (arithmetic, percentages, unit
conversion, clock times, string and list manipulation) have answers computed here, so no text
is copied from anywhere and every answer is right. Seeded: the same arguments give the same file,
byte for byte. Only the Python standard library is used.
"""

import argparse
import json
import os
import random

# Short common words for the string tasks (lowercase ASCII, so that the answers are unambiguous).
WORDS = [
    "apple", "river", "stone", "garden", "window", "planet", "rocket", "silver", "forest", "candle",
    "bridge", "market", "pencil", "winter", "summer", "thunder", "lantern", "harbor", "meadow",
    "castle", "violin", "copper", "falcon", "island", "jacket", "kettle", "ladder", "marble",
    "needle", "orange", "pepper", "quartz", "rabbit", "saddle", "tunnel", "velvet", "wizard",
    "yellow", "zipper", "anchor", "basket", "carpet", "desert", "engine", "feather", "glacier",
]
NAMES = ["Ada", "Bo", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kofi", "Lena"]
SYSTEM_PROMPTS = [
    "You are a careful assistant. Answer briefly and exactly.",
    "You are a helpful assistant that shows the key step of each calculation.",
    "Answer in one short sentence.",
]


def fmt_number(x):
    """A float without trailing zeros: 12.5, 3, 0.25."""
    text = f"{x:.2f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def arithmetic(rng):
    op = rng.choice(["+", "-", "*", "//"])
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    if op == "+":
        q = rng.choice([f"What is {a} + {b}?", f"Add {a} and {b}.", f"Compute the sum of {a} and {b}."])
        return q, f"{a} + {b} = {a + b}."
    if op == "-":
        q = rng.choice([f"What is {a} - {b}?", f"Subtract {b} from {a}.", f"How much is {a} minus {b}?"])
        return q, f"{a} - {b} = {a - b}."
    if op == "*":
        a = rng.randint(2, 99)
        q = rng.choice([f"What is {a} times {b}?", f"Multiply {a} by {b}.", f"Compute {a} * {b}."])
        return q, f"{a} * {b} = {a * b}."
    q = rng.choice([f"Divide {a} by {b}. Give the quotient and the remainder.",
                    f"What are the quotient and remainder of {a} divided by {b}?"])
    return q, f"{a} = {b} * {a // b} + {a % b}, so the quotient is {a // b} and the remainder is {a % b}."


def percentage(rng):
    p = rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 50, 75])
    n = rng.randint(2, 80) * 10
    if rng.random() < 0.5:
        return f"What is {p}% of {n}?", f"{p}% of {n} is {fmt_number(p * n / 100)}."
    price = rng.randint(10, 400)
    return (f"A jacket costs {price} euros and is {p}% off. What is the sale price?",
            f"The discount is {fmt_number(price * p / 100)} euros, so the sale price is "
            f"{fmt_number(price * (100 - p) / 100)} euros.")


CONVERSIONS = [
    # (from, to, factor or function, value range)
    ("kilometers", "miles", lambda x: x * 0.621371, (1, 500)),
    ("miles", "kilometers", lambda x: x * 1.609344, (1, 300)),
    ("kilograms", "pounds", lambda x: x * 2.204623, (1, 200)),
    ("pounds", "kilograms", lambda x: x * 0.453592, (1, 400)),
    ("meters", "feet", lambda x: x * 3.280840, (1, 1000)),
    ("inches", "centimeters", lambda x: x * 2.54, (1, 100)),
    ("liters", "US gallons", lambda x: x * 0.264172, (1, 200)),
    ("degrees Celsius", "degrees Fahrenheit", lambda x: x * 9 / 5 + 32, (-40, 100)),
    ("degrees Fahrenheit", "degrees Celsius", lambda x: (x - 32) * 5 / 9, (-40, 212)),
    ("hours", "minutes", lambda x: x * 60, (1, 48)),
    ("gigabytes", "megabytes", lambda x: x * 1000, (1, 64)),
]


def conversion(rng):
    source, target, convert, (lo, hi) = rng.choice(CONVERSIONS)
    value = rng.randint(lo, hi)
    q = rng.choice([f"Convert {value} {source} to {target}.", f"How many {target} are {value} {source}?",
                    f"{value} {source} is how many {target}? Round to two decimals."])
    return q, f"{value} {source} is {fmt_number(convert(value))} {target}."


def clock(rng):
    h, m = rng.randint(0, 23), rng.choice(range(0, 60, 5))
    delta = rng.choice([15, 25, 40, 45, 50, 75, 90, 125, 200])
    total = (h * 60 + m + delta) % (24 * 60)
    start, end = f"{h:02d}:{m:02d}", f"{total // 60:02d}:{total % 60:02d}"
    name = rng.choice(NAMES)
    q = rng.choice([f"What time is it {delta} minutes after {start}?",
                    f"{name} starts a task at {start} that takes {delta} minutes. When does it end?"])
    return q, f"{delta} minutes after {start} it is {end}."


def strings(rng):
    word = rng.choice(WORDS)
    kind = rng.randrange(6)
    if kind == 0:
        return f"Reverse the word \"{word}\".", f"\"{word}\" reversed is \"{word[::-1]}\"."
    if kind == 1:
        return f"Write \"{word}\" in capital letters.", word.upper()
    if kind == 2:
        vowels = sum(c in "aeiou" for c in word)
        return f"How many vowels are in \"{word}\"?", f"\"{word}\" has {vowels} vowel{'s' if vowels != 1 else ''}."
    if kind == 3:
        letter = rng.choice(sorted(set(word)))
        count = word.count(letter)
        return (f"How many times does the letter \"{letter}\" appear in \"{word}\"?",
                f"The letter \"{letter}\" appears {count} time{'s' if count != 1 else ''} in \"{word}\".")
    if kind == 4:
        return f"Sort the letters of \"{word}\" alphabetically.", "".join(sorted(word))
    words = rng.sample(WORDS, rng.randint(3, 6))
    sentence = " ".join(words)
    return (f"How many words are in this text: \"{sentence}\"?",
            f"There are {len(words)} words.")


def lists(rng):
    values = [rng.randint(-50, 150) for _ in range(rng.randint(4, 8))]
    text = ", ".join(map(str, values))
    kind = rng.randrange(4)
    if kind == 0:
        return f"Sort these numbers from smallest to largest: {text}.", ", ".join(map(str, sorted(values)))
    if kind == 1:
        return f"What is the largest number in this list: {text}?", f"The largest is {max(values)}."
    if kind == 2:
        return f"Add up these numbers: {text}.", f"The sum is {sum(values)}."
    evens = [v for v in values if v % 2 == 0]
    return (f"Which of these numbers are even: {text}?",
            ", ".join(map(str, evens)) if evens else "None of them are even.")


TASKS = [arithmetic, percentage, conversion, clock, strings, lists]


def make_samples(count, seed):
    rng = random.Random(seed)
    samples = []
    for i in range(count):
        question, answer = TASKS[i % len(TASKS)](rng)
        messages = []
        if rng.random() < 0.25:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer})
        samples.append({"messages": messages})
    rng.shuffle(samples)
    return samples


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "sft-tasks.jsonl"))
    parser.add_argument("--count", type=int, default=360)
    parser.add_argument("--seed", type=int, default=2024)
    args = parser.parse_args()
    with open(args.out, "w", encoding="utf-8") as f:
        for sample in make_samples(args.count, args.seed):
            f.write(json.dumps(sample, ensure_ascii=False) + "\n")
    print(f"wrote {args.count} samples to {args.out}")


if __name__ == "__main__":
    main()
