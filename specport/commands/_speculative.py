"""Loading an artifact for the speculative options chat and serve share.

The `--suffix-record` file is checked before the artifact loads (a bad path fails in a second,
not after minutes of hashing and session setup) and attached after, once the command knows it
will run; `--suffix-corpus FILE --suffix-record FILE` starts empty while FILE is new.
"""

from __future__ import annotations

import argparse
from typing import Any

import specport


def load_model(args: argparse.Namespace) -> tuple[Any, int | None]:
    """(the loaded model, the largest id in the --suffix-record file or None without one)."""
    from specport.runtime.speculative.suffix_record import check_record, corpus_to_read

    record = getattr(args, "suffix_record", None)
    largest = None if record is None else check_record(record)
    model = specport.load(
        args.artifact,
        provider=args.provider,
        threads=args.threads,
        # MTP trees derive their own graph from the artifact
        mtp_branch=args.speculative == "mtp" and getattr(args, "tree_width", 1) == 1,
        suffix_corpus=corpus_to_read(args.suffix_corpus, record),
    )
    return model, largest


def start_recording(model: Any, args: argparse.Namespace, largest: int | None) -> Any:
    """The `SuffixRecorder` keeping what `model` learns (None without --suffix-record); the
    caller closes it when done."""
    if largest is None:
        return None
    from specport.runtime.speculative.suffix_record import SuffixRecorder

    return SuffixRecorder.attach(model, args.suffix_record, largest)
