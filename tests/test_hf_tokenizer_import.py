"""The tokenizer of tools/import_hf.py and tools/export_hf.py against transformers' AutoTokenizer.

A Llama-family import's ids are those of ``AutoTokenizer.from_pretrained(dir).encode(text,
add_special_tokens=False)`` on texts with special tokens spelled in them, unicode, digits and
odd whitespace, its end of document is the model's eos, and the export's AutoTokenizer gives the
same ids, bos and eos. Tokenizers: a Llama-3-shaped tokenizer.json
(``tests/fixtures/llama3_tokenizer.py``), and the fixture sentencepiece model as Llama 2's
tokenizer.model. A model with more embedding rows than its tokenizer has ids (as Qwen2.5's)
keeps every row through import and export; the --tokenizer-* flags name another tokenizer; the
mistakes are one line and exit status 2. Tiny models, one process, module-scoped fixtures.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from megatron.config.load import CONFIG_DIR
from megatron.data.tokenizers.factory import build_tokenizer
from megatron.errors import ConfigError
from megatron.interop.export import export_hf
from megatron.interop.hf_tokenizer import find_tokenizer
from megatron.interop.importer import import_hf
from megatron.interop.verify import TOLERANCE, max_logit_difference
from tests.fixtures.llama3_tokenizer import EOS, write_llama3_style_tokenizer
from tools.import_hf import main as import_main

transformers = pytest.importorskip("transformers")
FIXTURES = Path(__file__).parent / "fixtures" / "tokenizers"
TEXTS = (
    "Hello world, it's 3.14159 and 1234567 items; don't stop.",
    " a leading space,  two spaces\tand a tab\n\nnew lines \n",
    "café Größe 東京 Ελλάδα москва 🙂🚀 x² ½ Ñandú",
    "<|begin_of_text|>spelled <|end_of_text|> specials<|eot_id|>in text",
    "<s> llama two </s> specials</s>glued<unk>",
)
# Llama-2-7b-hf's tokenizer_config.json, its special tokens as the AddedToken dicts it writes.
_TOKEN = {"__type": "AddedToken", "lstrip": False, "normalized": False, "rstrip": False}
LLAMA2_CONFIG = {
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": {**_TOKEN, "content": "<s>"},
    "eos_token": {**_TOKEN, "content": "</s>"},
    "unk_token": {**_TOKEN, "content": "<unk>"},
    "clean_up_tokenization_spaces": False,
    "legacy": False,
    "pad_token": None,
    "tokenizer_class": "LlamaTokenizer",
}


def our_ids(tokenizer) -> list[list[int]]:
    """Our tokenizer's ids of TEXTS."""
    return [tokenizer.encode(t) for t in TEXTS]


