"""Every shell command in the README and docs/ works as written.

The commands are read from the Markdown itself: every line of a ``bash`` fence, the ``$ ``
lines of a bare fence (the rest is output), and the lines of an indented block that start with a
command. Each one has an entry in ``CHECKS`` (tests/documented_checks.py) saying how
it is checked, in a workspace laid out as a new user's clone (the repository's files, linked)
with the venv first on PATH, as the README says to activate it:

- ``Run()``: as written, in document order, so later commands use what earlier ones made (the
  demo's checkpoint, the preprocessed data, the imported model);
- ``Run(append=...)``: as written plus overrides that only make it shorter (fewer iterations);
- ``Run(replace=...)``: what the shortened runs named otherwise (``iter_0000004``, not 100);
- ``Instead(command, why)``: what needs GPUs or a cluster, checked by its preflight or dry mode;
- ``Covered(test)``: run as written by another test;
- ``Skip(why)``: the install and test commands, which are what CI itself runs, and the GPU check.

The commands run in one process, in order (under xdist: ``--dist loadfile``, as the README's
test command says). A documented command without an entry, or an entry whose command is no
longer documented, fails the test: the docs and their checks change together.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.documented_checks import CHECKS, SHOWS, Covered, Instead, Run, Skip
from tests.fixtures.llama3_tokenizer import write_llama3_style_tokenizer

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FIXTURES = ROOT / "tests" / "fixtures" / "tokenizers"
# A line of a bare fence or an indented block is a command when it starts with one of these
# (after VAR=value assignments and an optional "$ " prompt); other lines there are output.
COMMAND_WORDS = ("python", "python3", "torchrun", "bash", "sbatch", "mkdir", "scripts/", ".venv/")


@dataclass
class Documented:
    command: str
    where: list[str] = field(default_factory=list)


def _is_command(line: str) -> bool:
    words = line.removeprefix("$ ").split()
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    return bool(words) and words[0].startswith(COMMAND_WORDS)


def _logical_lines(lines: list[str]) -> list[str]:
    """Lines with their backslash continuations joined."""
    joined, current = [], ""
    for line in lines:
        current = f"{current} {line.strip()}" if current else line.strip()
        if current.endswith("\\"):
            current = current[:-1].rstrip()
            continue
        joined.append(current)
        current = ""
    return joined


def documented_commands(paths: list[Path] = DOCS) -> dict[str, Documented]:
    """Every command in ``paths``, by its text (a repeated command is checked once)."""
    found: dict[str, Documented] = {}
    for path in paths:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = re.fullmatch(r"```(\w*)\s*", lines[i])
            block: list[str] = []
            if fence:
                j = i + 1
                while j < len(lines) and not lines[j].startswith("```"):
                    j += 1
                block, labelled = lines[i + 1 : j], fence.group(1) in ("bash", "sh")
                if not fence.group(1):  # a bare fence: its "$ " lines are commands, the rest output
                    block = [line for line in block if line.startswith("$ ")]
                elif not labelled:  # yaml, json, text
                    block = []
                i = j + 1
            elif lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
                j = i
                while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                    j += 1
                block, labelled = [line[4:] for line in lines[i:j]], False
                i = j
            else:
                i += 1
                continue
            for line in _logical_lines(block):
                if not line or line.startswith("#") or not (labelled or _is_command(line)):
                    continue
                # the command itself, without its prompt and its trailing comment
                command = re.sub(r"\s+#\s.*$", "", line.removeprefix("$ "))
                entry = found.setdefault(command, Documented(command))
                entry.where.append(path.relative_to(ROOT).as_posix())
    return found


def _workspace(base: Path) -> Path:
    """A new user's clone: the repository's files linked, the venv as .venv, no data or runs."""
    ws = base / "clone"
    ws.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in {".git", ".venv", "data", "runs", "logs", "gpu_check", "hf"}:
            (ws / entry.name).symlink_to(entry)
    (ws / ".venv").symlink_to(sys.prefix)
    return ws


def _user_files(ws: Path) -> None:
    """What the docs assume a user brings: a gzipped corpus and GPT-2's tokenizer files (the
    tests' small ones), the big configs' data (data/gpt2_text_document), prompts, an evaluation
    text and a LAMBADA file, a Hugging Face GPT-2 and Llama (tiny, random)."""
    from tools.make_sample_corpus import iter_documents

    documents = iter(iter_documents())
    lines = [json.dumps(next(documents)) for _ in range(400)]
    (ws / "corpus").mkdir()
    with gzip.open(ws / "corpus" / "part0.jsonl.gz", "wt") as f:
        f.write("\n".join(lines) + "\n")
    shutil.copy(FIXTURES / "gpt2-vocab.json", ws / "gpt2-vocab.json")
    shutil.copy(FIXTURES / "gpt2-merges.txt", ws / "gpt2-merges.txt")
    (ws / "data").mkdir()
    shutil.copy(FIXTURES / "gpt2-vocab.json", ws / "data" / "gpt2-vocab.json")
    shutil.copy(FIXTURES / "gpt2-merges.txt", ws / "data" / "gpt2-merges.txt")
    preprocess = [sys.executable, "tools/preprocess_data.py", "--input", "corpus/part0.jsonl.gz"]
    preprocess += ["--output-prefix", "data/gpt2", "--tokenizer-type", "GPT2BPETokenizer"]
    preprocess += ["--vocab-file", "data/gpt2-vocab.json", "--merge-file", "data/gpt2-merges.txt"]
    subprocess.run([*preprocess, "--append-eod"], cwd=ws, check=True, capture_output=True)
    (ws / "my-corpus.json").write_text("\n".join(lines) + "\n")
    texts = [json.loads(line)["text"] for line in lines[:40]]
    (ws / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t[:30]}) + "\n" for t in texts))
    (ws / "wiki.test.tokens").write_text("\n".join(texts[:20]) + "\n")
    lambada = [{"text": " ".join(t.split()[:12])} for t in texts if len(t.split()) > 12]
    (ws / "lambada_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lambada))
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab = json.loads((FIXTURES / "gpt2-vocab.json").read_text())
    config = GPT2Config(vocab_size=len(vocab), n_positions=256, n_embd=64, n_layer=2, n_head=2)
    hf = ws / "hf" / "gpt2"
    GPT2LMHeadModel(config).save_pretrained(hf)
    shutil.copy(FIXTURES / "gpt2-vocab.json", hf / "vocab.json")
    shutil.copy(FIXTURES / "gpt2-merges.txt", hf / "merges.txt")
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = ws / "hf" / "llama"
    ids = write_llama3_style_tokenizer(str(llama))
    config = LlamaConfig(
        vocab_size=ids, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(llama)


def _documented_task(ws: Path) -> None:
    """docs/evaluation.md's lm-eval task, its YAML and JSON blocks as the files it names."""
    text = (ROOT / "docs" / "evaluation.md").read_text()
    yaml = re.search(r"```yaml\n(task: my_choice\n.*?)```", text, re.S).group(1)
    data = re.search(r"```json\n(.*?)```", text, re.S).group(1)
    (ws / "my_tasks").mkdir()
    (ws / "my_tasks" / "my_choice.yaml").write_text(yaml)
    (ws / "my_tasks" / "my_choice.json").write_text(data)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict:
    ws = _workspace(tmp_path_factory.mktemp("newcomer"))
    _user_files(ws)
    _documented_task(ws)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.update(VIRTUAL_ENV=sys.prefix, OMP_NUM_THREADS="1", HF_DATASETS_CACHE=str(ws / "cache"))
    return {"ws": ws, "env": env}


