"""`specport chat` and `generate --chat` on a tiny artifact with a real ChatML tokenizer and
template (tests/fixtures.py: add_chat_tokenizer), through real processes: stdin piped, and a
pseudo-terminal for the interactive prompt, EOF and Ctrl-C."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import specport
from specport.core.chat_template import load_chat_template

N = 8  # new tokens per answer


def _answer(model, messages) -> str:
    ids = load_chat_template(model).render_ids(messages)
    return model.generate(prompt_ids=ids, max_new_tokens=N).text


def test_generate_chat_is_one_turn_of_the_template(cli, tiny_chat_artifact):
    model = specport.load(tiny_chat_artifact)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    ids = load_chat_template(model).render_ids(messages)
    assert ids[0] == 3 and ids[-1] == 5  # <|im_start|> ... "assistant\n" (ChatML)
    want = model.generate(prompt_ids=ids, max_new_tokens=N)
    code, out, err = cli(
        "generate", tiny_chat_artifact, "--chat", "Hello", "--system", "Be brief.",
        "--max-new-tokens", N, "--json",
    )  # fmt: skip
    assert code == 0, err
    got = json.loads(out)
    assert got["tokens"] == want.tokens and got["text"] == want.text
    assert got["metrics"]["prompt_tokens"] == len(ids)


def test_chat_piped_turns_reset_and_exit(tiny_chat_artifact):
    """Turn 2 sees turn 1's answer; /reset starts over (same answer again); /exit ends; a
    message longer than the context is refused and the chat goes on."""
    model = specport.load(tiny_chat_artifact)
    u1, u2 = "Hello", "How are you?"
    a1 = _answer(model, [{"role": "user", "content": u1}])
    a2 = _answer(
        model,
        [
            {"role": "user", "content": u1},
            {"role": "assistant", "content": a1},
            {"role": "user", "content": u2},
        ],
    )
    too_long = "Hello there " * 40  # > the tiny model's 128-token context
    stdin = f"{u1}\n{u2}\n/reset\n{too_long}\n{u1}\n/exit\nnever read\n"
    cmd = [sys.executable, "-m", "specport", "chat", str(tiny_chat_artifact)]
    r = subprocess.run(
        [*cmd, "--max-new-tokens", str(N), "--threads", "1"],
        input=stdin, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{a1}\n{a2}\n{a1}\n"
    assert "[conversation reset]" in r.stderr and "context is 128" in r.stderr
    assert "Traceback" not in r.stderr


def test_chat_ends_cleanly_on_eof(tiny_chat_artifact):
    r = subprocess.run(
        [sys.executable, "-m", "specport", "chat", str(tiny_chat_artifact), "--max-new-tokens", "4"],
        input="Hello\n",  # no /exit: stdin just ends
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.count("\n") == 1 and "Traceback" not in r.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
@pytest.mark.parametrize("ending", ["ctrl-d", "ctrl-c", "/exit"])
def test_chat_on_a_terminal(tiny_chat_artifact, ending):
    """A real pty as the controlling terminal (stdin, stdout and stderr, as in a shell): the
    prompt shows, an answer streams, and Ctrl-D / Ctrl-C / /exit end the chat with exit 0."""
    import fcntl
    import pty
    import termios

    main_fd, child_fd = pty.openpty()

    def own_terminal() -> None:  # a new session whose controlling terminal is the pty
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        if ending == "ctrl-c":  # started with SIGINT ignored (nohup, some job runners and
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # test workers): Ctrl-C still ends it

    cmd = [sys.executable, "-m", "specport", "chat", str(tiny_chat_artifact)]
    proc = subprocess.Popen(
        [*cmd, "--max-new-tokens", "4"],
        stdin=child_fd, stdout=child_fd, stderr=child_fd, preexec_fn=own_terminal,
    )  # fmt: skip
    os.close(child_fd)
    try:
        seen = _read_until(main_fd, b"> ", proc)
        assert b"chatting with" in seen
        os.write(main_fd, b"Hello\r")
        seen = _read_until(main_fd, b"> ", proc)  # the echo, the answer, the next prompt
        assert seen.startswith(b"Hello")
        os.write(main_fd, {"ctrl-d": b"\x04", "ctrl-c": b"\x03", "/exit": b"/exit\r"}[ending])
        proc.wait(timeout=60)
        rest = _drain(main_fd)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(main_fd)
    assert proc.returncode == 0, rest
    assert b"Traceback" not in seen + rest


def _read_until(fd: int, marker: bytes, proc: subprocess.Popen, timeout: float = 120) -> bytes:
    data = b""
    end = time.monotonic() + timeout
    while marker not in data:
        if time.monotonic() > end or proc.poll() is not None:
            raise AssertionError(f"no {marker!r} from chat; got {data!r}")
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            data += os.read(fd, 4096)
    return data


def _drain(fd: int) -> bytes:
    data = b""
    while select.select([fd], [], [], 0.2)[0]:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child closed its side
            break
        if not chunk:
            break
        data += chunk
    return data


def test_chat_refuses_an_artifact_without_a_template(cli, tiny_llama_artifact: Path):
    code, _, err = cli("chat", tiny_llama_artifact)
    assert code == 1 and "generate --prompt" in err and "Traceback" not in err


@pytest.mark.slow
def test_train_mtp_on_chat_answers(cli, tiny_chat_artifact, tmp_path):
    """`train-mtp --chat`: each document is a user turn; the base model answers under the chat
    template, the heads train on those answers, and MTP speculation on the result still gives
    plain greedy's tokens."""
    data = tmp_path / "messages.txt"
    data.write_text("\n\n".join(f"Tell me about topic {i}." for i in range(20)) + "\n")
    out = tmp_path / "mtp"
    code, stdout, err = cli(
        "train-mtp", tiny_chat_artifact, "--chat", "--data", data, "--out", out, "--heads", "2",
        "--steps", "3", "--sequences", "16", "--batch", "4", "--window", "8", "--json",
    )  # fmt: skip
    assert code == 0, err
    training = json.loads(stdout)["training"]
    assert training["source"] == "self-distillation (chat answers)" and training["window"] == 8
    assert training["sequences"][0] == 16
    # progress by generated token, not by batch of 32 answers (minutes apart on a real model)
    assert sum("self-generating chat answers: " in line for line in err.splitlines()) >= 5, err
    model, spec = specport.load(tiny_chat_artifact), specport.load(out)
    ids = load_chat_template(model).render_ids([{"role": "user", "content": "Hello"}])
    plain = model.generate(prompt_ids=ids, max_new_tokens=N)
    fast = spec.generate(prompt_ids=ids, max_new_tokens=N, speculative="mtp")
    assert fast.tokens == plain.tokens