def hf_ids(tokenizer) -> list[list[int]]:
    """A transformers tokenizer's ids of TEXTS, without the special tokens it would add."""
    return [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


def save_llama(path: Path, rows: int, tied: bool) -> Path:
    """A random tiny LlamaForCausalLM with ``rows`` embedding rows, saved at ``path``."""
    config = transformers.LlamaConfig(
        vocab_size=rows, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
        tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def save_gpt2(path: Path, rows: int) -> Path:
    """A random tiny GPT2LMHeadModel with ``rows`` embedding rows, saved at ``path``."""
    config = transformers.GPT2Config(
        vocab_size=rows, n_embd=32, n_layer=1, n_head=2, n_positions=32,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


def add_files(hf_dir: Path, source: Path, *names: str) -> Path:
    """Copy tokenizer files ``names`` of ``source`` into ``hf_dir``."""
    for name in names:
        shutil.copy(source / name, hf_dir / name)
    return hf_dir


def without_weights(hf_dir: Path, dest: Path, **config: object) -> Path:
    """``hf_dir``'s config.json alone (``config`` keys replaced) in ``dest``: enough for what
    import checks before it reads any weight."""
    dest.mkdir()
    hf = json.loads((hf_dir / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**hf, **config}))
    return dest


def imported_tokenizer(ours: Path) -> tuple[dict, object]:
    """config.yaml's tokenizer section of the import ``ours`` (its ``${config_dir}`` paths as
    the loader reads them), and the tokenizer it builds."""
    written = yaml.safe_load((ours / "config.yaml").read_text())["tokenizer"]
    section = {k: v.replace(CONFIG_DIR, str(ours)) if isinstance(v, str) else v
               for k, v in written.items()}  # fmt: skip
    return section, build_tokenizer(**section)


def assert_same_tensors(original: Path, exported: Path) -> None:
    """Every tensor of the original model.safetensors, back bit for bit."""
    before = load_file(str(original / "model.safetensors"))
    after = load_file(str(exported / "model.safetensors"))
    assert set(before) == set(after)
    for key, tensor in before.items():
        assert torch.equal(tensor, after[key]), key


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path | int]:
    """Tokenizer directories: Llama 3's shape (tokenizer.json, eos <|end_of_text|>) and Llama
    2's tokenizer.model alone with its tokenizer_config.json."""
    root = tmp_path_factory.mktemp("tokenizers")
    ids = write_llama3_style_tokenizer(str(root / "llama3"), 1024)
    llama2 = root / "llama2"
    llama2.mkdir()
    shutil.copy(FIXTURES / "sp-bpe.model", llama2 / "tokenizer.model")
    (llama2 / "tokenizer_config.json").write_text(json.dumps(LLAMA2_CONFIG))
    return {"root": root, "llama3": root / "llama3", "llama3_ids": ids, "llama2": llama2}


@pytest.fixture(scope="module")
def padded_llama(tokenizers) -> dict[str, Path | int]:
    """A Llama with Llama 3's tokenizer and 100 embedding rows more than its ids, untied (as
    Qwen2.5 pads its vocabulary), imported at TP=2 (its padding, 1280 rows, is not those rows)."""
    root = tokenizers["root"] / "padded_llama"
    rows = tokenizers["llama3_ids"] + 100
    hf_dir = save_llama(root / "hf", rows, tied=False)
    add_files(hf_dir, tokenizers["llama3"], "tokenizer.json", "tokenizer_config.json")
    import_hf(str(hf_dir), str(root / "ours"), 2)
    return {"root": root, "hf": hf_dir, "ours": root / "ours", "rows": rows}


def test_llama3_tokenizer_and_padded_rows_round_trip(tokenizers, padded_llama):
    """Ids and eos are AutoTokenizer's; the 100 rows the tokenizer never produces are kept as
    vocabulary (all 1128 logits equal HF's) and come back in the export, as every tensor does."""
    hf_dir, ours, rows = padded_llama["hf"], padded_llama["ours"], padded_llama["rows"]
    reference = transformers.AutoTokenizer.from_pretrained(hf_dir)
    section, tokenizer = imported_tokenizer(ours)
    assert section == {"type": "hf", "model": str(ours / "tokenizer" / "tokenizer.json"),
                       "vocab_size": rows}  # fmt: skip
    assert sorted(p.name for p in (ours / "tokenizer").iterdir()) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert our_ids(tokenizer) == hf_ids(reference)
    assert tokenizer.eod == reference.eos_token_id == reference.convert_tokens_to_ids(EOS)
    assert (tokenizer.vocab_size, len(reference)) == (rows, tokenizers["llama3_ids"])
    meta = json.loads((ours / "iter_0000000" / "meta.json").read_text())
    assert (meta["vocab_size"], meta["padded_vocab_size"]) == (rows, 1280)
    assert max_logit_difference(str(ours / "iter_0000000"), str(hf_dir)) < TOLERANCE

    back = Path(export_hf(str(ours), str(padded_llama["root"] / "back")))
    unused = load_file(str(hf_dir / "model.safetensors"))["lm_head.weight"][len(reference) :]
    assert unused.shape[0] == 100 and unused.abs().min() > 0  # random rows, not zero padding
    assert_same_tensors(hf_dir, back)
    assert json.loads((back / "config.json").read_text())["vocab_size"] == rows
    exported = transformers.AutoTokenizer.from_pretrained(back)
    assert hf_ids(exported) == our_ids(tokenizer)
    assert (exported.bos_token, exported.eos_token) == (reference.bos_token, reference.eos_token)


def test_llama2_tokenizer_model_alone(tokenizers):
    """A tokenizer.model without tokenizer.json imports as AutoTokenizer converts it, which is
    not raw sentencepiece (Megatron's Llama2Tokenizer): a spelled </s> is one id, and no
    second "▁" is prefixed to a leading space. Its eos </s> is our end of document."""
    root = tokenizers["root"] / "llama2_model"
    hf_dir = add_files(
        save_llama(root / "hf", 1000, tied=True),
        tokenizers["llama2"],
        "tokenizer.model",
        "tokenizer_config.json",
    )
    import_hf(str(hf_dir), str(root / "ours"), 1)
    reference = transformers.AutoTokenizer.from_pretrained(hf_dir)
    _, tokenizer = imported_tokenizer(root / "ours")
    assert our_ids(tokenizer) == hf_ids(reference)
    raw = build_tokenizer("Llama2Tokenizer", model=str(hf_dir / "tokenizer.model"))
    assert our_ids(raw) != hf_ids(reference)
    assert tokenizer.eod == reference.eos_token_id == raw.eod  # </s>, 3 in the fixture model

    back = Path(export_hf(str(root / "ours"), str(root / "back")))
    exported = transformers.AutoTokenizer.from_pretrained(back)
    assert hf_ids(exported) == our_ids(tokenizer)
    assert (exported.bos_token, exported.eos_token) == ("<s>", "</s>")


def legacy_llama2_tokenizer_json(model: Path, path: Path) -> None:
    """tokenizer.json as Llama-2-7b-hf ships it (transformers 4's conversion: a normaliser
    prefixing "▁" to every piece between special tokens), of the sentencepiece ``model``."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    spm = SentencePieceExtractor(str(model)).extract(BPE)
    tok = Tokenizer(BPE(spm["vocab"], spm["merges"], unk_token="<unk>", fuse_unk=True,
                        byte_fallback=True))  # fmt: skip
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t in ("<pad>", "<unk>", "<s>", "</s>")])  # fmt: skip
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    tok.save(str(path))


def test_llama2_with_both_files_takes_what_autotokenizer_loads(tokenizers, tmp_path):
    """With tokenizer.json beside tokenizer.model, AutoTokenizer reads tokenizer.json, but
    LlamaTokenizer rebuilds its pre-tokenizer: the file as written gives other ids. The import
    saves the tokenizer AutoTokenizer builds, so ours are AutoTokenizer's."""
    hf_dir = tmp_path / "llama2"
    shutil.copytree(tokenizers["llama2"], hf_dir)
    legacy_llama2_tokenizer_json(hf_dir / "tokenizer.model", hf_dir / "tokenizer.json")
    reference = transformers.AutoTokenizer.from_pretrained(hf_dir)
    as_written = build_tokenizer("hf", model=str(hf_dir / "tokenizer.json"))
    assert our_ids(as_written) != hf_ids(reference)
    tokenizer = build_tokenizer(**find_tokenizer(str(hf_dir), False, [], str(tmp_path / "s")))
    assert our_ids(tokenizer) == hf_ids(reference) and tokenizer.eod == reference.eos_token_id


def test_vocab_json_beside_tokenizer_json_is_not_read_as_gpt2(tokenizers, tmp_path):
    """Qwen's directories hold vocab.json + merges.txt beside tokenizer.json, which has its
    added tokens and pre-tokenizer: a Llama-family import reads what AutoTokenizer does."""
    hf_dir = tmp_path / "qwen_like"
    shutil.copytree(tokenizers["llama3"], hf_dir)
    shutil.copy(FIXTURES / "gpt2-vocab.json", hf_dir / "vocab.json")
    shutil.copy(FIXTURES / "gpt2-merges.txt", hf_dir / "merges.txt")
    section = find_tokenizer(str(hf_dir), False, [], str(tmp_path / "scratch"))
    reference = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert section["type"] == "hf" and our_ids(build_tokenizer(**section)) == hf_ids(reference)


@pytest.mark.parametrize("where", ["tokenizer_config.json", "special_tokens_map.json"])
def test_eos_is_the_models_eos(tokenizers, tmp_path, where):
    """An instruct model's eos (<|eot_id|>, as Llama 3 Instruct names it) is our end of document,
    also where only special_tokens_map.json names it; the import's tokenizer_config.json then
    names it, so the export's AutoTokenizer has it too."""
    hf_dir = tmp_path / "instruct"
    shutil.copytree(tokenizers["llama3"], hf_dir)
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    if where == "tokenizer_config.json":
        config["eos_token"] = "<|eot_id|>"
    else:
        del config["eos_token"]
        (hf_dir / where).write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    section = find_tokenizer(str(hf_dir), False, [], str(tmp_path / "scratch"))
    reference = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert (
        build_tokenizer(**section).eod
        == reference.eos_token_id
        == reference.convert_tokens_to_ids("<|eot_id|>")
    )
    written = json.loads((tmp_path / "scratch" / "tokenizer_config.json").read_text())
    assert written["eos_token"] == "<|eot_id|>" and written["bos_token"] == "<|begin_of_text|>"


def refused(argv: list[str], capsys) -> str:
    """tools/import_hf.py's one line for ``argv`` (exit status 2, nothing written)."""
    assert import_main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert not Path(argv[argv.index("--output") + 1]).exists()
    return err


def test_flags_win_over_the_directorys_files(tokenizers, tmp_path, capsys):
    """A GPT-2 directory holds GPT-2 BPE files (1025 ids) for a model of 1128 rows: refused, as
    BPE files cannot leave rows unused; the flags name Llama 3's tokenizer.json instead, whose
    files are copied (its tokenizer_config.json too), and the 100 unused rows round-trip."""
    hf_dir = save_gpt2(tmp_path / "hf", tokenizers["llama3_ids"] + 100)
    shutil.copy(FIXTURES / "gpt2-vocab.json", hf_dir / "vocab.json")
    shutil.copy(FIXTURES / "gpt2-merges.txt", hf_dir / "merges.txt")
    args = ["--input", str(hf_dir), "--output", str(tmp_path / "ours")]
    assert "only a HF tokenizer.json can leave rows unused" in refused(args, capsys)

    source = tokenizers["llama3"] / "tokenizer.json"
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(source)]
    assert import_main([*args, *flags]) == 0
    section, tokenizer = imported_tokenizer(tmp_path / "ours")
    assert (section["type"], section["vocab_size"]) == ("HuggingFaceTokenizer", 1128)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        copy = tmp_path / "ours" / "tokenizer" / name
        assert copy.read_bytes() == (tokenizers["llama3"] / name).read_bytes()
    back = Path(export_hf(str(tmp_path / "ours"), str(tmp_path / "back")))
    assert_same_tensors(hf_dir, back)
    assert hf_ids(transformers.AutoTokenizer.from_pretrained(back)) == our_ids(tokenizer)


