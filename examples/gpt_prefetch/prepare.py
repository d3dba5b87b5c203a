"""Writes data/train.bin and data/val.bin: uint16 token ids, as the GPT trainers' prepare scripts
do (a seeded generator stands in for a tokenized corpus: nothing is downloaded).

    python prepare.py
"""

from pathlib import Path

import numpy as np

VOCAB = 128

if __name__ == "__main__":
    out = Path(__file__).with_name("data")
    out.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 200_000), ("val", 20_000)):
        # a little structure to learn: a token often follows its predecessor plus one
        ids = rng.integers(0, VOCAB, n)
        follow = rng.random(n) < 0.5
        ids[1:][follow[1:]] = (ids[:-1][follow[1:]] + 1) % VOCAB
        ids.astype(np.uint16).tofile(out / f"{split}.bin")
    print(f"wrote {out}/train.bin and val.bin")