def _chat(artifact, stdin: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "specport", "chat", str(artifact), "--threads", "1"]
    r = subprocess.run(
        [*cmd, "--max-new-tokens", str(2 * N), *extra],
        input=stdin, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return r


def _two_turns(model) -> tuple[list[int], list[int], str]:
    """Plain greedy's token ids for two turns (the second sees the first) and chat's stdout."""
    template = load_chat_template(model)
    u1, u2 = "Hello", "How are you?"
    first = model.generate(prompt_ids=template.render_ids([{"role": "user", "content": u1}]),
                           max_new_tokens=2 * N)  # fmt: skip
    messages = [
        {"role": "user", "content": u1},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": u2},
    ]
    second = model.generate(prompt_ids=template.render_ids(messages), max_new_tokens=2 * N)
    return first.tokens, second.tokens, f"{first.text}\n{second.text}\n"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_chat_speculative_answers_equal_plain_greedy(tiny_chat_artifact, tmp_path, method):
    """Two turns with --speculative: the very answers of plain greedy; suffix drafting learns
    each answer, and --suffix-record appends them to a file a later chat reads back (the same
    FILE as --suffix-corpus: missing on the first start, then restored and appended to)."""
    a1, a2, want = _two_turns(specport.load(tiny_chat_artifact))
    extra = ["--speculative", method]
    if method == "ngram":
        assert _chat(tiny_chat_artifact, "Hello\nHow are you?\n", *extra).stdout == want
        return
    record = tmp_path / "learned.jsonl"
    keep = ["--suffix-corpus", str(record), "--suffix-record", str(record)]
    assert _chat(tiny_chat_artifact, "Hello\nHow are you?\n", *extra, *keep).stdout == want
    first = record.read_text()
    assert [json.loads(line)["ids"] for line in first.splitlines()] == [a1, a2]
    restored = specport.load(tiny_chat_artifact, suffix_corpus=record)
    assert len(restored.suffix_index) == len(a1) + len(a2) + 2  # two answers, two separators
    assert _chat(tiny_chat_artifact, "Hello\n", *extra, *keep).stdout == want.split("\n")[0] + "\n"
    again = record.read_text()
    assert again.startswith(first) and [json.loads(x)["ids"] for x in again.splitlines()][2] == a1


@pytest.mark.slow
def test_chat_token_trees_answer_as_plain_greedy(tiny_zoo, tmp_path):
    """`chat --speculative ngram --tree-width 3` on a --tree-mask export: two turns, the very
    answers of plain greedy (the second turn on the KV the first left)."""
    from tests.fixtures import add_chat_tokenizer

    art = add_chat_tokenizer(tiny_zoo.shared("llama", tree_mask=True), tmp_path / "chat")
    _, _, want = _two_turns(specport.load(art))
    trees = ["--speculative", "ngram", "--tree-width", "3"]
    assert _chat(art, "Hello\nHow are you?\n", *trees).stdout == want


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--suffix-corpus", "c.jsonl"], "--suffix-corpus is read only by --speculative suffix"),
        (["--speculative", "ngram", "--suffix-record", "r.jsonl"], "--suffix-record keeps"),
        (["--draft", "d"], "--draft is used only with --speculative draft"),
        (["--speculative", "draft"], "--speculative draft needs --draft DIR"),
        (["--num-draft", "3"], "--num-draft sets the draft length"),
        (["--tree-width", "2"], "--tree-width needs --speculative ngram, mtp or eagle"),
        (["--speculative", "suffix", "--tree-width", "2"], "--tree-width needs"),
    ],
)
def test_chat_speculative_usage_errors(cli, tiny_chat_artifact, extra, words):
    code, out, err = cli("chat", tiny_chat_artifact, *extra)
    assert code == 2 and out == "" and "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert words in line


def test_chat_refuses_a_record_file_that_is_not_a_corpus(cli, tmp_path):
    """Checked before the artifact loads: here the artifact is not even there."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    code, _, err = cli(
        "chat", tmp_path / "no-artifact", "--speculative", "suffix", "--suffix-record", notes
    )
    assert code == 1 and f"--suffix-record {notes}:1: not a JSON object" in err, err
    assert notes.read_text() == "my notes\n"