def test_flags_for_a_directory_without_tokenizer(tokenizers, padded_llama, tmp_path, capsys):
    """No tokenizer files: refused in one line naming the flags; with them it imports."""
    hf_dir = tmp_path / "bare"
    hf_dir.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(padded_llama["hf"] / name, hf_dir / name)
    args = ["--input", str(hf_dir), "--output", str(tmp_path / "ours")]
    err = refused(args, capsys)
    assert "no tokenizer files (tokenizer.json or tokenizer.model)" in err
    assert "--tokenizer-type" in err
    model = str(tokenizers["llama3"] / "tokenizer.json")
    assert import_main([*args, "--tokenizer-type", "hf", "--tokenizer-model", model]) == 0
    _, tokenizer = imported_tokenizer(tmp_path / "ours")
    assert tokenizer.vocab_size == padded_llama["rows"]


def test_mistakes_are_one_line(tokenizers, padded_llama, tmp_path, capsys, monkeypatch):
    """More ids than rows, flags without --tokenizer-type, no transformers to read a Llama's
    tokenizer with, and a tokenizer.vocab_size below the file's ids."""
    small = without_weights(padded_llama["hf"], tmp_path / "small", vocab_size=1000)
    add_files(small, tokenizers["llama3"], "tokenizer.json", "tokenizer_config.json")
    out = ["--output", str(tmp_path / "ours")]
    err = refused(["--input", str(small), *out], capsys)
    assert "config.json: vocab_size=1000, but the tokenizer (hf) has 1028 ids" in err
    model = str(tokenizers["llama3"] / "tokenizer.json")
    err = refused(["--input", str(small), *out, "--tokenizer-model", model], capsys)
    assert "add --tokenizer-type" in err

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    err = refused(["--input", str(padded_llama["hf"]), *out], capsys)
    assert "needs transformers" in err and "pip install transformers" in err
    monkeypatch.undo()

    with pytest.raises(ConfigError, match=r"tokenizer.vocab_size \(--vocab-size\)=10 is below"):
        build_tokenizer("hf", model=model, vocab_size=10)
