"""Writes tests/fixtures/safetensors/python_numpy.safetensors with the reference writer.

tests/io/test_safetensors.cpp reads it and checks every value, and checks that memtune's writer,
given the same tensors in the same order, produces the same bytes. Values are exactly
representable in their dtypes so that the test can compare them exactly.

    pip install safetensors numpy
    python tools/make_safetensors_fixture.py

numpy has no bfloat16, so BF16 is covered by memtune's own round-trip tests instead.
"""

import os

import numpy as np
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures", "safetensors", "python_numpy.safetensors")


def main():
    tensors = {
        "model.embed_tokens.weight": (np.arange(12, dtype=np.float32) * 0.5 - 2.0).reshape(3, 4),
        "model.norm.weight": np.array([1.0, -2.5, 0.125, 65504.0], dtype=np.float16),
        "token_ids": np.array([[-1, 0], [7, 2147483647]], dtype=np.int32),
        "codes": np.array([0, 1, 127, 128, 255], dtype=np.uint8),
        "scalar": np.array(3.25, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    # One metadata key: the reference writer keeps metadata in a hash map, so with several keys
    # their order in the header (and the file's bytes) would vary from run to run.
    save_file(tensors, OUT, metadata={"format": "np"})
    print("wrote", os.path.normpath(OUT), os.path.getsize(OUT), "bytes")


if __name__ == "__main__":
    main()
