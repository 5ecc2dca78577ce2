"""A random-weight Llama for benchmarks, built from a config (no downloads).

    python -m benchmarks.model out/llama32m           # the ~32M benchmark model
    python -m benchmarks.model out/tiny --tiny        # 2 layers, hidden 64

The builder is the tests' (`tests/fixtures.make_llama`): one tiny-model module for both.
A byte-level tokenizer (256 byte tokens + <unk>/<s>/</s>) is written next to the weights.
"""

from __future__ import annotations

import argparse

from tests.fixtures import TINY, make_llama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    print(make_llama(args.out, **(TINY if args.tiny else {})))


if __name__ == "__main__":
    main()