def _shell(command: str, workspace: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", command],
        cwd=workspace["ws"],
        env=workspace["env"],
        capture_output=True,
        text=True,
        timeout=600,
    )


def _what_runs(command: str, check: Run | Instead) -> str:
    if isinstance(check, Instead):
        return check.command
    for old, new in check.replace:
        command = command.replace(old, new)
    return " ".join([command, *check.append])


DOCUMENTED = documented_commands()


def test_every_documented_command_has_a_check():
    missing = [c for c in DOCUMENTED if c not in CHECKS]
    stale = [c for c in CHECKS if c not in DOCUMENTED]
    assert not missing, "documented commands without a check in CHECKS:\n" + "\n".join(missing)
    assert not stale, "CHECKS entries no longer documented:\n" + "\n".join(stale)


def test_documented_launches_end_in_one_line():
    """Every documented torchrun launch is megatron.launch.torchrun's: plain torchrun would bury a
    worker's one-line mistake under its own traceback and exit 1."""
    plain = [c for c in documented_commands() if re.search(r"(^|\s)torchrun\s", c)]
    assert not plain, plain


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in DOCUMENTED if c in CHECKS])
def test_documented_command_works(command, workspace):
    check = CHECKS[command]
    if isinstance(check, Skip):
        pytest.skip(check.why)
    if isinstance(check, Covered):
        path, name = check.test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), f"{check.test} is gone"
        return
    done = _shell(_what_runs(command, check), workspace)
    where = ", ".join(DOCUMENTED[command].where)
    output = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"{where}: `{command}` exited {done.returncode}\n{output}"
    assert "Traceback" not in done.stderr, f"{where}: `{command}`\n{done.stderr[-3000:]}"
    assert SHOWS.get(command, "") in done.stdout, f"{where}: `{command}`\n{output}"
