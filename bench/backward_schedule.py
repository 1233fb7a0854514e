#!/usr/bin/env python3
"""How long the Hopper backward's grid takes to drain in each block order, counted, not measured.

Each block (a key block of 128 keys of one row: kv head x batch row) visits group x q_blocks items,
q_blocks = the causal query blocks of 64 at or after its keys. Blocks go to the multiprocessor that
frees first, in launch order, one at a time (one block an SM, as __launch_bounds__(256, 1) makes
it), each item taking the same time and each block a fixed start cost. The ratio printed is the
last block's end over the perfectly balanced time: the tail that the order alone costs.

    python3 bench/backward_schedule.py [--sms 132] [--start-items 2] [--rows-a-group 2 4 8]
"""
import argparse
import heapq


def drain(durations, sms):
    free = [0.0] * sms
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def block_items(seq, group):
    key_blocks = (seq + 127) // 128
    return [group * ((seq - 128 * kb + 63) // 64) for kb in range(key_blocks)]


def orders(batch, seq, kv_heads, group, sms, extra_groups=()):
    items = block_items(seq, group)
    key_blocks, rows = len(items), batch * kv_heads
    # The kernel's default group size (launch_backward in attention_hopper_backward.cu): as many
    # groups as hold two waves of blocks each, the rows shared evenly among them.
    wave_rows = -(-2 * sms // key_blocks)
    groups = max(1, rows // wave_rows)
    default_rows = min(rows, max(1, -(-rows // groups)))

    def grouped(group_rows):
        out = []
        for first in range(0, rows, group_rows):
            here = min(group_rows, rows - first)
            out += [items[kb] for kb in range(key_blocks) for _ in range(here)]
        return out

    counted = {
        "keys_first": grouped(rows),
        "rows, one a group": grouped(1),
        f"rows, {default_rows} a group (default)": grouped(default_rows),
    }
    for group_rows in extra_groups:
        if 1 < group_rows <= rows and group_rows != default_rows:
            counted[f"rows, {group_rows} a group"] = grouped(group_rows)
    return counted


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sms", type=int, default=132, help="multiprocessors (H100 SXM: 132)")
    parser.add_argument("--start-items", type=float, default=2.0, help="a block's start cost, in items")
    parser.add_argument("--rows-a-group", type=int, nargs="*", default=[],
                        help="also count the rows orders with these group sizes (the timing print's 2, 4, 8)")
    args = parser.parse_args()
    print(f"{args.sms} SMs, a block's start = {args.start_items} items; 32 query / 8 kv heads")
    for batch, seq in [(8, 2048), (2, 8192), (1, 32768)]:
        for name, blocks in orders(batch, seq, 8, 4, args.sms, args.rows_a_group).items():
            durations = [d + args.start_items for d in blocks]
            ideal = sum(durations) / args.sms
            print(f"  b{batch} s{seq:<6} {name:<28} {drain(durations, args.sms) / ideal:.3f} x balanced")


if __name__ == "__main__":
    main()
